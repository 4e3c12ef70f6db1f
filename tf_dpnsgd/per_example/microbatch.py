"""The loop engine: one unit at a time (an example, or a microbatch).

For each unit ``u`` (in a ``tf.while_loop``): the gradient ``g_u`` of the
unit's mean loss with an ordinary tape, its norm, ``h_u``, and ``h_u g_u``
added to a running sum. Works for any model an ordinary training step works
for (no pfor conversion, no layer rules) and holds only one unit's gradient at
a time; it is the slowest engine (``U`` small steps per batch) and the
reference the other engines are tested against.
"""

from __future__ import annotations

import tensorflow as tf

from tf_dpnsgd import transforms
from tf_dpnsgd.per_example import factored
from tf_dpnsgd.per_example import stateless
from tf_dpnsgd.per_example.base import EngineOutput, output_spec, variable_gradients
from tf_dpnsgd.per_example.vectorized import (batch_size_of, check_mask_and_microbatches,
                                              check_microbatches, check_no_sparse_inputs)


def _slice(x, start, size):
  return tf.nest.map_structure(lambda t: t[start:start + size], x)


@tf.autograph.experimental.do_not_convert
def microbatch_engine(model, loss_fn, x, y, transform, mask=None, num_microbatches=None,
                      variables=None) -> EngineOutput:
  """Transformed sum of per-unit gradients, one unit per loop iteration.

  Args:
    model, loss_fn, x, y, transform, mask, num_microbatches: as
      :func:`tf_dpnsgd.per_example.vectorized.vectorized_engine`.
    variables: variables to differentiate (default ``model.trainable_variables``).

  Returns:
    :class:`EngineOutput`.

  Raises:
    ValueError: for ``tf.SparseTensor`` inputs (``tf.RaggedTensor`` ones are exact here).
  """
  check_no_sparse_inputs(x, "per_example='microbatch'")
  if variables is None:
    variables = model.trainable_variables
  check_mask_and_microbatches(mask, num_microbatches)
  batch = batch_size_of(x)
  with tf.control_dependencies(check_microbatches(batch, num_microbatches)):
    units = tf.identity(num_microbatches or batch)
  size = batch // units

  def unit_gradients(u):
    x_u, y_u = _slice(x, u * size, size), _slice(y, u * size, size)
    with tf.GradientTape() as tape:
      with stateless.NoStateWrites(model):  # only the seed generators may advance
        y_pred = model(x_u, training=True)
        losses = loss_fn(y_u, y_pred)
      loss = tf.reduce_mean(tf.cast(losses, tf.float32))
    m = None if mask is None else mask[u:u + 1]
    return variable_gradients(tape, loss, variables), losses, y_pred, m

  return sum_over_units(model, x, units, unit_gradients, transform, variables)


def sum_over_units(model, x, units, unit_gradients, transform, variables) -> EngineOutput:
  """The loop of the unit-at-a-time engines: for ``u`` in ``[0, units)``, one at a time
  (``parallel_iterations=1``), ``unit_gradients(u) -> (gradients, losses, y_pred, mask_u)``
  (the unit's gradient per variable, its rows' losses and outputs, its ``[1]`` mask or
  None), transformed (:func:`tf_dpnsgd.transforms.transform_and_sum`: a masked or
  non-finite unit adds exactly 0) and summed; accumulators made at run time
  (:func:`~tf_dpnsgd.per_example.factored.runtime_zeros`: nothing held between steps)."""
  y_spec = output_spec(model, x)
  pred_dtypes = [t.dtype for t in tf.nest.flatten(y_spec)]

  def new_ta(dtype):
    return tf.TensorArray(dtype, size=units, infer_shape=False)

  def body(u, acc, ta_losses, ta_norms, ta_factors, ta_preds):
    grads, losses, y_pred, m = unit_gradients(u)
    contribution, norms, factors = transforms.transform_and_sum([g[None] for g in grads],
                                                                transform, m)  # [1, ...]
    acc = [a + tf.cast(c, a.dtype) for a, c in zip(acc, contribution)]
    preds = [ta.write(u, p) for ta, p in zip(ta_preds, tf.nest.flatten(y_pred))]
    return (u + 1, acc, ta_losses.write(u, tf.cast(tf.reshape(losses, [-1]), tf.float32)),
            ta_norms.write(u, norms), ta_factors.write(u, factors), preds)

  init = (tf.constant(0), [factored.runtime_zeros(v.shape, v.dtype) for v in variables],
          new_ta(tf.float32), new_ta(tf.float32), new_ta(tf.float32),
          [new_ta(d) for d in pred_dtypes])
  _, acc, ta_l, ta_n, ta_f, ta_p = tf.while_loop(
      lambda u, *_: u < units, body, init, parallel_iterations=1)
  preds = [tf.ensure_shape(ta.concat(), (None,) + tuple(spec.shape[1:]))
           for ta, spec in zip(ta_p, tf.nest.flatten(y_spec))]
  y_pred = tf.nest.pack_sequence_as(y_spec, preds)
  return EngineOutput(summed=acc, norms=tf.reshape(ta_n.concat(), [-1]),
                      factors=tf.reshape(ta_f.concat(), [-1]),
                      losses=tf.reshape(ta_l.concat(), [-1]), y_pred=y_pred)
