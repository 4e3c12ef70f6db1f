r"""``python -m tf_dpnsgd.launch.compare``: compare tuning methods over finished sweeps.

  python -m tf_dpnsgd.launch.compare \
      --sweep=DP-NSGD=runs/tuning/dpnsgd --sweep=DP-SGD=runs/tuning/dpsgd \
      --sweep="adaptive (lr x quantile)=runs/tuning/adaclip_quantile" \
      --out_dir=runs/tuning/comparison

Each ``--sweep=LABEL=DIR`` is a sweep folder (:mod:`tf_dpnsgd.launch.sweep`) with
a ``seed`` axis (replicates) and a ``target_epsilon`` axis (panels). Writes
``comparison.md`` (one table row per method and epsilon), ``comparison.json``
and one heatmap per method (the mean over seeds); see
:mod:`tf_dpnsgd.sweeps.compare` for what each number means.
"""

from __future__ import annotations

from absl import app
from absl import flags

from tf_dpnsgd.sweeps import SweepError
from tf_dpnsgd.sweeps import compare as compare_lib

FLAGS = flags.FLAGS
flags.DEFINE_multi_string("sweep", [], "LABEL=SWEEP_DIR (repeatable, in table order).")
flags.DEFINE_string("out_dir", None, "Output folder (comparison.md/.json, heatmaps).")
flags.DEFINE_enum("metric", "final", ("final", "best"), "Final or best test accuracy.")
flags.DEFINE_float("near_best_points", 2.0, "Near-best: within this many accuracy points.")
flags.DEFINE_float("success_probability", 0.9,
                   "Random search sized to reach a near-best cell with this probability.")


def parse_sweeps(items) -> list:
  """``["LABEL=DIR", ...]`` -> ``[(label, dir)]``; raises ``app.UsageError`` on a bad item."""
  out = []
  for item in items:
    label, sep, directory = item.partition("=")
    if not sep or not label or not directory:
      raise app.UsageError(f"--sweep={item!r}: expected LABEL=SWEEP_DIR.")
    out.append((label, directory))
  if not out:
    raise app.UsageError("Give at least one --sweep=LABEL=SWEEP_DIR.")
  return out


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  if not FLAGS.out_dir:
    raise app.UsageError("--out_dir is required.")
  try:
    result = compare_lib.compare(parse_sweeps(FLAGS.sweep), FLAGS.out_dir, FLAGS.metric,
                                 FLAGS.near_best_points, FLAGS.success_probability)
  except SweepError as e:
    raise app.UsageError(str(e)) from e
  print("\n".join(compare_lib.table_lines(result["entries"])))
  print("Figures: " + ", ".join(result["figures"]))


if __name__ == "__main__":
  app.run(main)
