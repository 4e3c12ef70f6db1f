r"""One table for a GPU machine: plain vs DP-NSGD step time and peak memory, with and
without XLA and mixed precision, and a short real CIFAR-10 run (issue 12, item 7).

Usage (from the repository root)::

    python benchmarks/gpu.py                          # full sizes; meant for a GPU
    python benchmarks/gpu.py --cifar_data_dir=$HOME/data --cifar_steps=200
    python benchmarks/gpu.py --smoke                  # tiny shapes on a CPU, all 8 rows
    bash benchmarks/gpu.sh --smoke                    # the same through the shell wrapper

Rows: {ResNet20-GN, batch 1000, 32x32x3; BERT-base size (hidden 768, 12
layers, 12 heads, intermediate 3072, sequence 128, random weights), batch 32}
x {XLA off, on} x {float32, mixed precision}, then one row for the CIFAR-10
run. Mixed precision is ``mixed_float16`` on a GPU and ``mixed_bfloat16`` on a
CPU (where float16 matmuls are emulated).

Each step-time row runs in its own subprocess (a clean allocator, a clean
peak RSS; with ``--smoke`` the step rows share one, and its RSS column is the
high-water mark so far). In it, a plain ``keras.Model`` compiled with SGD and
``tf_dpnsgd.make_private`` of a second copy compiled with DP-NSGD (noise
multiplier 1, ``per_example="auto"``; the engine it chose is shown) alternate
``train_on_batch`` on the same random batch, so that both see the same
machine load; after ``--warmup`` steps of each (tracing, XLA compilation and
the first-batch interaction probe), ``--steps`` steps of each are timed and
the table shows the medians and their ratio. Peak memory: TensorFlow's
allocator statistics (``tf.config.experimental.get_memory_info``, GPU:0 on a
GPU, CPU:0 on a CPU), reset before each step, maximum over the timed steps;
on a CPU the process' resident-set high-water mark (``ru_maxrss``, plain and
DP models together) is shown too.

The CIFAR-10 row runs the real launcher, ``python -m tf_dpnsgd.launch.cifar10
--flagfile=configs/cifar10/dpnsgd_eps8_step.flags --max_steps=N`` (the
paper's plan, stopped after N steps), on tensorflow-datasets' ``cifar10`` or
``--cifar_data_dir``; it reports test accuracy, the epsilon of the steps
taken, and steps/s from the wall-clock times of the launcher's per-step
epsilon events (first step, i.e. compilation, excluded). Without the data the
row says ``unavailable`` instead of failing. ``--smoke`` writes random images
in the ``cifar-10-batches-py`` layout and runs the same launcher for a few
steps with ``--resnet_depth=8`` (ResNet8-GN, the family's smallest); its XLA
rows compile without LLVM's optimizations (``SMOKE_XLA_FLAGS``), since on a
CPU the compile is most of a smoke run's time.

A cell that fails shows ``refused: <reason>`` when tf_dpnsgd refused the
configuration on purpose (a ``ValueError``, ``TypeError`` or
``NotImplementedError`` raised by tf_dpnsgd's own code, e.g. an unsupported
dtype policy) and ``error: <reason>`` otherwise (a crash, a bug). One cell's
failure never stops the table; with ``--smoke`` the exit status is 1 if any
cell shows ``error``, so that CI notices.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELS = ("resnet20", "bert")
XLA = (False, True)
PRECISIONS = ("float32", "mixed")
CIFAR_FLAGFILE = os.path.join(ROOT, "configs", "cifar10", "dpnsgd_eps8_step.flags")
REFUSAL_TYPES = (ValueError, TypeError, NotImplementedError)

# name -> (full size, smoke size). The smoke sizes are the smallest that keep every layer
# kind of the full model (ResNet8: the stem, an identity and two projection shortcuts; one
# BERT block with two heads) and more than one example per batch.
SIZES = {
    "resnet20": ({"batch": 1000, "image": 32, "depth": 20},
                 {"batch": 2, "image": 8, "depth": 8}),
    "bert": ({"batch": 32, "seq": 128, "vocab": 30522, "layers": 12, "hidden": 768,
              "heads": 12, "intermediate": 3072},
             {"batch": 2, "seq": 8, "vocab": 40, "layers": 1, "hidden": 8, "heads": 2,
              "intermediate": 16}),
}
# --smoke: XLA compiles without LLVM's optimizations (the compile, not the step, is what a
# smoke run on a CPU spends its time on; no timing is asserted). A user's XLA_FLAGS win.
SMOKE_XLA_FLAGS = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"


def describe(name, size):
  if name == "resnet20":
    return f"ResNet{size['depth']}-GN {size['image']}x{size['image']}x3", size["batch"]
  return (f"BERT L{size['layers']} H{size['hidden']} A{size['heads']} seq {size['seq']}",
          size["batch"])


# --- one configuration (child process) ------------------------------------------------
def classify(exc: BaseException) -> str:
  """``"refused: ..."`` for a deliberate refusal by tf_dpnsgd, else ``"error: ..."``.

  A refusal is a ``ValueError``/``TypeError``/``NotImplementedError`` raised by a
  frame of the ``tf_dpnsgd`` package itself; anything else (``AttributeError``,
  an exception from TensorFlow or Keras, ...) is an error.
  """
  message = " ".join(str(exc).split())[:300] or type(exc).__name__
  frames = traceback.extract_tb(exc.__traceback__)
  package = os.path.join(ROOT, "tf_dpnsgd") + os.sep
  raised_here = bool(frames) and os.path.abspath(frames[-1].filename).startswith(package)
  if isinstance(exc, REFUSAL_TYPES) and raised_here:
    return f"refused: {type(exc).__name__}: {message}"
  return f"error: {type(exc).__name__}: {message}"


def build(name, size):
  """Returns ``(make_model, x, y)`` for one model; ``make_model()`` builds a fresh copy."""
  import keras
  import numpy as np

  rng = np.random.default_rng(0)
  batch = size["batch"]
  if name == "resnet20":
    from tf_dpnsgd.models import resnet20

    shape = (size["image"], size["image"], 3)
    x = rng.normal(size=(batch,) + shape).astype("float32")
    y = rng.integers(0, 10, size=(batch,)).astype("int32")
    return (lambda: resnet20(input_shape=shape, depth=size["depth"])), x, y
  if name == "bert":
    import keras_hub

    def make():
      backbone = keras_hub.models.BertBackbone(
          vocabulary_size=size["vocab"], num_layers=size["layers"], num_heads=size["heads"],
          hidden_dim=size["hidden"], intermediate_dim=size["intermediate"],
          max_sequence_length=max(512, size["seq"]))
      return keras_hub.models.BertTextClassifier(backbone=backbone, num_classes=2,
                                                 preprocessor=None)

    seq = size["seq"]
    x = {"token_ids": rng.integers(0, size["vocab"], size=(batch, seq)).astype("int32"),
         "segment_ids": np.zeros((batch, seq), "int32"),
         "padding_mask": np.ones((batch, seq), "int32")}
    y = rng.integers(0, 2, size=(batch,)).astype("int32")
    return make, x, y
  raise ValueError(f"unknown model {name!r}")


def run_config(name, xla, precision, smoke, steps, warmup):
  """Measures one row in this process; returns a JSON-able dict (errors as strings)."""
  import resource

  import keras
  import tensorflow as tf

  import tf_dpnsgd

  gpu = bool(tf.config.list_physical_devices("GPU"))
  device = "GPU:0" if gpu else "CPU:0"
  policy = "float32" if precision == "float32" else (
      "mixed_float16" if gpu else "mixed_bfloat16")
  size = SIZES[name][1 if smoke else 0]
  label, batch = describe(name, size)
  row = {"model": label, "batch": batch, "xla": xla, "policy": policy,
         "device": "GPU" if gpu else "CPU", "engine": ""}
  keras.backend.clear_session()  # --smoke runs several rows in one process
  keras.mixed_precision.set_global_policy(policy)
  keras.utils.set_random_seed(0)
  make, x, y = build(name, size)
  x = tf.nest.map_structure(tf.convert_to_tensor, x)
  y = tf.convert_to_tensor(y)
  loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

  models = {}
  try:
    plain = make()
    plain.compile(optimizer=keras.optimizers.SGD(0.01), loss=loss, jit_compile=xla)
    models["plain"] = plain
  except Exception as exc:  # noqa: BLE001 - reported in the table
    row["plain_error"] = classify(exc)
  try:
    private = tf_dpnsgd.make_private(make(), per_example="auto",
                                     trust_untagged_batches=True)  # timing: synthetic batches
    private.compile(optimizer=tf_dpnsgd.DPNSGD(learning_rate=0.01, regularizer=0.01,
                                               noise_multiplier=1.0),
                    loss=loss, jit_compile=xla)
    row["engine"] = tf_dpnsgd.per_example.engine_name(private._dp_engine)  # auto's choice
    models["dp"] = private
  except Exception as exc:  # noqa: BLE001
    row["dp_error"] = classify(exc)

  def step(model):
    # The allocator statistics exist on GPU; on CPU some allocators (e.g. under XLA)
    # keep none, and then the peak is "n/a" (the CPU rows also report the process RSS).
    try:
      tf.config.experimental.reset_memory_stats(device)
    except ValueError:
      pass
    start = time.perf_counter()
    logs = model.train_on_batch(x, y, return_dict=True)
    float(logs["loss"])  # wait for the step
    elapsed = time.perf_counter() - start
    try:
      peak = tf.config.experimental.get_memory_info(device)["peak"]
    except ValueError:
      peak = None
    return elapsed, peak

  times = {k: [] for k in models}
  peaks = {k: [] for k in models}
  for i in range(warmup + steps):
    for key in list(models):
      try:
        t, p = step(models[key])
      except Exception as exc:  # noqa: BLE001
        row[f"{key}_error"] = classify(exc)
        del models[key]
        continue
      if i >= warmup:
        times[key].append(t)
        peaks[key].append(p)
  for key in models:
    row[f"{key}_ms"] = 1000 * statistics.median(times[key])
    known = [p for p in peaks[key] if p is not None]
    row[f"{key}_peak_mb"] = max(known) / 2**20 if known else None
  row["rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
  return row


# --- the CIFAR-10 run (child process) ---------------------------------------------------
def write_random_cifar(folder, images_per_batch, seed=0):
  """Writes random images in the ``cifar-10-batches-py`` layout (for ``--smoke``)."""
  import numpy as np

  rng = np.random.default_rng(seed)
  os.makedirs(folder, exist_ok=True)
  for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
    images = rng.integers(0, 256, size=(images_per_batch, 3072), dtype=np.uint8)
    labels = [int(v) for v in rng.integers(0, 10, size=images_per_batch)]
    with open(os.path.join(folder, name), "wb") as f:
      pickle.dump({b"data": images, b"labels": labels}, f, protocol=2)


def epsilon_event_times(log_dir):
  """``[(step, wall_time)]`` of the launcher's per-step ``epsilon`` events."""
  import tensorflow as tf

  out = []
  folder = os.path.join(log_dir, "privacy")
  for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else ():
    for event in tf.compat.v1.train.summary_iterator(os.path.join(folder, name)):
      if any(v.tag == "epsilon" for v in event.summary.value):
        out.append((int(event.step), float(event.wall_time)))
  return sorted(out)


def run_cifar(smoke, data_dir, max_steps, timeout):
  """Runs the CIFAR-10 launcher; returns a row dict."""
  row = {"model": "CIFAR-10 run (launcher, ResNet20-GN, DP-NSGD)", "xla": False,
         "policy": "float32", "kind": "cifar"}
  with tempfile.TemporaryDirectory() as tmp:
    args = [f"--flagfile={CIFAR_FLAGFILE}", f"--model_dir={tmp}/run", "--verbose=0"]
    if smoke:
      data_dir = os.path.join(tmp, "data", "cifar-10-batches-py")
      write_random_cifar(data_dir, images_per_batch=32)
      row["model"] = "CIFAR-10 smoke (launcher, ResNet8-GN, random images)"
      args += ["--batch_size=16", "--physical_batch_size=16", "--groups=4", "--epochs=2",
               "--resnet_depth=8"]
    if data_dir:
      args.append(f"--data_dir={data_dir}")
    args.append(f"--max_steps={max_steps}")
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    start = time.perf_counter()
    try:
      proc = subprocess.run([sys.executable, "-m", "tf_dpnsgd.launch.cifar10", *args],
                            capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    except subprocess.TimeoutExpired:
      row["dp_error"] = f"error: the launcher ran over {timeout} s"
      return row
    row["wall_s"] = time.perf_counter() - start
    if proc.returncode != 0:
      text = proc.stderr + proc.stdout
      lines = [l.strip() for l in text.splitlines() if l.strip()]
      reason = lines[-1][:300] if lines else f"exit {proc.returncode}"
      if "cifar-10-batches-py" in text or "FileNotFoundError" in text:
        row["unavailable"] = f"unavailable: {reason}"
      else:
        row["dp_error"] = f"error: launcher exit {proc.returncode}: {reason}"
      return row
    with open(os.path.join(tmp, "run", "privacy_report.json")) as f:
      report = json.load(f)
    events = epsilon_event_times(os.path.join(tmp, "run", "tensorboard"))
  row.update(steps=report["steps"], epsilon=report["epsilon"], delta=report["delta"],
             accuracy=report["final_metrics"].get("accuracy"), batch=report["hyperparameters"]
             .get("batch_size"), engine=report["hyperparameters"].get("per_example", ""))
  if len(events) >= 2 and events[-1][0] > events[0][0]:
    (s0, t0), (s1, t1) = events[0], events[-1]
    row["steps_per_s"] = (s1 - s0) / max(t1 - t0, 1e-9)
  else:
    row["steps_per_s"] = None
  return row


# --- the table (parent process) ---------------------------------------------------------
def run_child(specs, args):
  """Rows of ``specs`` (a list), measured in one child process, in order."""
  cmd = [sys.executable, os.path.abspath(__file__), "--child", ",".join(specs),
         f"--steps={args.steps}", f"--warmup={args.warmup}",
         f"--cifar_steps={args.cifar_steps}", f"--child_timeout={args.child_timeout}"]
  if args.smoke:
    cmd.append("--smoke")
  if args.cifar_data_dir:
    cmd.append(f"--cifar_data_dir={args.cifar_data_dir}")
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
  env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
  if args.smoke:
    env.setdefault("XLA_FLAGS", SMOKE_XLA_FLAGS)
  timeout = args.child_timeout * sum(2 if spec == "cifar" else 1 for spec in specs)
  try:
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=timeout)
  except subprocess.TimeoutExpired:
    failed = {"error": f"error: ran over {timeout} s"}
    return [failed] * len(specs)
  rows = [json.loads(l[len("RESULT "):]) for l in proc.stdout.splitlines()
          if l.startswith("RESULT ")]
  if proc.returncode == 0 and len(rows) == len(specs):
    return rows
  if proc.returncode < 0:
    failed = {"error": f"error: crashed (signal {-proc.returncode})"}
  else:
    tail = [l for l in proc.stderr.strip().splitlines() if "Error" in l][-1:]
    failed = {"error": f"error: exit {proc.returncode}: {' '.join(tail)[:300]}"}
  return rows[:len(specs)] + [failed] * (len(specs) - len(rows))


def fmt(value, digits=1):
  return "" if value is None else f"{value:.{digits}f}"


def table_rows(rows):
  """Markdown lines of the table; returns ``(lines, errors)``."""
  lines = ["| model | batch | XLA | precision | engine | plain step ms | DP-NSGD step ms "
           "| ratio | plain peak MB | DP peak MB | process RSS MB | notes |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
  errors = []
  for spec, r in rows:
    cells_error = [r[k] for k in ("error", "plain_error", "dp_error") if r.get(k)]
    errors += [f"{spec}: {c}" for c in cells_error if c.startswith("error")]
    if r.get("kind") == "cifar":
      if "unavailable" in r or "dp_error" in r:
        note = r.get("unavailable") or r["dp_error"]
        lines.append(f"| {r['model']} | | off | float32 | | | | | | | | {note} |")
        continue
      sps = r.get("steps_per_s")
      ms = "" if not sps else fmt(1000 / sps)
      note = (f"test accuracy {r['accuracy']:.4f}; epsilon {r['epsilon']:.3f} "
              f"(delta {r['delta']:g}) after {r['steps']} steps; "
              f"{fmt(sps, 2) or '?'} steps/s (compile excluded); wall {r['wall_s']:.0f} s")
      lines.append(f"| {r['model']} | {r.get('batch', '')} | off | float32 | "
                   f"{r.get('engine', '')} | | {ms} | | | | | {note} |")
      continue
    if "error" in r:
      model, xla, precision = spec.split(":")
      lines.append(f"| {model} | | {xla} | {precision} | | {r['error']} | | | | | | |")
      continue
    plain = r.get("plain_error") or fmt(r.get("plain_ms"))
    dp = r.get("dp_error") or fmt(r.get("dp_ms"))
    ratio = (f"{r['dp_ms'] / r['plain_ms']:.2f}x" if "dp_ms" in r and "plain_ms" in r else "")
    rss = fmt(r.get("rss_mb"), 0) if r.get("device") == "CPU" else ""
    lines.append(f"| {r['model']} | {r['batch']} | {'on' if r['xla'] else 'off'} | "
                 f"{r['policy']} | {r['engine']} | {plain} | {dp} | {ratio} | "
                 f"{fmt(r.get('plain_peak_mb'), 0) or 'n/a'} | {fmt(r.get('dp_peak_mb'), 0) or 'n/a'} | "
                 f"{rss} | |")
  return lines, errors


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--smoke", action="store_true",
                      help="tiny shapes and few steps (CPU); exit 1 on any error cell")
  parser.add_argument("--models", default=",".join(MODELS))
  parser.add_argument("--xla", default="off,on", help="off,on | off | on")
  parser.add_argument("--precisions", default=",".join(PRECISIONS))
  parser.add_argument("--rows", default="",
                      help="explicit rows MODEL:off|on:float32|mixed, comma-separated, instead "
                           "of the product of --models, --xla and --precisions")
  parser.add_argument("--steps", type=int, default=None, help="timed steps (10; smoke 2)")
  parser.add_argument("--warmup", type=int, default=None, help="warm-up steps (2; smoke 1)")
  parser.add_argument("--cifar_steps", type=int, default=None,
                      help="CIFAR-10 run length in steps (100; smoke 3); 0 skips the run")
  parser.add_argument("--cifar_data_dir", default=None,
                      help="folder with cifar-10-batches-py (else tensorflow-datasets)")
  parser.add_argument("--child_timeout", type=int, default=None,
                      help="seconds per row (1800; smoke 600)")
  parser.add_argument("--child", help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  args.steps = args.steps or (2 if args.smoke else 10)
  args.warmup = args.warmup or (1 if args.smoke else 2)
  args.cifar_steps = (3 if args.smoke else 100) if args.cifar_steps is None else args.cifar_steps
  args.child_timeout = args.child_timeout or (600 if args.smoke else 1800)
  if args.steps < 1 or args.warmup < 1:
    parser.error("--steps and --warmup must be >= 1")

  if args.child:
    for spec in args.child.split(","):
      if spec == "cifar":
        row = run_cifar(args.smoke, args.cifar_data_dir, args.cifar_steps, args.child_timeout)
      else:
        model, xla, precision = spec.split(":")
        row = run_config(model, xla == "on", precision, args.smoke, args.steps, args.warmup)
      print("RESULT " + json.dumps(row), flush=True)
    return 0

  if args.rows:
    specs = args.rows.split(",")
    for spec in specs:
      parts = spec.split(":")
      if (len(parts) != 3 or parts[0] not in MODELS or parts[1] not in ("off", "on")
          or parts[2] not in PRECISIONS):
        parser.error(f"--rows: {spec!r} is not MODEL:off|on:PRECISION with MODEL in "
                     f"{MODELS} and PRECISION in {PRECISIONS}")
  else:
    specs = [f"{m}:{x}:{p}" for m in args.models.split(",") for x in args.xla.split(",")
             for p in args.precisions.split(",")]
  if args.cifar_steps > 0:
    specs.append("cifar")
  # One process per row (a clean allocator and peak RSS); --smoke measures nothing, so its
  # step rows share one process (TensorFlow and keras-hub imported once, not eight times).
  steps = [s for s in specs if s != "cifar"]
  groups = ([steps] if args.smoke and steps else [[s] for s in steps]) + [
      [s] for s in specs if s == "cifar"]
  rows = []
  start = time.perf_counter()
  for group in groups:
    t0 = time.perf_counter()
    rows += zip(group, run_child(group, args))
    print(f"[{time.perf_counter() - t0:6.1f} s] {', '.join(group)}: "
          f"{json.dumps([r for _, r in rows[-len(group):]])}", file=sys.stderr, flush=True)
  lines, errors = table_rows(rows)
  device = next((r.get("device") for _, r in rows if r.get("device")), "?")
  print(f"\n{'Smoke run (tiny shapes): ' if args.smoke else ''}device {device}; "
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} logical cores; "
        f"medians over {args.steps} timed steps after {args.warmup} warm-up steps, plain and DP "
        f"steps alternating; total {time.perf_counter() - start:.0f} s.\n")
  print("\n".join(lines), flush=True)
  if errors:
    print("\nErrored cells:\n" + "\n".join(errors), file=sys.stderr)
    if args.smoke:
      return 1
  return 0


if __name__ == "__main__":
  sys.exit(main())
