"""Plain step vs the layer-wise DP step, book-keeping and two passes: time and memory.

Usage (from the repository root)::

    python benchmarks/engine_ratio.py                      # ResNet20-GN b256, BERT b32
    python benchmarks/engine_ratio.py --models=resnet20 --batch=16 --steps=2  # a quick check
    python benchmarks/engine_ratio.py --fit_gib=8          # + the largest batch in 8 GiB

Configurations: ResNet20-GN (CIFAR shapes) at batch 256 and a keras-hub BERT
of MiniLM-L6 size (6 layers, hidden 384, 12 heads, intermediate 1536, sequence
128, random weights, no download) at batch 32 (the builders of
``benchmarks/per_example_engines.py``); on request
(``--models=scatter_cnn,scatter_cnn_2views``) Tramer and Boneh's CNN on CIFAR-10
scattering features at batch 512, on one view or on two views with shared
weights. Each runs with ``jit_compile`` in ``--jit``. The DP models are
``tf_dpnsgd.make_private(per_example=...)`` with DPNSGD (noise multiplier 1):
``"layerwise"`` (book-keeping; ``--keep_mib`` values, 'default' = the engine's
budget) and ``"two_pass"`` (``--modes``).

Time: one subprocess per (configuration, keep budget) builds the plain model
and every DP model and runs one ``train_on_batch`` of each in turn (the order
rotating every round), ``--steps`` rounds after ``--warmup`` (tracing
included), so that load from other processes hits all alike; the table gives
medians, each DP mode's ratio of medians to the plain step, and the
interquartile range of the per-round ratios as a noise gauge.

Floors: in the same rounds, the plain model's forward pass, its backward pass to
the inputs (every layer's input gradient, no weight gradient) and its full
gradient, as ``tf.function`` s. A two-pass step repeats at least the first two
(a second forward pass) or the second alone (a second backward pass over a shared
forward pass) on top of a plain step; the table under the main one gives those
lower bounds as multiples of the plain gradient's time (:func:`floors`).

Memory: one more subprocess per (configuration, mode) runs only that model:
its resident-set high-water mark (``ru_maxrss``) after ``--memory_steps``
steps, minus the high-water mark before the first step (imports, model,
optimizer, batch: the baseline), is the step's memory (tracing included).
TensorFlow's CPU allocator statistics miss what oneDNN and XLA allocate
themselves; on a GPU, ``tf.config.experimental.get_memory_info`` would be the
measure. ``--memory_steps=0`` skips it. ``--fit_gib=G`` also measures each
mode at half the batch and extrapolates linearly (per-example slope) to the
largest batch whose peak RSS fits in ``G`` GiB.

Sampler: examples per second of a Poisson ``tf.data`` stream
(``tf_dpnsgd.sampling.PoissonSampler.dataset``) over 50000 CIFAR-shaped
examples with expected batch 256, iterated without a model (``--sampler_batches=0``
skips it).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import families  # noqa: E402  (standard library only at import)

BATCHES = {"resnet20": 256, "bert": 32, "scatter_cnn": 512, "scatter_cnn_2views": 512}
# and benchmarks/families.py's (the support table's families at realistic size)
ENGINES = {"bookkeeping": "layerwise", "two_pass": "two_pass"}


def _peak_mib():
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _build(model_name, jit, mode, keep_mib=None, batch=None):
  """``(model, x, y)``: the plain model (``mode="plain"``) or a DP one, compiled."""
  import keras
  import numpy as np
  import tensorflow as tf

  import tf_dpnsgd
  from per_example_engines import build
  from per_example_engines import loss_for

  keras.utils.set_random_seed(0)
  make, x, y, full = build(model_name)
  if batch is not None and batch != full:  # the first rows (tiled if more are asked for)
    rows = np.arange(batch) % full
    x = {k: v[rows] for k, v in x.items()} if isinstance(x, dict) else x[rows]
    y = y[rows]
  loss = loss_for(model_name)
  if mode == "plain":
    model = make()
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss=loss, jit_compile=jit)
  else:
    model = tf_dpnsgd.make_private(make(), per_example=ENGINES[mode], keep_per_example_mib=keep_mib,
                                   trust_untagged_batches=True)  # timing: synthetic batches
    model.compile(optimizer=tf_dpnsgd.DPNSGD(learning_rate=0.01, regularizer=0.1,
                                             noise_multiplier=1.0, seed=0),
                  loss=loss, jit_compile=jit)
  return model, tf.nest.map_structure(tf.convert_to_tensor, x), tf.convert_to_tensor(y)


def _floor_functions(model, x, y, loss, jit):
  """The parts of a plain step any two-pass step repeats, as ``tf.function`` s on ``model``.

  ``forward``: forward pass and summed loss; ``to_inputs``: that and the backward
  pass to the model's first layer, every layer's input gradient but no weight
  gradient (to the float inputs, or to the embedding tables of token inputs: their
  sparse gradients cost next to nothing); ``gradient``: the full backward pass.
  Pass 1 of a two-pass step needs at least ``to_inputs`` (the output gradient
  of every layer, for its norm), pass 2 at least ``gradient``. Not quite a lower
  bound: ``to_inputs`` also computes the first layer's input gradient, which pass
  1 does not need (ResNet20-GN's 3-channel stem convolution: about 1% of the
  backward pass's multiply-adds), and the token embedding's gradient is made
  dense in both ``to_inputs`` and ``gradient``.
  """
  import keras
  import tensorflow as tf

  inputs = [t for t in tf.nest.flatten(x) if t.dtype.is_floating]
  firsts = [v for layer in model._flatten_layers() if isinstance(layer, keras.layers.Embedding)
            for v in layer.trainable_variables]
  if not inputs and not firsts:
    raise ValueError("no float input and no embedding: nothing to take the backward pass to")

  def total():
    return tf.reduce_sum(loss(y, model(x, training=True)))

  def backward(targets):
    with tf.GradientTape() as tape:
      tape.watch(inputs)
      value = total()
    # None: a variable the loss does not use (a decoder backbone's untied reverse embedding)
    return [tf.zeros_like(t) if g is None else tf.convert_to_tensor(g)
            for g, t in zip(tape.gradient(value, targets), targets)]

  compile_ = lambda fn: tf.function(fn, jit_compile=jit)  # noqa: E731
  return {"forward": compile_(total),
          "to_inputs": compile_(lambda: backward(inputs or firsts)),
          "gradient": compile_(lambda: backward(model.trainable_variables))}


def time_child(model_name, jit, modes, steps, warmup, keep_mib=None, batch=None):
  """Step times (``train_on_batch``) of the plain and DP models, and of the plain model's
  forward pass, backward pass to its inputs and full gradient (:func:`_floor_functions`),
  all in turn in each round."""
  import tensorflow as tf
  from per_example_engines import loss_for

  models = {m: _build(model_name, jit, m, keep_mib, batch) for m in ["plain"] + modes}
  plain, px, py = models["plain"]
  floors = _floor_functions(plain, px, py, loss_for(model_name), jit)

  def step(mode):
    start = time.perf_counter()
    if mode in floors:
      for t in tf.nest.flatten(floors[mode]()):
        t.numpy()
    else:
      model, x, y = models[mode]
      model.train_on_batch(x, y)
    return time.perf_counter() - start

  names = list(models) + list(floors)
  for _ in range(warmup):
    for m in names:
      step(m)
  times = {m: [] for m in names}
  for i in range(steps):  # rotate which goes first
    for m in names[i % len(names):] + names[:i % len(names)]:
      times[m].append(step(m))
  out = {"plain_ms": 1e3 * statistics.median(times["plain"])}
  for m in modes:
    ratios = sorted(d / p for d, p in zip(times[m], times["plain"]))
    q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
    out[f"{m}_ms"] = 1e3 * statistics.median(times[m])
    out[f"{m}_ratio"] = out[f"{m}_ms"] / out["plain_ms"]
    out[f"{m}_iqr"] = [q[0], q[2]]
  for m in floors:
    out[f"{m}_ms"] = 1e3 * statistics.median(times[m])
  return out


def floors(row):
  """Lower bounds of a two-pass step's time over a plain step's, before any per-example work.

  ``second_forward`` (``per_example="two_pass"``: pass 1 is a forward pass and the
  backward pass to the inputs, pass 2 a plain step): ``1 + to_inputs / gradient``.
  ``shared_forward`` (pass 2 a second backward pass over pass 1's forward pass):
  ``1 + (to_inputs - forward) / gradient``. Both leave out the norms.

  >>> floors({"forward_ms": 35.0, "to_inputs_ms": 78.0, "gradient_ms": 100.0})
  {'forward': 0.35, 'backward_to_inputs': 0.43, 'second_forward': 1.78, 'shared_forward': 1.43}
  """
  g = row["gradient_ms"]
  return {"forward": round(row["forward_ms"] / g, 3),
          "backward_to_inputs": round((row["to_inputs_ms"] - row["forward_ms"]) / g, 3),
          "second_forward": round(1 + row["to_inputs_ms"] / g, 3),
          "shared_forward": round(1 + (row["to_inputs_ms"] - row["forward_ms"]) / g, 3)}


def _status_mib(field):
  with open("/proc/self/status") as f:
    for line in f:
      if line.startswith(field + ":"):
        return int(line.split()[1]) / 1024
  return float("nan")


def memory_child(model_name, jit, mode, steps, keep_mib=None, batch=None):
  """Peak RSS of the first ``steps`` steps (tracing included) over the baseline; then, for
  ``steps`` more, the steady state: the peak RSS of those steps alone (Linux' high-water
  mark reset through ``/proc/self/clear_refs``) and the peak of TensorFlow's CPU allocator
  (the tensors; oneDNN's and XLA's own buffers are outside it). TensorFlow keeps allocator
  statistics only with oneDNN on, which it turns off by default on CPUs without AVX-512:
  there the tensors column is left empty (set ``TF_ENABLE_ONEDNN_OPTS=1`` for it)."""
  import tensorflow as tf

  model, x, y = _build(model_name, jit, mode, keep_mib, batch)
  baseline = _peak_mib()
  for _ in range(steps):
    model.train_on_batch(x, y)
  peak = _peak_mib()
  out = {"peak_mib": peak, "baseline_mib": baseline, "step_mib": peak - baseline}
  try:
    with open("/proc/self/clear_refs", "w") as f:
      f.write("5")  # resets VmHWM to the current RSS
  except OSError:
    return out
  try:
    tf.config.experimental.reset_memory_stats("CPU:0")
    allocator_stats = True
  except ValueError:  # none without oneDNN (off by default on CPUs without AVX-512)
    allocator_stats = False
  before = _status_mib("VmRSS")
  for _ in range(steps):
    model.train_on_batch(x, y)
  out.update(steady_rss_before_mib=before, steady_peak_mib=_status_mib("VmHWM"))
  if allocator_stats:
    out["tensors_peak_mib"] = tf.config.experimental.get_memory_info("CPU:0")["peak"] / 2**20
  return out


def sampler_child(batches):
  import numpy as np

  from tf_dpnsgd import sampling

  n, b = 50000, 256
  rng = np.random.default_rng(0)
  x = rng.normal(size=(n, 32, 32, 3)).astype("float32")
  y = rng.integers(0, 10, n).astype("int32")
  sampler = sampling.make_sampler("poisson", n, b, seed=0)
  it = iter(sampler.dataset(x, y))
  next(it)  # start-up
  start = time.perf_counter()
  rows = 0
  for _ in range(batches):
    _, _, tags = next(it)
    rows += int(np.sum(tags["dp_mask"].numpy()))
  elapsed = time.perf_counter() - start
  return {"batches_per_s": batches / elapsed, "examples_per_s": rows / elapsed}


def _child(args_list):
  cmd = [sys.executable, os.path.abspath(__file__)] + args_list
  proc = subprocess.run(cmd, capture_output=True, text=True,
                        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
  lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
  if proc.returncode != 0 or not lines:
    tail = (proc.stderr or "").strip().splitlines()[-3:]
    return {"error": f"exit {proc.returncode}: {' | '.join(tail)}"}
  return json.loads(lines[-1][len("RESULT "):])


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--models", default="resnet20,bert")
  parser.add_argument("--modes", default="bookkeeping,two_pass",
                      help="DP modes next to the plain step: bookkeeping, two_pass")
  parser.add_argument("--jit", default="0", help="jit_compile values, e.g. 0,1")
  parser.add_argument("--batch", type=int, default=None,
                      help="batch size for every model (default: each model's own)")
  parser.add_argument("--steps", type=int, default=8)
  parser.add_argument("--warmup", type=int, default=2)
  parser.add_argument("--memory_steps", type=int, default=3)
  parser.add_argument("--fit_gib", type=float, default=0.0,
                      help="also extrapolate the largest batch whose peak RSS fits (GiB)")
  parser.add_argument("--sampler_batches", type=int, default=0)
  parser.add_argument("--keep_mib", default="default",
                      help="keep_per_example_mib values of the DP models (MiB; 'default': "
                           "the engine's budget), e.g. default,0")
  parser.add_argument("--child", help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.steps < 1 or args.warmup < 1:
    parser.error("--steps and --warmup must be >= 1")
  modes = args.modes.split(",")
  if any(m not in ENGINES for m in modes):
    parser.error(f"--modes: each of {sorted(ENGINES)}")

  if args.child:
    kind, *rest = args.child.split(":")
    if kind == "sampler":
      out = sampler_child(args.sampler_batches)
    else:
      keep = None if rest[-2] == "default" else float(rest[-2])
      batch = int(rest[-1]) if rest[-1] else None
      if kind == "time":
        out = time_child(rest[0], rest[1] == "1", rest[2].split("+"), args.steps, args.warmup,
                         keep, batch)
      else:
        out = memory_child(rest[0], rest[1] == "1", rest[2], args.memory_steps, keep, batch)
    print("RESULT " + json.dumps(out))
    return 0

  rows = []
  for model_name in args.models.split(","):
    batch = args.batch or BATCHES.get(model_name) or families.BATCHES[model_name]
    for jit in args.jit.split(","):
      for keep in args.keep_mib.split(","):
        row = {"model": model_name, "jit": jit == "1", "batch": batch, "keep_mib": keep}
        row.update(_child(["--child", f"time:{model_name}:{jit}:{'+'.join(modes)}:{keep}:{batch}",
                           "--steps", str(args.steps), "--warmup", str(args.warmup)]))
        if args.memory_steps > 0:
          for mode in ["plain"] + modes:
            for b in ([batch, batch // 2] if args.fit_gib > 0 else [batch]):
              mem = _child(["--child", f"memory:{model_name}:{jit}:{mode}:{keep}:{b}",
                            "--memory_steps", str(args.memory_steps)])
              row[f"{mode}_mem_{b}"] = mem
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
  sampler = (_child(["--child", "sampler", "--sampler_batches", str(args.sampler_batches)])
             if args.sampler_batches > 0 else None)

  import platform

  load = os.getloadavg()
  print(f"\nCPU: {platform.processor() or platform.machine()}, {os.cpu_count()} logical cores, "
        f"load average at the end {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} (1/5/15 min); "
        f"all models' steps in turn, medians over {args.steps} rounds after {args.warmup} "
        "warm-up rounds; memory: peak RSS of a separate run of each minus its peak before the "
        "first step (tracing included); steady: the peak RSS of as many further steps "
        "(high-water mark reset) and the peak of TensorFlow's CPU allocator in them.\n")
  print("| model | batch | XLA | keep MiB | mode | step ms | x plain | ratio IQR "
        "| step MiB (peak RSS - baseline) | x plain | peak RSS MiB | x plain "
        "| steady peak RSS MiB | x plain | steady tensors MiB | x plain |"
        + (f" largest batch in {args.fit_gib:g} GiB |" if args.fit_gib > 0 else ""))
  print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
        + ("---|" if args.fit_gib > 0 else ""))
  for r in rows:
    head = f"| {r['model']} | {r['batch']} | {r['jit']} | {r['keep_mib']} "
    if "error" in r:
      print(f"{head}| | failed: {r['error']} | | | | | | | | | | |")
      continue
    b = r["batch"]
    plain_mem = r.get(f"plain_mem_{b}", {})
    for mode in ["plain"] + modes:
      mem = r.get(f"{mode}_mem_{b}", {})
      ms = r[f"{mode}_ms"] if mode != "plain" else r["plain_ms"]
      ratio = "1" if mode == "plain" else f"{r[f'{mode}_ratio']:.2f}x"
      iqr = "" if mode == "plain" else "{:.2f}-{:.2f}".format(*r[f"{mode}_iqr"])
      if "step_mib" in mem and "step_mib" in plain_mem:
        memory = (f"{mem['step_mib']:.0f} | {mem['step_mib'] / plain_mem['step_mib']:.2f}x "
                  f"| {mem['peak_mib']:.0f} | {mem['peak_mib'] / plain_mem['peak_mib']:.2f}x")
        for key in ("steady_peak_mib", "tensors_peak_mib"):
          if key in mem and key in plain_mem:
            memory += f" | {mem[key]:.0f} | {mem[key] / plain_mem[key]:.2f}x"
          else:
            memory += " | - | -"
      else:
        memory = f"{mem.get('error', '-')} | - | - | - | - | - | - | -"
      fit = ""
      if args.fit_gib > 0:
        half = r.get(f"{mode}_mem_{b // 2}", {})
        if "peak_mib" in mem and "peak_mib" in half and mem["peak_mib"] > half["peak_mib"]:
          slope = (mem["peak_mib"] - half["peak_mib"]) / (b - b // 2)
          fit = f" {int(b + (args.fit_gib * 1024 - mem['peak_mib']) / slope)} |"
        else:
          fit = " - |"
      print(f"{head}| {mode} | {ms:.0f} | {ratio} | {iqr} | {memory} |{fit}")
  floor_rows = [r for r in rows if "gradient_ms" in r]
  if floor_rows:
    print("\nFloors of a two-pass step, x a plain gradient (the plain model's forward pass, "
          "backward pass to its inputs and full gradient, timed in the same rounds; no "
          "per-example work counted):\n")
    print("| model | batch | XLA | forward | backward to inputs | two passes, second forward "
          "(>=) | two passes, shared forward (>=) |")
    print("|---|---|---|---|---|---|---|")
    for r in floor_rows:
      f = floors(r)
      print(f"| {r['model']} | {r['batch']} | {r['jit']} | {f['forward']:.2f} "
            f"| {f['backward_to_inputs']:.2f} | {f['second_forward']:.2f}x "
            f"| {f['shared_forward']:.2f}x |")
  if sampler is not None:
    if "error" in sampler:
      print(f"\nPoisson sampler: failed: {sampler['error']}")
    else:
      print(f"\nPoisson sampler (N=50000 CIFAR-shaped, expected batch 256, tf.data, no model): "
            f"{sampler['batches_per_s']:.1f} batches/s, {sampler['examples_per_s']:.0f} "
            "examples/s")
  return 0


if __name__ == "__main__":
  sys.exit(main())
