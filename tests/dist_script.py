"""Subprocess body of tests/test_distribute.py and tests/test_multiworker.py (not a test).

``python tests/dist_script.py MODE OUT``; MODE is ``single`` (no strategy),
``mirrored`` (MirroredStrategy over 2 logical CPUs) or ``worker``
(MultiWorkerMirroredStrategy from TF_CONFIG, CPU ring collectives). For every
sampling kind it trains

* ``data``: a small model at noise 0 on real data (B = 15, so 2 replicas need a
  padding row; example 0 is scaled to 1e6, so a padding row, which repeats
  index 0, would show if it contributed), and saves the weights;
* ``noise``: a model whose data gradient is exactly 0 (zero inputs, no bias)
  at sigma = 2 with an OS noise key, so ``w_T - w_0`` is the noise alone, and
  saves that difference.

Writes ``OUT`` (npz) with the weights, the noise differences, the ledger steps
and kinds.
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

MODE, OUT = sys.argv[1], sys.argv[2]
if MODE == "mirrored":
  cpu = tf.config.list_physical_devices("CPU")[0]
  tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)

import keras  # noqa: E402
import tf_dpnsgd  # noqa: E402

from dist_checks import B, CLIP, N, SAMPLINGS, SIGMA, STEPS, UNITS  # noqa: E402

if MODE == "single":
  strategy = tf.distribute.get_strategy()
elif MODE == "mirrored":
  strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
elif MODE == "worker":
  strategy = tf.distribute.MultiWorkerMirroredStrategy(
      communication_options=tf.distribute.experimental.CommunicationOptions(
          implementation=tf.distribute.experimental.CommunicationImplementation.RING))
else:
  raise ValueError(MODE)

rng = np.random.default_rng(0)
x = rng.normal(size=(N, 5)).astype("float32")
x[0] *= 1e6
y = rng.integers(0, 2, N).astype("int32")
loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
out = {"replicas": strategy.num_replicas_in_sync}

for sampling in SAMPLINGS:
  # --- noise 0 on real data -------------------------------------------------
  plan = tf_dpnsgd.PrivacyPlan(dataset_size=N, batch_size=B, sampling=sampling, steps=STEPS,
                               noise_multiplier=1.0, delta=1e-5, seed=3)
  with strategy.scope():
    keras.utils.set_random_seed(0)
    inp = keras.Input((5,))
    model = tf_dpnsgd.DPModel(inp, keras.layers.Dense(2)(inp))
    model.compile(optimizer=tf_dpnsgd.DPSGD(learning_rate=0.5, l2_norm_clip=0.3,
                                            noise_multiplier=0.0),
                  loss=loss)
  # Validation and evaluate run Keras' test step, whose logs the multi-worker
  # reduction needs at rank 1 like the train step's.
  val = tf.data.Dataset.from_tensor_slices((x[1:17], y[1:17])).batch(8)
  seen = []

  def halve(x_i, y_i, seed, seen=seen):  # a per-example augmentation, inside each pipeline
    seen.append(1)  # once per trace: one per input pipeline
    return x_i * 0.5

  stream = plan.dataset(x, y, model=model, augment=halve)
  # Under the one-process strategy: one input pipeline per replica (what is compared below
  # is that it trains exactly like one process); elsewhere one global tf.data stream.
  out[f"{sampling}_per_replica_pipelines"] = not isinstance(stream, tf.data.Dataset)
  out[f"{sampling}_augment_traces"] = len(seen)
  model.fit(stream, verbose=0, validation_data=val, **plan.fit_kwargs(model))
  out[f"{sampling}_data_eval"] = model.evaluate(val, verbose=0, return_dict=True)["loss"]
  for i, w in enumerate(model.get_weights()):
    out[f"{sampling}_data_{i}"] = w
  out[f"{sampling}_data_steps"] = model.privacy_ledger.steps
  out[f"{sampling}_data_kind"] = model.privacy_ledger.kind

  # --- noise only: zero inputs, no bias => every per-example gradient is 0 ------
  plan = tf_dpnsgd.PrivacyPlan(dataset_size=N, batch_size=B, sampling=sampling,
                               steps=STEPS, noise_multiplier=SIGMA, delta=1e-5, seed=4)
  with strategy.scope():
    keras.utils.set_random_seed(1)
    inp = keras.Input((5,))
    model = tf_dpnsgd.DPModel(inp, keras.layers.Dense(UNITS, use_bias=False)(inp))
    model.compile(optimizer=tf_dpnsgd.DPSGD(learning_rate=1.0, l2_norm_clip=CLIP,
                                            noise_multiplier=SIGMA),  # OS noise key
                  loss=loss)
    model.build((None, 5))
  before = model.get_weights()[0]
  model.fit(plan.dataset(np.zeros_like(x), y % 2, model=model), verbose=0,
            **plan.fit_kwargs(model))
  out[f"{sampling}_noise_diff"] = model.get_weights()[0] - before
  out[f"{sampling}_noise_steps"] = model.privacy_ledger.steps

if MODE == "worker":
  # Adversarial: each worker's plan has its own sampler seed (worker i: seed 10 + i), so
  # the workers would draw different batches. Every worker must refuse, none may hang.
  import json  # noqa: E402
  task = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
  plan = tf_dpnsgd.PrivacyPlan(dataset_size=N, batch_size=B, sampling="poisson", steps=STEPS,
                               noise_multiplier=1.0, delta=1e-5, seed=10 + int(task))
  with strategy.scope():
    inp = keras.Input((5,))
    model = tf_dpnsgd.DPModel(inp, keras.layers.Dense(2)(inp))
  try:
    plan.dataset(x, y, model=model)
    out["mismatched_seed_refused"] = ""
  except ValueError as e:
    out["mismatched_seed_refused"] = str(e)

if MODE == "worker":
  # Issue 19, scenario 12: the cross-worker checks at the start of EVERY fit, whatever the
  # call. (a) plan.dataset(x, y) WITHOUT model= (no check there) and per-worker seeds.
  import json  # noqa: E402
  task = int(json.loads(os.environ["TF_CONFIG"])["task"]["index"])

  def fresh_model():
    with strategy.scope():
      keras.utils.set_random_seed(0)
      inp = keras.Input((5,))
      m = tf_dpnsgd.DPModel(inp, keras.layers.Dense(2)(inp))
      m.compile(optimizer=tf_dpnsgd.DPSGD(learning_rate=0.1, l2_norm_clip=1.0,
                                          noise_multiplier=1.0),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
      m.build((None, 5))
    return m

  def refusal(trained, plan, **kw):
    try:
      trained.fit(plan.dataset(x, y, **kw), steps_per_epoch=1, epochs=1, verbose=0)
      return ""
    except ValueError as e:
      return str(e)

  own_seed = tf_dpnsgd.PrivacyPlan(dataset_size=N, batch_size=B, sampling="poisson",
                                   steps=STEPS, noise_multiplier=1.0, delta=1e-5,
                                   seed=20 + task)
  model = fresh_model()
  out["fit_seed_refused"] = refusal(model, own_seed)
  out["fit_seed_steps"] = model.privacy_ledger.steps
  # (b) workers resuming from different checkpoints (no shared model_dir): worker 1 holds
  # a ledger 2 steps ahead, written by a single-device run of the same architecture.
  shared = tf_dpnsgd.PrivacyPlan(dataset_size=N, batch_size=B, sampling="poisson",
                                 steps=STEPS, noise_multiplier=1.0, delta=1e-5, seed=33)
  if task == 1:
    keras.utils.set_random_seed(0)
    inp = keras.Input((5,))
    alone = tf_dpnsgd.DPModel(inp, keras.layers.Dense(2)(inp))
    alone.compile(optimizer=tf_dpnsgd.DPSGD(learning_rate=0.1, l2_norm_clip=1.0,
                                            noise_multiplier=1.0),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    alone.fit(shared.dataset(x, y, model=alone), steps_per_epoch=2, epochs=1, verbose=0)
    alone.save_weights(OUT + ".ahead.weights.h5")
  model = fresh_model()
  if task == 1:
    model.load_weights(OUT + ".ahead.weights.h5")
  out["fit_ledger_refused"] = refusal(model, shared, model=model)
  out["fit_ledger_steps"] = model.privacy_ledger.steps

np.savez(OUT, **out)
print("DONE", flush=True)
