"""The fixed cost of a private ``fit`` (issue 49): what a tiny model pays beyond the steps.

For a tiny Dense model and a tiny conv model, each in its own subprocess, after one
untimed warm-up of both paths (imports, TensorFlow's first-use costs), measures:

* ``first``: ``make_private(model, target_epsilon=..., epochs=1)`` + ``compile`` + ``fit``
  (one epoch of ``--steps`` Poisson batches of expected size ``--batch``), the path of the
  test suite's ~1000 fits; plain: ``compile`` + ``fit`` of the Keras model itself;
* ``second``: a second ``fit`` of the same model (private: after
  ``extend_privacy_plan(epochs=2)``, one more epoch), where nothing should be traced again.

Wall and process CPU time (all threads), medians over ``--repeats``; the cores may be
shared, and CPU time moves less with the load than wall time. Then a private first and
second fit runs under cProfile, ``--repeats`` times with the wall clock and as many with the
process CPU clock: the medians of named phases' cumulative time, and the top ``tf_dpnsgd``
functions, are printed (cProfile's own overhead inflates them: compare phases with each
other, not with the medians; a phase that waits, e.g. on a thread, shows in wall time only).
Writes
``benchmarks/results/fit_fixed_cost.csv`` with the machine (CPU model, cores, AVX-512, date).

  python benchmarks/fit_fixed_cost.py                          # both models, 3 repeats
  python benchmarks/fit_fixed_cost.py --models=dense --repeats=1 --top=0   # quick
  python benchmarks/fit_fixed_cost.py --label=before --append  # compare two trees
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                       "fit_fixed_cost.csv")

#: Named phases of a private fit: ``name -> (file under tf_dpnsgd/, function)``; each
#: phase's time is the cumulative time of that function in the profile (summed over its
#: entries, e.g. two classes' methods of one name in one file). A compiled function's phase
#: is its tracing only (running it is in the caller's); the interaction probe runs eagerly
#: without tf.distribute, so its phase holds its whole cost.
PHASES = (
    ("make_private (ledger, lineage, coverage)", "training.py", "make_private"),
    ("  ledger init", "ledger.py", "__init__"),
    ("compile (engine choice, plan resolve)", "training.py", "compile"),
    ("plan + sampler pipeline (per fit)", "owned_plan.py", "fit_arguments"),
    ("  sampler's tf.data pipeline", "sampling.py", "dataset"),
    ("  example identities (content digests)", "participation.py", "of_data"),
    ("guarded train function (all calls)", "guard.py", "function"),
    ("  DP step tracing (train_step)", "training.py", "train_step"),
    ("  interaction probe", "interaction.py", "probe"),
    ("  batch reader + host checks", "guard.py", "summarize"),
    ("ledger state reads", "ledger.py", "state"),
    ("privacy callbacks (epsilon)", "callbacks.py", "on_train_batch_end"),
    ("release iterators (end of fit)", "training.py", "_release_iterators"),
    ("record lineage (end of fit)", "training.py", "_record_lineage"),
)

CSV_FIELDS = ("date", "label", "cpu_model", "cores", "avx512", "tensorflow", "keras",
              "model", "path", "measure", "wall_ms", "cpu_ms", "repeats", "steps", "batch")


# --- machine ------------------------------------------------------------------------
def cpu_info(text: str) -> dict:
  """``{"cpu_model", "avx512"}`` from the text of ``/proc/cpuinfo`` (first processor).

  >>> cpu_info("processor : 0\\nmodel name\\t: AMD EPYC\\nflags\\t: sse avx512f\\n")
  {'cpu_model': 'AMD EPYC', 'avx512': 'yes'}
  """
  model, flags = "unknown", ""
  for line in text.splitlines():
    key, _, value = line.partition(":")
    key = key.strip()
    if key == "model name" and model == "unknown":
      model = value.strip()
    elif key == "flags" and not flags:
      flags = value
  return {"cpu_model": model,
          "avx512": "yes" if any(f.startswith("avx512") for f in flags.split()) else "no"}


def machine() -> dict:
  try:
    with open("/proc/cpuinfo", encoding="utf-8") as f:
      info = cpu_info(f.read())
  except OSError:
    info = {"cpu_model": platform.processor() or "unknown", "avx512": "unknown"}
  cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
  return dict(info, cores=cores, date=datetime.date.today().isoformat())


# --- the profile --------------------------------------------------------------------
def phase_ms(stats: dict, phases=PHASES) -> list:
  """``[(name, ms)]``: each phase's cumulative time in ``stats`` (``pstats.Stats.stats``:
  ``(file, line, function) -> (cc, nc, tottime, cumtime, callers)``).

  >>> stats = {("/x/tf_dpnsgd/training.py", 9, "fit"): (1, 1, 0.0, 0.5, {}),
  ...          ("/x/tf_dpnsgd/ledger.py", 3, "state"): (4, 4, 0.0, 0.02, {})}
  >>> phase_ms(stats, (("fit", "training.py", "fit"), ("state", "ledger.py", "state"),
  ...                  ("none", "guard.py", "wrap")))
  [('fit', 500.0), ('state', 20.0), ('none', 0.0)]
  """
  out = []
  for name, path, function in phases:
    suffix = "tf_dpnsgd" + os.sep + path
    total = sum(v[3] for (file, _, fn), v in stats.items()
                if fn == function and file.endswith(suffix))
    out.append((name, total * 1e3))
  return out


def top_functions(stats: dict, count: int) -> list:
  """``[(ms, calls, "path:line(function)")]``: the ``count`` tf_dpnsgd functions of
  largest cumulative time.

  >>> top_functions({("/x/tf_dpnsgd/a.py", 1, "f"): (2, 2, 0.0, 0.1, {}),
  ...                ("/x/keras/b.py", 1, "g"): (1, 1, 0.0, 9.0, {})}, 5)
  [(100.0, 2, 'a.py:1(f)')]
  """
  marker = "tf_dpnsgd" + os.sep
  rows = [(v[3] * 1e3, v[1], f"{file.split(marker, 1)[1]}:{line}({fn})")
          for (file, line, fn), v in stats.items() if marker in file]
  return sorted(rows, reverse=True)[:count]


# --- the child: one model kind ------------------------------------------------------
def _model(kind: str):
  import keras  # pylint: disable=g-import-not-at-top
  keras.utils.set_random_seed(0)
  if kind == "dense":
    inp = keras.Input((4,))
    out = keras.layers.Dense(2)(keras.layers.Dense(8, activation="tanh")(inp))
  elif kind == "conv":
    inp = keras.Input((8, 8, 3))
    h = keras.layers.Conv2D(4, 3, activation="relu")(inp)
    out = keras.layers.Dense(3)(keras.layers.GlobalAveragePooling2D()(h))
  else:
    raise ValueError(f"unknown model {kind!r}: dense or conv")
  return keras.Model(inp, out, name=f"tiny_{kind}")


def _data(kind: str, n: int):
  import numpy as np  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(0)
  shape = (4,) if kind == "dense" else (8, 8, 3)
  x = rng.normal(size=(n,) + shape).astype("float32")
  return x, (x.reshape(n, -1)[:, 0] > 0).astype("int32")


def _timed(fn) -> tuple:
  wall, cpu = time.perf_counter(), time.process_time()
  fn()
  return (time.perf_counter() - wall) * 1e3, (time.process_time() - cpu) * 1e3


def _one_run(kind: str, path: str, steps: int, batch: int) -> dict:
  """``{"first": (wall, cpu), "second": (wall, cpu)}`` ms for a fresh model."""
  import keras  # pylint: disable=g-import-not-at-top

  import tf_dpnsgd  # pylint: disable=g-import-not-at-top

  x, y = _data(kind, steps * batch)
  loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
  base = _model(kind)
  model = None

  def first():
    nonlocal model
    if path == "plain":
      model = base
      model.compile(optimizer=keras.optimizers.SGD(0.1), loss=loss, metrics=["accuracy"])
      model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0)
    else:
      model = tf_dpnsgd.make_private(base, target_epsilon=3.0, delta=1e-5, batch_size=batch,
                                     epochs=1)
      model.compile(optimizer=tf_dpnsgd.DPNSGD(learning_rate=0.1, regularizer=0.01),
                    loss=loss, metrics=["accuracy"])
      model.fit(x, y, verbose=0)

  def second():
    if path == "plain":
      model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0)
    else:
      model.fit(x, y, verbose=0)

  out = {"first": _timed(first)}
  if path == "private":
    model.extend_privacy_plan(epochs=2)  # not timed: the plan's arithmetic, not the fit's
  out["second"] = _timed(second)
  return out


def child(kind: str, repeats: int, steps: int, batch: int, top: int) -> dict:
  import cProfile  # pylint: disable=g-import-not-at-top
  import pstats  # pylint: disable=g-import-not-at-top

  import tf_dpnsgd  # pylint: disable=g-import-not-at-top

  for path in ("plain", "private"):
    _one_run(kind, path, steps, batch)  # warm-up: imports, first-use costs
  runs = {"plain": [], "private": []}
  for _ in range(repeats):
    for path in ("plain", "private"):
      runs[path].append(_one_run(kind, path, steps, batch))
  medians = {path: {measure: [statistics.median(r[measure][i] for r in rs) for i in (0, 1)]
                    for measure in ("first", "second")} for path, rs in runs.items()}
  profiled = {"wall": [], "cpu": []}
  for clock, timer in (("wall", time.perf_counter), ("cpu", time.process_time)):
    for _ in range(repeats):
      profile = cProfile.Profile(timer)
      profile.enable()
      _one_run(kind, "private", steps, batch)
      profile.disable()
      stats = pstats.Stats(profile).stats
      profiled[clock].append(phase_ms(stats))
      if clock == "wall":
        top_rows = top_functions(stats, top)
  phases = [(name, statistics.median(run[i][1] for run in profiled["wall"]),
             statistics.median(run[i][1] for run in profiled["cpu"]))
            for i, (name, _, _) in enumerate(PHASES)]
  return {"medians": medians, "phases": phases, "top": top_rows,
          "library": os.path.dirname(os.path.abspath(tf_dpnsgd.__file__))}


# --- the parent ---------------------------------------------------------------------
def csv_rows(results: dict, info: dict, args, versions: dict) -> list:
  """One row per (model, path, measure): timings and the profile's phases."""
  common = dict(date=info["date"], label=args.label, cpu_model=info["cpu_model"],
                cores=info["cores"], avx512=info["avx512"], repeats=args.repeats,
                steps=args.steps, batch=args.batch, **versions)
  rows = []
  for kind, res in results.items():
    for path, measures in res["medians"].items():
      for measure, (wall, cpu) in measures.items():
        rows.append(dict(common, model=kind, path=path, measure=f"{measure} fit",
                         wall_ms=f"{wall:.0f}", cpu_ms=f"{cpu:.0f}"))
    for name, wall, cpu in res["phases"]:
      rows.append(dict(common, model=kind, path="private (cProfile)",
                       measure=f"phase: {name.strip()}", wall_ms=f"{wall:.0f}",
                       cpu_ms=f"{cpu:.0f}"))
  return rows


def write_csv(path: str, rows: list, append: bool) -> None:
  exists = os.path.exists(path)
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, "a" if append else "w", newline="", encoding="utf-8") as f:
    writer = csv.DictWriter(f, fieldnames=CSV_FIELDS)
    if not (append and exists):
      writer.writeheader()
    writer.writerows(rows)


def main():
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--models", default="dense,conv")
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--steps", type=int, default=4, help="steps per epoch (N = steps*batch)")
  parser.add_argument("--batch", type=int, default=8, help="expected (Poisson) batch size")
  parser.add_argument("--top", type=int, default=25, help="tf_dpnsgd functions to print")
  parser.add_argument("--label", default="", help="a name for this tree in the CSV")
  parser.add_argument("--output", default=RESULTS)
  parser.add_argument("--append", action="store_true", help="add rows to --output")
  parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.child:
    print(json.dumps(child(args.child, args.repeats, args.steps, args.batch, args.top)))
    return
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", CUDA_VISIBLE_DEVICES="")
  results = {}
  for kind in args.models.split(","):
    cmd = [sys.executable, os.path.abspath(__file__), f"--child={kind}",
           f"--repeats={args.repeats}", f"--steps={args.steps}", f"--batch={args.batch}",
           f"--top={args.top}"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout
    results[kind] = json.loads(out.strip().splitlines()[-1])
    print(f"  measured {kind}", file=sys.stderr)
  versions = json.loads(subprocess.run(
      [sys.executable, "-c", "import json, keras, tensorflow as tf; print(json.dumps("
       "{'tensorflow': tf.__version__, 'keras': keras.__version__}))"],
      check=True, capture_output=True, text=True, env=env).stdout.strip().splitlines()[-1])
  info = machine()
  print(f"Fixed cost of fit: {info['cpu_model']}, {info['cores']} cores, AVX-512 "
        f"{info['avx512']}, {info['date']}; TF {versions['tensorflow']}, Keras "
        f"{versions['keras']}; {args.steps} steps of batch {args.batch}, medians of "
        f"{args.repeats} (wall / process CPU ms){' [' + args.label + ']' if args.label else ''}")
  print(f"tf_dpnsgd from {sorted({r['library'] for r in results.values()})}")
  print(f"{'model':<6} {'path':<8} {'first fit':>15} {'second fit':>15} {'first x plain':>14}")
  for kind, res in results.items():
    plain = res["medians"]["plain"]["first"][0]
    for path, m in res["medians"].items():
      print(f"{kind:<6} {path:<8} {m['first'][0]:>7.0f} / {m['first'][1]:<5.0f} "
            f"{m['second'][0]:>7.0f} / {m['second'][1]:<5.0f} {m['first'][0] / plain:>13.2f}x")
  for kind, res in results.items():
    print(f"\n{kind}: phases of a private first + second fit under cProfile (cumulative ms, "
          f"median of {args.repeats} profiled runs per clock)")
    print(f"  {'phase':<44} {'wall':>8} {'CPU':>8}")
    for name, wall, cpu in res["phases"]:
      print(f"  {name:<44} {wall:>8.0f} {cpu:>8.0f}")
    if res["top"]:
      print(f"{kind}: top tf_dpnsgd functions (cumulative wall ms, calls; last profiled run)")
      for ms, calls, where in res["top"]:
        print(f"  {ms:>8.0f} {calls:>6}  {where}")
  write_csv(args.output, csv_rows(results, info, args, versions), args.append)
  print(f"\nwrote {os.path.relpath(args.output)}", file=sys.stderr)


if __name__ == "__main__":
  main()
