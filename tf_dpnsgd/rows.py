"""Row identity: which example each row of a batch is, and a digest of what it holds.

The sampler (:mod:`tf_dpnsgd.sampling`) tags every row of a batch with the
index of the example it holds (``dp_example``) and a 63-bit digest of the row's
contents as it left the sampler, after the per-example augmentation
(``dp_digest``: :func:`row_digests` of ``(x, y)``). Before each step the
guard (:mod:`tf_dpnsgd.guard`) recomputes the digests of the batch it is
about to train on and refuses it (:func:`check_rows`) when

* a row's contents changed after the sampler: a ``.map`` that mixes rows
  (MixUp, CutMix, batch statistics), or any other batch-level transform, which
  can make one example's data reach several rows' gradients (its sensitivity
  then exceeds the one the noise is calibrated to);
* two real (unmasked) rows hold the same example: a batch concatenated with
  (an augmented copy of) itself, tags copied along, counts one example twice;
* a padding row (``dp_example = -1``: Poisson padding, or padding to a
  multiple of the replicas) was made real by changing its ``dp_mask``: an
  example the sampler did not draw would join the batch.

A batch repeated as a whole (``flat_map``, ``concatenate``, ``repeat``) has the
step tag of the batch before it; :meth:`tf_dpnsgd.ledger.PrivacyLedger.check_batch`
refuses it (a replayed step), also within one ``steps_per_execution`` call.

The digest is an unkeyed hash: it guards against an accidental pipeline, not
against a forger (who controls the training code anyway). It is exact integer
arithmetic modulo ``2**64`` (the same on every device), over the raw bits of
every leaf: floats by their bit patterns (``-0.0`` is not ``0.0``), integers
and booleans by value, strings by ``tf.strings.to_hash_bucket_fast``, ragged
rows with their lengths. A ``tf.SparseTensor`` (or a dtype without a bit
pattern here, e.g. complex) raises ``TypeError``: densify it, or make it a
``tf.RaggedTensor``.

Cost: a few elementwise passes over the batch, fused by XLA in the guard.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import tensorflow as tf

from tf_dpnsgd.ledger import LedgerMismatchError

# Odd 64-bit constants (the golden ratio and splitmix64's multipliers), as int64.
_GOLDEN = -7046029254386353131  # 0x9E3779B97F4A7C15
_MIX1 = -4658895280553007687  # 0xBF58476D1CE4E5B9
_MIX2 = -7723592293110705685  # 0x94D049BB133111EB
_INT63 = (1 << 63) - 1

_WIDE_BITS = {tf.float16: tf.int16, tf.bfloat16: tf.int16, tf.float32: tf.int32,
              tf.float64: tf.int64, tf.uint64: tf.int64}


def _words(values: tf.Tensor) -> tf.Tensor:
  """``values`` as int64 words carrying every bit of each element (same shape)."""
  dtype = values.dtype
  if dtype == tf.string:
    return tf.strings.to_hash_bucket_fast(values, _INT63)
  if dtype in _WIDE_BITS:
    return tf.cast(tf.bitcast(values, _WIDE_BITS[dtype]), tf.int64)
  if dtype == tf.int64:
    return values
  if dtype.is_integer or dtype == tf.bool:
    return tf.cast(values, tf.int64)
  raise TypeError(f"tf_dpnsgd: cannot digest a batch leaf of dtype {dtype.name} (row identity, "
                  "tf_dpnsgd.rows); give the sampler float, integer, bool or string arrays.")


def _mix(words: tf.Tensor, position) -> tf.Tensor:
  """A nonlinear int64 mix of each word with its position (wraps modulo 2**64)."""
  position = tf.cast(position, tf.int64)  # int64 tensors: products wrap, never overflow
  t = tf.bitwise.bitwise_xor(words, position * _GOLDEN) * _MIX1
  return tf.bitwise.bitwise_xor(t, tf.bitwise.right_shift(t, 31)) * _MIX2


def _finish(h: tf.Tensor) -> tf.Tensor:
  h = tf.bitwise.bitwise_xor(h, tf.bitwise.right_shift(h, 33)) * _MIX1
  return tf.bitwise.bitwise_xor(h, tf.bitwise.right_shift(h, 29))


def _dense_digest(t: tf.Tensor) -> tf.Tensor:
  """int64 ``[rows]`` of a dense tensor ``[rows, ...]`` (rank 1: one scalar per row)."""
  words = _words(t)
  words = tf.reshape(words, [tf.shape(words, out_type=tf.int64)[0], -1])
  position = tf.range(tf.shape(words, out_type=tf.int64)[1], dtype=tf.int64)
  return tf.reduce_sum(_mix(words, position[None, :]), axis=1)


# The same function compiled with XLA (one fused pass; exact integer arithmetic, so the same
# bits), for dense numeric leaves of at least _XLA_MIN_ELEMENTS elements (or of unknown size):
# below that, compiling for each new shape costs more than it saves.
_dense_digest_xla = tf.function(_dense_digest, jit_compile=True, reduce_retracing=True,
                                autograph=False)
_XLA_MIN_ELEMENTS = 1 << 16


def _ragged_digest(rt: tf.RaggedTensor) -> tf.Tensor:
  """int64 ``[rows]`` of a ragged tensor: each row's elements in order and its length."""
  inner = rt.values
  if isinstance(inner, tf.RaggedTensor):
    per_value = _ragged_digest(inner)  # one digest per sub-row, then the outer rows of them
  else:
    per_value = _dense_digest(inner) if inner.shape.rank > 1 else _mix(_words(inner), 0)
  rowids = rt.value_rowids()
  position = tf.range(tf.size(rowids, out_type=tf.int64), dtype=tf.int64) - tf.gather(
      rt.row_starts(), rowids)
  mixed = _mix(per_value, position + 1)
  summed = tf.math.unsorted_segment_sum(mixed, rowids, rt.nrows())
  return summed + _mix(rt.row_lengths(), -1)


def _leaf_digest(leaf, xla: bool) -> tf.Tensor:
  if isinstance(leaf, tf.RaggedTensor):
    return _ragged_digest(leaf)
  if isinstance(leaf, tf.SparseTensor):
    raise TypeError("tf_dpnsgd: cannot digest a tf.SparseTensor batch leaf (row identity, "
                    "tf_dpnsgd.rows); give the sampler dense arrays or a tf.RaggedTensor.")
  leaf = tf.convert_to_tensor(leaf)
  if leaf.shape.rank == 0:
    raise TypeError("tf_dpnsgd: a batch leaf is a scalar; every leaf needs one row per example.")
  size = leaf.shape.num_elements()
  if xla and leaf.dtype != tf.string and (size is None or size >= _XLA_MIN_ELEMENTS):
    _words(leaf[:0])  # an unsupported dtype raises here, not inside XLA
    return _dense_digest_xla(leaf)
  return _dense_digest(leaf)


def row_digests(structure, xla: bool = False) -> tf.Tensor:
  """A digest of each row of a batch: int64 ``[rows]`` in ``[0, 2**63)``.

  ``structure``: a tensor, ``tf.RaggedTensor`` or nested structure of them
  (e.g. ``(x, y)`` with ``x`` a dict), each with the rows on axis 0. Row ``r``'s
  digest depends only on row ``r`` of every leaf (in ``tf.nest`` order), never
  on the other rows nor on the row's position in the batch. ``xla``: digest
  large dense numeric leaves in an XLA-compiled function (about 3x faster on
  a CPU; the same values).

  Edge cases: every bit of a float counts (``-0.0``, NaN payloads); the same
  values in another dtype digest differently only if their bits differ (an
  ``int32`` and an ``int64`` holding 3 digest alike); an empty structure raises.

  >>> a = tf.constant([[1.0, 2.0], [3.0, 4.0]])
  >>> d = row_digests((a, tf.constant([0, 1])))
  >>> bool(d[0] != d[1])
  True
  >>> bool(row_digests((a[1:], tf.constant([1])))[0] == d[1])
  True
  """
  leaves = tf.nest.flatten(structure, expand_composites=False)
  if not leaves:
    raise ValueError("tf_dpnsgd: nothing to digest (an empty batch structure).")
  h = None
  for salt, leaf in enumerate(leaves):
    part = _finish(_leaf_digest(leaf, xla) + tf.constant(salt, tf.int64) * _GOLDEN)
    h = part if h is None else _finish(h * _MIX2 + part)
  return tf.bitwise.bitwise_and(h, _INT63)


@dataclasses.dataclass(frozen=True)
class RowCheck:
  """Host-side counts of one batch's rows (see :func:`check_rows`): ``altered`` real rows
  whose digest no longer matches, ``duplicated`` real rows repeating an example,
  ``unmasked_padding`` real rows tagged as padding (example -1)."""

  altered: int = 0
  duplicated: int = 0
  unmasked_padding: int = 0


def count_problems(examples: np.ndarray, real: np.ndarray, digest_ok: np.ndarray) -> RowCheck:
  """Counts rows whose digest no longer matches, and real rows repeating an example.

  Args:
    examples: the ``dp_example`` tag of every row (all replicas' shards of one batch; -1
      for a padding row).
    real: whether each row is real (``dp_mask``; all True without one).
    digest_ok: whether each row's recomputed digest equals its ``dp_digest`` tag.

  >>> count_problems(np.array([3, 5, 3, -1]), np.array([True, True, True, False]),
  ...                np.array([True, True, True, False]))  # the padding row is not real
  RowCheck(altered=0, duplicated=1, unmasked_padding=0)
  """
  examples, real = np.asarray(examples).reshape(-1), np.asarray(real, bool).reshape(-1)
  ids = examples[real]
  altered = int(np.sum(~np.asarray(digest_ok, bool).reshape(-1)[real]))
  padding = int(np.sum(ids < 0))
  real_ids = ids[ids >= 0]
  return RowCheck(altered, int(real_ids.size - np.unique(real_ids).size), padding)


def check_rows(check: RowCheck, offset: int = 0) -> None:
  """Raises :class:`tf_dpnsgd.ledger.LedgerMismatchError` if a batch's rows were changed or
  duplicated after the sampler (``offset``: the batch's place in one train-function call)."""
  where = f"batch {offset} of this call" if offset else "this batch"
  if check.altered:
    raise LedgerMismatchError(
        f"tf_dpnsgd: {check.altered} row(s) of {where} changed after the sampler drew them "
        "(their content digest no longer matches): a transformation of the batch stream, "
        "e.g. plan.dataset(...).map(mixup), can mix examples across rows and multiply one "
        "example's sensitivity. Give augmentation to the sampler as a function of ONE "
        "example, plan.dataset(x, y, model=model, augment=fn) with fn(x_i, y_i, seed) -> "
        "x_i' (and multiplicity=K for K views of each example), not as a map over batches.")
  if check.unmasked_padding:
    raise LedgerMismatchError(
        f"tf_dpnsgd: {where} has {check.unmasked_padding} padding row(s) marked real (their "
        "dp_mask was changed after the sampler): an example the sampler did not draw would "
        "join the batch. Do not change the batches of plan.dataset(...); give augmentation "
        "to the sampler (augment=fn).")
  if check.duplicated:
    raise LedgerMismatchError(
        f"tf_dpnsgd: {where} holds {check.duplicated} real row(s) repeating an example "
        "already in it (e.g. a batch concatenated with an augmented copy of itself): each "
        "copy adds to the sum, multiplying that example's sensitivity. For several "
        "augmented views of each example use plan.dataset(..., augment=fn, "
        "multiplicity=K) with a multi-view model (tf_dpnsgd.models.views), which averages "
        "them inside the example's contribution.")


__all__ = ["RowCheck", "check_rows", "count_problems", "row_digests"]
