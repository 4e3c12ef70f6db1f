"""Phase 1 of the DP step: ``sum_i h_i g_i`` from the model's engine, in physical chunks.

``physical_batch_size`` splits the logical batch into fixed-size chunks (same
sum, less memory); the noise is still added once per logical batch (phase 2).

Text batches at their real length (``length_key``, e.g. ``"padding_mask"``):
after the logical batch is drawn its rows are ordered by length and each
chunk is cut to its own longest row (:func:`trim_to_longest`), so a chunk of
short sentences does not pay for the batch's longest one. Exact for models
whose output for an example does not depend on its padding positions
(attention masking the padding, a [CLS] or masked pooling): every example's
gradient is then unchanged (docs/per_example.md, "Text batches at their real
length"). The sum, the noise and the ledger are those of the logical batch;
the per-example outputs are returned in the batch's own order. For a model
that does not mask its padding the cut is a privacy failure, not an accuracy
one (one example's length changes the other rows' gradients in its chunk):
the guard refuses such models before the first step
(:mod:`tf_dpnsgd.padding_probe`).
"""

from __future__ import annotations

import tensorflow as tf

from tf_dpnsgd import per_example as per_example_lib
from tf_dpnsgd.per_example import factored
from tf_dpnsgd.per_example import loss_scale as loss_scale_lib
from tf_dpnsgd.per_example import units as units_lib


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


def sequence_lengths(padding_mask):
  """``[B]`` int32: one past each row's last real position (0 for a row of padding only).

  >>> sequence_lengths(tf.constant([[1, 1, 0, 0], [1, 1, 1, 0], [0, 0, 0, 0]])).numpy().tolist()
  [2, 3, 0]
  """
  real = tf.cast(padding_mask, tf.bool)
  positions = tf.range(1, tf.shape(real)[1] + 1)
  return tf.reduce_max(tf.where(real, positions[None, :], 0), axis=1)


def trim_to_longest(x, length_key):
  """``x``'s sequence tensors cut to the longest row of ``x[length_key]`` (at least 1).

  Every tensor of the dict ``x`` whose axis 1 has the padding mask's (static)
  length is sliced to ``[:, :n]``, ``n`` one past the last real position of
  any row; other tensors are returned as they are. Positions kept keep their
  index (right padding is dropped, nothing is shifted).

  >>> x = {"padding_mask": tf.constant([[1, 0, 0], [1, 1, 0]]), "token_ids": tf.constant([[5, 0, 0], [6, 7, 0]])}
  >>> trim_to_longest(x, "padding_mask")["token_ids"].numpy().tolist()
  [[5, 0], [6, 7]]
  """
  n = tf.maximum(tf.reduce_max(sequence_lengths(x[length_key])), 1)
  return cut_to_length(x, length_key, n)


def cut_to_length(x, length_key, n):
  """``x``'s sequence tensors cut to their first ``n`` positions, as :func:`trim_to_longest`.

  Every tensor of the dict ``x`` whose axis 1 has ``x[length_key]``'s static
  length is sliced to ``[:, :n]``; other tensors are returned as they are.
  The padding probe (:mod:`tf_dpnsgd.padding_probe`) cuts with this same
  function, so it tests the cut the step makes.

  >>> x = {"padding_mask": tf.constant([[1, 0, 0]]), "label": tf.constant([[4]])}
  >>> {k: v.shape.as_list() for k, v in cut_to_length(x, "padding_mask", 2).items()}
  {'padding_mask': [1, 2], 'label': [1, 1]}
  """
  length = x[length_key].shape[1]
  return {k: (t[:, :n] if len(t.shape) >= 2 and t.shape[1] == length else t)
          for k, t in x.items()}


def check_length_key(x, length_key):
  """Raises ``ValueError`` unless ``x`` is a dict with a ``[B, L]`` ``x[length_key]``, static L."""
  if not isinstance(x, dict) or length_key not in x:
    raise ValueError(f"Length bucketing needs dict inputs with a {length_key!r} entry (e.g. "
                     f"keras-hub's token dict); got {type(x).__name__}.")
  mask = x[length_key]
  if len(mask.shape) != 2 or mask.shape[1] is None:
    raise ValueError(f"Length bucketing needs a [batch, length] {length_key!r} with a static "
                     f"length; got shape {mask.shape}.")


def contributions(model, x, y, mask, num_microbatches, transform, length_key=None):
  """The engine's :class:`~tf_dpnsgd.per_example.EngineOutput` for the logical batch.

  ``length_key``: with ``model.physical_batch_size``, the padding mask's key
  in ``x``: chunks are formed from rows ordered by length and cut to their
  longest row (see the module docstring); None: every chunk at ``x``'s length.
  """
  engine = model._dp_engine
  size = model.physical_batch_size
  if length_key is None:
    length_key = getattr(model, "_dp_length_key", None)
  rows_per_user = getattr(model, "_dp_rows_per_user", None)
  if rows_per_user:  # user-level: units of k rows, one user each (tf_dpnsgd.users)
    if size is not None or num_microbatches:
      raise ValueError("User-level units (privacy_unit='user') are groups of k rows already: "
                       "drop physical_batch_size and num_microbatches.")
    # Layer-wise slots where the model's engine is layer-wise (auto), else the loop.
    return loss_scale_lib.scaled_contributions(units_lib.unit_engine_for(engine), model,
                                               model._dp_loss_fn, x, y, transform,
                                               model.loss_scale, mask=mask,
                                               rows_per_unit=rows_per_user)
  if size is None:
    return loss_scale_lib.scaled_contributions(engine, model, model._dp_loss_fn, x, y,
                                               transform, model.loss_scale, mask=mask,
                                               num_microbatches=num_microbatches)
  if num_microbatches:
    raise ValueError("physical_batch_size cannot be combined with num_microbatches; "
                     "the microbatch is already the unit of computation.")
  return chunked_contributions(model, engine, transform, x, y, mask, size, length_key)


def chunked_contributions(model, engine, transform, x, y, mask, size, length_key=None):
  """:func:`contributions` over fixed-size chunks of ``size`` rows (a ``tf.while_loop``).

  With ``length_key`` the rows are first ordered by length (longest first, a
  data-dependent permutation of the logical batch: the sum is the same) and
  each chunk's sequence tensors are cut to its longest row; the per-example
  outputs are put back into the batch's order. The cut lengths are
  data-dependent shapes, so this runs in graph mode but not under XLA
  (``jit_compile=True`` fails to compile the slice).
  """
  order = None
  if length_key is not None:
    check_length_key(x, length_key)
    order = tf.argsort(sequence_lengths(x[length_key]), direction="DESCENDING", stable=True)
    x, y = gather_rows(x, order), gather_rows(y, order)
    mask = None if mask is None else tf.gather(mask, order)
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
    x_chunk = gather_rows(x, rows)
    if length_key is not None:
      x_chunk = trim_to_longest(x_chunk, length_key)
    out = loss_scale_lib.scaled_contributions(
        engine, model, model._dp_loss_fn, x_chunk, gather_rows(y, rows),
        transform, model.loss_scale, mask=m, num_microbatches=None)
    acc = [a + tf.cast(s, a.dtype) for a, s in zip(acc, out.summed)]
    preds = [ta.write(i, p) for ta, p in zip(ta_preds, tf.nest.flatten(out.y_pred))]
    return (i + 1, acc, ta_losses.write(i, out.losses), ta_norms.write(i, out.norms),
            ta_factors.write(i, out.factors), preds)

  init = (tf.constant(0), [factored.runtime_zeros(v.shape, v.dtype) for v in variables],
          new_ta(tf.float32), new_ta(tf.float32), new_ta(tf.float32),
          [new_ta(d) for d in pred_dtypes])
  _, acc, ta_l, ta_n, ta_f, ta_p = tf.while_loop(
      lambda i, *_: i < num_chunks, body, init, parallel_iterations=1)

  inverse = None if order is None else tf.math.invert_permutation(order)

  def concat(ta, shape=(None,)):
    t = ta.concat()[:batch]  # drop the repeated rows of the last chunk
    if inverse is not None:  # back to the batch's order
      t = tf.gather(t, inverse)
    t.set_shape(shape)
    return t

  y_pred = tf.nest.pack_sequence_as(
      y_spec, [concat(ta, s.shape) for ta, s in zip(ta_p, tf.nest.flatten(y_spec))])
  return per_example_lib.EngineOutput(summed=acc, norms=concat(ta_n), factors=concat(ta_f),
                                      losses=concat(ta_l), y_pred=y_pred)


__all__ = ["check_length_key", "chunk_rows", "chunked_contributions", "contributions",
           "cut_to_length", "gather_rows", "sequence_lengths", "trim_to_longest"]
