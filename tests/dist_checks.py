"""Checks shared by tests/test_distribute.py and tests/test_multiworker.py (not a test)."""

import numpy as np

# The experiment of tests/dist_script.py (which imports these).
N, B, STEPS = 64, 15, 3
SIGMA, CLIP, UNITS = 2.0, 0.5, 400

SAMPLINGS = ("poisson", "uniform", "shuffle")


def assert_same_training(single: dict, distributed: dict) -> None:
  """Same ledger (steps counted once, same kind) and weights to float tolerance."""
  for s in SAMPLINGS:
    assert int(distributed[f"{s}_data_steps"]) == int(single[f"{s}_data_steps"]) > 0, s
    assert str(distributed[f"{s}_data_kind"]) == s
    keys = sorted(k for k in single if k.startswith(f"{s}_data_") and k[-1].isdigit())
    assert keys
    moved = 0.0
    for k in keys:
      np.testing.assert_allclose(distributed[k], single[k], rtol=1e-5, atol=1e-6, err_msg=k)
      moved = max(moved, float(np.abs(np.asarray(single[k], np.float64)).max()))
    assert moved > 1e-3  # the weights are not trivially zero
    np.testing.assert_allclose(float(np.ravel(distributed[f"{s}_data_eval"])[0]),
                               float(np.ravel(single[f"{s}_data_eval"])[0]), rtol=1e-5)


def assert_one_draw_per_step(distributed: dict) -> None:
  """Update noise of a zero-gradient model: std sigma * C * sqrt(T) / B over 2000 weights.

  The empirical std of 2000 Gaussians is within ~2.2% (1 s.e.) of the truth;
  two draws averaged would give ratio 0.71, two summed 1.41.
  """
  for s in SAMPLINGS:
    steps = int(distributed[f"{s}_noise_steps"])
    assert steps > 0
    expected = SIGMA * CLIP * np.sqrt(steps) / B  # qN = B for Poisson
    diff = distributed[f"{s}_noise_diff"]
    assert diff.size == 5 * UNITS
    ratio = float(diff.std()) / expected
    assert 0.9 < ratio < 1.1, (s, ratio)
