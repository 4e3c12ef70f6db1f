"""Accounting for quantile-adaptive clipping: two Gaussian queries on the same batch.

Each step of adaptive clipping (Andrew et al. 2021) releases, from the SAME
sampled batch,

1. the clipped gradient sum plus ``N(0, (sigma_grad C_t)^2 I)``: sensitivity
   ``C_t`` (add/remove-one), noise multiplier ``sigma_grad``;
2. the centered count of unclipped units ``sum_i (1[||g_i|| <= C_t] - 1/2)``
   plus ``N(0, sigma_b^2)``: sensitivity ``1/2``, noise multiplier
   ``2 sigma_b``.

Stacked, the two are ONE Gaussian mechanism on a vector whose blocks have
sensitivities ``C_t`` and ``1/2``; rescaling each block by its noise std shows
its privacy loss is that of a Gaussian mechanism with the effective noise
multiplier ``sigma_eff = (sigma_grad^-2 + (2 sigma_b)^-2)^(-1/2)``, under
Poisson or uniform subsampling alike (the batch is shared), and under
replace-one both sensitivities double, so the same ``sigma_eff`` holds.

Convention of this package: the user-facing ``noise_multiplier`` (optimizer,
plan, ledger, every accountant and calibration) IS ``sigma_eff``; the
optimizer derives the gradient's own multiplier
``sigma_grad = (sigma_eff^-2 - (2 sigma_b)^-2)^(-1/2)`` (larger than
``sigma_eff``) and refuses ``2 sigma_b <= sigma_eff``, where no ``sigma_grad``
exists. So a calibrated plan, its report and the ledger's recorded sigma cover
both queries with no other change.

References:
  Andrew, Thakkar, McMahan, Ramaswamy (NeurIPS 2021), "Differentially Private
  Learning with Adaptive Clipping", Sec. 3.1 and Thm. 1 (the composition above,
  ``sigma_Delta = (z^-2 - (2 sigma_b)^-2)^(-1/2)``), Algorithm 1.
  tensorflow-privacy, ``QuantileAdaptiveClipSumQuery`` (the same split) and
  dp-accounting, whose ``PoissonSampledDpEvent`` over a ``ComposedDpEvent`` of
  Gaussians uses the same effective multiplier.
"""

from __future__ import annotations

import math

import dp_accounting

from tf_dpnsgd.accounting.validation import AccountingError, validate_noise_multiplier

# The centered count's add/remove-one sensitivity (each unit adds +-1/2).
COUNT_SENSITIVITY = 0.5

# Andrew et al. (2021) and tensorflow-privacy: sigma_b = expected batch size / 20.
COUNT_STDDEV_BATCH_FRACTION = 1.0 / 20.0


def default_clipped_count_stddev(expected_batch_size: float) -> float:
  """``sigma_b = m / 20`` (Andrew et al. 2021, Sec. 3.1; tensorflow-privacy's default).

  >>> default_clipped_count_stddev(256)
  12.8
  """
  return float(expected_batch_size) * COUNT_STDDEV_BATCH_FRACTION


def validate_clipped_count_stddev(clipped_count_stddev) -> float:
  """``sigma_b`` as a float; raises unless a finite number ``>= 0``."""
  try:
    value = float(clipped_count_stddev)
  except (TypeError, ValueError) as e:
    raise AccountingError(f"`clipped_count_stddev` must be a finite number >= 0; "
                          f"got {clipped_count_stddev!r}.") from e
  if not (math.isfinite(value) and value >= 0):
    raise AccountingError(f"`clipped_count_stddev` must be a finite number >= 0; "
                          f"got {clipped_count_stddev!r}.")
  return value


def effective_noise_multiplier(gradient_noise_multiplier: float,
                               clipped_count_stddev: float) -> float:
  """``(sigma_grad^-2 + (2 sigma_b)^-2)^(-1/2)``: the one Gaussian both queries amount to.

  Args:
    gradient_noise_multiplier: ``sigma_grad >= 0`` (noise std over the clip).
    clipped_count_stddev: ``sigma_b >= 0`` (noise std on the centered count).

  Returns:
    ``sigma_eff`` (0 if either is 0: a noiseless query is not private).

  >>> round(effective_noise_multiplier(1.0 / math.sqrt(0.75), 1.0), 12)  # 0.75 + 0.25 = 1
  1.0
  """
  s = validate_noise_multiplier(gradient_noise_multiplier, allow_zero=True)
  b = validate_clipped_count_stddev(clipped_count_stddev)
  if s == 0 or b == 0:
    return 0.0
  return (s ** -2 + (b / COUNT_SENSITIVITY) ** -2) ** -0.5


def gradient_noise_multiplier(noise_multiplier: float, clipped_count_stddev: float) -> float:
  """``sigma_grad = (sigma_eff^-2 - (2 sigma_b)^-2)^(-1/2)``: the gradient's own multiplier.

  Args:
    noise_multiplier: ``sigma_eff >= 0``, the effective multiplier the
      accountant uses (the plan's, calibrated or given).
    clipped_count_stddev: ``sigma_b``, noise std on the centered count.

  Returns:
    ``sigma_grad >= sigma_eff``; 0 when ``sigma_eff = 0`` (no privacy claimed).

  Raises:
    AccountingError: ``2 sigma_b <= sigma_eff > 0``: the count alone would
      spend at least the whole budget. Raise ``clipped_count_stddev`` (the
      default is the expected batch size / 20) or lower the noise.

  >>> round(gradient_noise_multiplier(1.0, 1.0), 12) == round(1 / math.sqrt(0.75), 12)
  True
  """
  s = validate_noise_multiplier(noise_multiplier, allow_zero=True)
  b = validate_clipped_count_stddev(clipped_count_stddev)
  if s == 0:
    return 0.0
  count_multiplier = b / COUNT_SENSITIVITY
  if count_multiplier <= s:
    raise AccountingError(
        f"clipped_count_stddev={b!r} is too small for noise_multiplier={s!r}: adaptive "
        f"clipping needs 2 * clipped_count_stddev > noise_multiplier (the count query "
        f"alone would spend the whole budget). Use a larger clipped_count_stddev (Andrew et "
        f"al. use the expected batch size / 20) or a smaller noise_multiplier.")
  return (s ** -2 - count_multiplier ** -2) ** -0.5


def adaptive_clipping_event(gradient_noise_multiplier_: float, clipped_count_stddev: float
                            ) -> dp_accounting.DpEvent:
  """One unsampled step as dp-accounting sees it: the two Gaussian queries composed.

  ``ComposedDpEvent([GaussianDpEvent(sigma_grad), GaussianDpEvent(2 sigma_b)])``:
  wrap it in a sampling event for the batch (dp-accounting's RDP accountant
  reduces a Poisson-sampled composition of Gaussians to ``sigma_eff``).
  """
  s = validate_noise_multiplier(gradient_noise_multiplier_, allow_zero=True)
  b = validate_clipped_count_stddev(clipped_count_stddev)
  return dp_accounting.ComposedDpEvent([dp_accounting.GaussianDpEvent(s),
                                        dp_accounting.GaussianDpEvent(b / COUNT_SENSITIVITY)])


__all__ = ["COUNT_SENSITIVITY", "COUNT_STDDEV_BATCH_FRACTION", "adaptive_clipping_event",
           "default_clipped_count_stddev", "effective_noise_multiplier",
           "gradient_noise_multiplier", "validate_clipped_count_stddev"]
