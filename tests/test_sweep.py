"""Sweeps: the library (grid parsing, resume checks, heatmaps, results of recorded runs) and
the CLI, end to end on a tiny MNIST-format sweep (subprocesses of the real launcher on a tiny
.npz written here)."""

import csv
import json
import math
import os
import sys

import numpy as np
import pytest

from tf_dpnsgd import accounting
from tf_dpnsgd import export
from tf_dpnsgd import plots
from tf_dpnsgd import sweeps
from tf_dpnsgd.records import RunRecord
import zygote  # children forked from a pre-imported process (tests/zygote.py)

ENV = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", TF_ENABLE_ONEDNN_OPTS="0")


def write_tiny_mnist(path, n_train=200, n_test=100, seed=0):
  """A learnable MNIST-format .npz: each class lights its own 8x4 block of a noisy image."""
  rng = np.random.default_rng(seed)

  def make(n):
    y = rng.integers(0, 10, n)
    x = rng.integers(0, 60, (n, 28, 28)).astype(np.uint8)
    for i, k in enumerate(y):
      r, c = divmod(int(k), 5)
      x[i, 4 + 12 * r:12 + 12 * r, 1 + 5 * c:5 + 5 * c] = 255
    return x, y.astype(np.uint8)

  (xt, yt), (xs, ys) = make(n_train), make(n_test)
  np.savez(path, x_train=xt, y_train=yt, x_test=xs, y_test=ys)
  return path


def run_sweep(*args):
  out = zygote.run([sys.executable, "-m", "tf_dpnsgd.launch.sweep", *args],
                   capture_output=True, text=True, timeout=900, env=ENV)
  if out.returncode != 0:
    raise AssertionError(f"sweep failed:\n{out.stdout[-4000:]}\n{out.stderr[-4000:]}")
  return out.stdout


# ---------------------------------------------------------------------------
# Grid.
# ---------------------------------------------------------------------------
def test_axis_parsing_and_errors():
  a = sweeps.Axis.parse("learning_rate=0.05, 0.1,3.2")
  assert (a.name, a.values, a.condition) == ("learning_rate", ("0.05", "0.1", "3.2"), None)
  assert sweeps.Axis.parse("--l2_norm_clip=1,10@optimizer=dpsgd").condition == (
      "optimizer", "dpsgd")
  for bad in ("learning_rate", "learning_rate=", "lr=1,1", "model_dir=a,b", "x=1@optimizer",
              "1x=2"):
    with pytest.raises(sweeps.SweepError):
      sweeps.Axis.parse(bad)


def test_expand_grid_with_conditional_and_virtual_axes():
  axes = [sweeps.Axis.parse(t) for t in (
      "optimizer=dpnsgd,dpsgd", "target_epsilon=2,8",
      "learning_rate=0.1,0.2@optimizer=dpnsgd", "regularizer=1e-3,1e-2,1@optimizer=dpnsgd",
      "effective_lr=0.1,0.2@optimizer=dpsgd", "l2_norm_clip=0.1,10@optimizer=dpsgd")]
  cells = sweeps.expand_grid(axes)
  assert len(cells) == 2 * (2 * 3) + 2 * (2 * 2)          # per epsilon: 6 DP-NSGD + 4 DP-SGD
  assert len({c.name for c in cells}) == len(cells)
  dpsgd = [c for c in cells if c.get("optimizer") == "dpsgd"]
  assert all(c.get("regularizer") is None for c in dpsgd)
  cell = next(c for c in dpsgd if c.get("effective_lr") == "0.2" and c.get("l2_norm_clip") == "10")
  assert cell.launcher_flags({}) == ["--optimizer=dpsgd", "--target_epsilon=2",
                                     "--learning_rate=0.02", "--l2_norm_clip=10"]
  # Panels: one figure per optimizer, one panel per epsilon, lr x r (3 wide) or lr*c x c.
  opts = sweeps.SweepOptions(base="mnist", sweep_dir="/unused", axes=tuple(axes))
  panels = sweeps.arrange_panels(opts, cells)
  shapes = {(p.figure, p.label): (len(p.y_values), len(p.x_values), p.x_axis, p.y_axis)
            for p in panels}
  assert shapes == {
      ("optimizer=dpnsgd", "epsilon = 2"): (2, 3, "regularizer", "learning_rate"),
      ("optimizer=dpnsgd", "epsilon = 8"): (2, 3, "regularizer", "learning_rate"),
      ("optimizer=dpsgd", "epsilon = 2"): (2, 2, "l2_norm_clip", "effective_lr"),
      ("optimizer=dpsgd", "epsilon = 8"): (2, 2, "l2_norm_clip", "effective_lr")}


@pytest.mark.parametrize("texts,match", [
    (["lr=1,2", "lr=3,4"], "twice"),
    (["r=1,2@optimizer=dpnsgd"], "not an unconditional"),
    (["optimizer=dpnsgd", "r=1@optimizer=dpsgd"], "takes only"),
])
def test_bad_grids_raise(texts, match):
  with pytest.raises(sweeps.SweepError, match=match):
    sweeps.expand_grid([sweeps.Axis.parse(t) for t in texts])


def test_effective_lr_needs_a_clip():
  cell = sweeps.expand_grid([sweeps.Axis.parse("effective_lr=1")])[0]
  with pytest.raises(sweeps.SweepError, match="l2_norm_clip"):
    cell.launcher_flags({})
  assert cell.launcher_flags({"l2_norm_clip": "4"}) == ["--learning_rate=0.25"]


def test_resume_refuses_a_cell_started_with_other_flags(tmp_path):
  axes = (sweeps.Axis.parse("learning_rate=0.1,0.2"),)
  old = sweeps.SweepOptions(base="mnist", sweep_dir=str(tmp_path), axes=axes,
                           fixed=(("epochs", "1"),))
  new = sweeps.SweepOptions(base="mnist", sweep_dir=str(tmp_path), axes=axes,
                           fixed=(("epochs", "2"),))
  cell = sweeps.expand_grid(axes)[0]
  directory = sweeps.cell_dir(old, cell)
  os.makedirs(directory)
  with open(os.path.join(directory, "cell.json"), "w") as f:
    json.dump(sweeps.cell_record(old, cell), f)
  sweeps.check_cell_record(old, cell, directory)           # same flags: fine
  with pytest.raises(sweeps.SweepError, match="different settings"):
    sweeps.check_cell_record(new, cell, directory)


def test_fresh_seeds_and_explicit_seeds_conflict():
  with pytest.raises(sweeps.SweepError, match="cell_seeds"):
    sweeps.SweepOptions(base="mnist", sweep_dir="x", axes=(), fixed=(("seed", "1"),))
  sweeps.SweepOptions(base="mnist", sweep_dir="x", axes=(), fixed=(("seed", "1"),),
                     cell_seeds="base")


# ---------------------------------------------------------------------------
# Robustness of a heatmap.
# ---------------------------------------------------------------------------
def test_robustness_summary_hand_case():
  acc = [[0.90, 0.91, float("nan")],   # lr 0.1
         [0.95, 0.94, 0.93],           # lr 0.2: best row; 93 is exactly 2 points below
         [0.50, 0.929, 0.96]]          # lr 0.4: 96 is the best cell
  s = sweeps.robustness_summary(acc, threshold_points=2.0)
  assert s["best"] == pytest.approx(96.0) and s["best_cell"] == (2, 2)
  assert s["spread_at_best_row"] == pytest.approx(46.0)   # 96 - 50
  assert s["cells"] == 8
  assert s["near_best"] == 3                               # 96, 95, 94 (93.0 < 94)
  s = sweeps.robustness_summary(acc, threshold_points=3.0)
  assert s["near_best"] == 4                               # + 93.0, exactly 3 below
  for bad in ([[float("nan")]], [0.5, 0.6], [[]]):
    with pytest.raises(sweeps.SweepError):
      sweeps.robustness_summary(bad)


def write_cell(opts, cell, record):
  """A finished cell as a launcher leaves it: its cell.json and privacy_report.json."""
  directory = sweeps.cell_dir(opts, cell)
  os.makedirs(directory)
  with open(os.path.join(directory, "cell.json"), "w") as f:
    json.dump({**sweeps.cell_record(opts, cell), "seconds": 1.0}, f)
  export.write_privacy_report(directory, **record.to_dict())


def test_summary_of_recorded_private_and_non_private_cells(tmp_path):
  """Results, report and printed summary from run records alone (no training)."""
  axes = (sweeps.Axis.parse("optimizer=dpnsgd,sgd"),)
  opts = sweeps.SweepOptions(base="mnist", sweep_dir=str(tmp_path), axes=axes,
                             fixed=(("target_epsilon", "4"),), curves=("none",))
  dp, sgd = sweeps.expand_grid(axes)
  run = {"final_metrics": {"accuracy": 0.5, "loss": 1.0}, "best_val_accuracy": 0.6}
  report = accounting.compute_epsilon(200, 50, 1.5, 1e-5, "poisson", steps=8)
  write_cell(opts, dp, RunRecord.from_privacy_report(
      report, hyperparameters={"optimizer": "dpnsgd"}, **run))
  write_cell(opts, sgd, RunRecord.non_private(steps=8, dataset_size=200,
                                              hyperparameters={"optimizer": "sgd"}, **run))
  rows = {r["cell"]: r for r in (sweeps.cell_result(opts, c) for c in (dp, sgd))}
  assert rows[sgd.name]["private"] is False and rows[sgd.name]["epsilon"] is None
  assert rows[dp.name]["epsilon"] == pytest.approx(report.epsilon)
  printed = []
  summary = sweeps.summarize(opts, [dp, sgd], print_fn=printed.append)
  assert summary["finished"] == 2 and summary["whole_sweep"]["runs"] == 2
  assert summary["whole_sweep"]["private"] is False  # the sgd cell: see test_coverage
  assert any("one run epsilon" in line for line in printed)
  results = strict_json(tmp_path / "results.json")
  assert {c["optimizer"]: c["epsilon"] for c in results["cells"]}["sgd"] is None
  strict_json(tmp_path / "report.json")
  with open(tmp_path / "results.csv") as f:
    csv_rows = {r["optimizer"]: r for r in csv.DictReader(f)}
  assert csv_rows["sgd"]["epsilon"] == "" and csv_rows["sgd"]["private"] == "False"
  sgd_png = next(p for p in summary["heatmaps"] if p.endswith("optimizer_sgd.png"))
  assert plots.read_annotations(sgd_png)["panels"][0]["title"] == "non-private"


def heatmap_title(path):
  from PIL import Image
  with Image.open(path) as image:
    return image.text.get("Title", "")


def write_dp_and_sgd_cells(opts, cells):
  """Each cell's record: DP-NSGD cells share one report (sigma 1.5, 8 Poisson steps of
  B=50 out of N=200); sgd cells are non-private."""
  run = {"final_metrics": {"accuracy": 0.5, "loss": 1.0}, "best_val_accuracy": 0.6}
  report = accounting.compute_epsilon(200, 50, 1.5, 1e-5, "poisson", steps=8)
  for cell in cells:
    if cell.get("optimizer", "dpnsgd") == "sgd":
      record = RunRecord.non_private(steps=8, dataset_size=200,
                                     hyperparameters={"optimizer": "sgd"}, **run)
    else:
      record = RunRecord.from_privacy_report(report, hyperparameters={"optimizer": "dpnsgd"},
                                             **run)
    write_cell(opts, cell, record)


@pytest.mark.slow
def test_a_sweep_with_a_non_private_cell_is_not_private_as_a_whole(tmp_path):
  """Issue 19, scenario 10: a grid optimizer=dpnsgd,sgd used to print "Whole sweep: 2 runs
  released, naive composition epsilon ..." although the sgd runs, trained on the same data
  without noise, are released with it. Printed summary, report.json/.md and every heatmap
  must say NOT private; the private runs' own composition is kept apart (oracle: two
  identical Poisson runs of 8 steps compose to one run of 16 steps)."""
  import re
  axes = (sweeps.Axis.parse("optimizer=dpnsgd,sgd"), sweeps.Axis.parse("learning_rate=0.5,2"))
  cells = sweeps.expand_grid(axes)
  sgd = sorted(c.name for c in cells if c.get("optimizer") == "sgd")
  two_runs = accounting.compute_epsilon(200, 50, 1.5, 1e-5, "poisson", steps=16).epsilon

  opts = sweeps.SweepOptions(base="mnist", sweep_dir=str(tmp_path / "by_optimizer"),
                             axes=axes, fixed=(("target_epsilon", "4"),), curves=("none",))
  write_dp_and_sgd_cells(opts, cells)
  printed = []
  summary = sweeps.summarize(opts, cells, print_fn=printed.append)
  text = "\n".join(printed)
  assert "Whole sweep: NOT PRIVATE (epsilon = infinity)" in text
  assert not re.search(r"Whole sweep: \d+ runs released", text)
  whole = summary["whole_sweep"]
  assert whole["private"] is False and whole["epsilon"] is None and summary["private"] is False
  assert sorted(whole["non_private_cells"]) == sgd and whole["runs"] == 4
  assert "naive_composition" not in whole  # no finite number where one would read it
  assert whole["private_runs_only"]["naive_composition"]["epsilon"] == pytest.approx(
      two_runs, rel=1e-6)
  on_disk = strict_json(tmp_path / "by_optimizer" / "report.json")
  assert on_disk["whole_sweep"]["private"] is False and on_disk["whole_sweep"]["epsilon"] is None
  with open(tmp_path / "by_optimizer" / "report.md") as f:
    assert "Whole sweep: NOT PRIVATE" in f.read()
  assert len(summary["heatmaps"]) == 2
  for path in summary["heatmaps"]:  # the DP-NSGD figure too: it is released with the sgd one
    assert heatmap_title(path).endswith(sweeps.figures.NOT_PRIVATE_SUFFIX)

  # One panel holding both kinds (optimizer on the x axis): the panel itself says so.
  opts = sweeps.SweepOptions(base="mnist", sweep_dir=str(tmp_path / "mixed_panel"), axes=axes,
                             fixed=(("target_epsilon", "4"),), curves=("none",),
                             x_axis=("optimizer",))
  write_dp_and_sgd_cells(opts, cells)
  printed = []
  summary = sweeps.summarize(opts, cells, print_fn=printed.append)
  (entry,) = summary["panels"]
  assert sorted(entry["non_private_cells"]) == sgd
  assert any(line.startswith("* NOT private: this panel") for line in printed)
  (png,) = summary["heatmaps"]
  assert plots.read_annotations(png)["panels"][0]["title"].startswith("NOT private")

  # All cells private: the whole sweep's epsilon is the composition (same oracle).
  dp_axes = (sweeps.Axis.parse("learning_rate=0.5,2"),)
  opts = sweeps.SweepOptions(base="mnist", sweep_dir=str(tmp_path / "private"), axes=dp_axes,
                             fixed=(("target_epsilon", "4"),), curves=("none",))
  dp_cells = sweeps.expand_grid(dp_axes)
  write_dp_and_sgd_cells(opts, dp_cells)
  printed = []
  summary = sweeps.summarize(opts, dp_cells, print_fn=printed.append)
  assert summary["whole_sweep"]["private"] is True and summary["private"] is True
  assert summary["whole_sweep"]["epsilon"] == pytest.approx(two_runs, rel=1e-6)
  assert any(line.startswith("Whole sweep: 2 runs released") for line in printed)
  assert not heatmap_title(summary["heatmaps"][0]).endswith(sweeps.figures.NOT_PRIVATE_SUFFIX)


@pytest.mark.slow
def test_sweep_curves_show_test_metrics_unless_training_metrics_are_asked_for(tmp_path):
  """Issue 19, scenario 13: the training loss/accuracy in a cell's history are exact,
  unprivatized training-set metrics; curves.png draws only val_* unless
  --plot_training_metrics, and the report says which."""
  axes = (sweeps.Axis.parse("learning_rate=0.5,2"),)
  cells = sweeps.expand_grid(axes)
  history = {"epoch": [1, 2], "loss": [0.9, 0.5], "accuracy": [0.6, 0.8],
             "val_loss": [1.0, 0.7], "val_accuracy": [0.5, 0.7]}
  drawn = {}
  for asked in (False, True):
    opts = sweeps.SweepOptions(base="mnist", sweep_dir=str(tmp_path / str(asked)), axes=axes,
                               fixed=(("target_epsilon", "4"),), curves=("best",),
                               plot_training_metrics=asked)
    write_dp_and_sgd_cells(opts, cells)
    for cell in cells:
      with open(os.path.join(sweeps.cell_dir(opts, cell), "history.json"), "w") as f:
        json.dump(history, f)
    summary = sweeps.summarize(opts, cells, print_fn=lambda *a: None)
    drawn[asked] = {key for _, key in plots.read_annotations(summary["curves"]["path"])["curves"]}
    assert any(("UNPRIVATIZED" in a or "unprivatized" in a) and "curves.png" in a
               for a in summary["assumptions"])
  assert drawn[False] == {"val_loss", "val_accuracy"}
  assert drawn[True] == {"loss", "accuracy", "val_loss", "val_accuracy"}


@pytest.mark.parametrize("base,split", [("sst2", "dev"), ("mnist", "test")])
def test_figures_and_report_name_the_split_the_launcher_scores_on(tmp_path, base, split):
  """SST-2 scores on GLUE's dev set: its heatmaps said "test accuracy"."""
  axes = (sweeps.Axis.parse("learning_rate=0.5,2"),)
  cells = sweeps.expand_grid(axes)
  opts = sweeps.SweepOptions(base=base, sweep_dir=str(tmp_path), axes=axes,
                             fixed=(("target_epsilon", "4"),), curves=("none",))
  write_dp_and_sgd_cells(opts, cells)
  summary = sweeps.summarize(opts, cells, print_fn=lambda *a: None)
  other = {"dev": "test", "test": "dev"}[split]
  titles = [heatmap_title(p) for p in summary["heatmaps"]]
  assert titles and all(f"{split} accuracy" in t and other not in t for t in titles), titles
  assert summary["eval_split"] == split
  text = "\n".join(sweeps.report_lines(summary) + summary["assumptions"])
  assert f"{split} accuracy" in text and f"{other} accuracy" not in text


# ---------------------------------------------------------------------------
# Heatmap figure.
# ---------------------------------------------------------------------------
def test_heatmap_annotations_and_image(tmp_path):
  values = np.array([[0.912, 0.5, np.nan], [0.8, 0.75, 0.7]])
  panels = [plots.HeatmapPanel("epsilon = 2", values, ["1e-3", "1e-2", "1"], ["0.1", "0.2"]),
            plots.HeatmapPanel("epsilon = 8", values + 0.05, ["1e-3", "1e-2", "1"],
                               ["0.1", "0.2"])]
  path = str(tmp_path / "h.png")
  drawn = plots.heatmap(path, panels, "regularizer r", "learning rate", title="t")
  assert drawn[0] == [["91.2", "50.0", "n/a"], ["80.0", "75.0", "70.0"]]
  assert drawn[1][0][0] == "96.2"
  meta = plots.read_annotations(path)
  assert [p["annotations"] for p in meta["panels"]] == drawn
  assert meta["panels"][1]["y_ticks"] == ["0.1", "0.2"]
  from PIL import Image
  with Image.open(path) as im:
    pixels = np.asarray(im.convert("L"), dtype=float)
  assert pixels.shape[0] > 100 and pixels.shape[1] > 300 and pixels.std() > 10
  with pytest.raises(ValueError, match="do not match"):
    plots.HeatmapPanel("bad", values, ["a"], ["b"])


# ---------------------------------------------------------------------------
# End to end: 2x2 grid of the MNIST launcher, results, figures, report, resume; dry run.
# ---------------------------------------------------------------------------
@pytest.mark.slow
def test_sweep_end_to_end_and_resume(tmp_path):
  data = write_tiny_mnist(tmp_path / "tiny.npz")
  sweep_dir = tmp_path / "sweep"
  args = ["--base=mnist", f"--fixed=data_path={data}", "--fixed=epochs=2",
          "--fixed=batch_size=50", "--fixed=width=8", "--fixed=target_epsilon=4",
          "--grid=learning_rate=0.5,2", "--grid=regularizer=0.01,1",
          f"--sweep_dir={sweep_dir}", "--curves=best"]
  out = run_sweep(*args)
  assert "4 cells: 0 finished (skipped), 4 to run." in out

  with open(sweep_dir / "results.csv") as f:
    rows = list(csv.DictReader(f))
  assert len(rows) == 4 and all(r["status"] == "finished" for r in rows)
  acc = {(r["learning_rate"], r["regularizer"]): float(r["final_accuracy"]) for r in rows}
  assert set(acc) == {("0.5", "0.01"), ("0.5", "1"), ("2", "0.01"), ("2", "1")}
  for r in rows:
    assert 0.0 <= float(r["final_accuracy"]) <= 1.0
    assert 0 < float(r["epsilon"]) <= 4.0 + 1e-9 and int(r["steps"]) == 8  # floor(2*200/50)
    assert float(r["best_val_accuracy"]) >= float(r["final_accuracy"]) - 1e-9

  # The heatmap shows the CSV's accuracies, in a 2 (lr) x 2 (r) grid.
  pngs = [p for p in os.listdir(sweep_dir) if p.startswith("heatmap_")]
  assert pngs == ["heatmap_learning_rate_x_regularizer.png"]
  png = sweep_dir / pngs[0]
  assert os.path.getsize(png) > 5000
  meta = plots.read_annotations(str(png))
  (panel,) = meta["panels"]
  assert panel["y_ticks"] == ["0.5", "2"] and panel["x_ticks"] == ["0.01", "1"]
  assert panel["annotations"] == [[f"{100 * acc[(lr, r)]:.1f}" for r in ("0.01", "1")]
                                  for lr in ("0.5", "2")]
  assert os.path.getsize(sweep_dir / "curves.png") > 5000

  # Report: robustness recomputed here from the CSV, privacy orderings.
  with open(sweep_dir / "report.json") as f:
    report = json.load(f)
  (entry,) = report["panels"]
  best = max(acc.values())
  rob = entry["robustness"]
  assert rob["best"] == pytest.approx(100 * best)
  assert rob["near_best"] == sum(100 * v >= 100 * best - 2 - 1e-9 for v in acc.values())
  best_lr = max(acc, key=acc.get)[0]
  row = [acc[(best_lr, r)] for r in ("0.01", "1")]
  assert rob["spread_at_best_row"] == pytest.approx(100 * (max(row) - min(row)))
  priv = entry["privacy"]
  single, naive = priv["single_run"]["epsilon"], priv["naive_composition"]["epsilon"]
  assert single <= 4.0 + 1e-9 < naive
  assert [r["mean_trials"] for r in priv["random_search"]] == pytest.approx([4.0, 4.0, 4.0])
  assert all(single < r["epsilon"] for r in priv["random_search"])
  assert "naive composition" in out and "random search" in out

  # Resume: drop one cell's report (as if interrupted before it finished); only it reruns.
  cells = sorted(os.listdir(sweep_dir / "cells"))
  victim = cells[1]
  os.remove(sweep_dir / "cells" / victim / "privacy_report.json")
  mtimes = {c: os.path.getmtime(sweep_dir / "cells" / c / "privacy_report.json")
            for c in cells if c != victim}
  out = run_sweep(*args)
  assert "4 cells: 3 finished (skipped), 1 to run." in out
  assert f"] {victim} ..." in out
  for c, t in mtimes.items():
    assert os.path.getmtime(sweep_dir / "cells" / c / "privacy_report.json") == t
    with open(sweep_dir / "cells" / c / "log.txt") as f:
      assert f.read().count("\n=== ") == 1
  assert os.path.exists(sweep_dir / "cells" / victim / "privacy_report.json")

  # Dry run of a grid over epsilon: planned epsilon matches the accountant for the printed sigma.
  out = run_sweep("--base=mnist", f"--fixed=data_path={data}", "--fixed=epochs=2",
                  "--fixed=batch_size=50", "--grid=target_epsilon=1,4",
                  "--grid=learning_rate=0.5,2", "--dry_run", f"--sweep_dir={tmp_path}/dry")
  with open(tmp_path / "dry" / "plan.json") as f:
    plan = json.load(f)
  assert len(plan["cells"]) == 4
  for c in plan["cells"]:
    assert c["steps"] == 8 and c["dataset_size"] == 200
    expected = accounting.compute_epsilon(200, 50, c["noise_multiplier"], 1e-5, "poisson",
                                          steps=8).epsilon
    assert c["epsilon"] == pytest.approx(expected, rel=1e-9)
    assert c["epsilon"] <= float(c["target_epsilon"]) + 1e-9
    assert c["cell"] in out
  assert not os.path.exists(tmp_path / "dry" / "cells")
  assert {p["panel"] for p in plan["panels"]} == {"epsilon = 1", "epsilon = 4"}
  assert all(math.isfinite(p["privacy"]["naive_composition"]["epsilon"]) for p in plan["panels"])


# ---------------------------------------------------------------------------
# Non-private cells (optimizer=sgd) and flag errors.
# ---------------------------------------------------------------------------
def strict_json(path):
  """Loads JSON refusing NaN/Infinity (which `json` writes for float inf but is not JSON)."""
  def refuse(constant):
    raise ValueError(f"{path}: non-standard JSON constant {constant}")
  with open(path) as f:
    return json.load(f, parse_constant=refuse)


def test_sgd_cells_drop_the_fixed_privacy_flags_and_refuse_privacy_axes():
  opts = sweeps.SweepOptions(base="mnist", sweep_dir="x",
                            axes=(sweeps.Axis.parse("optimizer=dpnsgd,sgd"),),
                            fixed=(("target_epsilon", "4"), ("epochs", "1")))
  dp, sgd = sweeps.expand_grid(opts.axes)
  assert opts.cell_argv(dp) == ["--target_epsilon=4", "--epochs=1", "--optimizer=dpnsgd"]
  assert opts.cell_argv(sgd) == ["--epochs=1", "--optimizer=sgd"]
  axes = (sweeps.Axis.parse("optimizer=dpnsgd,sgd"), sweeps.Axis.parse("target_epsilon=2,4"))
  opts = sweeps.SweepOptions(base="mnist", sweep_dir="x", axes=axes)
  with pytest.raises(sweeps.SweepError, match="condition that axis"):
    sweeps.check_cells(opts, sweeps.expand_grid(axes))
  axes = (sweeps.Axis.parse("optimizer=dpnsgd,sgd"),
          sweeps.Axis.parse("target_epsilon=2,4@optimizer=dpnsgd"))
  opts = sweeps.SweepOptions(base="mnist", sweep_dir="x", axes=axes)
  sweeps.check_cells(opts, sweeps.expand_grid(axes))  # fine: conditioned on the private cells


@pytest.mark.slow
def test_dry_run_with_sgd_axis_and_flag_errors(tmp_path):
  from launch_each import launch_each  # the dry run and the three refusals in one process
  args = ["--base=quickstart", "--fixed=epochs=2", "--grid=optimizer=dpnsgd,sgd", "--dry_run"]
  bad_flags = ((["--grid=target_epsilon=2,4"], "condition that axis"),
               (["--fixed=noise_multiplier=1", "--fixed=target_epsilon=2"], "only one"),
               (["--fixed=regularizer=0"], "--regularizer must be > 0"))
  dry, *refused = launch_each("tf_dpnsgd.launch.sweep", [
      args + [f"--sweep_dir={tmp_path}/dry"], *[args + bad for bad, _ in bad_flags]],
      env=ENV, timeout=300)
  assert dry.returncode == 0, f"sweep failed:\n{dry.stdout[-4000:]}\n{dry.stderr[-4000:]}"
  out = dry.stdout
  assert "non-private" in out
  assert "NOT private as a whole" in out  # issue 19, scenario 10
  plan = strict_json(tmp_path / "dry" / "plan.json")
  assert plan["private"] is False
  rows = {c["optimizer"]: c for c in plan["cells"]}
  assert rows["sgd"]["epsilon"] is None and rows["sgd"]["private"] is False
  assert 0 < rows["dpnsgd"]["epsilon"] <= 4.0 + 1e-9  # the quickstart's default target
  for proc, (bad, message) in zip(refused, bad_flags):
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, (bad, proc.stderr[-3000:])
    assert "FATAL sweep error" in proc.stderr and message in proc.stderr, (bad, proc.stderr)


@pytest.mark.slow
def test_sweep_with_a_non_private_cell(tmp_path):
  """A real 2-cell sweep, DP-NSGD and the sgd baseline: results, report (strict JSON),
  heatmaps and summary handle the non-private cell; cell logs hold no seed."""
  data = write_tiny_mnist(tmp_path / "tiny.npz", n_train=100, n_test=50)
  sweep_dir = tmp_path / "sweep"
  out = run_sweep("--base=mnist", f"--fixed=data_path={data}", "--fixed=epochs=1",
                  "--fixed=batch_size=50", "--fixed=width=8", "--fixed=target_epsilon=4",
                  "--grid=optimizer=dpnsgd,sgd", f"--sweep_dir={sweep_dir}")
  assert "non-private" in out
  with open(sweep_dir / "results.csv") as f:
    rows = {r["optimizer"]: r for r in csv.DictReader(f)}
  assert all(r["status"] == "finished" for r in rows.values())
  assert rows["sgd"]["private"] == "False" and rows["sgd"]["epsilon"] == ""
  assert rows["dpnsgd"]["private"] == "True" and 0 < float(rows["dpnsgd"]["epsilon"]) <= 4 + 1e-9
  results = strict_json(sweep_dir / "results.json")
  assert {c["optimizer"]: c["epsilon"] for c in results["cells"]}["sgd"] is None
  report = strict_json(sweep_dir / "report.json")
  assert report["finished"] == 2 and len(report["heatmaps"]) == 2
  whole = report["whole_sweep"]  # the sgd run makes the sweep non-private (issue 19, #10)
  assert whole["private"] is False and whole["epsilon"] is None and whole["runs"] == 2
  assert whole["private_runs_only"]["runs"] == 1
  assert "Whole sweep: NOT PRIVATE" in out
  for path in report["heatmaps"]:
    assert os.path.getsize(path) > 5000
  sgd_png = next(p for p in report["heatmaps"] if p.endswith("optimizer_sgd.png"))
  assert plots.read_annotations(sgd_png)["panels"][0]["title"] == "non-private"
  for cell in os.listdir(sweep_dir / "cells"):
    with open(sweep_dir / "cells" / cell / "log.txt") as f:
      log = f.read()
    assert "Traceback" not in log and '"seed"' not in log and "seed=" not in log
