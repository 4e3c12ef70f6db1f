"""Models used in the paper's experiments."""

from tf_dpnsgd.models.resnet import resnet20
from tf_dpnsgd.models.text import text_classifier

__all__ = ["resnet20", "text_classifier"]
