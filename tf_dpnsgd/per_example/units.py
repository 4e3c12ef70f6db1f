"""Units of several rows with a row mask: one user's rows (user-level DP, :mod:`tf_dpnsgd.users`).

The batch is ``U`` slots of ``k`` rows (rows ``[u k, (u + 1) k)`` belong to slot ``u``).
For each slot, in a ``tf.while_loop`` (one slot at a time, like the microbatch engine,
so any model an ordinary step runs works): the gradient ``g_u`` of the MEAN loss of the
slot's real rows (``mask``), its norm, the transform's factor ``h_u`` and ``h_u g_u``
added to the sum.

==============================  =================================================
case                            contribution of the slot
==============================  =================================================
``m`` real rows (1 <= m <= k)   ``h(||g_u||) g_u``, ``g_u`` = grad of
                                ``sum_{real i} loss_i / m`` (norm <= ``S``)
padding rows of a real slot     exactly 0: replaced by a copy of the slot's
                                first real row before the forward pass (so a
                                NaN/inf they hold never reaches ``g_u``), their
                                losses then selected away with ``tf.where``
no real row (a padding slot)    exactly 0 (factor 0, zeroed with ``tf.where``)
non-finite ``g_u``              exactly 0 (the transform's factor 0)
==============================  =================================================

Formal guarantee: every slot's contribution has norm at most ``transform.sensitivity``,
whatever its rows hold; with one user per slot (checked on the host,
:func:`tf_dpnsgd.users.check_user_batch`) that is the user-level bound. Tested against a
loop of one ``tf.GradientTape`` per user (``tests/test_user_level.py``).

The layer-wise engine computes the same slots' gradients without the loop
(:func:`user_unit_layerwise_engine`): a slot is a microbatch of ``k`` rows, whose
factored representations :mod:`tf_dpnsgd.per_example.layerwise` regroups into one unit
(a slot's gradient is the sum over its rows and positions of the per-row outer
products, i.e. one example's over a ``k`` times longer sequence: exact); each row's loss
is weighted by ``1 / m`` (real rows) or 0 (padding rows, selected away), so the unit's
loss is the masked mean above. Padding rows are the same copies as in the loop, and
padding slots get factor 0 (``unit_mask``). ``per_example="auto"`` uses it where the
model's engine is the layer-wise one (:func:`unit_engine_for`); the loop is the
fallback (any other model, ragged inputs). Tested against the same oracle
(``tests/test_user_level_engines.py``).

The vectorized engine computes them with ``tf.vectorized_map`` over the slots
(:func:`user_unit_vectorized_engine`, for ``per_example="vectorized"``): the same gathered
rows reshaped to ``[U, k, ...]``, each slot's gradient of its masked mean loss, the
vectorized engine's refusals (oneDNN, ``tf.while_loop`` layers) and per-slot random
streams; padding slots get factor 0. Tested against the same oracle.
"""

from __future__ import annotations

import dataclasses
import functools

import tensorflow as tf

from tf_dpnsgd import transforms
from tf_dpnsgd.per_example import layerwise
from tf_dpnsgd.per_example import microbatch
from tf_dpnsgd.per_example import stateless
from tf_dpnsgd.per_example.base import EngineOutput, variable_gradients
from tf_dpnsgd.per_example import vectorized
from tf_dpnsgd.per_example.vectorized import batch_size_of, check_no_sparse_inputs


def unit_mask(mask, batch, rows_per_unit):
  """``[batch / k]`` bool: the slots with at least one real row.

  >>> unit_mask(tf.constant([True, False, False, False]), 4, 2).numpy().tolist()
  [True, False]
  """
  real = tf.ones([batch], tf.bool) if mask is None else tf.cast(mask, tf.bool)
  return tf.reduce_any(tf.reshape(real, [-1, int(rows_per_unit)]), axis=1)


def masked_mean(losses, mask):
  """Mean of ``losses`` over the True rows of ``mask`` (0 if none), the others selected away
  with ``tf.where`` (a NaN there does not reach the value).

  >>> float(masked_mean(tf.constant([1., 3., float("nan")]), tf.constant([True, True, False])))
  2.0
  """
  losses = tf.cast(tf.reshape(losses, [-1]), tf.float32)
  kept = tf.where(mask, losses, tf.zeros_like(losses))
  return tf.reduce_sum(kept) / tf.maximum(tf.reduce_sum(tf.cast(mask, tf.float32)), 1.0)


def slot_rows(row_mask, units, k):
  """``[U k]`` int32: the row each position of a slot computes; a padding row becomes its
  slot's first real row (the slot's first row if it has none).

  >>> slot_rows(tf.constant([True, False, False, True]), 2, 2).numpy().tolist()  # slot 1: row 3
  [0, 0, 3, 3]
  """
  m = tf.reshape(row_mask, [units, k])
  first = tf.argmax(tf.cast(m, tf.int32), axis=1, output_type=tf.int32)  # 0 if no real row
  starts = tf.range(units)[:, None] * k
  return tf.reshape(starts + tf.where(m, tf.range(k)[None, :], first[:, None]), [-1])


def _static_units(x, rows_per_unit):
  k = int(rows_per_unit or 0)
  if k < 1:
    raise ValueError(f"`rows_per_unit` must be an integer >= 1; got {rows_per_unit!r}.")
  static = tf.get_static_value(batch_size_of(x))
  if static is None:
    raise ValueError("User-level units need a static batch size (the sampler's batches have "
                     "one).")
  if int(static) % k:
    raise ValueError(f"A user-level batch has whole units of k = {k} rows; got {static} rows.")
  return int(static) // k, k


@tf.autograph.experimental.do_not_convert
def user_unit_engine(model, loss_fn, x, y, transform, mask=None, rows_per_unit=None,
                     variables=None) -> EngineOutput:
  """Transformed sum of per-slot gradients of the slots' masked mean losses.

  Args:
    model, loss_fn, x, y, transform: as
      :func:`tf_dpnsgd.per_example.vectorized.vectorized_engine`.
    mask: ``[B]`` bool, the real rows (None: all).
    rows_per_unit: ``k``, the rows of one slot; must divide ``B``.
    variables: variables to differentiate (default ``model.trainable_variables``).

  Returns:
    :class:`EngineOutput` with ``[B / k]`` norms and factors, ``[B]`` losses and
    predictions, and ``unit_mask`` (the slots with a real row).
  """
  check_no_sparse_inputs(x, "user-level units")
  units, k = _static_units(x, rows_per_unit)
  if variables is None:
    variables = model.trainable_variables
  row_mask = tf.ones([units * k], tf.bool) if mask is None else tf.cast(mask, tf.bool)
  slots = unit_mask(row_mask, units * k, k)

  def unit_gradients(u):
    m = row_mask[u * k:(u + 1) * k]
    # Padding rows become copies of the slot's first real row before the forward pass, so
    # nothing they held (a NaN, an infinity) reaches the gradient, not even through a
    # weight gradient x * 0; their losses are then selected away (masked_mean).
    first = tf.argmax(tf.cast(m, tf.int32), output_type=tf.int32)  # 0 if no real row
    rows = u * k + tf.where(m, tf.range(k), first)
    x_u = tf.nest.map_structure(lambda t: tf.gather(t, rows), x)
    y_u = tf.nest.map_structure(lambda t: tf.gather(t, rows), y)
    with tf.GradientTape() as tape:
      with stateless.NoStateWrites(model):  # only the seed generators may advance
        y_pred = model(x_u, training=True)
        losses = loss_fn(y_u, y_pred)
      loss = masked_mean(losses, m)
    return variable_gradients(tape, loss, variables), losses, y_pred, slots[u:u + 1]

  out = microbatch.sum_over_units(model, x, units, unit_gradients, transform, variables)
  return dataclasses.replace(out, unit_mask=slots)


def _has_ragged_inputs(x) -> bool:
  return any(isinstance(t, tf.RaggedTensor) for t in tf.nest.flatten(x))


@tf.autograph.experimental.do_not_convert
def user_unit_layerwise_engine(model, loss_fn, x, y, transform, mask=None, rows_per_unit=None,
                               **layerwise_kwargs) -> EngineOutput:
  """:func:`user_unit_engine`'s result from the layer-wise engine (no loop over slots).

  Each slot of ``k`` rows is one microbatch unit of
  :func:`~tf_dpnsgd.per_example.layerwise.layerwise_engine`, whose representations sum
  the slot's rows' per-row gradients exactly (see the module docstring); row ``i``'s
  loss weight is ``1 / m_u`` (real rows of a slot with ``m_u`` of them) or 0 (padding,
  selected away with ``tf.where``), and padding slots have factor 0 (``unit_mask``).
  Ragged inputs run :func:`user_unit_engine` (the layer-wise rules refuse them).

  Args:
    model, loss_fn, x, y, transform, mask, rows_per_unit: as :func:`user_unit_engine`.
    **layerwise_kwargs: ``registry``, ``keep_bytes``, ``mode`` of the layer-wise engine.

  Raises:
    UnsupportedLayerError: a trainable variable without a layer-wise rule.
  """
  if _has_ragged_inputs(x):
    return user_unit_engine(model, loss_fn, x, y, transform, mask=mask,
                            rows_per_unit=rows_per_unit)
  check_no_sparse_inputs(x, "user-level units")
  units, k = _static_units(x, rows_per_unit)
  row_mask = tf.ones([units * k], tf.bool) if mask is None else tf.cast(mask, tf.bool)
  slots = unit_mask(row_mask, units * k, k)
  rows = slot_rows(row_mask, units, k)
  x_rows, y_rows = tf.nest.map_structure(lambda t: tf.gather(t, rows), (x, y))
  real = tf.reduce_sum(tf.cast(tf.reshape(row_mask, [units, k]), tf.float32), axis=1)
  weights = tf.where(row_mask, tf.repeat(1.0 / tf.maximum(real, 1.0), k), 0.0)
  out = layerwise.layerwise_engine(model, loss_fn, x_rows, y_rows, transform,
                                   num_microbatches=units, loss_weights=weights,
                                   unit_mask=slots, **layerwise_kwargs)
  return dataclasses.replace(out, unit_mask=slots)


def user_unit_vectorized_engine(model, loss_fn, x, y, transform, mask=None, rows_per_unit=None,
                                variables=None) -> EngineOutput:
  """:func:`user_unit_engine`'s result from ``tf.vectorized_map`` over the slots.

  The rows are gathered as in the loop (a padding row becomes its slot's first real row,
  :func:`slot_rows`), reshaped to ``[U, k, ...]`` and each slot's gradient of its
  :func:`masked_mean` loss computed by
  :func:`~tf_dpnsgd.per_example.vectorized.checked_unit_gradients` (the vectorized
  engine's per-unit gradients, its oneDNN refusal and per-unit random streams); padding
  slots get factor 0 (``unit_mask``) and, like non-finite slot gradients, are zeroed with
  ``tf.where`` before the sum (:func:`tf_dpnsgd.transforms.weighted_sum`).

  Args:
    model, loss_fn, x, y, transform, mask, rows_per_unit, variables: as
      :func:`user_unit_engine`.

  Raises:
    ValueError: ragged or sparse inputs
      (:func:`~tf_dpnsgd.per_example.vectorized.check_dense_inputs`).
    UnsupportedLayerError, StateWriteError: as
      :func:`~tf_dpnsgd.per_example.vectorized.vectorized_engine`, before anything runs.
  """
  vectorized.check_dense_inputs(x, "vectorized")
  vectorized.check_no_while_loop_layers(model)
  units, k = _static_units(x, rows_per_unit)
  if variables is None:
    variables = model.trainable_variables
  row_mask = tf.ones([units * k], tf.bool) if mask is None else tf.cast(mask, tf.bool)
  slots = unit_mask(row_mask, units * k, k)
  rows = slot_rows(row_mask, units, k)
  x_rows, y_rows = tf.nest.map_structure(lambda t: tf.gather(t, rows), (x, y))
  slot_masks = tf.reshape(row_mask, [units, k])

  def slot_loss(losses, u):
    return masked_mean(losses, tf.gather(slot_masks, u))

  grads, losses, y_pred = vectorized.checked_unit_gradients(
      model, loss_fn, x_rows, y_rows, vectorized.to_units(x_rows, units),
      vectorized.to_units(y_rows, units), variables, units, unit_loss=slot_loss)
  summed, norms, factors = transforms.transform_and_sum(grads, transform, slots)
  return EngineOutput(summed=summed, norms=norms, factors=factors,
                      losses=tf.reshape(losses, [-1]),
                      y_pred=vectorized.from_units(y_pred, units), unit_mask=slots)


def unit_engine_for(engine):
  """The user-level engine matching a resolved example-level ``engine``
  (:func:`tf_dpnsgd.per_example.resolve_engine`): :func:`user_unit_layerwise_engine` with
  the same keyword arguments (mode, keep budget) where ``engine`` (or ``"auto"``'s choice
  for dense inputs, its ``dense_engine``) is the layer-wise or two-pass engine,
  :func:`user_unit_vectorized_engine` where ``engine`` is the vectorized engine (an
  explicit ``per_example="vectorized"``; ``"auto"`` keeps the loop where it did not pick
  the layer-wise engine), else the loop :func:`user_unit_engine`.

  >>> unit_engine_for(layerwise.two_pass_engine).keywords
  {'mode': 'two_pass'}
  >>> unit_engine_for(vectorized.vectorized_engine) is user_unit_vectorized_engine
  True
  >>> unit_engine_for(microbatch.microbatch_engine) is user_unit_engine
  True
  """
  if engine is vectorized.vectorized_engine:
    return user_unit_vectorized_engine
  fn = getattr(engine, "dense_engine", engine)
  keywords = {}
  while isinstance(fn, functools.partial):
    keywords = {**fn.keywords, **keywords}
    fn = fn.func
  if fn is layerwise.two_pass_engine:
    keywords.setdefault("mode", "two_pass")
  elif fn is not layerwise.layerwise_engine:
    return user_unit_engine
  return functools.partial(user_unit_layerwise_engine, **keywords)


__all__ = ["masked_mean", "slot_rows", "unit_engine_for", "unit_mask", "user_unit_engine",
           "user_unit_layerwise_engine", "user_unit_vectorized_engine"]
