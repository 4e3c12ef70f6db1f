"""Per-example losses from whatever ``model.compile(loss=...)`` received.

Keras 3 reduces the compiled loss to a scalar; DP training needs one loss per
example. :func:`per_example_loss_fn` rebuilds the unreduced losses from the
user's loss spec (name, function, ``keras.losses.Loss`` with any reduction,
or a list/dict of them per output with ``loss_weights``). The per-example loss
of example ``i`` is the mean of its unreduced values over non-batch axes, so
that the mean over the batch equals Keras' default
``"sum_over_batch_size"`` reduction.
"""

from __future__ import annotations

from typing import Any, Callable

import keras
import tensorflow as tf


def _mean_over_non_batch_axes(values: tf.Tensor) -> tf.Tensor:
  values = tf.convert_to_tensor(values)
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


def _unreduced(loss) -> Callable[[Any, Any], tf.Tensor]:
  """An ``fn(y_true, y_pred) -> [B]`` for one output's loss spec."""
  if isinstance(loss, str):
    loss = keras.losses.get(loss)
  if isinstance(loss, keras.losses.Loss):
    loss_obj = loss

    def fn(y_true, y_pred):
      y_pred = tf.cast(y_pred, loss_obj.dtype or "float32")
      if y_true.dtype.is_floating:
        y_true = tf.cast(y_true, y_pred.dtype)
      # `Loss.call` is the unreduced loss: reduction and sample weights are
      # applied only by `Loss.__call__`.
      return _mean_over_non_batch_axes(loss_obj.call(y_true, y_pred))

    return fn
  if callable(loss):
    def fn(y_true, y_pred):
      if y_true.dtype.is_floating:
        y_true = tf.cast(y_true, y_pred.dtype)
      return _mean_over_non_batch_axes(loss(y_true, y_pred))

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
