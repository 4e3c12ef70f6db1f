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

References:
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


@dataclasses.dataclass(frozen=True)
class Clip:
  """DP-SGD's per-example clipping ``h_i = min(1, c / ||g_i||)``; sensitivity ``c``.

  Attributes:
    l2_norm_clip: ``c > 0``; ``float('inf')`` disables clipping (then the
      mechanism is not private unless the noise is also 0: for testing only).
  """

  l2_norm_clip: float

  def __post_init__(self):
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
    norms = tf.cast(norms, tf.float32)
    safe = tf.where(tf.math.is_finite(norms), norms, tf.zeros_like(norms))
    if math.isinf(self.l2_norm_clip):
      factors = tf.ones_like(safe)
    else:
      inflated = safe * (1.0 + NORM_SAFETY_MARGIN)
      factors = tf.where(inflated > self.l2_norm_clip,
                         self.l2_norm_clip / tf.maximum(inflated, 1e-30),
                         tf.ones_like(safe))
    return _finite_and_masked(norms, factors, mask)


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
    g = tf.where(keep, g, tf.zeros_like(g))
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
