r"""The noise each mechanism puts into the model at the same (epsilon, delta): a table.

  python benchmarks/correlated_error.py [--dataset_size=50000] [--batch_size=1000] \
      [--epochs=20] [--epsilons=1,2,4,8] [--momentum=0.9] [--bands=8,50] [--blt_buffers=2]

For one training schedule (N, B, epochs) and each epsilon, the noise multiplier each
mechanism needs (calibrated by the package's own plan, i.e. its accounting) and the
error it leaves in what the optimizer applies: the root mean squared error of the
prefix sums of the (momentum) updates per coordinate, in units of the per-example
bound, ``sqrt(sens^2 sigma^2 ||A C^{-1}||_F^2 / n)``:

* independent noise, Poisson sampling at ``B/N`` (DP-SGD / DP-NSGD today, amplified);
* BandMF with ``b`` bands, cyclic Poisson at ``bB/N`` over ``ceil(T / b)`` compositions
  (Choquette-Choo et al. 2023, Thm. 4; amplified);
* a BLT with ``d`` buffers, each example at most once every ``b`` steps, accounted
  WITHOUT amplification (one Gaussian mechanism of the min-separation sensitivity).

No training: the mechanisms' error only (the quantity their strategies minimize). Whether
it becomes accuracy is the CIFAR-10 study's question (docs/correlated_noise.md).
"""

from __future__ import annotations

import argparse
import math

import numpy as np

from tf_dpnsgd.correlated import blt as blt_lib
from tf_dpnsgd.correlated import strategy as strategy_lib
from tf_dpnsgd.plan import PrivacyPlan


def rms_error(sigma, total_error, n):
  """RMS prefix-sum error per step and coordinate (noise std ``sigma`` on ``C x``)."""
  return math.sqrt(sigma ** 2 * total_error / n)


def rows(dataset_size, batch_size, epochs, epsilons, momentum, bands, buffers, delta=1e-5):
  common = dict(dataset_size=dataset_size, batch_size=batch_size, delta=delta, epochs=epochs)
  n = PrivacyPlan(sampling="poisson", noise_multiplier=1.0, **common).num_steps
  identity = strategy_lib.identity_strategy(n, momentum).error
  out = []
  for eps in epsilons:
    plan = PrivacyPlan(sampling="poisson", target_epsilon=eps, **common)
    sigma = plan.training_noise_multiplier
    out.append(dict(epsilon=eps, mechanism="independent (Poisson)", steps=n, sigma=sigma,
                    rms=rms_error(sigma, identity, n)))
    for b in bands:
      if b * batch_size > dataset_size or b > n:
        continue
      plan = PrivacyPlan(sampling="cyclic_poisson", bands=b, target_epsilon=eps, **common)
      sigma = plan.training_noise_multiplier
      error = strategy_lib.optimize_bands(n, b, momentum).error
      out.append(dict(epsilon=eps, mechanism=f"BandMF b={b}", steps=n, sigma=sigma,
                      rms=rms_error(sigma, error, n)))
      blt = blt_lib.optimize_blt(n, buffers, b, momentum)
      plan = PrivacyPlan(sampling="cyclic_poisson", bands=b, target_epsilon=eps,
                         blt=blt.parameters(), **common)
      sigma = plan.training_noise_multiplier  # noise std on C x is sigma (sens inside eps)
      out.append(dict(epsilon=eps, mechanism=f"BLT d={buffers}, separation {b}", steps=n,
                      sigma=sigma, rms=rms_error(sigma, blt_lib.total_error(blt, n, momentum),
                                                 n)))
  return out


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--dataset_size", type=int, default=50000)
  parser.add_argument("--batch_size", type=int, default=1000)
  parser.add_argument("--epochs", type=float, default=20)
  parser.add_argument("--epsilons", default="1,2,4,8")
  parser.add_argument("--momentum", type=float, default=0.9)
  parser.add_argument("--bands", default="8,50")
  parser.add_argument("--blt_buffers", type=int, default=2)
  args = parser.parse_args()
  table = rows(args.dataset_size, args.batch_size, args.epochs,
               [float(e) for e in args.epsilons.split(",")], args.momentum,
               [int(b) for b in args.bands.split(",")], args.blt_buffers)
  print(f"N={args.dataset_size} B={args.batch_size} epochs={args.epochs:g} "
        f"momentum={args.momentum:g} delta=1e-5")
  print("| epsilon | mechanism | steps | noise multiplier | RMS prefix-sum error | x independent |")
  print("|---|---|---|---|---|---|")
  base = {}
  for r in table:
    if r["mechanism"].startswith("independent"):
      base[r["epsilon"]] = r["rms"]
    print(f"| {r['epsilon']:g} | {r['mechanism']} | {r['steps']} | {r['sigma']:.4g} | "
          f"{r['rms']:.4g} | {r['rms'] / base[r['epsilon']]:.3f} |")


if __name__ == "__main__":
  np.set_printoptions(precision=4)
  main()
