"""Step time and peak memory: plain Keras SGD vs DPNSGD vs DPSGD on ResNet20-GN.

Each configuration runs in its own subprocess so that its peak resident memory
(ru_maxrss) is its own. Prints medians over --steps timed steps after
--warmup steps, and DP / plain ratios measured in this one run.

  python benchmarks/step_time.py                      # batch 64 and 256
  python benchmarks/step_time.py --batch_sizes=1000 --physical_batch_size=100 --steps=3
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


def run_one(optimizer: str, batch: int, steps: int, warmup: int, physical, per_example) -> dict:
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
  import keras
  import numpy as np

  import tf_dpnsgd

  keras.utils.set_random_seed(0)
  base = tf_dpnsgd.models.resnet20()
  loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
  if optimizer == "sgd":
    model = base
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss=loss, jit_compile=False)
  else:
    model = tf_dpnsgd.make_private(base, physical_batch_size=physical, per_example=per_example,
                                   trust_untagged_batches=True)  # timing: synthetic batches
    opt = (tf_dpnsgd.DPNSGD(learning_rate=0.1, regularizer=0.01, noise_multiplier=1.0, seed=0)
           if optimizer == "dpnsgd" else
           tf_dpnsgd.DPSGD(learning_rate=0.1, l2_norm_clip=1.0, noise_multiplier=1.0, seed=0))
    model.compile(optimizer=opt, loss=loss)
  rng = np.random.default_rng(0)
  x = rng.normal(size=(batch, 32, 32, 3)).astype("float32")
  y = rng.integers(0, 10, batch).astype("int32")
  times = []
  for i in range(warmup + steps):
    t0 = time.perf_counter()
    model.train_on_batch(x, y)
    dt = time.perf_counter() - t0
    if i >= warmup:
      times.append(dt)
  peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
  return {"optimizer": optimizer, "batch": batch, "median_s": statistics.median(times),
          "peak_rss_mib": peak_mib, "physical_batch_size": physical}


def main():
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--batch_sizes", default="64,256")
  parser.add_argument("--steps", type=int, default=10)
  parser.add_argument("--warmup", type=int, default=2)
  parser.add_argument("--physical_batch_size", type=int, default=None)
  parser.add_argument("--per_example", default="auto")
  parser.add_argument("--optimizers", default="sgd,dpnsgd,dpsgd")
  parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.child:
    opt, batch = args.child.split(":")
    print(json.dumps(run_one(opt, int(batch), args.steps, args.warmup, args.physical_batch_size,
                             args.per_example)))
    return
  rows = []
  for batch in [int(b) for b in args.batch_sizes.split(",")]:
    for opt in args.optimizers.split(","):
      cmd = [sys.executable, __file__, f"--child={opt}:{batch}", f"--steps={args.steps}",
             f"--warmup={args.warmup}", f"--per_example={args.per_example}"]
      if args.physical_batch_size and opt != "sgd":
        cmd.append(f"--physical_batch_size={args.physical_batch_size}")
      out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
      rows.append(json.loads(out.strip().splitlines()[-1]))
      print(f"  measured {opt} batch {batch}: {rows[-1]['median_s']:.3f} s", file=sys.stderr)
  plain = {r["batch"]: r for r in rows if r["optimizer"] == "sgd"}
  print(f"ResNet20-GN, CIFAR-10 shapes, medians over {args.steps} steps after {args.warmup} "
        f"warm-up (per_example={args.per_example}, physical_batch_size={args.physical_batch_size})")
  print(f"{'optimizer':<8} {'batch':>5} {'step s':>8} {'x plain':>8} {'peak MiB':>9} {'x plain':>8}")
  for r in rows:
    p = plain.get(r["batch"])
    tr = f"{r['median_s'] / p['median_s']:.2f}" if p else "-"
    mr = f"{r['peak_rss_mib'] / p['peak_rss_mib']:.2f}" if p else "-"
    print(f"{r['optimizer']:<8} {r['batch']:>5} {r['median_s']:>8.3f} {tr:>8} "
          f"{r['peak_rss_mib']:>9.0f} {mr:>8}")


if __name__ == "__main__":
  main()
