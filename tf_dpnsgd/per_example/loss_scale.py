"""A fixed, public loss scale for mixed precision, undone before the transform.

Under ``mixed_float16`` the backward pass runs in float16, whose smallest
normal value is ``6.1e-5``: small gradient entries would flush to zero. Keras
multiplies the loss by a scale ``S`` and wraps the optimizer in
``keras.optimizers.LossScaleOptimizer``, which changes ``S`` (and skips the
step) depending on whether any gradient of the batch overflowed. That is a
data-dependent decision released through the weights and through the scale
itself (a variable saved with checkpoints), so the DP train step does not use
it (``DPModel.compile`` refuses a ``LossScaleOptimizer`` and passes
``auto_scale_loss=False`` to Keras). Instead:

1. every engine differentiates ``S * loss_i`` with a fixed ``S`` chosen
   without looking at data (:data:`DEFAULT_FLOAT16_LOSS_SCALE`, or the
   ``loss_scale`` given to ``compile``), so the float16 backward pass keeps
   its small entries;
2. the engine's norms of the scaled per-unit gradients ``S g_u`` (computed in
   float32, float64 in the layer-wise rules) are divided by ``S`` before the
   transform, and the factors are divided by ``S`` (:class:`Unscaled`), so
   ``h_u (S g_u) = transform.factors(||g_u||) g_u``;
3. a unit whose float16 gradient overflowed has a non-finite norm and
   contributes exactly zero (as every engine already guarantees); the step is
   never skipped and no state depends on the data.

Formal guarantee: ``S`` is a power of two in ``[1, 2^24]``, so dividing a
float32 norm or factor by ``S`` is exact (no rounding) except below the
float32 normal range (``1.2e-38``), where the error is at most ``2^-149``
absolute. Hence the contribution of every unit is exactly what the unscaled
transform gives for the (float16-rounded) gradient ``g_u`` that enters the
sum, and its norm is at most ``transform.sensitivity``, as in float32
training. The noise (float32, from ``transform.sensitivity``) is unchanged.

==================================  ==========================================
unit                                contribution
==================================  ==========================================
finite scaled gradient              ``transform.factors(||g_u||) g_u``
float16 overflow (``inf``/NaN)      exactly 0 (factor 0; counted in the
                                    ``nonfinite_examples`` metric)
masked out (padding)                exactly 0
==================================  ==========================================

References:
  Micikevicius et al. (2018), "Mixed Precision Training" (loss scaling).
"""

from __future__ import annotations

import dataclasses
import math

import tensorflow as tf

from tf_dpnsgd.per_example.base import EngineOutput

#: Default scale when some layer computes in float16. Keras starts its dynamic
#: scale at ``2**15`` on the MEAN loss of a batch; the DP engines differentiate
#: each example's own loss (``B`` times larger gradients), so ``2**15`` on a
#: batch of 256 corresponds to ``2**7`` here. Overflowing units are dropped (not
#: clipped), so the default leans low: entries up to ``65504 / 128 = 512`` fit.
DEFAULT_FLOAT16_LOSS_SCALE = 2.0 ** 7

#: The largest scale accepted: ``2**24`` keeps ``S * loss`` and ``S * g`` far
#: from float32 overflow for any loss a float16 network can produce.
MAX_LOSS_SCALE = 2.0 ** 24


def validate_loss_scale(loss_scale) -> float:
  """A power of two in ``[1, 2^24]`` (so that unscaling is exact), as a float.

  >>> validate_loss_scale(128)
  128.0
  """
  try:
    value = float(loss_scale)
  except (TypeError, ValueError) as e:
    raise ValueError(f"`loss_scale` must be a power of two in [1, 2**24]; got "
                     f"{loss_scale!r}.") from e
  if isinstance(loss_scale, bool) or not (1.0 <= value <= MAX_LOSS_SCALE) \
      or math.frexp(value)[0] != 0.5:
    raise ValueError(f"`loss_scale` must be a power of two in [1, 2**24] (dividing by it must "
                     f"be exact); got {loss_scale!r}. It is fixed (never adapted to the data).")
  return value


def uses_float16(model) -> bool:
  """True if the model or any of its layers computes in float16."""
  layers = [model] + list(model._flatten_layers(include_self=False, recursive=True))
  return any(getattr(layer, "compute_dtype", None) == "float16" for layer in layers)


def default_loss_scale(model) -> float:
  """:data:`DEFAULT_FLOAT16_LOSS_SCALE` if any layer computes in float16, else 1.

  bfloat16 has the range of float32 and needs no scaling.
  """
  return DEFAULT_FLOAT16_LOSS_SCALE if uses_float16(model) else 1.0


@dataclasses.dataclass(frozen=True)
class Unscaled:
  """The transform applied to gradients of ``scale * loss``, as if to those of ``loss``.

  ``factors(n) = transform.factors(n / scale) / scale``, so the scaled
  gradient ``scale * g`` times the factor is ``transform.factors(||g||) * g``.
  Both divisions are exact (``scale`` is a power of two, see
  :func:`validate_loss_scale`).

  >>> from tf_dpnsgd import transforms
  >>> t = Unscaled(transforms.Clip(1.0), 128.0)
  >>> (t.factors(tf.constant([64., 512., float("inf")])) * 128).numpy().round(6).tolist()
  [1.0, 0.25, 0.0]
  """

  transform: object
  scale: float

  @property
  def sensitivity(self) -> float:
    return self.transform.sensitivity

  def factors(self, norms: tf.Tensor, mask: tf.Tensor | None = None) -> tf.Tensor:
    norms = tf.cast(norms, tf.float32)
    return self.transform.factors(norms / self.scale, mask) / self.scale


def scaled_contributions(engine, model, loss_fn, x, y, transform, loss_scale: float,
                         **kwargs) -> EngineOutput:
  """``engine`` on ``loss_scale * loss``, with the output expressed for the unscaled loss.

  Args:
    engine: a per-example engine (see :mod:`tf_dpnsgd.per_example`).
    model, loss_fn, x, y, transform: as the engine's.
    loss_scale: a value accepted by :func:`validate_loss_scale`; 1 calls the
      engine unchanged.
    **kwargs: passed to the engine (``mask``, ``num_microbatches``).

  Returns:
    :class:`EngineOutput` whose ``summed`` is ``sum_u transform.factors(||g_u||) g_u``
    and whose ``norms``, ``factors`` and ``losses`` are those of the unscaled
    loss (a non-finite scaled norm stays non-finite).
  """
  scale = validate_loss_scale(loss_scale)
  if scale == 1.0:
    return engine(model, loss_fn, x, y, transform, **kwargs)

  def scaled_loss_fn(y_true, y_pred):
    return tf.cast(loss_fn(y_true, y_pred), tf.float32) * scale

  out = engine(model, scaled_loss_fn, x, y, Unscaled(transform, scale), **kwargs)
  return dataclasses.replace(out, norms=tf.cast(out.norms, tf.float32) / scale,
                             factors=out.factors * scale,
                             losses=tf.cast(out.losses, tf.float32) / scale)
