"""tf_dpnsgd.sweeps.compare: seed means, robustness and the privacy of tuning across sweeps.

Synthetic sweep folders (cell.json + privacy_report.json, as the sweep runner and
launchers write them); expected values are computed here with numpy and with
dp-accounting directly.
"""

import json
import os

import dp_accounting
import numpy as np
import pytest

from tf_dpnsgd.sweeps import SweepError
from tf_dpnsgd.sweeps import compare

SIGMA, STEPS, N, B, DELTA = 1.2, 40, 10000, 250, 1e-5
LRS, CLIPS, SEEDS = ("0.5", "1", "2"), ("0.1", "1"), ("1", "2", "3")


def _report(acc):
  return {"accountant": "rdp", "batch_size": B, "bound": "default", "conversion": "modern",
          "dataset_size": N, "delta": DELTA, "epsilon": 1.0, "private": True,
          "sampling": "poisson", "noise_multiplier": SIGMA, "steps": STEPS,
          "final_metrics": {"accuracy": acc, "loss": 0.5}, "best_val_accuracy": acc,
          "hyperparameters": {}, "notes": []}


def _accuracy(seed, lr, clip):
  return 0.5 + 0.1 * float(lr) + 0.02 * float(clip) + 0.01 * int(seed)


def _write_sweep(root, skip=()):
  for seed in SEEDS:
    for lr in LRS:
      for clip in CLIPS:
        name = f"seed-{seed}__target_epsilon-1__effective_lr-{lr}__l2_norm_clip-{clip}"
        d = os.path.join(root, "cells", name)
        os.makedirs(d)
        assignments = {"seed": seed, "target_epsilon": "1", "effective_lr": lr,
                       "l2_norm_clip": clip}
        with open(os.path.join(d, "cell.json"), "w") as f:
          json.dump({"cell": name, "assignments": assignments}, f)
        if (seed, lr, clip) in skip:
          continue
        with open(os.path.join(d, "privacy_report.json"), "w") as f:
          json.dump(_report(_accuracy(seed, lr, clip)), f)
  return root


def test_seed_mean_std_and_robustness_match_numpy(tmp_path):
  grid = compare.load_sweep("DP-SGD", _write_sweep(str(tmp_path / "s")))
  assert (grid.y_axis, grid.x_axis) == ("effective_lr", "l2_norm_clip")
  [entry] = compare.summarize_method(grid)
  acc = np.array([[[_accuracy(s, lr, c) for c in CLIPS] for lr in LRS] for s in SEEDS])
  np.testing.assert_allclose(entry["mean"], acc.mean(axis=0), rtol=1e-12)
  np.testing.assert_allclose(entry["std"], acc.std(axis=0, ddof=1), rtol=1e-9)
  rob = entry["robustness"]
  # Best mean: lr 2, clip 1 -> 0.5 + 0.2 + 0.02 + 0.02 = 0.74.
  assert (rob["best_y"], rob["best_x"]) == ("2", "1")
  assert rob["best"] == pytest.approx(74.0)
  assert rob["spread_at_best_row"] == pytest.approx(1.8)  # clip 0.1 vs 1 at lr 2
  assert rob["near_best"] == 2 and rob["cells"] == 6  # lr 2 row only (lr 1 is 5 points below)
  assert entry["complete"] and entry["runs_finished"] == 18
  assert [s["best_y"] for s in entry["per_seed"]] == ["2", "2", "2"]


def test_tuning_privacy_against_dp_accounting(tmp_path):
  grid = compare.load_sweep("DP-SGD", _write_sweep(str(tmp_path / "s")))
  [entry] = compare.summarize_method(grid)
  priv = entry["privacy"]
  q = B / N
  step = dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(SIGMA))

  def eps(count):
    acc = dp_accounting.rdp.RdpAccountant()
    acc.compose(dp_accounting.SelfComposedDpEvent(step, count))
    return acc.get_epsilon(DELTA)

  assert priv["single_run"]["epsilon"] == pytest.approx(eps(STEPS), rel=1e-3)
  # One seed of the 6 cells released: 6 runs composed; all 18 replicate runs: 18.
  assert priv["naive_composition_one_seed"]["epsilon"] == pytest.approx(eps(6 * STEPS), rel=1e-3)
  assert priv["naive_composition"]["epsilon"] == pytest.approx(eps(18 * STEPS), rel=1e-3)
  # Random search releases only the best trial: more than one run, less than all cells.
  for r in priv["random_search"]:
    assert eps(STEPS) < r["epsilon"] < priv["naive_composition"]["epsilon"]


def test_missing_runs_are_nan_and_marked_incomplete(tmp_path):
  root = _write_sweep(str(tmp_path / "s"), skip={("2", "1", "1"), ("1", "0.5", "0.1"),
                                                 ("2", "0.5", "0.1"), ("3", "0.5", "0.1")})
  [entry] = compare.summarize_method(compare.load_sweep("m", root))
  assert not entry["complete"] and entry["runs_finished"] == 14
  assert np.isnan(entry["mean"][0][0])  # no seed finished lr 0.5 / clip 0.1
  expected = np.mean([_accuracy(s, "1", "1") for s in ("1", "3")])
  assert entry["mean"][1][1] == pytest.approx(expected)
  lines = compare.table_lines([entry])
  assert "(incomplete)" in lines[2]


def test_compare_writes_table_and_figures(tmp_path):
  a = _write_sweep(str(tmp_path / "a"))
  out = compare.compare([("A", a), ("B", a)], str(tmp_path / "out"))
  assert len(out["entries"]) == 2 and all(os.path.isfile(p) for p in out["figures"])
  from tf_dpnsgd import plots
  meta = plots.read_annotations(out["figures"][0])
  assert meta["panels"][0]["annotations"][2][1] == "74.0"  # the best cell's seed mean
  with open(tmp_path / "out" / "comparison.md") as f:
    assert f.read().count("\n| A ") == 1


def test_refuses_a_grid_without_two_axes(tmp_path):
  d = tmp_path / "s" / "cells" / "c"
  d.mkdir(parents=True)
  (d / "cell.json").write_text(json.dumps({"assignments": {"seed": "1", "learning_rate": "1"}}))
  with pytest.raises(SweepError, match="two varying axes"):
    compare.load_sweep("m", str(tmp_path / "s"))
  with pytest.raises(SweepError, match="no cells"):
    compare.load_sweep("m", str(tmp_path))


def test_a_non_private_run_in_a_grid_makes_its_panel_not_private(tmp_path):
  """Issue 19, scenario 10, in the comparison: a finished non-private run in a method's
  grid was silently left out of the privacy numbers; now the panel says NOT private."""
  root = _write_sweep(str(tmp_path / "s"))
  name = "seed-1__target_epsilon-1__effective_lr-1__l2_norm_clip-1"
  with open(os.path.join(root, "cells", name, "privacy_report.json"), "w") as f:
    json.dump({**_report(0.9), "private": False, "epsilon": None, "delta": None,
               "noise_multiplier": None}, f)
  [entry] = compare.summarize_method(compare.load_sweep("DP-SGD", root))
  assert entry["non_private_cells"] == [name] and entry["privacy"]["private"] is False
  assert "NOT private" in compare.table_lines([entry])[2]
  [clean] = compare.summarize_method(compare.load_sweep("DP-SGD", _write_sweep(
      str(tmp_path / "t"))))
  assert "non_private_cells" not in clean and "private" not in clean["privacy"]
