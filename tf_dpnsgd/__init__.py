"""tf_dpnsgd: differentially private DP-NSGD / DP-SGD training for TensorFlow + Keras 3.

Public API:
  * Optimizers: :class:`DPNSGD`, :class:`DPSGD`, :class:`DPAdam`, :class:`DPNAdam`.
  * Models: :class:`DPModel`, :func:`make_private`; ``tf_dpnsgd.models.resnet20``.
  * Math: :mod:`tf_dpnsgd.transforms` (normalize/clip + sensitivity),
    :mod:`tf_dpnsgd.noise` (Gaussian mechanism).
  * Privacy: :class:`PrivacyPlan` (sampler + noise + event + report from one
    object), :class:`PrivacyLedger` (what the train step executed, owned by the
    model; every report reads it), :mod:`tf_dpnsgd.accounting`, :mod:`tf_dpnsgd.sampling`,
    :mod:`tf_dpnsgd.callbacks`.
"""

from tf_dpnsgd import accounting
from tf_dpnsgd import callbacks
from tf_dpnsgd import coverage
from tf_dpnsgd import data
from tf_dpnsgd import export
from tf_dpnsgd import ledger
from tf_dpnsgd import lineage
from tf_dpnsgd import models
from tf_dpnsgd import noise
from tf_dpnsgd import sampling
from tf_dpnsgd import schedules
from tf_dpnsgd import transforms
from tf_dpnsgd.interaction import ExampleInteractionError
from tf_dpnsgd.layer_fixes import fix_layers
from tf_dpnsgd.ledger import LedgerMismatchError, PrivacyLedger, ledger_of
from tf_dpnsgd.plan import PrivacyPlan
from tf_dpnsgd.optimizers import (DPAdam, DPNAdam, DPNSGD, DPSGD,
                                  PrivateOptimizer, make_private_optimizer)
from tf_dpnsgd.training import DPModel, PrivateModelWrapper, make_private, validate_layers

__version__ = "0.1.0"

__all__ = [
    "DPAdam", "DPNAdam", "DPNSGD", "DPSGD", "PrivateOptimizer",
    "make_private_optimizer", "DPModel", "PrivateModelWrapper",
    "make_private", "validate_layers", "fix_layers", "PrivacyPlan", "PrivacyLedger", "LedgerMismatchError",
    "ExampleInteractionError",
    "ledger", "ledger_of", "accounting", "callbacks", "sampling", "data", "export", "models", "noise", "schedules", "transforms", "__version__",
]
