r"""``python -m tf_dpnsgd.launch.sweep``: hyperparameter sweeps of a launcher from the command line.

  python -m tf_dpnsgd.launch.sweep --flagfile=configs/sweeps/mnist_small.flags \
      --sweep_dir=runs/sweeps/mnist_small
  python -m tf_dpnsgd.launch.sweep --base=quickstart --fixed=epochs=5 \
      --grid=learning_rate=0.5,1,2 --grid=regularizer=0.001,0.01,0.1 \
      --sweep_dir=runs/sweeps/digits --dry_run

Each cell of the grid is one run of the base launcher (``python -m <base>
--flagfile=<base_flagfile> --<fixed> --<cell flags> --model_dir=<sweep_dir>/cells/<cell>``),
one after the other. A cell is finished when its ``privacy_report.json``
exists; rerunning the same command skips finished cells and resumes the
others (the launchers resume from their checkpoints). A cell whose recorded
flags differ from the current ones stops the sweep (use a new --sweep_dir).

Grid axes (--grid, repeatable):

* ``AXIS=V1,V2,...``: ``AXIS`` is a flag of the base launcher; values are
  passed verbatim.
* ``AXIS=V1,...@OTHER=VALUE``: a conditional axis, used only in cells whose
  axis ``OTHER`` has ``VALUE`` (e.g. ``regularizer=...@optimizer=dpnsgd`` and
  ``l2_norm_clip=...@optimizer=dpsgd`` in one sweep).
* ``effective_lr``: a virtual axis for DP-SGD, ``learning_rate =
  effective_lr / l2_norm_clip``, so that ``lr * c`` (the step of a clipped
  gradient) covers the same values for every clip.

Written to --sweep_dir: ``sweep.json`` (the definition), ``cells/<cell>/``
(the run, ``cell.json``, ``log.txt``), ``results.csv`` / ``results.json``
(final and best accuracy, epsilon, sigma, steps per cell), one
``heatmap_<figure>.png`` per figure (x: ``regularizer`` or ``l2_norm_clip``,
y: ``learning_rate`` or ``effective_lr``, one panel per ``target_epsilon``),
``curves.png`` (test loss/accuracy per epoch of the --curves cells; the
unprivatized training curves only with --plot_training_metrics), and
``report.json`` / ``report.md``: per panel the robustness summary and the
privacy of tuning (single run, naive composition of all cells, random search
after Papernot & Steinke 2022; see :mod:`tf_dpnsgd.tuning`).

The flags are defined and read here and nowhere else; the work is done by the
library :mod:`tf_dpnsgd.sweeps`, which takes plain arguments.
"""

from __future__ import annotations

import importlib
import json
import os
import sys

from absl import app
from absl import flags

from tf_dpnsgd import sweeps
from tf_dpnsgd.sweeps import SweepError, SweepOptions

# --dry_run asks the base launcher for its training-set size through its
# `planned_dataset_size(flag_values)` function (every launcher here has one).

FLAGS = flags.FLAGS
flags.DEFINE_string("base", None, "Base launcher: quickstart, mnist, cifar10, sst2 or a module.")
flags.DEFINE_string("base_flagfile", None, "Flag file of the base launcher (its --flagfile).")
flags.DEFINE_multi_string("grid", [], "Grid axis AXIS=V1,V2,...[@OTHER=VALUE] (repeatable).")
flags.DEFINE_multi_string("fixed", [], "NAME=VALUE: a base-launcher flag set in every cell.")
flags.DEFINE_string("sweep_dir", None, "Output folder (cells, results, figures, report).")
flags.DEFINE_boolean("dry_run", False, "List the cells and their planned epsilon; run nothing.")
flags.DEFINE_list("curves", ["best"], "Cells whose training curves are plotted: 'best' (the "
                  "best cell of each panel), 'none', or cell names.")
flags.DEFINE_list("x_axis", list(sweeps.X_CANDIDATES), "Heatmap x axis: first of these in a cell.")
flags.DEFINE_list("y_axis", list(sweeps.Y_CANDIDATES), "Heatmap y axis: first of these in a cell.")
flags.DEFINE_string("panel_axis", sweeps.PANEL_AXIS, "One heatmap panel per value of this axis.")
flags.DEFINE_enum("metric", "final", ("final", "best"),
                  "final: test accuracy at the end; best: best test accuracy over epochs.")
flags.DEFINE_float("near_best_points", 2.0, "Near-best: within this many accuracy points.")
flags.DEFINE_list("tuning_etas", ["0", "1"], "Shapes eta of truncated negative binomial "
                  "random search (0: logarithmic, 1: geometric).")
flags.DEFINE_boolean("tuning_poisson", True, "Also report Poisson random search.")
flags.DEFINE_float("tuning_mean", None, "E[K] of random search (default: cells per panel).")
flags.DEFINE_float("success_probability", 0.9, "Also report the random search that reaches a "
                   "near-best cell with this probability.")
flags.DEFINE_enum("cell_seeds", "fresh", ("fresh", "base"),
                  "The launchers' --seed (initialisation and data order only: every run "
                  "draws its DP noise and sampler seeds from the OS, so cells never share "
                  "noise). fresh: a random --seed per cell run; base: the base launcher's "
                  "(reproducible initialisation).")
flags.DEFINE_integer("cell_timeout", None, "Seconds before a cell run is killed (None: no limit).")
flags.DEFINE_integer("dry_run_dataset_size", None,
                     "Training-set size for --dry_run when the launcher cannot tell.")
flags.DEFINE_boolean("keep_going", True, "Continue with the next cell after a failed one.")
flags.DEFINE_boolean("plot_training_metrics", False,
                     "Also draw the training loss/accuracy in curves.png. Off by default: they "
                     "are exact, unprivatized training-set metrics that no epsilon covers.")


def options_from_flags() -> SweepOptions:
  try:
    etas = tuple(float(e) for e in FLAGS.tuning_etas)
  except ValueError as e:
    raise SweepError(f"--tuning_etas must be numbers; got {FLAGS.tuning_etas}.") from e
  return SweepOptions(
      base=FLAGS.base, sweep_dir=FLAGS.sweep_dir,
      axes=tuple(sweeps.Axis.parse(g) for g in FLAGS.grid),
      fixed=tuple(sweeps.parse_fixed(FLAGS.fixed).items()), base_flagfile=FLAGS.base_flagfile,
      dry_run=FLAGS.dry_run, curves=tuple(FLAGS.curves), x_axis=tuple(FLAGS.x_axis),
      y_axis=tuple(FLAGS.y_axis), panel_axis=FLAGS.panel_axis or None, metric=FLAGS.metric,
      near_best_points=FLAGS.near_best_points, tuning_etas=etas,
      tuning_poisson=FLAGS.tuning_poisson, tuning_mean=FLAGS.tuning_mean,
      success_probability=FLAGS.success_probability, cell_seeds=FLAGS.cell_seeds,
      cell_timeout=FLAGS.cell_timeout, dry_run_dataset_size=FLAGS.dry_run_dataset_size,
      keep_going=FLAGS.keep_going, plot_training_metrics=FLAGS.plot_training_metrics)


# --------------------------------------------------------------------------
# Dry run: the base launcher's own flags say what each cell would do.
# --------------------------------------------------------------------------
def planned_dataset_size(opts: SweepOptions, module, flag_values) -> int:
  if opts.dry_run_dataset_size:
    return opts.dry_run_dataset_size
  if hasattr(module, "planned_dataset_size"):
    return int(module.planned_dataset_size(flag_values))
  raise SweepError(f"--dry_run cannot tell the training-set size of {module.__name__}: pass "
                   "--dry_run_dataset_size.")


def dry_run(opts: SweepOptions, cells) -> dict:
  """:func:`tf_dpnsgd.sweeps.dry_run` with each cell's arguments parsed by the base
  launcher's flags (imported here; it defines them) and its plan built as
  :func:`tf_dpnsgd.launch.common.run_experiment` would. Resets the flag values
  to their defaults afterwards."""
  from tf_dpnsgd.launch import common  # local: it imports Keras
  module = importlib.import_module(opts.base)

  def configure(cell):
    FLAGS.unparse_flags()
    try:
      FLAGS(["sweep-dry-run", *opts.cell_argv(cell)])
      cfg = common.config_from_flags()
    except (flags.Error, common.LaunchError) as e:
      raise SweepError(str(e)) from None
    return cfg, planned_dataset_size(opts, module, FLAGS)

  def make_plan(cfg, dataset_size):
    try:
      return common.make_plan(cfg, dataset_size)
    except common.LaunchError as e:
      raise SweepError(str(e)) from None

  was_parsed = FLAGS.is_parsed()
  try:
    return sweeps.dry_run(opts, cells, configure, make_plan)
  finally:
    FLAGS.unparse_flags()
    if was_parsed:  # defaults, but readable (absl's app.run reads flags on a failed exit)
      FLAGS.mark_as_parsed()


# --------------------------------------------------------------------------
def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  try:
    return _main()
  except SweepError as e:  # a bad sweep definition: one line, no traceback
    raise SystemExit(f"FATAL sweep error: {e}") from None


def _main():
  opts = options_from_flags()
  cells = sweeps.expand_grid(opts.axes)
  sweeps.check_cells(opts, cells)
  if opts.dry_run:
    dry_run(opts, cells)
    return 0
  os.makedirs(opts.sweep_dir, exist_ok=True)
  with open(os.path.join(opts.sweep_dir, "sweep.json"), "w") as f:
    json.dump(opts.to_dict(), f, indent=1)
  sweeps.run_cells(opts, cells)
  report = sweeps.summarize(opts, cells)
  if report["not_finished"]:
    print(f"{len(report['not_finished'])} cell(s) did not finish: {report['not_finished']}; "
          "rerun the same command to retry them.", file=sys.stderr)
    return 1
  return 0


if __name__ == "__main__":
  app.run(main)
