"""Per-unit gradients of one variable, kept in factored form.

The layer-wise engine never builds ``[U, *var_shape]`` per-unit gradients
unless that is the cheaper way to get their norms. A layer rule (see
:mod:`tf_dpnsgd.per_example.registry`) describes the per-unit gradient of each
of its variables by one of these objects, built from the layer's input and the
gradient of the summed loss with respect to the layer's output:

=====================  ==========================================  ======================
representation         per-unit gradient ``g_u``                   used by
=====================  ==========================================  ======================
:class:`Materialized`  ``g[u]`` (stored as is)                     biases, norm layers
:class:`Outer`         ``sum_t a[u, t] (x) b[u, t]``               Dense, EinsumDense, conv
:class:`Scattered`     ``sum_t onehot(ids[u, t]) (x) b[u, t]``     Embedding, positions
:class:`Sum`           sum of the above (shared / tied weights)    multiple calls, tying
=====================  ==========================================  ======================

Each one answers two questions, both pure functions of its tensors:

* ``squared_norms()``: ``[U]`` values ``||g_u||^2``. :class:`Outer` picks per
  call between the ghost-norm identity (Goodfellow 2015; Li et al. 2021)
  ``||sum_t a_t b_t^T||^2 = sum_{t,s} <a_t, a_s> <b_t, b_s>`` at cost
  ``T^2 (p + q)`` and materialising ``g_u`` at cost ``T p q``, whichever is
  cheaper for the shapes (:func:`use_ghost`).
* ``weighted_sum(factors)``: ``sum_u factors[u] g_u`` from the same tensors
  (book-keeping, Bu et al. 2022): no second backward pass.

Formal guarantee of ``weighted_sum`` (for every representation): a unit whose
factor is 0 (masked, or with a non-finite norm) contributes exactly 0, even if
its tensors hold NaN or inf: its rows are replaced by zeros with ``tf.where``
before any product or reduction over units (:func:`zero_dropped_units`), so
``0 * nan`` never reaches the sum.

References:
  Goodfellow (2015), "Efficient Per-Example Gradient Computations".
  Li, Tramer, Liang, Hashimoto (2021), "Large Language Models Can Be Strong
  Differentially Private Learners", Section 4 (ghost clipping).
  Bu, Mao, Xu (2022), "Scalable and Efficient Training of Large Convolutional
  Neural Networks with Differential Privacy" (mixed ghost clipping: the
  ``T^2`` vs ``p q`` rule); Bu, Wang, Zha, Karypis (2022), "Differentially
  Private Optimization on Large Model at Small Cost" (book-keeping).
"""

from __future__ import annotations

import math
from typing import Sequence

import tensorflow as tf


# --- helpers -----------------------------------------------------------------

def zero_dropped_units(t: tf.Tensor, keep: tf.Tensor) -> tf.Tensor:
  """Rows ``u`` of ``t`` with ``keep[u]`` False replaced by exact zeros.

  The copy is skipped (``tf.cond``) when every unit is kept, the common case.

  >>> zero_dropped_units(tf.constant([[1., 2.], [float("nan"), 3.]]), tf.constant([True, False])).numpy().tolist()
  [[1.0, 2.0], [0.0, 0.0]]
  """
  keep = tf.reshape(tf.cast(keep, tf.bool), [-1] + [1] * (len(t.shape) - 1))

  def zeroed():
    return tf.where(keep, t, tf.zeros_like(t))

  return tf.cond(tf.reduce_all(keep), lambda: tf.identity(t), zeroed)


def _units_first_reshape(t: tf.Tensor, num_units: int) -> tf.Tensor:
  """``[B, N, ...]`` -> ``[m, (B/m) N, ...]`` (examples of a unit become positions)."""
  shape = tf.shape(t)
  rest = t.shape[2:]
  out = tf.reshape(t, tf.concat([[num_units, -1], shape[2:]], axis=0))
  return tf.ensure_shape(out, [num_units, None] + list(rest))


def _static_or_dynamic(t: tf.Tensor, axis: int):
  dim = t.shape[axis]
  return dim if dim is not None else tf.shape(t)[axis]


def use_ghost(num_positions, p: int, q: int):
  """True where the ghost norm is cheaper than materialising the gradient.

  Ghost: ``[T, T]`` Gram matrices of both factors, ``T^2 (p + q)``
  multiply-adds per unit; materialise: ``b^T a``, ``T p q``. ``num_positions``
  may be a Python int (decided at trace time) or a scalar tensor.

  >>> use_ghost(128, 384, 1536), use_ghost(1024, 144, 16)
  (True, False)
  """
  if isinstance(num_positions, int):
    return num_positions * (p + q) < p * q
  t = tf.cast(num_positions, tf.int64)
  return t * (p + q) < p * q


# --- representations ---------------------------------------------------------

class Materialized:
  """Per-unit gradients stored as a ``[U, *var_shape]`` tensor."""

  def __init__(self, grads: tf.Tensor):
    self.grads = tf.cast(grads, tf.float32)

  def squared_norms(self) -> tf.Tensor:
    g = self.grads
    return tf.reduce_sum(tf.reshape(tf.square(g), [tf.shape(g)[0], -1]), axis=1)

  def weighted_sum(self, factors: tf.Tensor) -> tf.Tensor:
    g = zero_dropped_units(self.grads, factors > 0)
    return tf.tensordot(factors, g, axes=[[0], [0]])

  def per_unit(self) -> tf.Tensor:
    return self.grads

  def to_units(self, num_units: int) -> "Materialized":
    g = self.grads
    g = tf.reshape(g, tf.concat([[num_units, -1], tf.shape(g)[1:]], axis=0))
    return Materialized(tf.reduce_sum(g, axis=1))

  def merge(self, other: "Materialized") -> "Materialized":
    return Materialized(self.grads + other.grads)


class Outer:
  """``g_u = reshape_transpose(sum_t a[u, t]^T b[u, t])``, ``a: [U, T, p]``, ``b: [U, T, q]``.

  The ``[p, q]`` matrix maps to the variable by reshaping to
  ``in_dims + out_dims`` and transposing by ``perm`` (Dense: ``[d_in, d_out]``,
  identity; conv: ``[kh, kw, c_in, c_out]`` from flattened patches; EinsumDense:
  the kernel's letter order).

  Args:
    a: ``[U, T, p]`` layer inputs (or input patches), ``b``: ``[U, T, q]``
      gradients of the summed loss w.r.t. the layer's pre-activation output.
    in_dims, out_dims: factorisations of ``p`` and ``q``.
    perm: permutation from ``in_dims + out_dims`` to the variable's axes.
    method: ``"auto"`` (per :func:`use_ghost`), ``"ghost"`` or ``"materialize"``.
  """

  def __init__(self, a, b, in_dims: Sequence[int], out_dims: Sequence[int],
               perm: Sequence[int] | None = None, method: str = "auto"):
    if method not in ("auto", "ghost", "materialize"):
      raise ValueError(f"`method` must be 'auto', 'ghost' or 'materialize'; got {method!r}.")
    self.a = tf.cast(a, tf.float32)
    self.b = tf.cast(b, tf.float32)
    self.in_dims = tuple(int(d) for d in in_dims)
    self.out_dims = tuple(int(d) for d in out_dims)
    self.p = math.prod(self.in_dims)
    self.q = math.prod(self.out_dims)
    if self.a.shape[-1] != self.p or self.b.shape[-1] != self.q:
      raise ValueError(f"Outer factors of widths {self.a.shape[-1]}, {self.b.shape[-1]} do not "
                       f"match in_dims {self.in_dims} / out_dims {self.out_dims}.")
    rank = len(self.in_dims) + len(self.out_dims)
    self.perm = tuple(perm) if perm is not None else tuple(range(rank))
    self.method = method
    self._materialized = None  # [U, q, p], cached by squared_norms

  def _ghost(self) -> bool | tf.Tensor:
    if self.method != "auto":
      return self.method == "ghost"
    return use_ghost(_static_or_dynamic(self.a, 1), self.p, self.q)

  def _per_unit_qp(self) -> tf.Tensor:
    # b^T a ([q, T] x [T, p]) is markedly faster than a^T b on CPU batched GEMM.
    return tf.matmul(self.b, self.a, transpose_a=True)

  def squared_norms(self) -> tf.Tensor:
    positions = self.a.shape[1]
    if positions == 1:  # ||a b^T||^2 = ||a||^2 ||b||^2
      return (tf.reduce_sum(tf.square(self.a), axis=[1, 2])
              * tf.reduce_sum(tf.square(self.b), axis=[1, 2]))

    def ghost():
      aa = tf.matmul(self.a, self.a, transpose_b=True)
      bb = tf.matmul(self.b, self.b, transpose_b=True)
      return tf.reduce_sum(aa * bb, axis=[1, 2])

    def materialize():
      g = self._per_unit_qp()
      return g, tf.reduce_sum(tf.square(g), axis=[1, 2])

    choice = self._ghost()
    if isinstance(choice, bool):
      if choice:
        return ghost()
      per_unit, sq = materialize()
      # Keep per-unit gradients for the weighted sum only where they are smaller
      # than the factors a, b it would otherwise need.
      if isinstance(positions, int) and self.p * self.q <= positions * (self.p + self.q):
        self._materialized = per_unit
      return sq
    return tf.cond(choice, ghost, lambda: materialize()[1])

  def _to_variable_layout(self, qp: tf.Tensor, leading: list) -> tf.Tensor:
    """``[..., q, p]`` -> ``[..., *var_shape]``."""
    n = len(leading)
    pq = tf.linalg.matrix_transpose(qp)
    full = tf.reshape(pq, leading + list(self.in_dims) + list(self.out_dims))
    if self.perm != tuple(range(len(self.perm))):
      full = tf.transpose(full, list(range(n)) + [n + i for i in self.perm])
    return full

  def weighted_sum(self, factors: tf.Tensor) -> tf.Tensor:
    keep = factors > 0
    if self._materialized is not None:
      g = zero_dropped_units(self._materialized, keep)
      qp = tf.tensordot(factors, g, axes=[[0], [0]])
    else:
      a = zero_dropped_units(self.a, keep)
      b = zero_dropped_units(self.b, keep) * tf.reshape(factors, [-1, 1, 1])
      a2 = tf.reshape(a, [-1, self.p])
      b2 = tf.reshape(b, [-1, self.q])
      qp = tf.matmul(b2, a2, transpose_a=True)
    return self._to_variable_layout(qp, [])

  def per_unit(self) -> tf.Tensor:
    qp = self._materialized if self._materialized is not None else self._per_unit_qp()
    return self._to_variable_layout(qp, [tf.shape(qp)[0]])

  def to_units(self, num_units: int) -> "Outer":
    return Outer(_units_first_reshape(self.a, num_units), _units_first_reshape(self.b, num_units),
                 self.in_dims, self.out_dims, self.perm, self.method)

  def mergeable(self, other) -> bool:
    return (isinstance(other, Outer) and other.in_dims == self.in_dims
            and other.out_dims == self.out_dims and other.perm == self.perm)

  def merge(self, other: "Outer") -> "Outer":
    """Two calls of the same layer: concatenate their positions (exact)."""
    return Outer(tf.concat([self.a, other.a], axis=1), tf.concat([self.b, other.b], axis=1),
                 self.in_dims, self.out_dims, self.perm, self.method)


class Scattered:
  """``g_u[v] = sum_{t: ids[u, t] = v} b[u, t]`` for a ``[num_rows, d]`` table.

  Args:
    ids: ``[U, N]`` integer row indices (token ids, positions).
    b: ``[U, N, d]`` gradients of the summed loss w.r.t. the gathered rows.
    num_rows: rows of the table (vocabulary size).
    distinct: True if the ids of one unit are known to be distinct
      (positions), which makes ``||g_u||^2 = sum_t ||b[u, t]||^2``.
  """

  def __init__(self, ids, b, num_rows: int, distinct: bool = False):
    self.ids = tf.cast(ids, tf.int32)
    self.b = tf.cast(b, tf.float32)
    self.num_rows = int(num_rows)
    self.distinct = distinct

  def squared_norms(self) -> tf.Tensor:
    if self.distinct:
      return tf.reduce_sum(tf.square(self.b), axis=[1, 2])
    return scattered_squared_norms(self.ids, self.b)

  def weighted_sum(self, factors: tf.Tensor) -> tf.Tensor:
    b = zero_dropped_units(self.b, factors > 0) * tf.reshape(factors, [-1, 1, 1])
    d = self.b.shape[-1]
    return tf.math.unsorted_segment_sum(tf.reshape(b, [-1, d]), tf.reshape(self.ids, [-1]),
                                        self.num_rows)

  def per_unit(self) -> tf.Tensor:
    units = tf.shape(self.ids)[0]
    d = self.b.shape[-1]
    offsets = tf.range(units)[:, None] * self.num_rows
    flat = tf.math.unsorted_segment_sum(tf.reshape(self.b, [-1, d]),
                                        tf.reshape(self.ids + offsets, [-1]),
                                        units * self.num_rows)
    return tf.reshape(flat, [units, self.num_rows, d])

  def to_units(self, num_units: int) -> "Scattered":
    return Scattered(_units_first_reshape(self.ids, num_units),
                     _units_first_reshape(self.b, num_units), self.num_rows, distinct=False)

  def mergeable(self, other) -> bool:
    return isinstance(other, Scattered) and other.num_rows == self.num_rows

  def merge(self, other: "Scattered") -> "Scattered":
    return Scattered(tf.concat([self.ids, other.ids], axis=1), tf.concat([self.b, other.b], axis=1),
                     self.num_rows, distinct=False)


def scattered_squared_norms(ids: tf.Tensor, b: tf.Tensor) -> tf.Tensor:
  """``||sum_t onehot(ids[u, t]) b[u, t]^T||^2`` per unit, in ``O(U N (log N + d))``.

  Rows of one unit are sorted by id; rows with equal ids are summed
  (segment sum) and the squared norms of the sums are added up. Static shapes
  throughout (no ``tf.unique``).

  >>> ids = tf.constant([[3, 1, 3]]); b = tf.constant([[[1., 0.], [0., 2.], [1., 1.]]])
  >>> scattered_squared_norms(ids, b).numpy().tolist()  # row 3: [2, 1], row 1: [0, 2]
  [9.0]
  """
  ids = tf.cast(ids, tf.int32)
  units, n = tf.shape(ids)[0], tf.shape(ids)[1]
  order = tf.argsort(ids, axis=1, stable=True)
  sorted_ids = tf.gather(ids, order, batch_dims=1)
  sorted_b = tf.gather(b, order, batch_dims=1)
  new_segment = tf.concat([tf.ones([units, 1], tf.int32),
                           tf.cast(sorted_ids[:, 1:] != sorted_ids[:, :-1], tf.int32)], axis=1)
  segment = tf.cumsum(new_segment, axis=1) - 1 + tf.range(units)[:, None] * n
  d = b.shape[-1]
  sums = tf.math.unsorted_segment_sum(tf.reshape(sorted_b, [-1, d]), tf.reshape(segment, [-1]),
                                      units * n)
  return tf.reduce_sum(tf.reshape(tf.square(sums), [units, -1]), axis=1)


def _cross_scattered_outer_t(s: Scattered, o: Outer) -> tf.Tensor:
  """``<g_u^S, g_u^O>`` when ``g^O`` is ``[rows, d]`` = transpose of ``a^T b`` (tied reverse embedding).

  ``g^O_u[v] = sum_s o.b[u, s, v] o.a[u, s]``; so
  ``<g^S_u, g^O_u> = sum_{t,s} o.b[u, s, ids[u, t]] <s.b[u, t], o.a[u, s]>``.
  """
  picked = tf.gather(o.b, s.ids, axis=2, batch_dims=1)  # [U, S, T]
  dots = tf.matmul(o.a, s.b, transpose_b=True)  # [U, S, T]
  return tf.reduce_sum(picked * dots, axis=[1, 2])


def _cross(r1, r2) -> tf.Tensor:
  """``<g_u^1, g_u^2>`` per unit for two representations of the same variable."""
  for s, o in ((r1, r2), (r2, r1)):
    if (isinstance(s, Scattered) and isinstance(o, Outer) and o.perm == (1, 0)
        and len(o.in_dims) == 1 and len(o.out_dims) == 1 and o.out_dims[0] == s.num_rows):
      return _cross_scattered_outer_t(s, o)
  if isinstance(r1, Outer) and r1.mergeable(r2):
    aa = tf.matmul(r1.a, r2.a, transpose_b=True)
    bb = tf.matmul(r1.b, r2.b, transpose_b=True)
    return tf.reduce_sum(aa * bb, axis=[1, 2])
  g1, g2 = r1.per_unit(), r2.per_unit()
  return tf.reduce_sum(tf.reshape(g1 * g2, [tf.shape(g1)[0], -1]), axis=1)


class Sum:
  """Per-unit gradient that is the sum of several representations (tied weights).

  ``||sum_k g^k||^2 = sum_k ||g^k||^2 + 2 sum_{k<l} <g^k, g^l>``; the cross
  terms use a closed form where one exists (embedding table used both as a
  lookup and as the transposed output projection), else the materialised
  per-unit gradients.
  """

  def __init__(self, parts):
    self.parts = list(parts)

  def squared_norms(self) -> tf.Tensor:
    total = tf.add_n([p.squared_norms() for p in self.parts])
    for i, p in enumerate(self.parts):
      for r in self.parts[i + 1:]:
        total += 2.0 * _cross(p, r)
    # Cancellation may leave a tiny negative value (NaN is kept: the unit is dropped).
    return tf.where(total < 0.0, tf.zeros_like(total), total)

  def weighted_sum(self, factors: tf.Tensor) -> tf.Tensor:
    return tf.add_n([p.weighted_sum(factors) for p in self.parts])

  def per_unit(self) -> tf.Tensor:
    return tf.add_n([p.per_unit() for p in self.parts])

  def to_units(self, num_units: int) -> "Sum":
    return Sum([p.to_units(num_units) for p in self.parts])


def _can_merge(m, rep) -> bool:
  if isinstance(m, Materialized):
    return isinstance(rep, Materialized)
  return m.mergeable(rep) if hasattr(m, "mergeable") else False


def combine(reps):
  """One representation for several of the same variable (a layer called twice, tying)."""
  merged = []
  for rep in reps:
    target = next((i for i, m in enumerate(merged) if _can_merge(m, rep)), None)
    if target is None:
      merged.append(rep)
    else:
      merged[target] = merged[target].merge(rep)
  return merged[0] if len(merged) == 1 else Sum(merged)
