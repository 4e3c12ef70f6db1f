"""Privacy accounting that matches how batches were drawn: a thin layer over dp-accounting.

Every number here is for the Gaussian mechanism applied to the SUM of
per-example contributions, each with L2 norm at most ``S`` (the transform's
``sensitivity``: 1 for normalization, ``c`` for clipping), with noise
``N(0, (sigma * S)^2 I)``. ``sigma`` is the *noise multiplier*, the unit used
everywhere in this package (optimizers, plans, callbacks, CLI).

Modules (each imports only the ones above it):

=================  =====================================================================
``validation``     named validators and the errors (:class:`AccountingError`)
``paper_bound``    the paper's bound, Bun et al. (2018) Thm. 11, and its conditions
``conversions``    RDP -> (epsilon, delta): ``"modern"`` and ``"classic"``
``spec``           :class:`AccountingSpec`: sampling, neighbours, events, the order grids
``rdp``            :func:`rdp_curve` of one composition; the algebra of RDP curves
``report``         :class:`PrivacyReport`, :class:`StepAccountant`, :func:`compute_epsilon`
``calibration``    :func:`calibrate_noise_multiplier`, :func:`calibrate`
``adaptive``       adaptive clipping's count query: ``sigma_eff`` <-> ``sigma_grad``
=================  =====================================================================

The samplings, their neighbouring relations and dp-accounting events (and
why replace-one passes ``sigma / 2`` to the RDP accountant but ``sigma`` to
PLD) are tabulated in :mod:`tf_dpnsgd.accounting.spec`; docs/accounting.md
has the whole story with numbers.

References:
  Yang, Zhang, Chen, Liu (2022), "Normalized/Clipped SGD with Perturbation for
  Differentially Private Non-Convex Optimization", appendix "Proof for Privacy
  Guarantee" (the paper's bound, :func:`paper_subsampled_gaussian_rdp`).
  Bun, Dwork, Rothblum, Steinke (2018), "Composable and Versatile Privacy via
  Truncated CDP" (STOC 2018), Thm. 11; its hypotheses (q < 0.1, rho = 1/(2 s^2)
  <= 0.1, log(1/q) >= 3 rho (2 + log2(1/rho))) are enforced by
  :func:`paper_bound_conditions`.
  Mironov (2017), "Renyi Differential Privacy", Prop. 1 (composition), Prop. 3.
  Canonne, Kamath, Steinke (2020), Prop. 12 (the "modern" conversion).
  Mironov, Talwar, Zhang (2019), "Renyi Differential Privacy of the Sampled
  Gaussian Mechanism" (Poisson, dp-accounting's RDP accountant).
  Wang, Balle, Kasiviswanathan (2019), "Subsampled Renyi Differential Privacy
  and Analytical Moments Accountant", Thm. 9 (sampling without replacement).
  Doroshenko, Ghazi, Kamath, Kumar, Manurangsi (2022), "Connect the Dots"
  (dp-accounting's PLD accountant).
"""

from tf_dpnsgd.accounting.validation import (AccountingError, UnsupportedAccountingError,
                                             planned_steps, resolve_steps,
                                             steps_from_epochs, steps_per_epoch,
                                             validate_dataset_and_batch, validate_delta,
                                             validate_noise_multiplier, validate_steps,
                                             validate_target_epsilon)
from tf_dpnsgd.accounting.paper_bound import (PAPER_CONDITIONS, PAPER_CONSTANT, PAPER_MAX_RHO,
                                              PAPER_MAX_SAMPLING_RATIO, PaperBoundConditionError,
                                              paper_bound_conditions, paper_order_limit,
                                              paper_rho, paper_subsampled_gaussian_rdp)
from tf_dpnsgd.accounting.conversions import CONVERTERS, classic_epsilon, modern_epsilon
from tf_dpnsgd.accounting.spec import (ACCOUNTANTS, BOUNDS, CONVERSIONS, DEFAULT_ORDERS,
                                       NEIGHBORING_RELATIONS, SAMPLINGS, WOR_ORDERS,
                                       AccountingSpec, NeighboringRelation, make_spec)
from tf_dpnsgd.accounting.rdp import (RdpCurve, common_orders, composed_rdp, monotone_rdp,
                                      rdp_curve, rdp_to_delta, rdp_to_epsilon,
                                      validate_conversion, validate_curve, worst_case_rdp)
from tf_dpnsgd.accounting.report import (PrivacyReport, StepAccountant, compute_epsilon,
                                         epsilon_for)
from tf_dpnsgd.accounting.calibration import (calibrate, calibrate_noise_multiplier,
                                              within_target_on_few_orders)
from tf_dpnsgd.accounting.adaptive import (adaptive_clipping_event,
                                           default_clipped_count_stddev,
                                           effective_noise_multiplier, gradient_noise_multiplier,
                                           validate_clipped_count_stddev)
from tf_dpnsgd.accounting.group import example_level_for_group, group_privacy_epsilon

__all__ = [
    "ACCOUNTANTS", "AccountingError", "adaptive_clipping_event",
    "default_clipped_count_stddev", "effective_noise_multiplier", "gradient_noise_multiplier",
    "validate_clipped_count_stddev", "AccountingSpec", "BOUNDS", "CONVERSIONS", "CONVERTERS",
    "DEFAULT_ORDERS", "example_level_for_group", "group_privacy_epsilon", "NEIGHBORING_RELATIONS", "NeighboringRelation", "PAPER_CONDITIONS",
    "PAPER_CONSTANT", "PAPER_MAX_RHO", "PAPER_MAX_SAMPLING_RATIO", "PaperBoundConditionError",
    "PrivacyReport", "RdpCurve", "SAMPLINGS", "StepAccountant", "UnsupportedAccountingError",
    "WOR_ORDERS", "calibrate", "calibrate_noise_multiplier", "within_target_on_few_orders", "classic_epsilon", "common_orders",
    "composed_rdp", "compute_epsilon", "epsilon_for", "make_spec", "modern_epsilon",
    "monotone_rdp", "paper_bound_conditions", "paper_order_limit", "paper_rho",
    "paper_subsampled_gaussian_rdp", "rdp_curve", "rdp_to_delta", "rdp_to_epsilon",
    "planned_steps", "resolve_steps", "steps_from_epochs", "steps_per_epoch", "validate_conversion", "validate_curve",
    "validate_dataset_and_batch", "validate_delta", "validate_noise_multiplier", "validate_steps",
    "validate_target_epsilon", "worst_case_rdp",
]
