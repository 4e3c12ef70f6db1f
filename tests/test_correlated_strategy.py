"""tf_dpnsgd.correlated.strategy: banded Toeplitz strategies against dense oracles."""

import numpy as np
import pytest

from tf_dpnsgd.correlated import strategy as st


def test_b1_is_the_identity_and_dp_sgd_error():
  s = st.optimize_bands(12, 1)
  np.testing.assert_array_equal(s.matrix(), np.eye(12))
  assert s.error == 12 * 13 / 2  # ||A||_F^2 of the 12 x 12 lower-triangular ones


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_total_error_matches_the_dense_formula(momentum):
  c = st.normalize([1.0, 0.5, -0.2, 0.1])
  A = st.workload_matrix(30, momentum)
  dense = np.linalg.norm(A @ np.linalg.inv(st.strategy_matrix(c, 30)), "fro") ** 2
  assert st.total_error(c, 30, momentum) == pytest.approx(dense, rel=1e-10)
  np.testing.assert_allclose(st.inverse_column(c, 30),
                             np.linalg.inv(st.strategy_matrix(c, 30))[:, 0], atol=1e-12)


def test_momentum_workload_is_the_parameters_of_heavy_ball():
  beta, n = 0.9, 6
  g = np.random.default_rng(0).normal(size=n)
  velocity, params = 0.0, []
  for t in range(n):
    velocity = beta * velocity + g[t]
    params.append((params[-1] if params else 0.0) + velocity)
  np.testing.assert_allclose(st.workload_matrix(n, beta) @ g, params)


@pytest.mark.parametrize("n,bands,momentum", [(12, 3, 0.0), (64, 4, 0.0), (64, 4, 0.9),
                                              (200, 8, 0.0)])
def test_optimized_error_is_at_most_identity_and_sqrt(n, bands, momentum):
  best = st.optimize_bands(n, bands, momentum)
  assert best.bands == bands and best.coefficients[0] > 0
  assert np.linalg.norm(best.coefficients) == pytest.approx(1.0)
  assert best.error < st.identity_strategy(n, momentum).error
  assert best.error <= st.sqrt_banded_strategy(n, bands, momentum).error * (1 + 1e-6)


def test_brute_force_sensitivity_under_min_separation():
  n, b = 12, 3
  C = st.optimize_bands(n, b).matrix()
  # One participation: the largest column norm, 1 after normalization.
  assert st.sensitivity(C, 1) == pytest.approx(1.0)
  assert st.sensitivity(C, 1) == pytest.approx(np.linalg.norm(C, axis=0).max())
  # k participations at least b apart touch disjoint rows: sqrt(k) at most (n/b = 4 here).
  for k in (2, 3, 4):
    assert st.sensitivity(C, k, separation=b) == pytest.approx(np.sqrt(k))
  assert st.sensitivity(C, None, separation=b) == pytest.approx(2.0)
  # Closer participations overlap (positive band): more than sqrt(2) for two steps 1 apart.
  assert st.sensitivity(C, 2, separation=1) > np.sqrt(2) + 0.1


def test_validation():
  with pytest.raises(ValueError, match="bands"):
    st.optimize_bands(4, 5)
  with pytest.raises(ValueError, match="c_0"):
    st.normalize([0.0, 1.0])
  with pytest.raises(ValueError, match="momentum"):
    st.workload_column(4, 1.0)
