"""What auditing costs: the train step with canaries, and scoring m canaries.

* Step time: the DP train step of the MNIST MLP (784-128-10) without and with
  the white-box canary head (``with_dirac_canaries``, m canaries), on the same
  batch, interleaved, medians after warm-up. Input-space canaries are plain
  rows of the same model: their step is the unmodified one.
* Scoring m canaries on a trained-size model: white-box (read the canary
  table), black-box (one forward pass over the m canary images, -loss), and
  the one-run bound over the default rule grid (Bonferroni).

  python benchmarks/audit_overhead.py [--num_canaries=1000 --batch_size=256 --steps=30]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--num_canaries", type=int, default=1000)
  p.add_argument("--batch_size", type=int, default=256)
  p.add_argument("--steps", type=int, default=30)
  p.add_argument("--warmup", type=int, default=3)
  p.add_argument("--repeats", type=int, default=5)
  args = p.parse_args()

  import keras
  import numpy as np

  import tf_dpnsgd
  from tf_dpnsgd import audit
  from tf_dpnsgd.audit import canaries, scoring

  m, b = args.num_canaries, args.batch_size
  rng = np.random.default_rng(0)
  x = rng.random((b, 28, 28, 1)).astype("float32")
  y = rng.integers(0, 10, b).astype("int32")

  def mlp():
    inp = keras.Input((28, 28, 1))
    h = keras.layers.Dense(128, activation="tanh")(keras.layers.Flatten()(inp))
    return keras.Model(inp, keras.layers.Dense(10)(h))

  def compiled(model):
    model = tf_dpnsgd.make_private(model, trust_untagged_batches=True)  # timing: synthetic batches
    model.compile(optimizer=tf_dpnsgd.DPSGD(learning_rate=0.5, l2_norm_clip=1.0,
                                            noise_multiplier=1.0, seed=0),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model

  keras.utils.set_random_seed(0)
  plain = compiled(mlp())
  audited = compiled(audit.with_dirac_canaries(mlp(), m))
  # A batch of the audited model: real rows plus a few canary rows (as Poisson would draw).
  ca = audit.dirac_canaries((28, 28, 1), m, 10, np.ones(m, bool), gradient_norm=100.0)
  xa = canaries.as_dirac_inputs(x)
  k = max(1, b // 40)   # ~2.5% canary rows, as with 500 of 20,000
  for key in xa:
    xa[key][:k] = ca.x[key][:k]
  ya = y.copy()
  ya[:k] = ca.y[:k]

  times = {"plain": [], "with canary head": []}
  for i in range(args.warmup + args.steps):
    for name, model, xb, yb in (("plain", plain, x, y), ("with canary head", audited, xa, ya)):
      t0 = time.perf_counter()
      model.train_on_batch(xb, yb)
      if i >= args.warmup:
        times[name].append(time.perf_counter() - t0)
  med = {k: statistics.median(v) for k, v in times.items()}
  print(f"DP-SGD train step, MLP 784-128-10, batch {b}, m={m} (median of {args.steps}):")
  for name, t in med.items():
    print(f"  {name:18s} {1e3 * t:7.2f} ms")
  print(f"  ratio              {med['with canary head'] / med['plain']:.3f}")

  # Scoring m canaries.
  xc = rng.random((m, 28, 28, 1)).astype("float32")
  yc = rng.integers(0, 10, m).astype("int32")
  included = audit.draw_inclusion(m, seed=0)

  def timed(fn):
    out = []
    for _ in range(args.repeats):
      t0 = time.perf_counter()
      fn()
      out.append(time.perf_counter() - t0)
    return statistics.median(out)

  scoring.loss_scores(plain, xc, yc)   # warm-up (traces predict)
  t_white = timed(lambda: scoring.dirac_scores(audited))
  t_black = timed(lambda: scoring.loss_scores(plain, xc, yc))
  scores = included + rng.normal(size=m)   # a detectable signal: the bisection runs
  t_bound = timed(lambda: audit.audit_scores(scores, included, delta=1e-5))
  print(f"Scoring m={m} canaries (median of {args.repeats}):")
  print(f"  white-box (canary table)          {1e3 * t_white:8.2f} ms")
  print(f"  black-box (-loss, one forward)    {1e3 * t_black:8.2f} ms")
  print(f"  one-run bound, default rule grid  {1e3 * t_bound:8.2f} ms")


if __name__ == "__main__":
  main()
