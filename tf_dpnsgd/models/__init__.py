"""Models used in the paper's experiments, and scattering-network classifiers."""

from tf_dpnsgd.models.resnet import resnet20
from tf_dpnsgd.models.scattering import Scattering2D
from tf_dpnsgd.models.text import text_classifier

__all__ = ["Scattering2D", "resnet20", "text_classifier"]
