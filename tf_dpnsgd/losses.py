"""Per-example losses from whatever ``model.compile(loss=...)`` received.

Keras 3 reduces the compiled loss to a scalar; DP training needs one loss per
example. :func:`per_example_loss_fn` rebuilds the unreduced losses from the
user's loss spec (name, function, ``keras.losses.Loss`` with any reduction,
or a list/dict of them per output with ``loss_weights``). The per-example loss
of example ``i`` is the mean of its unreduced values over non-batch axes, so
that the mean over the batch equals Keras' default
``"sum_over_batch_size"`` reduction.

Masked values (sequence models, e.g. a causal LM's per-token cross-entropy):
when the unreduced values carry a Keras mask (``SparseCategoricalCrossentropy(
..., ignore_class=k)`` masks the positions labelled ``k``; a prediction's own
Keras mask of the values' rank counts too, as in ``Loss.__call__``), the
per-example loss is the mean over that example's unmasked positions only:
``sum_t m_t l_t / max(sum_t m_t, 1)``. Masked positions contribute exactly
nothing (their values are replaced by 0 with ``tf.where``, not multiplied by 0,
so a NaN there does not reach the loss); the denominator is the example's own
count (no other row enters its loss); a row with no unmasked position has loss
0 and gradient 0. This is the per-example analogue of Keras' masked
``"sum_over_batch_size"`` (the mean over valid entries, ``apply_mask`` in
``keras.losses.Loss``); for a row without masked positions it is the plain
mean. See docs/text_library_path.md, "Causal language models".
"""

from __future__ import annotations

from typing import Any, Callable

import keras
import tensorflow as tf


def _keras_mask(tensor):
  """The Keras mask a Keras op attached to ``tensor`` (TensorFlow backend), or None."""
  return getattr(tensor, "_keras_mask", None)


def _mean_over_non_batch_axes(values: tf.Tensor, mask=None) -> tf.Tensor:
  """``[B]``: the mean of each row's values, over its unmasked entries if ``mask``."""
  values = tf.convert_to_tensor(values)
  if mask is not None and values.shape.rank is not None and values.shape.rank >= 1:
    return _masked_mean(values, mask)
  if values.shape.rank is None:
    raise ValueError("Per-example loss values must have a known rank.")
  if values.shape.rank == 0:
    raise ValueError(
        "The compiled loss returned a scalar for a batch: it reduces across examples, "
        "which DP training cannot split into per-example losses. Use a Keras loss "
        "or a function `fn(y_true, y_pred)` returning one value per example.")
  if values.shape.rank == 1:
    return values
  return tf.reduce_mean(values, axis=list(range(1, values.shape.rank)))


def _masked_mean(values: tf.Tensor, mask) -> tf.Tensor:
  """``sum_t m_t v_t / max(sum_t m_t, 1)`` per row; masked entries enter as exact zeros."""
  mask = tf.convert_to_tensor(mask)
  if mask.shape.rank is not None and mask.shape.rank > values.shape.rank:
    raise ValueError(f"A loss mask of shape {mask.shape} for loss values of shape "
                     f"{values.shape}: the mask must mark the values' entries.")
  mask = tf.cast(mask, tf.bool)
  while mask.shape.rank is not None and mask.shape.rank < values.shape.rank:
    mask = mask[..., tf.newaxis]  # a per-row (or per-position) mask over trailing axes
  mask = tf.broadcast_to(mask, tf.shape(values))
  if values.shape.rank == 1:
    return tf.where(mask, values, tf.zeros_like(values))
  axes = list(range(1, values.shape.rank))
  total = tf.reduce_sum(tf.where(mask, values, tf.zeros_like(values)), axis=axes)
  count = tf.reduce_sum(tf.cast(mask, values.dtype), axis=axes)
  return total / tf.maximum(count, tf.ones_like(count))


def _combined_mask(values, in_mask):
  """The loss values' Keras mask and the prediction's (``in_mask``), combined as
  ``keras.losses.Loss`` does (either one alone, or both). A prediction mask of
  another rank than the values (a loss that reduces its own positions) is not
  theirs to mask and is left out."""
  out_mask = _keras_mask(values)
  values_rank = tf.convert_to_tensor(values).shape.rank
  if in_mask is not None and tf.convert_to_tensor(in_mask).shape.rank != values_rank:
    in_mask = None
  if in_mask is None or out_mask is None:
    return out_mask if in_mask is None else in_mask
  return tf.logical_and(tf.cast(out_mask, tf.bool), tf.cast(in_mask, tf.bool))


def _unreduced(loss) -> Callable[[Any, Any], tf.Tensor]:
  """An ``fn(y_true, y_pred) -> [B]`` for one output's loss spec."""
  if isinstance(loss, str):
    loss = keras.losses.get(loss)
  if isinstance(loss, keras.losses.Loss):
    loss_obj = loss

    def fn(y_true, y_pred):
      pred_mask = _keras_mask(y_pred)
      y_pred = tf.cast(y_pred, loss_obj.dtype or "float32")
      if y_true.dtype.is_floating:
        y_true = tf.cast(y_true, y_pred.dtype)
      # `Loss.call` is the unreduced loss: reduction, masks and sample weights
      # are applied only by `Loss.__call__`.
      values = loss_obj.call(y_true, y_pred)
      return _mean_over_non_batch_axes(values, _combined_mask(values, pred_mask))

    return fn
  if callable(loss):
    def fn(y_true, y_pred):
      if y_true.dtype.is_floating:
        y_true = tf.cast(y_true, y_pred.dtype)
      values = loss(y_true, y_pred)
      mask = _combined_mask(values, _keras_mask(y_pred))
      return _mean_over_non_batch_axes(values, mask)

    return fn
  raise ValueError(f"Unsupported loss {loss!r}: pass a Keras loss name, a "
                   "`keras.losses.Loss`, or a function `fn(y_true, y_pred)`.")


def per_example_loss_fn(loss, loss_weights=None, output_names=None):
  """Builds ``fn(y_true, y_pred) -> [B]`` per-example losses.

  Args:
    loss: what was passed to ``compile(loss=...)``: one spec, a list (one per
      output), or a dict keyed by output name.
    loss_weights: optional list/dict of per-output weights, as in ``compile``.
    output_names: the model's output names (needed for dict specs).

  Returns:
    A function of ``(y_true, y_pred)`` with the same nesting as the model's
    outputs, returning a ``[B]`` tensor.
  """
  if loss is None:
    raise ValueError("Compile the DP model with a `loss`.")
  if isinstance(loss, dict):
    if not output_names:
      raise ValueError("A dict of losses needs a model with named outputs.")
    names = [n for n in output_names if n in loss]
    unknown = set(loss) - set(output_names)
    if unknown:
      raise ValueError(f"Losses given for unknown outputs {sorted(unknown)}; outputs are {output_names}.")
    fns = {n: _unreduced(loss[n]) for n in names}
    weights = dict(loss_weights or {})

    def fn(y_true, y_pred):
      y_pred_d = y_pred if isinstance(y_pred, dict) else dict(zip(output_names, tf.nest.flatten(y_pred)))
      y_true_d = y_true if isinstance(y_true, dict) else dict(zip(output_names, tf.nest.flatten(y_true)))
      return tf.add_n([weights.get(n, 1.0) * fns[n](y_true_d[n], y_pred_d[n]) for n in names])

    return fn
  if isinstance(loss, (list, tuple)):
    fns = [_unreduced(l) for l in loss]
    weights = list(loss_weights) if loss_weights is not None else [1.0] * len(fns)

    def fn(y_true, y_pred):
      yt, yp = tf.nest.flatten(y_true), tf.nest.flatten(y_pred)
      return tf.add_n([w * f(t, p) for w, f, t, p in zip(weights, fns, yt, yp)])

    return fn
  single = _unreduced(loss)
  weight = float(loss_weights) if isinstance(loss_weights, (int, float)) else 1.0

  def fn(y_true, y_pred):
    if isinstance(y_pred, (list, tuple, dict)):
      y_pred = tf.nest.flatten(y_pred)[0]
    if isinstance(y_true, (list, tuple, dict)):
      y_true = tf.nest.flatten(y_true)[0]
    y_true = tf.convert_to_tensor(y_true)
    return weight * single(y_true, y_pred)

  return fn
