r"""What checking participation on example identity costs (issue 46).

Two costs, on synthetic data of the real sizes (the values do not matter, only the shapes):

* once per ``plan.dataset(...)`` (every ``fit``): the examples' identities, i.e. the
  content digest of every ``(x_i, y_i)`` (:class:`tf_dpnsgd.participation.Population`),
  and cyclic Poisson's parts of them;
* before every step, on the host: the guard's check of the batch's real rows
  (:meth:`tf_dpnsgd.participation.ParticipationCheck.check`), for cyclic Poisson (part of
  each row) and shuffling (no example twice in the epoch).

Shapes: CIFAR-10 (50,000 x 32x32x3 float32, labels; batch 1000) and SST-2 (67,349
sentences x 128 int32 token ids plus a padding mask; batch 32 and 1024).

Usage: ``python benchmarks/participation_cost.py [--repeats=5]``
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from tf_dpnsgd import participation
from tf_dpnsgd.correlated import sampling as cs


def _median_ms(fn, repeats):
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    fn()
    times.append((time.perf_counter() - start) * 1e3)
  return statistics.median(times)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--repeats", type=int, default=5)
  args = parser.parse_args()
  rng = np.random.default_rng(0)
  cifar = (rng.random((50_000, 32, 32, 3), np.float32), rng.integers(0, 10, 50_000))
  sst2 = ({"token_ids": rng.integers(0, 30_000, (67_349, 128)).astype(np.int32),
           "padding_mask": np.ones((67_349, 128), np.int32)}, rng.integers(0, 2, 67_349))
  print("| data | identities (once per fit) | parts, b=16 (once) | batch | check, cyclic "
        "Poisson | check, shuffle |")
  print("|---|---|---|---|---|---|")
  for name, (x, y), batches in (("CIFAR-10", cifar, (1000,)), ("SST-2", sst2, (32, 1024))):
    n = len(y)
    population = participation.Population.of_data(x, y)  # warm-up (tracing of the digest)
    ident_ms = _median_ms(lambda: participation.Population.of_data(x, y), args.repeats)
    sampler = cs.CyclicPoissonSampler(dataset_size=n, batch_size=64, bands=16, seed=1)
    parts_ms = _median_ms(lambda: participation.part_of(
        population.identities, sampler.seed_tag(population), 16), args.repeats)
    for batch in batches:
      ids = population.identities[:batch]
      key = 12345
      parts = participation.part_of(ids, key, 16)
      same_part = ids[parts == parts[0]]
      check = participation.ParticipationCheck()
      cyclic_ms = _median_ms(lambda: check.check("cyclic_poisson", int(parts[0]), 16, key,
                                                 same_part), args.repeats * 20)

      def shuffle_step():
        fresh = participation.ParticipationCheck()
        fresh.commit(fresh.check("shuffle", 0, n // batch, key, ids))

      shuffle_ms = _median_ms(shuffle_step, args.repeats * 20)
      print(f"| {name} (N={n}) | {ident_ms:.0f} ms | {parts_ms:.1f} ms | {batch} | "
            f"{cyclic_ms:.3f} ms | {shuffle_ms:.3f} ms |")


if __name__ == "__main__":
  main()
