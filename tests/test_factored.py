"""The speed paths of ``tf_dpnsgd.per_example.factored``: blocked sums of squares, the
ghost norm's scale from Gram diagonals, and kept per-unit gradients.

Oracles: NumPy float64 (and exact rational arithmetic via ``math.fsum`` on float64
squares of float32 values, which are exact) and per-unit gradients built with einsum.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import tensorflow as tf

from tf_dpnsgd.per_example import factored


def _exact_squares(g):
  """Exact ``||g_u||^2`` (float32 squares are exact in float64; fsum is correctly rounded)."""
  g = np.asarray(g, np.float64).reshape(len(g), -1)
  return np.array([math.fsum(row * row) for row in g])


@pytest.mark.parametrize("magnitude", [1e-30, 1e-3, 1.0, 1e6, 1e18])
def test_sum_of_squares_bound_holds_and_is_tight(magnitude):
  rng = np.random.default_rng(0)
  g = (magnitude * rng.normal(size=(5, 7, 12))).astype(np.float32)  # n = 84: blocks of 4
  value, error = (t.numpy() for t in factored.sum_of_squares(tf.constant(g)))
  exact = _exact_squares(g)
  assert np.all(np.abs(value - exact) <= error)
  assert np.all(error <= 1e-6 * exact)  # tight: within LOOSENESS_LIMIT


def test_sum_of_squares_edge_rows():
  g = np.zeros((5, 8), np.float32)
  g[1, :] = 3e-30                # squares underflow float32: summed in float64
  g[2, 0] = 2.0 ** 100           # square overflows float32, finite in float64
  g[3, 0] = np.nan
  g[4, :3] = [1.0, 2.0, 2.0]
  value, error = (t.numpy() for t in factored.sum_of_squares(tf.constant(g)))
  assert value[0] == 0.0 and error[0] == 0.0  # a zero row stays exactly zero
  np.testing.assert_allclose(value[1], 8 * np.float64(np.float32(3e-30)) ** 2, rtol=1e-14)
  assert value[1] > 0
  assert value[2] == 2.0 ** 200
  assert np.isnan(value[3])
  assert value[4] == 9.0 and error[4] <= 1e-6 * 9.0


def test_sum_of_squares_odd_length_uses_float64():
  g = np.random.default_rng(1).normal(size=(3, 7)).astype(np.float32)  # 7: no block of 4
  value, error = (t.numpy() for t in factored.sum_of_squares(tf.constant(g)))
  assert np.all(np.abs(value - _exact_squares(g)) <= error)


@pytest.mark.parametrize("scale", [1.0, 1e6])
def test_ghost_scale_from_diagonals_bounds_the_exact_quantities(scale):
  rng = np.random.default_rng(2)
  a = (scale * rng.normal(size=(4, 6, 5))).astype(np.float32)
  b = rng.normal(size=(4, 6, 3)).astype(np.float32)
  value, error, s = (t.numpy() for t in factored.ghost_estimate_and_scale(a, b))
  a64, b64 = a.astype(np.float64), b.astype(np.float64)
  exact = (np.einsum("utp,utq->upq", a64, b64) ** 2).sum((1, 2))
  norms = (np.linalg.norm(a64, axis=2) * np.linalg.norm(b64, axis=2)).sum(1)
  assert np.all(s >= norms)
  assert np.all(s <= norms * (1 + 1e-12))
  assert np.all(np.abs(value - exact) <= error)


def _outer(units, positions, p, q, seed=0):
  rng = np.random.default_rng(seed)
  a = rng.normal(size=(units, positions, p)).astype(np.float32)
  b = rng.normal(size=(units, positions, q)).astype(np.float32)
  return factored.Outer(a, b, [p], [q]), a, b


def test_plan_keeping_prefers_long_sequences_within_the_budget():
  long, _, _ = _outer(2, 16, 8, 8)    # 2 * 8 * 8 * 4 = 512 bytes
  short, _, _ = _outer(2, 4, 8, 8)    # 512 bytes
  single, _, _ = _outer(2, 1, 8, 8)   # T = 1: not a candidate
  used = factored.plan_keeping([short, single, long], budget=600)
  assert used == 512
  assert (long.keep, short.keep, single.keep) == (True, False, None)


@pytest.mark.parametrize("keep", [True, False])
def test_kept_and_unkept_outer_give_the_same_norms_and_sum(keep):
  """A ghost-sized layer (T (p + q) < p q) kept or not: same result as the einsum oracle."""
  rep, a, b = _outer(3, 4, 16, 16, seed=3)
  rep.keep = keep
  per_unit = np.einsum("utp,utq->upq", a.astype(np.float64), b.astype(np.float64))
  bounds = rep.squared_norms().numpy()
  exact = (per_unit ** 2).sum((1, 2))
  assert np.all(bounds >= exact)
  np.testing.assert_allclose(bounds, exact, rtol=2e-6)
  assert (rep._materialized is not None) == keep
  h = np.array([0.5, 0.0, 2.0], np.float32)
  np.testing.assert_allclose(rep.weighted_sum(tf.constant(h)),
                             np.einsum("u,upq->pq", h, per_unit), rtol=1e-5, atol=1e-5)


def test_zero_dropped_units_builds_no_batch_sized_constant():
  """Zeroing rows must not build a batch-sized tensor that does not depend on the rows.

  ``tf.zeros_like(t)`` of a static shape is a batch-sized constant (one per layer
  and pass, allocated for the whole step): in two passes that was +55% of a
  plain ResNet20-GN step's tensors. Checked in the traced graph and the graphs
  of its branches: every batch-sized tensor other than an input depends on one.
  """
  spec = (tf.TensorSpec([4, 3, 5], tf.float32), tf.TensorSpec([4], tf.bool))
  graph = tf.function(factored.zero_dropped_units).get_concrete_function(*spec).graph

  def graphs(g):
    yield g
    for op in g.get_operations():
      for attr in ("then_branch", "else_branch"):
        if attr in op.node_def.attr:
          yield from graphs(g._get_function(op.get_attr(attr).name).graph)

  def data_dependent(tensor, seen):
    if tensor.op.type == "Placeholder":
      return True
    if tensor.op.type in ("ZerosLike", "OnesLike", "Shape", "Size", "Rank") or tensor.op.name in seen:
      return False  # shape only
    seen.add(tensor.op.name)
    return any(data_dependent(i, seen) for i in tensor.op.inputs)

  checked = 0
  for g in graphs(graph):
    for op in g.get_operations():
      for out in op.outputs:
        if op.type != "Placeholder" and out.shape.rank == 3 and out.shape.num_elements() == 60:
          assert data_dependent(out, set()), f"{op.type} '{out.name}' is batch-sized but constant"
          checked += 1
  assert checked >= 2  # the copy and the zeroed rows
  x = tf.constant([[1.0, 2.0], [float("nan"), float("inf")]])
  np.testing.assert_array_equal(factored.zero_dropped_units(x, tf.constant([True, False])).numpy(),
                                [[1.0, 2.0], [0.0, 0.0]])


def test_static_sizes_give_the_bounds_of_dynamic_ones_bit_for_bit():
  """A size known while tracing is folded in Python (``gamma``, ``sum_of_squares``' error
  terms): the same float64 operations in the same order as in a graph, so the same bits.
  Oracle: the documented bound evaluated with the size as a float64 tensor."""
  for n in (0, 1, 7, 84, 2**40 + 1, 2**53 + 1, 2**62 + 3):
    assert factored.gamma(n).numpy() == factored.gamma(tf.constant(n, tf.int64)).numpy(), n
    assert factored.gamma(float(n)).numpy() == factored.gamma(
        tf.constant(float(n), tf.float64)).numpy(), n
  rng = np.random.default_rng(1)
  g = (rng.normal(size=(6, 3, 12)) * np.array([1e-30, 1e-3, 1.0, 1e6, 1e18, 1.0])[:, None, None]
       ).astype(np.float32)
  g[5, 0, 0] = np.nan
  g[4] = 0.0
  for x, k in ((g, 4), (g[:, :, :7], 1), (g[:, :1, :2], 2)):
    value, error = tf.function(factored.sum_of_squares)(tf.constant(x))
    size = tf.constant(float(x[0].size), tf.float64)
    gamma = 2.0 * (size + 2.0) * factored.EPS64
    if k == 1:
      expected = gamma * value
    else:
      relative = 2.0 * (k + 2) * factored.EPS32 * (1.0 + 4.0 * (k + 2) * factored.EPS32) + \
          size * 2.0 ** -66
      redo = tf.logical_not(tf.logical_and(value >= 2.0 ** -60, tf.math.is_finite(value)))
      expected = (tf.where(redo, tf.zeros_like(value), relative) + gamma) * value
    np.testing.assert_array_equal(error.numpy(), expected.numpy())
