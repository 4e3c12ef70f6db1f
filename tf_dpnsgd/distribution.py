"""``tf.distribute`` helpers of DP training: replicas, workers, the chief, shared secrets.

How DP training runs under a strategy (``MirroredStrategy``,
``MultiWorkerMirroredStrategy``; nothing here prevents ``TPUStrategy``):

* Batches. The global batch of step ``t`` is a pure function of the sampler
  seed and ``t`` (:mod:`tf_dpnsgd.sampling`), the same set of examples for
  any number of replicas ``R``. :meth:`tf_dpnsgd.plan.PrivacyPlan.dataset`
  pads it with masked rows (``dp_mask`` False, exactly zero contribution) to
  a static multiple of ``R`` (:func:`padded_rows`), so every replica gets a
  static-shape shard and the denominator stays the global one (``B``, or
  ``qN`` for Poisson).
* Noise. Every replica all-reduces the summed contributions and adds the
  SAME draw, keyed by ``(noise key, ledger step)``; one draw per logical
  batch. Within one process every replica holds the same key; across workers
  the key is made common by :func:`broadcast_int` from worker 0 when the
  train function is built (:meth:`tf_dpnsgd.training.DPModel.make_train_function`),
  so the noise is not averaged over independent per-worker draws (which would
  divide its standard deviation by ``sqrt(workers)``). The key is never
  stored; it travels only between the workers of the job.
* Sampler seed. Every worker must draw the same batches, hence use the same
  (secret) sampler seed: :meth:`~tf_dpnsgd.plan.PrivacyPlan.dataset` refuses
  a plan whose seed differs from worker 0's (:func:`check_same_on_all_workers`);
  launchers draw it on worker 0 and broadcast it (:func:`broadcast_int`).
* Ledger. Its counters are ``only_first_replica`` variables: one logical
  step is recorded once, not ``R`` times; each replica checks its own shard's
  tags before the step.
* Writing. Reports, exports and checkpoints are written by the chief only
  (:func:`is_chief`).
"""

from __future__ import annotations

import json
import os
from typing import Optional

import tensorflow as tf


def num_replicas(strategy: Optional[tf.distribute.Strategy] = None) -> int:
  """Replicas in sync of ``strategy`` (default: the current one)."""
  strategy = strategy or tf.distribute.get_strategy()
  return int(strategy.num_replicas_in_sync)


def padded_rows(rows: int, replicas: int) -> int:
  """``rows`` rounded up to a multiple of ``replicas`` (the static global batch size).

  >>> padded_rows(15, 2), padded_rows(16, 2), padded_rows(41, 4), padded_rows(3, 8)
  (16, 16, 44, 8)
  """
  for name, value in (("rows", rows), ("replicas", replicas)):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
      raise ValueError(f"`{name}` must be a positive integer; got {value!r}.")
  return -(-rows // replicas) * replicas


def is_multi_worker(strategy: Optional[tf.distribute.Strategy] = None) -> bool:
  """True when the replicas of ``strategy`` span several processes (workers / hosts)."""
  strategy = strategy or tf.distribute.get_strategy()
  replicas = num_replicas(strategy)
  if replicas == 1:
    return False
  return replicas > len(strategy.extended.worker_devices)


def is_chief(strategy: Optional[tf.distribute.Strategy] = None) -> bool:
  """True on the process that writes reports, exports and checkpoints.

  The ``chief`` task, or ``worker`` 0 of a cluster without a chief (the
  convention of ``MultiWorkerMirroredStrategy``); True without ``TF_CONFIG``.
  ``strategy`` is accepted for symmetry; the answer comes from ``TF_CONFIG``
  (or the strategy's cluster resolver when it has one).
  """
  resolver = getattr(strategy, "cluster_resolver", None) if strategy is not None else None
  if resolver is not None and getattr(resolver, "task_type", None):
    task_type, task_id = resolver.task_type, resolver.task_id
    cluster = resolver.cluster_spec().as_dict()
  else:
    config = json.loads(os.environ.get("TF_CONFIG", "{}") or "{}")
    task = config.get("task", {})
    task_type, task_id = task.get("type"), task.get("index", 0)
    cluster = config.get("cluster", {})
  if not task_type:
    return True
  if task_type == "chief":
    return True
  return task_type == "worker" and int(task_id or 0) == 0 and "chief" not in cluster


def broadcast_int(strategy: tf.distribute.Strategy, value: int) -> int:
  """Worker 0's (replica 0's) ``value`` on every worker: one SUM all-reduce where
  every other replica contributes 0 (exact for int64).

  Call it on every worker at the same point of the program (it is a collective).
  With one replica it returns ``value``.

  Args:
    strategy: the strategy of the job.
    value: a non-negative int63 (a seed).

  Returns:
    Replica 0's ``value``.
  """
  if num_replicas(strategy) == 1:
    return int(value)
  if isinstance(value, bool) or not 0 <= int(value) < 2 ** 63:
    raise ValueError(f"broadcast_int takes an int in [0, 2**63); got {value!r}.")
  local = tf.constant(int(value), tf.int64)
  return _sum_over_replicas(
      strategy, lambda ctx: tf.where(tf.equal(ctx.replica_id_in_sync_group, 0), local,
                                     tf.zeros_like(local)))


def _sum_over_replicas(strategy: tf.distribute.Strategy, contribution) -> int:
  """The int64 SUM all-reduce of ``contribution(replica_context)`` over all replicas."""
  @tf.function(autograph=False)
  def run():
    def replica_fn():
      ctx = tf.distribute.get_replica_context()
      return ctx.all_reduce(tf.distribute.ReduceOp.SUM, contribution(ctx))
    return strategy.run(replica_fn)

  return int(strategy.experimental_local_results(run())[0].numpy())


def check_same_on_all_workers(strategy: tf.distribute.Strategy, value: int, what: str) -> None:
  """Raises ``ValueError`` on every worker unless all hold worker 0's ``value``.

  Two collectives (a broadcast, then a count of mismatches), so every worker
  raises together instead of leaving the others waiting in a collective.
  """
  if not is_multi_worker(strategy):
    return
  first = broadcast_int(strategy, value)
  mismatch = tf.constant(int(first != int(value)), tf.int64)
  if _sum_over_replicas(strategy, lambda ctx: mismatch):
    raise ValueError(
        f"The {what} differs between the workers of this job: every worker must draw the "
        f"same batches and noise. Draw it once on worker 0 and share it with "
        f"tf_dpnsgd.distribution.broadcast_int(strategy, value) (the launchers do), or pass "
        f"the same secret value on every worker.")


def per_replica_dataset(strategy: tf.distribute.Strategy, make_dataset):
  """One input pipeline per replica: ``make_dataset(r)`` yields replica ``r``'s shards.

  ``strategy.distribute_datasets_from_function`` in ``PER_REPLICA`` mode: each
  replica gathers only its own rows (``r`` in ``[0, R)``), instead of one
  pipeline gathering the global batch and ``tf.distribute`` splitting it
  (``benchmarks/input_pipeline.py`` measures both). What replica ``r`` receives
  is the same either way. Single-worker strategies only (one process holds
  every replica).

  Raises:
    ValueError: ``strategy`` spans several workers.
  """
  if is_multi_worker(strategy):
    raise ValueError("per_replica_dataset needs a single-worker strategy (PER_REPLICA input "
                     "pipelines); a multi-worker job splits one global pipeline per worker.")

  def dataset_fn(context: tf.distribute.InputContext):
    return make_dataset(int(context.input_pipeline_id))

  # Prefetching to the replica's device pays on accelerators; between logical CPUs it is
  # one more copy per element (benchmarks/input_pipeline.py: 0.48 vs 0.66-0.70 of a
  # single pipeline's examples/s for SST-2-sized batches on 2 cores).
  accelerators = any(kind in device.upper() for device in strategy.extended.worker_devices
                     for kind in ("GPU", "TPU"))
  options = tf.distribute.InputOptions(
      experimental_replication_mode=tf.distribute.InputReplicationMode.PER_REPLICA,
      experimental_place_dataset_on_device=False, experimental_fetch_to_device=accelerators)
  return strategy.distribute_datasets_from_function(dataset_fn, options=options)


__all__ = ["broadcast_int", "check_same_on_all_workers", "is_chief", "is_multi_worker",
           "num_replicas", "padded_rows", "per_replica_dataset"]
