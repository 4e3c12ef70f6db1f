"""Under MirroredStrategy (2 logical CPUs) the DP step equals the single-device step.

Runs in subprocesses: logical devices must be configured before TF starts.
Noise is added once per logical batch (same draw on every replica, on the
all-reduced sum), so with the same seed the weights match. The multi-worker
twin of these checks is tests/test_multiworker.py.
"""

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import dist_checks
from launch_each import once_per_session
import zygote  # children forked from a pre-imported process (tests/zygote.py)

SCRIPT = textwrap.dedent("""
    import json, os, sys
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
    import tensorflow as tf
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    import keras, numpy as np, tf_dpnsgd
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 5)).astype("float32"); y = rng.integers(0, 2, 16).astype("int32")
    strategy = None
    for case, (noise, kwargs) in enumerate(json.loads(sys.argv[1])):
      def build():
        keras.utils.set_random_seed(0)
        inp = keras.Input((5,)); m = tf_dpnsgd.DPModel(inp, keras.layers.Dense(2)(inp))
        m.compile(optimizer=tf_dpnsgd.DPSGD(learning_rate=0.5, l2_norm_clip=0.3,
                                            noise_multiplier=float(noise), seed=1, **kwargs),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return m
      single = build(); single.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
      strategy = strategy or tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
      with strategy.scope():
        multi = build()
      multi.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
      diff = max(float(np.abs(a - b).max()) for a, b in zip(single.get_weights(), multi.get_weights()))
      moved = max(float(np.abs(a - b).max()) for a, b in zip(single.get_weights(), build().get_weights()))
      clips = [float(getattr(m.optimizer, "current_l2_norm_clip", 0.3)) for m in (single, multi)]
      # The ledger's host reads (tf_dpnsgd.ledger.host_value) of mirrored variables: Keras' own.
      from tf_dpnsgd import ledger as ledger_lib
      held = list(multi.privacy_ledger._vars.values())
      reads = int(all(np.array_equal(ledger_lib.host_value(v), np.asarray(v.numpy())) for v in held)
                  and any(isinstance(v.value, tf.distribute.DistributedValues) for v in held))
      print("RESULT", case, strategy.num_replicas_in_sync, diff, moved, multi.privacy_ledger.steps,
            *clips, reads, flush=True)
""")


def run_mirrored_cases(cases) -> list:
  """Runs SCRIPT once for several ``(noise, DPSGD kwargs)`` cases (DPSGD on 1 device vs
  MirroredStrategy on 2, each case from the same seeds, one after the other in one process:
  TensorFlow is imported once) and returns one RESULT dict per case, in order: replicas, max
  weight difference, how far training moved the weights, ledger steps, the final clip of
  the single and the mirrored run, and 1 if the mirrored ledger's variables are distributed and
  every host read of them equals Keras' own."""
  out = zygote.run([sys.executable, "-c", SCRIPT, json.dumps(
      [[noise, kwargs] for noise, kwargs in cases])], capture_output=True, text=True, timeout=300)
  lines = [l.split()[1:] for l in out.stdout.splitlines() if l.startswith("RESULT")]
  assert [int(l[0]) for l in lines] == list(range(len(cases))), out.stderr[-3000:]
  keys = ("replicas", "diff", "moved", "steps", "clip_single", "clip_multi", "ledger_reads")
  return [{k: float(v) for k, v in zip(keys, l[1:])} for l in lines]


def run_mirrored(noise: float, **optimizer_kwargs) -> dict:
  """Runs SCRIPT for one case (DPSGD with ``noise_multiplier=noise`` and the extra DPSGD
  kwargs): see :func:`run_mirrored_cases`."""
  return run_mirrored_cases([(noise, optimizer_kwargs)])[0]


NOISES = (0.0, 2.0)


@pytest.fixture(scope="module")
def mirrored_by_noise(tmp_path_factory):
  """Both noise levels of the test below from one subprocess (was one process each), once
  per pytest session (``launch_each.once_per_session``)."""
  _, cases = once_per_session(tmp_path_factory, "distribute_mirrored",
                              lambda _: run_mirrored_cases([(noise, {}) for noise in NOISES]))
  return dict(zip(NOISES, cases))


@pytest.mark.slow
@pytest.mark.parametrize("noise", NOISES)
@pytest.mark.xdist_group("distribute_mirrored")  # one run of its module fixture: one worker
def test_mirrored_strategy_matches_single_device(noise, mirrored_by_noise):
  r = mirrored_by_noise[noise]
  assert r["replicas"] == 2
  assert r["moved"] > 1e-3  # training changed the weights
  assert r["diff"] < 1e-6  # ... identically on 1 and 2 replicas
  assert r["steps"] == 2  # one noise draw per logical batch
  assert r["ledger_reads"] == 1  # mirrored ledger variables, read on the host as Keras reads them


@pytest.mark.slow
def test_mirrored_every_sampling_matches_single_process_and_draws_once(tmp_path):
  """Poisson, uniform and shuffle plans (odd B: a masked padding row per step, next to an
  example of magnitude 1e6) on 2 replicas: same ledger and weights as one process at
  noise 0; at sigma > 0 (OS noise key) the update noise has std sigma * C * sqrt(T) / B."""
  script = os.path.join(os.path.dirname(__file__), "dist_script.py")
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
  env.pop("TF_CONFIG", None)
  procs = {mode: zygote.Popen([sys.executable, script, mode, str(tmp_path / f"{mode}.npz")],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for mode in ("single", "mirrored")}
  try:
    outputs = {mode: p.communicate(timeout=300)[0] for mode, p in procs.items()}
  finally:
    for p in procs.values():
      if p.poll() is None:
        p.kill()
        p.wait()
  for mode, p in procs.items():
    assert p.returncode == 0, outputs[mode][-4000:]
  single = dict(np.load(tmp_path / "single.npz"))
  mirrored = dict(np.load(tmp_path / "mirrored.npz"))
  assert int(mirrored["replicas"]) == 2
  for sampling in dist_checks.SAMPLINGS:  # the per-replica input path is the one compared
    assert bool(mirrored[f"{sampling}_per_replica_pipelines"])
    assert not bool(single[f"{sampling}_per_replica_pipelines"])
    # `augment` was traced in each replica's pipeline (2), or once in the global stream.
    assert int(mirrored[f"{sampling}_augment_traces"]) == 2
    assert int(single[f"{sampling}_augment_traces"]) == 1
  dist_checks.assert_same_training(single, mirrored)
  dist_checks.assert_one_draw_per_step(mirrored)
  dist_checks.assert_one_draw_per_step(single)  # the oracle holds without a strategy too


def test_padding_to_replicas_keeps_the_batch_and_masks_the_rest():
  """The global batch of step t is the same examples for any number of replicas; padding
  rows (index 0) are masked and the denominator stays B (qN for Poisson)."""
  from tf_dpnsgd import ledger, sampling as sampling_lib  # pylint: disable=import-outside-toplevel
  x = np.arange(40, dtype=np.float32).reshape(40, 1) + 1.0
  y = np.zeros(40, np.int32)
  for sampling in ("poisson", "uniform", "shuffle"):
    sampler = sampling_lib.make_sampler(sampling, 40, 7, seed=5)
    one = list(sampler.numpy_batches(x, y, num_steps=3))
    for replicas in (2, 3, 8):
      many = list(sampler.numpy_batches(x, y, num_steps=3, num_replicas=replicas))
      assert len(one) == len(many) == 3  # the zip below compares every step
      for (x1, _, t1), (xr, _, tr) in zip(one, many):
        assert len(xr) % replicas == 0 and len(xr) - len(x1) < replicas
        m1 = t1.get(ledger.DP_MASK_KEY, np.ones(len(x1), bool))
        mr = tr[ledger.DP_MASK_KEY]
        np.testing.assert_array_equal(np.sort(xr[mr, 0]), np.sort(x1[m1, 0]))
        assert not mr[len(x1):].any()
        np.testing.assert_array_equal(tr[ledger.DP_DENOMINATOR_KEY], 7.0)  # qN = B = 7
