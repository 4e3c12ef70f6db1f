"""Issue 31: no log noise at the user's first run (the README's example, a launcher).

Each check runs a short script in a subprocess and asserts that none of the lines a new
user took for errors reaches stderr: the sampler's generator iterator finalized at exit,
Keras' "shuffle=True ... will be ignored" for our datasets, TensorFlow's retracing warning
after a few private models (the interaction probe), TensorFlow's INFO lines while a
launcher exports.
"""

import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
NOISE = ("Error occurred when finalizing GeneratorDataset iterator",
         "Python interpreter state is not initialized",
         "`shuffle=True` was passed, but will be ignored",
         "triggered tf.function retracing",
         "Sharding callback duration",
         "INFO:tensorflow:")

SCRIPT = textwrap.dedent("""
    import keras, numpy as np, tf_dpnsgd
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x, y = x[:400] / 16, y[:400]
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    for i in range(6):  # the README's example, six times in one process (a notebook)
      model = tf_dpnsgd.make_private(
          keras.Sequential([keras.Input((64,)), keras.layers.Dense(10)]),
          target_epsilon=4.0, delta=1e-5, batch_size=64, epochs=1)
      model.compile(optimizer=tf_dpnsgd.DPNSGD(learning_rate=0.5, regularizer=0.01),
                    loss=loss, metrics=["accuracy"])
      model.fit(x, y, verbose=0)
    # The explicit path on a dataset of the plan's batches.
    plan = tf_dpnsgd.PrivacyPlan(dataset_size=400, batch_size=64, sampling="poisson",
                                 epochs=1, noise_multiplier=1.0, delta=1e-5)
    inp = keras.Input((64,))
    model = tf_dpnsgd.make_private(keras.Model(inp, keras.layers.Dense(10)(inp)))
    model.compile(optimizer=tf_dpnsgd.DPSGD(learning_rate=0.5, l2_norm_clip=1.0,
                                            noise_multiplier=1.0), loss=loss)
    model.fit(plan.dataset(x, y, model=model), callbacks=plan.callbacks(), verbose=0,
              **plan.fit_kwargs(model))
    print("steps", model.privacy_ledger.steps)
    """)


def _noise(stderr):
  return [line for line in stderr.splitlines() if any(n in line for n in NOISE)]


@pytest.mark.slow
def test_readme_example_and_the_explicit_path_log_no_noise():
  out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                       timeout=600, env=ENV, cwd=ROOT)
  assert out.returncode == 0, out.stderr[-3000:]
  assert "steps 6" in out.stdout
  assert _noise(out.stderr) == []


@pytest.mark.slow
def test_a_launcher_run_with_export_logs_no_noise(tmp_path):
  out = subprocess.run(
      [sys.executable, "-m", "tf_dpnsgd.launch.quickstart", "--epochs=1",
       f"--model_dir={tmp_path / 'run'}", f"--export_dir={tmp_path / 'export'}"],
      capture_output=True, text=True, timeout=600, env=ENV, cwd=ROOT)
  assert out.returncode == 0, out.stderr[-3000:]
  assert "SavedModel:" in out.stdout and "epoch   1" in out.stdout
  assert _noise(out.stderr) == []
