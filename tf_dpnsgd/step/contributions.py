"""Phase 1 of the DP step: ``sum_i h_i g_i`` from the model's engine, in physical chunks.

``physical_batch_size`` splits the logical batch into fixed-size chunks (same
sum, less memory); the noise is still added once per logical batch (phase 2).
"""

from __future__ import annotations

import tensorflow as tf

from tf_dpnsgd import per_example as per_example_lib
from tf_dpnsgd.per_example import loss_scale as loss_scale_lib


def chunk_rows(i, size, batch):
  """Row indices (``[size]``) of physical chunk ``i``, and which of them are real rows.

  Every chunk has exactly ``size`` rows, a static shape: indices past the end of
  the batch repeat its last row and are marked False (the engine masks them, so
  they contribute exactly zero). A short last slice ``x[i * size:batch]`` has a
  data-dependent shape, which XLA (``jit_compile=True``) compiles as a
  ``size``-row slice whose START is clamped back into range: it would count
  some examples twice, each then contributing twice the sensitivity.
  """
  rows = i * size + tf.range(size)
  return tf.minimum(rows, batch - 1), rows < batch


def gather_rows(x, rows):
  return tf.nest.map_structure(lambda t: tf.gather(t, rows), x)


def contributions(model, x, y, mask, num_microbatches, transform):
  """The engine's :class:`~tf_dpnsgd.per_example.EngineOutput` for the logical batch."""
  engine = model._dp_engine
  size = model.physical_batch_size
  if size is None:
    return loss_scale_lib.scaled_contributions(engine, model, model._dp_loss_fn, x, y,
                                               transform, model.loss_scale, mask=mask,
                                               num_microbatches=num_microbatches)
  if num_microbatches:
    raise ValueError("physical_batch_size cannot be combined with num_microbatches; "
                     "the microbatch is already the unit of computation.")
  return chunked_contributions(model, engine, transform, x, y, mask, size)


def chunked_contributions(model, engine, transform, x, y, mask, size):
  """:func:`contributions` over fixed-size chunks of ``size`` rows (a ``tf.while_loop``)."""
  batch = per_example_lib.vectorized.batch_size_of(x)
  num_chunks = (batch + size - 1) // size
  variables = model.trainable_variables
  y_spec = per_example_lib.base.output_spec(model, x)
  pred_dtypes = [t.dtype for t in tf.nest.flatten(y_spec)]

  def new_ta(dtype):
    return tf.TensorArray(dtype, size=num_chunks, infer_shape=False)

  def body(i, acc, ta_losses, ta_norms, ta_factors, ta_preds):
    rows, real = chunk_rows(i, size, batch)  # fixed-size chunks (see chunk_rows)
    m = real if mask is None else tf.logical_and(real, tf.gather(mask, rows))
    out = loss_scale_lib.scaled_contributions(
        engine, model, model._dp_loss_fn, gather_rows(x, rows), gather_rows(y, rows),
        transform, model.loss_scale, mask=m, num_microbatches=None)
    acc = [a + tf.cast(s, a.dtype) for a, s in zip(acc, out.summed)]
    preds = [ta.write(i, p) for ta, p in zip(ta_preds, tf.nest.flatten(out.y_pred))]
    return (i + 1, acc, ta_losses.write(i, out.losses), ta_norms.write(i, out.norms),
            ta_factors.write(i, out.factors), preds)

  init = (tf.constant(0), [tf.zeros(v.shape, v.dtype) for v in variables],
          new_ta(tf.float32), new_ta(tf.float32), new_ta(tf.float32),
          [new_ta(d) for d in pred_dtypes])
  _, acc, ta_l, ta_n, ta_f, ta_p = tf.while_loop(
      lambda i, *_: i < num_chunks, body, init, parallel_iterations=1)

  def concat(ta, shape=(None,)):
    t = ta.concat()[:batch]  # drop the repeated rows of the last chunk
    t.set_shape(shape)
    return t

  y_pred = tf.nest.pack_sequence_as(
      y_spec, [concat(ta, s.shape) for ta, s in zip(ta_p, tf.nest.flatten(y_spec))])
  return per_example_lib.EngineOutput(summed=acc, norms=concat(ta_n), factors=concat(ta_f),
                                      losses=concat(ta_l), y_pred=y_pred)


__all__ = ["chunk_rows", "chunked_contributions", "contributions", "gather_rows"]
