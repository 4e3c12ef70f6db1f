"""Under MirroredStrategy (2 logical CPUs) the DP step equals the single-device step.

Runs in a subprocess: logical devices must be configured before TF starts.
Noise is added once per logical batch (same draw on every replica, on the
all-reduced sum), so with the same seed the weights match.
"""

import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import os, sys
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
    import tensorflow as tf
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    import keras, numpy as np, tf_dpnsgd
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 5)).astype("float32"); y = rng.integers(0, 2, 16).astype("int32")
    def build():
      keras.utils.set_random_seed(0)
      inp = keras.Input((5,)); m = tf_dpnsgd.DPModel(inp, keras.layers.Dense(2)(inp))
      m.compile(optimizer=tf_dpnsgd.DPSGD(learning_rate=0.5, l2_norm_clip=0.3,
                                          noise_multiplier=float(sys.argv[1]), seed=1),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
      return m
    single = build(); single.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    with strategy.scope():
      multi = build()
    multi.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(16), epochs=2, verbose=0)
    diff = max(float(np.abs(a - b).max()) for a, b in zip(single.get_weights(), multi.get_weights()))
    moved = max(float(np.abs(a - b).max()) for a, b in zip(single.get_weights(), build().get_weights()))
    print("RESULT", strategy.num_replicas_in_sync, diff, moved, multi.privacy_ledger.steps)
""")


@pytest.mark.parametrize("noise", ["0.0", "2.0"])
def test_mirrored_strategy_matches_single_device(noise):
  out = subprocess.run([sys.executable, "-c", SCRIPT, noise], capture_output=True, text=True,
                       timeout=300)
  line = [l for l in out.stdout.splitlines() if l.startswith("RESULT")]
  assert line, out.stderr[-3000:]
  _, replicas, diff, moved, draws = line[0].split()
  assert int(replicas) == 2
  assert float(moved) > 1e-3  # training changed the weights
  assert float(diff) < 1e-6  # ... identically on 1 and 2 replicas
  assert int(draws) == 2  # one noise draw per logical batch
