"""Per-example gradient transforms: normalization (DP-NSGD) and clipping (DP-SGD).

Each transform maps per-unit gradient norms ``n_i = ||g_i||_2`` to scale factors
``h_i`` such that every scaled contribution ``h_i * g_i`` has L2 norm bounded by
the transform's ``sensitivity``. The noise added later is computed from that
sensitivity (see :mod:`tf_dpnsgd.noise`), never re-derived elsewhere.

A "unit" is one example, or one microbatch when ``num_microbatches`` is used
(then ``g_i`` is the gradient of the microbatch's mean loss).

Formal guarantees (for both transforms), whatever the input:

===========================  =====================================================
per-unit input               scaled contribution ``h_i * g_i``
===========================  =====================================================
``||g_i|| = 0``              0 (factor is finite: 1/r resp. 1)
finite ``||g_i||``           norm < 1 (normalize) resp. <= c (clip)
``||g_i||`` = inf or NaN     exactly 0 (factor 0, and the engines zero ``g_i``)
masked out (padding)         exactly 0
===========================  =====================================================

Quantile-adaptive clipping (:class:`AdaptiveClip`): the clip of each step is
optimizer state; the step clips with ``Clip(C_t)`` (a tensor read before the
step, also the sensitivity its noise uses), counts the unclipped units
(:func:`centered_unclipped_count`) and, after the noise, moves the clip with
:func:`quantile_clip_update` (see ``docs/adaptive_clipping.md``).

References:
  Andrew, Thakkar, McMahan, Ramaswamy (NeurIPS 2021), "Differentially Private
  Learning with Adaptive Clipping", Algorithm 1 (quantile-adaptive clipping).
  Yang, Zhang, Chen, Liu (2022), "Normalized/Clipped SGD with Perturbation for
  Differentially Private Non-Convex Optimization", Algorithm 1 (DP-NSGD:
  ``h_i = 1 / (r + ||g_i||)``) and DP-SGD (``h_i = min(1, c / ||g_i||)``).
  Abadi et al. (2016), "Deep Learning with Differential Privacy".
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import tensorflow as tf

# Relative safety margin applied to the measured norm before computing the
# factor. Float32 rounding in the norm and in the product h_i * g_i can push a
# contribution a few ulps above its nominal bound; inflating the norm by 1e-6
# (Opacus uses an absolute 1e-6) keeps the bound strict. The effect on the
# update is a relative 1e-6, far below the noise.
NORM_SAFETY_MARGIN = 1e-6


def _validate_positive(name: str, value: float, allow_inf: bool = False) -> float:
  try:
    value = float(value)
  except (TypeError, ValueError) as e:
    raise ValueError(f"`{name}` must be a positive number; got {value!r}.") from e
  if math.isnan(value) or value <= 0 or (math.isinf(value) and not allow_inf):
    raise ValueError(
        f"`{name}` must be a positive{' ' if not allow_inf else ' (possibly infinite) '}"
        f"number; got {value!r}.")
  return value


def global_norms(per_unit_grads: Sequence[tf.Tensor]) -> tf.Tensor:
  """L2 norm of each unit's gradient over all variables.

  Args:
    per_unit_grads: tensors of shape ``[U, *var_shape]``, one per variable.

  Returns:
    ``[U]`` float32 norms. A unit with any NaN/inf entry gets a non-finite norm.

  >>> g = [tf.constant([[3., 0.], [0., 0.]]), tf.constant([[4.], [0.]])]
  >>> global_norms(g).numpy().tolist()
  [5.0, 0.0]
  """
  squares = [
      tf.reduce_sum(tf.reshape(tf.square(tf.cast(g, tf.float32)), [tf.shape(g)[0], -1]), axis=1)
      for g in per_unit_grads
  ]
  return tf.sqrt(tf.add_n(squares))


def _finite_and_masked(norms: tf.Tensor, factors: tf.Tensor, mask: tf.Tensor | None):
  keep = tf.math.is_finite(norms)
  if mask is not None:
    keep = tf.logical_and(keep, tf.cast(mask, tf.bool))
  return tf.where(keep, factors, tf.zeros_like(factors))


@dataclasses.dataclass(frozen=True)
class Normalize:
  """DP-NSGD's per-example normalization ``h_i = 1 / (r + ||g_i||)``.

  ``||h_i g_i|| = ||g_i|| / (r + ||g_i||) < 1`` for any ``r > 0``, so the
  sensitivity of the sum (add/remove-one neighbours) is 1.

  Attributes:
    regularizer: ``r > 0``. Small ``r`` makes every contribution nearly unit
      norm (pure normalization); large ``r`` behaves like SGD scaled by ``1/r``.
  """

  regularizer: float

  def __post_init__(self):
    object.__setattr__(self, "regularizer", _validate_positive("regularizer", self.regularizer))

  @property
  def sensitivity(self) -> float:
    """L2 bound of one unit's contribution to the summed gradient."""
    return 1.0

  def factors(self, norms: tf.Tensor, mask: tf.Tensor | None = None) -> tf.Tensor:
    """Scale factors for ``[U]`` norms; 0 for non-finite norms and masked units.

    >>> Normalize(1.0).factors(tf.constant([0., 3., float("nan")])).numpy().round(4).tolist()
    [1.0, 0.25, 0.0]
    """
    norms = tf.cast(norms, tf.float32)
    safe = tf.where(tf.math.is_finite(norms), norms, tf.zeros_like(norms))
    factors = 1.0 / (self.regularizer + safe * (1.0 + NORM_SAFETY_MARGIN))
    return _finite_and_masked(norms, factors, mask)


def clip_factors(norms: tf.Tensor, l2_norm_clip, mask: tf.Tensor | None = None) -> tf.Tensor:
  """DP-SGD's factors ``h_i = min(1, c / ||g_i||)``, 0 for non-finite norms and masked units.

  Args:
    norms: ``[U]`` per-unit gradient norms.
    l2_norm_clip: ``c``: a positive float (``inf``: no clipping) or a scalar
      float32 tensor (the clip of one step of adaptive clipping, read from the
      optimizer's state before the step).
    mask: optional ``[U]`` boolean; False units get factor 0.

  Returns:
    ``[U]`` factors; every ``h_i g_i`` has norm ``<= c`` (the norm is
    inflated by :data:`NORM_SAFETY_MARGIN` first, so float32 rounding cannot
    push a contribution above ``c``).

  >>> clip_factors(tf.constant([0., 0.5, 4.]), tf.constant(2.0)).numpy().round(4).tolist()
  [1.0, 1.0, 0.5]
  """
  norms = tf.cast(norms, tf.float32)
  safe = tf.where(tf.math.is_finite(norms), norms, tf.zeros_like(norms))
  if not tf.is_tensor(l2_norm_clip) and math.isinf(l2_norm_clip):
    factors = tf.ones_like(safe)
  else:
    clip = tf.cast(l2_norm_clip, tf.float32)
    inflated = safe * (1.0 + NORM_SAFETY_MARGIN)
    factors = tf.where(inflated > clip, clip / tf.maximum(inflated, 1e-30), tf.ones_like(safe))
  return _finite_and_masked(norms, factors, mask)


@dataclasses.dataclass(frozen=True)
class Clip:
  """DP-SGD's per-example clipping ``h_i = min(1, c / ||g_i||)``; sensitivity ``c``.

  Attributes:
    l2_norm_clip: ``c > 0``; ``float('inf')`` disables clipping (then the
      mechanism is not private unless the noise is also 0: for testing only).
      A scalar tensor is the clip of ONE step of adaptive clipping
      (:class:`AdaptiveClip`), read from the optimizer's state at the start of
      the step; its owner keeps it positive and finite, and the same tensor
      is then the sensitivity the noise of that step is computed from.
  """

  l2_norm_clip: float

  def __post_init__(self):
    if not tf.is_tensor(self.l2_norm_clip):
      object.__setattr__(self, "l2_norm_clip",
                         _validate_positive("l2_norm_clip", self.l2_norm_clip, allow_inf=True))

  @property
  def sensitivity(self) -> float:
    return self.l2_norm_clip

  def factors(self, norms: tf.Tensor, mask: tf.Tensor | None = None) -> tf.Tensor:
    """Scale factors for ``[U]`` norms; 0 for non-finite norms and masked units.

    >>> Clip(1.0).factors(tf.constant([0., 0.5, 4., float("inf")])).numpy().round(4).tolist()
    [1.0, 1.0, 0.25, 0.0]
    """
    return clip_factors(norms, self.l2_norm_clip, mask)


# --- quantile-adaptive clipping (Andrew, Thakkar, McMahan, Ramaswamy 2021) -----------------

# Post-processing bounds on the adapted clip: the geometric update can drift to 0 or
# overflow over many steps (e.g. target quantile 0 or 1); clamping the noised result is
# data independent, so it costs no privacy.
ADAPTIVE_CLIP_BOUNDS = (1e-30, 1e30)


def centered_unclipped_count(norms: tf.Tensor, l2_norm_clip, mask: tf.Tensor | None = None
                             ) -> tf.Tensor:
  """``sum_i (1[||g_i|| <= c] - 1/2)`` over the real units: the count query's sum.

  Each real unit adds ``+1/2`` (unclipped) or ``-1/2`` (clipped, or a
  non-finite norm); masked (padding) units add exactly 0. Adding or removing
  one unit changes the sum by at most ``1/2``: the count query's sensitivity
  is 1/2 (replace-one: 1), which is why its noise multiplier is ``2 sigma_b``
  (tensorflow-privacy's ``QuantileEstimatorQuery`` centers the same way).
  "Unclipped" uses the same inflated norm as :func:`clip_factors`, so it is
  exactly the units whose factor is 1.

  Args:
    norms: ``[U]`` per-unit norms (one per example, or per microbatch).
    l2_norm_clip: the clip ``c_t`` that clipped this step.
    mask: optional ``[U]`` boolean of real units.

  Returns:
    A float32 scalar.

  >>> float(centered_unclipped_count(tf.constant([0.5, 3., float("nan"), 1.]), 2.0))
  0.0
  >>> float(centered_unclipped_count(tf.constant([0.5, 0.7, 1.]), 2.0,
  ...                                mask=tf.constant([True, True, False])))
  1.0
  """
  norms = tf.cast(norms, tf.float32)
  clip = tf.cast(l2_norm_clip, tf.float32)
  unclipped = tf.logical_and(tf.math.is_finite(norms),
                             norms * (1.0 + NORM_SAFETY_MARGIN) <= clip)
  centered = tf.where(unclipped, 0.5, -0.5)
  if mask is not None:
    centered = tf.where(tf.cast(mask, tf.bool), centered, tf.zeros_like(centered))
  return tf.reduce_sum(centered)


def quantile_clip_update(l2_norm_clip, noised_unclipped_fraction, target_unclipped_quantile,
                         clip_learning_rate):
  """The geometric clip update ``C_{t+1} = C_t exp(-eta_C (b_t - gamma))``.

  ``b_t`` is the NOISED fraction of unclipped units of step ``t``: the update is
  post-processing of that noised count and of public values only, so it costs
  no privacy beyond the count query itself. The result is clamped to
  :data:`ADAPTIVE_CLIP_BOUNDS` (data independent).

  Args:
    l2_norm_clip: ``C_t > 0`` (float or scalar tensor).
    noised_unclipped_fraction: ``b_t = (sum_i 1[||g_i|| <= C_t] + N(0, sigma_b^2)) / m``.
    target_unclipped_quantile: ``gamma`` in [0, 1].
    clip_learning_rate: ``eta_C >= 0``.

  Returns:
    ``C_{t+1}`` as a float32 tensor. Too many unclipped (``b_t > gamma``)
    shrinks the clip, too few grows it; ``b_t = gamma`` leaves it unchanged.

  References:
    Andrew, Thakkar, McMahan, Ramaswamy (NeurIPS 2021), "Differentially
    Private Learning with Adaptive Clipping", Algorithm 1 and the geometric
    update (Sec. 2.1, ``C <- C exp(-eta_C (b - gamma))``); Sec. 3.1 for the
    noised ``b``.

  >>> float(quantile_clip_update(1.0, 0.5, 0.5, 0.2))
  1.0
  >>> round(float(quantile_clip_update(1.0, 1.0, 0.5, 0.2)), 6)  # exp(-0.1)
  0.904837
  """
  update = tf.exp(-tf.cast(clip_learning_rate, tf.float32)
                  * (tf.cast(noised_unclipped_fraction, tf.float32)
                     - tf.cast(target_unclipped_quantile, tf.float32)))
  low, high = ADAPTIVE_CLIP_BOUNDS
  return tf.clip_by_value(tf.cast(l2_norm_clip, tf.float32) * update, low, high)


def _validate_unit_interval(name: str, value) -> float:
  try:
    value = float(value)
  except (TypeError, ValueError) as e:
    raise ValueError(f"`{name}` must be a number in [0, 1]; got {value!r}.") from e
  if not 0.0 <= value <= 1.0:
    raise ValueError(f"`{name}` must be in [0, 1]; got {value!r}.")
  return value


def _validate_non_negative(name: str, value) -> float:
  try:
    value = float(value)
  except (TypeError, ValueError) as e:
    raise ValueError(f"`{name}` must be a finite number >= 0; got {value!r}.") from e
  if not (math.isfinite(value) and value >= 0):
    raise ValueError(f"`{name}` must be a finite number >= 0; got {value!r}.")
  return value


# Andrew et al. (2021) use eta_C = 0.2 with the geometric update.
DEFAULT_CLIP_LEARNING_RATE = 0.2


@dataclasses.dataclass(frozen=True)
class AdaptiveClip:
  """The hyperparameters of quantile-adaptive clipping (Andrew et al. 2021, Algorithm 1).

  The clip of step ``t`` is optimizer state; each step clips with it (the
  transform is ``Clip(C_t)``, whose sensitivity ``C_t`` also sets that step's
  noise), releases a noised count of unclipped units, then moves the clip with
  :func:`quantile_clip_update`.

  Attributes:
    l2_norm_clip: the initial clip ``C_0 > 0`` (finite).
    target_unclipped_quantile: ``gamma`` in [0, 1], the fraction of units
      that should be unclipped.
    clip_learning_rate: ``eta_C >= 0`` (0 keeps the clip fixed but still
      spends the count query).
  """

  l2_norm_clip: float
  target_unclipped_quantile: float
  clip_learning_rate: float = DEFAULT_CLIP_LEARNING_RATE

  def __post_init__(self):
    object.__setattr__(self, "l2_norm_clip", _validate_positive("l2_norm_clip",
                                                                self.l2_norm_clip))
    object.__setattr__(self, "target_unclipped_quantile", _validate_unit_interval(
        "target_unclipped_quantile", self.target_unclipped_quantile))
    object.__setattr__(self, "clip_learning_rate", _validate_non_negative(
        "clip_learning_rate", self.clip_learning_rate))

  def at(self, l2_norm_clip) -> Clip:
    """The transform of one step: ``Clip`` at that step's clip ``C_t``."""
    return Clip(l2_norm_clip)

  def update(self, l2_norm_clip, noised_unclipped_fraction):
    """``C_{t+1}`` from ``C_t`` and the noised fraction (:func:`quantile_clip_update`)."""
    return quantile_clip_update(l2_norm_clip, noised_unclipped_fraction,
                                self.target_unclipped_quantile, self.clip_learning_rate)


Transform = Normalize | Clip


def weighted_sum(per_unit_grads: Sequence[tf.Tensor], factors: tf.Tensor) -> list[tf.Tensor]:
  """``sum_i factors[i] * g_i`` per variable; units with factor 0 add exactly 0.

  Units whose factor is 0 are zeroed with ``tf.where`` before the product, so a
  NaN/inf gradient cannot leak into the sum through ``0 * nan = nan``.

  >>> weighted_sum([tf.constant([[1., 2.], [float("nan"), 1.]])], tf.constant([2., 0.]))[0].numpy().tolist()
  [2.0, 4.0]
  """
  out = []
  for g in per_unit_grads:
    f = tf.cast(factors, g.dtype)
    keep = tf.reshape(f > 0, [-1] + [1] * (len(g.shape) - 1))
    g = tf.where(keep, g, tf.zeros([], g.dtype))  # broadcast: no batch-sized constant
    out.append(tf.tensordot(f, g, axes=[[0], [0]]))
  return out


def transform_and_sum(per_unit_grads: Sequence[tf.Tensor], transform: Transform,
                      mask: tf.Tensor | None = None):
  """Pure DP aggregation of materialised per-unit gradients.

  Args:
    per_unit_grads: ``[U, *var_shape]`` tensors, one per variable.
    transform: :class:`Normalize` or :class:`Clip`.
    mask: optional ``[U]`` boolean; False units (padding) contribute 0.

  Returns:
    ``(summed, norms, factors)``: the per-variable sums of the scaled
    contributions (each unit's contribution bounded by
    ``transform.sensitivity``), the ``[U]`` norms and the ``[U]`` factors.
  """
  norms = global_norms(per_unit_grads)
  factors = transform.factors(norms, mask)
  return weighted_sum(per_unit_grads, factors), norms, factors
