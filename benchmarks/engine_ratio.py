"""Layer-wise DP step vs plain step: time and memory, with and without XLA (issue 12).

Usage (from the repository root)::

    python benchmarks/engine_ratio.py                       # 6 rows + sampler
    python benchmarks/engine_ratio.py --models=bert --jit=0 --steps=20

Configurations: ResNet20-GN (CIFAR shapes) at batch 256 and a keras-hub BERT
of MiniLM-L6 size (6 layers, hidden 384, 12 heads, intermediate 1536, sequence
128, random weights, no download) at batch 32 (the builders of
``benchmarks/per_example_engines.py``), each compiled with ``jit_compile``
False and True; on request (``--models=scatter_cnn,scatter_cnn_2views``) Tramer
and Boneh's CNN on CIFAR-10 scattering features at batch 512, on one view or
on two views with shared weights (loss = mean over views); and
(``--models=bert_lora``) LoRA fine-tuning of a small BERT (4 layers, hidden
256, sequence 64, ``backbone.enable_lora(8)``) at batch 32, a plain LoRA step
against a DP LoRA step. The DP model is ``tf_dpnsgd.make_private(per_example=
"layerwise")`` with DPNSGD (noise multiplier 1). BERT runs twice per
``jit_compile`` value: with the engine's default budget for kept per-example
gradients and with ``keep_per_example_mib=0`` (``--keep_mib``), the
time-for-memory trade the user chooses; so do the scattering CNNs.

Time: one subprocess per configuration builds both models and alternates one
plain and one DP ``train_on_batch`` on the same batch, ``--steps`` times after
``--warmup`` (tracing included), so that load from other processes hits both
alike; the table gives the medians and the ratio of the medians, and the
interquartile ratio range (quartiles of the per-pair ratios) as a noise gauge.

Memory: the process's resident-set high-water mark (``ru_maxrss``), measured
in one more subprocess per (configuration, plain/DP) that runs only that
model for ``--memory_steps`` steps (TensorFlow's CPU allocator statistics miss
what oneDNN and XLA allocate themselves). ``--memory_steps=0`` skips it.

Sampler: examples per second of a Poisson ``tf.data`` stream
(``tf_dpnsgd.sampling.PoissonSampler.dataset``) over 50000 CIFAR-shaped
examples with expected batch 256, iterated without a model.
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

BATCHES = {"resnet20": 256, "bert": 32, "scatter_cnn": 512, "scatter_cnn_2views": 512,
           "bert_lora": 32}


def _models(model_name, jit, keep_mib=None):
  import keras

  import tf_dpnsgd
  from per_example_engines import build
  from per_example_engines import loss_for

  keras.utils.set_random_seed(0)
  make, x, y, batch = build(model_name)
  loss = loss_for(model_name)

  def plain():
    m = make()
    m.compile(optimizer=keras.optimizers.SGD(0.01), loss=loss, jit_compile=jit)
    return m

  def private():
    m = tf_dpnsgd.make_private(make(), per_example="layerwise", keep_per_example_mib=keep_mib,
                               trust_untagged_batches=True)  # timing: synthetic batches
    m.compile(optimizer=tf_dpnsgd.DPNSGD(learning_rate=0.01, regularizer=0.1,
                                         noise_multiplier=1.0, seed=0),
              loss=loss, jit_compile=jit)
    return m

  return plain, private, x, y, batch


def time_child(model_name, jit, steps, warmup, keep_mib=None):
  import tensorflow as tf

  plain_fn, private_fn, x, y, batch = _models(model_name, jit, keep_mib)
  plain, private = plain_fn(), private_fn()
  x = tf.nest.map_structure(tf.convert_to_tensor, x)
  y = tf.convert_to_tensor(y)

  def step(model):
    start = time.perf_counter()
    model.train_on_batch(x, y)
    return time.perf_counter() - start

  for _ in range(warmup):
    step(plain)
    step(private)
  times = {"plain": [], "dp": []}
  for i in range(steps):  # alternate which goes first
    order = (("plain", plain), ("dp", private)) if i % 2 == 0 else (("dp", private),
                                                                   ("plain", plain))
    for key, model in order:
      times[key].append(step(model))
  ratios = sorted(d / p for d, p in zip(times["dp"], times["plain"]))
  q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
  med = {k: statistics.median(v) for k, v in times.items()}
  return {"model": model_name, "jit": jit, "batch": batch, "steps": steps,
          "plain_ms": 1e3 * med["plain"], "dp_ms": 1e3 * med["dp"],
          "ratio": med["dp"] / med["plain"], "ratio_q1": q[0], "ratio_q3": q[2]}


def memory_child(model_name, jit, which, steps, keep_mib=None):
  import tensorflow as tf

  plain_fn, private_fn, x, y, _ = _models(model_name, jit, keep_mib)
  model = plain_fn() if which == "plain" else private_fn()
  x = tf.nest.map_structure(tf.convert_to_tensor, x)
  y = tf.convert_to_tensor(y)
  for _ in range(steps):
    model.train_on_batch(x, y)
  return {"peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


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
  parser.add_argument("--jit", default="0,1", help="jit_compile values, e.g. 0,1")
  parser.add_argument("--steps", type=int, default=12)
  parser.add_argument("--warmup", type=int, default=2)
  parser.add_argument("--memory_steps", type=int, default=3)
  parser.add_argument("--sampler_batches", type=int, default=50)
  parser.add_argument("--keep_mib", default="default,0",
                      help="keep_per_example_mib values of the DP model (MiB; 'default': the "
                           "engine's budget); BERT and the scattering CNNs run each, "
                           "ResNet20-GN 'default' only")
  parser.add_argument("--child", help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.steps < 1 or args.warmup < 1:
    parser.error("--steps and --warmup must be >= 1")

  if args.child:
    kind, *rest = args.child.split(":")
    keep = None if rest and rest[-1] == "default" else (float(rest[-1]) if rest else None)
    if kind == "time":
      out = time_child(rest[0], rest[1] == "1", args.steps, args.warmup, keep)
    elif kind == "memory":
      out = memory_child(rest[0], rest[1] == "1", rest[2], args.memory_steps, keep)
    else:
      out = sampler_child(args.sampler_batches)
    print("RESULT " + json.dumps(out))
    return 0

  rows = []
  for model_name in args.models.split(","):
    keeps = (args.keep_mib.split(",") if model_name in ("bert", "scatter_cnn", "scatter_cnn_2views")
             else ["default"])
    for jit in args.jit.split(","):
      for keep in keeps:
        row = {"model": model_name, "jit": jit == "1", "batch": BATCHES[model_name],
               "keep_mib": keep}
        row.update(_child(["--child", f"time:{model_name}:{jit}:{keep}", "--steps",
                           str(args.steps), "--warmup", str(args.warmup)]))
        if args.memory_steps > 0:
          for which in ("plain", "dp"):
            mem = _child(["--child", f"memory:{model_name}:{jit}:{which}:{keep}",
                          "--memory_steps", str(args.memory_steps)])
            row[f"{which}_rss_mib"] = mem.get("peak_rss_mib")
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
  sampler = (_child(["--child", "sampler", "--sampler_batches", str(args.sampler_batches)])
             if args.sampler_batches > 0 else None)

  import platform

  print(f"\nCPU: {platform.processor() or platform.machine()}, {os.cpu_count()} logical cores; "
        f"plain and DP steps alternated, medians over {args.steps} pairs after {args.warmup} "
        "warm-up pairs; peak RSS over a separate run of each.\n")
  print("| model | batch | XLA | keep MiB | plain ms | DP ms | DP/plain | ratio IQR "
        "| plain peak MiB | DP peak MiB | memory ratio |")
  print("|---|---|---|---|---|---|---|---|---|---|---|")
  for r in rows:
    head = f"| {r['model']} | {r['batch']} | {r['jit']} | {r['keep_mib']} "
    if "error" in r:
      print(f"{head}| failed: {r['error']} | | | | | | |")
      continue
    pm, dm = r.get("plain_rss_mib"), r.get("dp_rss_mib")
    mem = (f"{pm:.0f} | {dm:.0f} | {dm / pm:.2f}x" if pm and dm else "- | - | -")
    print(f"{head}| {r['plain_ms']:.0f} | {r['dp_ms']:.0f} "
          f"| {r['ratio']:.2f}x | {r['ratio_q1']:.2f}-{r['ratio_q3']:.2f} | {mem} |")
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
