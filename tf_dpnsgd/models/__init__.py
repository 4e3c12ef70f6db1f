"""Models used in the paper's experiments."""

from tf_dpnsgd.models.resnet import resnet20

__all__ = ["resnet20"]
