"""Throughput of ``plan.dataset(...)``: examples/s, with and without a strategy's split.

Prints the median (over ``--repeats``) examples per second delivered by the
sampler's ``tf.data`` stream for CIFAR-10-shaped images (32x32x3, uint8 and
float32) and SST-2-shaped token ids (int32 [N, 128]), for each sampling, read

* ``plain``: iterating the ``tf.data.Dataset`` itself (padded for R replicas);
* ``split``: through ``MirroredStrategy(R logical CPUs).experimental_distribute_dataset``
  (what ``model.fit`` does with a plain dataset under the strategy: one pipeline
  gathers the global batch, ``tf.distribute`` splits it), touching every replica's shard;
* ``per-replica``: what ``plan.dataset(x, y, model=model)`` returns under that strategy,
  one pipeline per replica gathering only its shard
  (``tf_dpnsgd.distribution.per_replica_dataset`` over ``sampler.dataset(...,
  replica_id=r)``), touching every replica's shard.

The ratios are to ``plain`` (the issue's target: per-replica >= 0.9).

Counts real (unmasked) examples only. No timed assertion: numbers are printed.

Usage: python benchmarks/input_pipeline.py [--replicas 2] [--batches 40] [--repeats 5]
"""

import argparse
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402


def parse():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--replicas", type=int, default=2)
  p.add_argument("--batches", type=int, default=40)
  p.add_argument("--repeats", type=int, default=5)
  p.add_argument("--dataset_size", type=int, default=20000)
  p.add_argument("--batch_size", type=int, default=1000)
  p.add_argument("--samplings", default="poisson,uniform,shuffle")
  return p.parse_args()


def measure(iterate, batches, repeats, real_per_batch):
  rates = []
  for _ in range(repeats):
    start = time.perf_counter()
    iterate(batches)
    rates.append(real_per_batch * batches / (time.perf_counter() - start))
  return float(np.median(rates))


def main():
  args = parse()
  cpu = tf.config.list_physical_devices("CPU")[0]
  tf.config.set_logical_device_configuration(
      cpu, [tf.config.LogicalDeviceConfiguration()] * args.replicas)
  import tf_dpnsgd  # pylint: disable=import-outside-toplevel
  strategy = tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(args.replicas)])
  n, b = args.dataset_size, args.batch_size
  rng = np.random.default_rng(0)
  inputs = {
      "cifar_uint8": rng.integers(0, 256, (n, 32, 32, 3), dtype=np.uint8),
      "cifar_float32": rng.random((n, 32, 32, 3), dtype=np.float32),
      "sst2_int32_128": rng.integers(0, 30000, (n, 128), dtype=np.int32),
  }
  y = rng.integers(0, 10, n).astype(np.int32)
  print(f"N={n} B={b} replicas={args.replicas} batches={args.batches} repeats={args.repeats} "
        f"cpus={os.cpu_count()}")
  print(f"{'input':16s} {'sampling':9s} {'plain ex/s':>11s} {'split ex/s':>11s} "
        f"{'ratio':>6s} {'per-replica ex/s':>17s} {'ratio':>6s}")
  for name, x in inputs.items():
    for sampling in args.samplings.split(","):
      plan = tf_dpnsgd.PrivacyPlan(dataset_size=n, batch_size=b, sampling=sampling,
                                   steps=10 ** 6, noise_multiplier=1.0, delta=1e-5, seed=0)
      ds = plan.dataset(x, y, num_replicas=args.replicas)

      plain_it = iter(ds)
      next(plain_it)

      def plain(k, it=plain_it):
        for _ in range(k):
          xb, _, _ = next(it)
        xb.numpy()  # noqa: F821  (wait for the last batch)

      dist_it = iter(strategy.experimental_distribute_dataset(ds))
      next(dist_it)

      def mirrored(k, it=dist_it):
        for _ in range(k):
          xb, _, _ = next(it)
        for shard in strategy.experimental_local_results(xb):
          shard.numpy()

      per_replica = tf_dpnsgd.distribution.per_replica_dataset(
          strategy, lambda r, x=x, plan=plan: plan.sampler.dataset(
              x, y, num_replicas=args.replicas, replica_id=r))
      replica_it = iter(per_replica)
      next(replica_it)

      def replicas(k, it=replica_it):
        for _ in range(k):
          xb, _, _ = next(it)
        for shard in strategy.experimental_local_results(xb):
          shard.numpy()

      # Poisson: real examples average qN = B; the others: exactly B. The three readers
      # alternate within each repeat, so load drifts hit them alike.
      rates = {"plain": [], "split": [], "replicas": []}
      for _ in range(args.repeats):
        for key, fn in (("plain", plain), ("split", mirrored), ("replicas", replicas)):
          rates[key].append(measure(fn, args.batches, 1, b))
      rate_plain, rate_dist, rate_rep = (float(np.median(rates[k]))
                                         for k in ("plain", "split", "replicas"))
      print(f"{name:16s} {sampling:9s} {rate_plain:11.0f} {rate_dist:11.0f} "
            f"{rate_dist / rate_plain:6.2f} {rate_rep:17.0f} {rate_rep / rate_plain:6.2f}",
            flush=True)


if __name__ == "__main__":
  main()
