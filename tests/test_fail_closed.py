"""Issue 19: privacy state that cannot be forked, rolled back or bypassed.

Each test runs, through the public API, a sequence from the second adversarial
review that used to make the printed epsilon cover fewer steps than the
weights went through, or made noise repeat; each now ends refused or with a
ledger that counts every executed step. Oracles are independent of the code
under test: step counts we drove ourselves, update vectors we recorded, and
dp-accounting's own epsilon.
"""

import os
import sys
import textwrap

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dpnsgd
from tf_dpnsgd.ledger import LedgerMismatchError
from tf_dpnsgd.plan import PrivacyPlan

import tiers
import zygote  # children forked from a pre-imported process (tests/zygote.py)

N, B, DELTA = 40, 8, 1e-5
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def toy_data(n=N, seed=0):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(n, 3)).astype("float32")
  return x, (x[:, 0] > 0).astype("int32")


def base_model(seed=0, use_bias=True):
  keras.utils.set_random_seed(seed)
  inp = keras.Input((3,))
  hidden = keras.layers.Dense(4, name="body", use_bias=use_bias)(inp)
  return keras.Model(inp, keras.layers.Dense(2, name="head", use_bias=use_bias)(hidden))


def compile_(model, sigma=1.0, lr=0.1, momentum=0.0, seed=None):
  model.compile(optimizer=tf_dpnsgd.DPSGD(learning_rate=lr, l2_norm_clip=1.0, momentum=momentum,
                                          noise_multiplier=sigma, seed=seed), loss=LOSS)
  return model


def plan_(sampling="poisson", steps=100, seed=None):
  return PrivacyPlan(dataset_size=N, batch_size=B, sampling=sampling, steps=steps,
                     noise_multiplier=1.0, delta=DELTA, seed=seed)


def fit_steps(model, plan, x, y, steps, **kwargs):
  model.fit(plan.dataset(x, y, model=model), steps_per_epoch=steps, epochs=1, verbose=0,
            **kwargs)


def weights(model):
  return [w.numpy().copy() for w in model.trainable_weights]


# --- scenario 1: make_private twice on one Keras model -----------------------------
@pytest.mark.slow
def test_a_second_make_private_of_the_same_model_continues_the_first_ledger():
  x, y = toy_data()
  plan = plan_()
  base = base_model()
  head_only = compile_(tf_dpnsgd.make_private(base))
  base.get_layer("body").trainable = False  # phase 1: the head
  fit_steps(head_only, plan, x, y, 4)
  assert head_only.privacy_ledger.steps == 4

  base.get_layer("body").trainable = True  # phase 2: all layers, a new wrapper
  everything = compile_(tf_dpnsgd.make_private(base))
  assert everything.privacy_ledger.steps == 4  # before the fix: 0 (the first phase vanished)
  assert everything.privacy_ledger is head_only.privacy_ledger  # one ledger, not a restored copy
  first = next(iter(plan.dataset(x, y, model=everything)))
  assert int(first[2]["dp_step"][0]) == 4  # the stream does not replay phase 1's batches
  with pytest.raises(LedgerMismatchError, match="replayed or skipped"):
    everything.fit(plan.dataset(x, y), steps_per_epoch=1, epochs=1, verbose=0)
  fit_steps(everything, plan, x, y, 3)
  assert plan.report(everything).steps == 7
  assert plan.report(everything).epsilon == pytest.approx(plan.epsilon(7))


# --- scenario 2: the user's own file of the wrapped model -----------------------------
def test_weights_reloaded_without_their_ledger_get_it_back(tmp_path):
  x, y = toy_data()
  plan = plan_()
  base = base_model()
  private = compile_(tf_dpnsgd.make_private(base))
  fit_steps(private, plan, x, y, 6)
  path = str(tmp_path / "base.keras")
  base.save(path)  # the plain Keras model: no DP wrapper in the file's config

  reloaded = keras.models.load_model(path)
  again = compile_(tf_dpnsgd.make_private(reloaded))
  assert again.privacy_ledger.steps == 6  # before the fix: a fresh ledger at 0
  assert plan.report(again).epsilon == pytest.approx(plan.epsilon(6))


@pytest.mark.slow
def test_weights_reloaded_in_a_new_process_get_their_ledger_back(tmp_path):
  """The same through two real processes sharing only the files on this machine."""
  x, y = toy_data()
  plan = plan_()
  base = base_model()
  private = compile_(tf_dpnsgd.make_private(base))
  fit_steps(private, plan, x, y, 5)
  path = str(tmp_path / "base.keras")
  base.save(path)
  script = textwrap.dedent(f"""
      import os
      os.environ["KERAS_BACKEND"] = "tensorflow"
      import keras, tf_dpnsgd
      base = keras.models.load_model({path!r})
      print("STEPS", tf_dpnsgd.make_private(base).privacy_ledger.steps)
  """)
  out = zygote.run([sys.executable, "-c", script], capture_output=True, text=True,
                   env=dict(os.environ), timeout=300)
  assert "STEPS 5" in out.stdout, out.stderr[-2000:]


# --- scenario 3: a shuffle run resumed with a new sampler seed ------------------------
@pytest.mark.slow
def test_resuming_a_shuffle_run_with_a_new_seed_is_refused(tmp_path):
  x, y = toy_data()
  first = plan_("shuffle", seed=11)
  model = compile_(tf_dpnsgd.make_private(base_model()))
  fit_steps(model, first, x, y, 2)  # mid-epoch: 5 steps per epoch
  path = str(tmp_path / "mid.weights.h5")
  model.save_weights(path)

  resumed = compile_(tf_dpnsgd.make_private(base_model(seed=1)))
  resumed.load_weights(path)
  assert resumed.privacy_ledger.steps == 2
  fresh = plan_("shuffle")  # the README's resume in a new process: a fresh OS seed
  # The oracle: the new permutation would repeat examples the first one already used.
  used = np.concatenate([first.sampler.indices(t) for t in range(2)])
  rest = np.concatenate([fresh.sampler.indices(t) for t in range(2, 5)])
  assert np.intersect1d(used, rest).size > 0
  with pytest.raises(LedgerMismatchError, match="another seed"):
    fit_steps(resumed, fresh, x, y, 1)
  assert resumed.privacy_ledger.steps == 2
  fit_steps(resumed, plan_("shuffle", seed=11), x, y, 3)  # the original seed continues
  assert resumed.privacy_ledger.steps == 5
  fit_steps(resumed, plan_("shuffle"), x, y, 2)  # a new epoch may start with a new seed
  assert resumed.privacy_ledger.steps == 7


@pytest.mark.slow
def test_poisson_steps_are_independent_so_a_fresh_seed_may_resume():
  x, y = toy_data()
  model = compile_(tf_dpnsgd.make_private(base_model()))
  fit_steps(model, plan_("poisson"), x, y, 2)
  fit_steps(model, plan_("poisson"), x, y, 2)  # another seed, same sampler otherwise
  assert model.privacy_ledger.steps == 4


# --- scenario 6: untagged batches from the user's own pipeline --------------------------
def oversampling_pipeline(x, y):
  """A rare-class oversampler: example 0 appears 7 times in the first batch."""
  idx = np.concatenate([np.zeros(7, np.int64), np.arange(1, N)])
  return tf.data.Dataset.from_tensor_slices((x[idx], y[idx])).batch(B)


def test_untagged_batches_of_a_user_pipeline_are_refused_before_any_step():
  x, y = toy_data()
  model = compile_(tf_dpnsgd.make_private(base_model()))
  before = weights(model)
  with pytest.raises(LedgerMismatchError, match="no sampler tags"):
    model.fit(oversampling_pipeline(x, y), epochs=1, verbose=0)
  assert model.privacy_ledger.steps == 0
  for a, b in zip(before, weights(model)):
    np.testing.assert_array_equal(a, b)
  with pytest.raises(LedgerMismatchError, match="no sampler tags"):
    model.train_on_batch(x[:B], y[:B])  # a user batch: nothing says how it was drawn


@pytest.mark.slow
def test_untagged_batches_need_an_explicit_opt_in_that_the_ledger_records():
  x, y = toy_data()
  model = compile_(tf_dpnsgd.make_private(base_model(), trust_untagged_batches=True))
  model.fit(oversampling_pipeline(x, y), epochs=1, verbose=0)
  assert model.privacy_ledger.steps == 6  # 46 rows in batches of 8
  assert model.privacy_ledger.flags & tf_dpnsgd.coverage.UNVERIFIED_BATCHES
  report = plan_("shuffle").report(model)
  assert any("at most once per batch" in item for item in report.not_covered)


def test_keras_batching_of_in_memory_arrays_is_accepted_and_unflagged():
  x, y = toy_data()
  model = compile_(tf_dpnsgd.make_private(base_model()))
  model.fit(x, y, batch_size=B, epochs=1, verbose=0)
  assert model.privacy_ledger.steps == 5 and model.privacy_ledger.kind == "untagged"
  assert model.privacy_ledger.flags == 0


# --- scenario 7: rolling back in the same process -------------------------------------
def pure_noise_model(seed=None):
  """Zero inputs, no bias: every update is exactly -lr * noise / B."""
  return compile_(tf_dpnsgd.make_private(base_model(use_bias=False)), sigma=3.0, lr=1.0,
                  seed=seed)


def step_updates(model, plan, x, y, steps):
  out = []
  for _ in range(steps):
    before = weights(model)[-1]
    fit_steps(model, plan, x, y, 1)
    out.append(weights(model)[-1] - before)
  return out


@pytest.mark.slow
@pytest.mark.parametrize("user_seed", [None, 5])
def test_load_weights_of_an_earlier_checkpoint_never_repeats_noise_nor_uncounts(tmp_path,
                                                                                user_seed):
  x = np.zeros((N, 3), np.float32)
  y = np.zeros(N, np.int32)
  plan = plan_("uniform")
  model = pure_noise_model(user_seed)
  model.get_layer("body").trainable = False  # only the head moves: its update is the noise
  fit_steps(model, plan, x, y, 3)
  path = str(tmp_path / "step3.weights.h5")
  model.save_weights(path)
  first_branch = step_updates(model, plan, x, y, 4)  # steps 3..6
  assert model.privacy_ledger.steps == 7

  model.load_weights(path)  # roll back to step 3
  assert model.privacy_ledger.steps == 7  # the ledger keeps what the lineage executed
  assert model.privacy_ledger.noise_generation == 1
  second_branch = step_updates(model, plan, x, y, 4)
  for a in first_branch:
    for b in second_branch:
      assert not np.allclose(a, b, atol=1e-6)  # before the fix: equal, draw for draw
  assert plan.report(model).steps == 11


def test_backup_and_restore_after_an_interrupted_fit_keeps_every_step(tmp_path):
  x, y = toy_data()
  plan = plan_("poisson")
  model = compile_(tf_dpnsgd.make_private(base_model()))

  class Interrupt(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
      if model.privacy_ledger.steps == 5:
        raise RuntimeError("preempted")

  backup = keras.callbacks.BackupAndRestore(str(tmp_path / "backup"))
  with pytest.raises(RuntimeError, match="preempted"):
    model.fit(plan.dataset(x, y, model=model), steps_per_epoch=2, epochs=4, verbose=0,
              callbacks=[backup, Interrupt()])
  assert model.privacy_ledger.steps == 5  # the backup holds step 4 (end of epoch 2)
  model.fit(plan.dataset(x, y, model=model), steps_per_epoch=2, epochs=4, verbose=0,
            callbacks=[keras.callbacks.BackupAndRestore(str(tmp_path / "backup"))])
  ledger = model.privacy_ledger
  assert ledger.noise_generation >= 1
  # Epochs 3 and 4 ran after the restore: 2 x 2 steps on top of the 5 executed.
  assert ledger.steps == 9
  assert plan.report(model).steps == 9


def test_tf_train_checkpoint_restore_is_seen_at_the_next_step(tmp_path):
  x, y = toy_data()
  plan = plan_()
  model = compile_(tf_dpnsgd.make_private(base_model()))
  fit_steps(model, plan, x, y, 2)
  checkpoint = tf.train.Checkpoint(model=model)
  path = checkpoint.save(str(tmp_path / "ckpt"))
  fit_steps(model, plan, x, y, 3)
  checkpoint.restore(path)
  assert int(model.privacy_ledger._vars["steps"].numpy()) == 2  # Keras-free restore...
  fit_steps(model, plan, x, y, 1)
  assert model.privacy_ledger.steps == 6  # ... seen before the step: 5 executed + 1
  assert model.privacy_ledger.noise_generation == 1


@pytest.mark.slow
def test_a_fresh_process_sees_a_rollback_through_the_lineage_record(tmp_path):
  x, y = toy_data()
  plan = plan_()
  model = compile_(tf_dpnsgd.make_private(base_model()))
  fit_steps(model, plan, x, y, 2)
  path = str(tmp_path / "early.weights.h5")
  model.save_weights(path)
  fit_steps(model, plan, x, y, 3)
  tf_dpnsgd.ledger._PROCESS_REACHED.clear()  # what a new process knows: only the files
  other = compile_(tf_dpnsgd.make_private(base_model(seed=3)))
  other.load_weights(path)
  assert other.privacy_ledger.steps == 5
  assert other.privacy_ledger.noise_generation == 1


# --- Keras habits that keep working -----------------------------------------------------
def test_weights_move_between_a_private_model_and_its_plain_twin(tmp_path):
  x, y = toy_data()
  plan = plan_()
  private = compile_(tf_dpnsgd.make_private(base_model()))
  fit_steps(private, plan, x, y, 3)
  plain = base_model(seed=7)
  plain.set_weights(private.get_weights())
  private.set_weights(plain.get_weights())
  plain_path = str(tmp_path / "plain.weights.h5")
  plain.save_weights(plain_path)
  private.load_weights(plain_path)  # a warm start from a plain checkpoint
  assert private.privacy_ledger.steps == 3  # the ledger stays: set_weights is by hand
  fresh = compile_(tf_dpnsgd.make_private(base_model(seed=8)))
  fresh.load_weights(plain_path)
  assert fresh.privacy_ledger.steps == 0
  for a, b in zip(fresh.get_weights(), plain.get_weights()):
    np.testing.assert_array_equal(a, b)


# quick tier: the .keras file (every path x model kind: test_save_paths_matrix.py, CI)
@pytest.mark.parametrize("how", tiers.quick_only(["keras", "weights", "checkpoint"], ["keras"]))
def test_the_ledger_travels_with_every_save_path(tmp_path, how):
  x, y = toy_data()
  plan = plan_("uniform")
  model = compile_(tf_dpnsgd.make_private(base_model()))
  fit_steps(model, plan, x, y, 4)
  if how == "keras":
    model.save(str(tmp_path / "m.keras"))
    loaded = keras.models.load_model(str(tmp_path / "m.keras"))
  elif how == "weights":
    model.save_weights(str(tmp_path / "m.weights.h5"))
    loaded = compile_(tf_dpnsgd.make_private(base_model(seed=2)))
    loaded.load_weights(str(tmp_path / "m.weights.h5"))
  else:
    path = tf.train.Checkpoint(model=model).save(str(tmp_path / "ck"))
    loaded = compile_(tf_dpnsgd.make_private(base_model(seed=2)))
    tf.train.Checkpoint(model=loaded).restore(path).expect_partial()
  loaded.privacy_ledger.sync()
  assert loaded.privacy_ledger.steps == 4
  assert loaded.privacy_ledger.sampler_seed_hash == plan.sampler.seed_hash


# --- scenario 5: tokens folded into the batch axis, under XLA ---------------------------
def token_folding_model(T=4, D=3):
  keras.utils.set_random_seed(0)
  inp = keras.Input((T, D))
  h = keras.layers.Lambda(lambda t: tf.reshape(t, [-1, D]))(inp)  # [B*T, D]: tokens as rows
  h = keras.layers.Dense(2, name="tok")(h)
  out = keras.layers.Lambda(lambda t: tf.reduce_sum(tf.reshape(t, [-1, T, 2]), axis=1))(h)
  return tf_dpnsgd.DPModel(inp, out, per_example="layerwise")


@pytest.mark.parametrize("jit_compile", [False, True])
def test_tokens_folded_into_the_batch_axis_are_refused_also_under_xla(jit_compile):
  T, D = 4, 3
  x = np.random.default_rng(0).normal(size=(10, T, D)).astype("float32") * 100
  y = np.zeros(10, np.int32)
  model = token_folding_model(T, D)
  model.compile(optimizer=tf_dpnsgd.DPSGD(learning_rate=1.0, l2_norm_clip=1.0,
                                          noise_multiplier=0.0), loss=LOSS,
                jit_compile=jit_compile)
  # The oracle, by hand: the example's kernel gradient is sum_t outer(x_t, delta) (delta =
  # dLoss/dlogits, the same for every token); clipping each TOKEN term to 1 and summing, as
  # an engine that took rows for examples would, moves the sum by more than the clip.
  logits = tf.constant(model(x[:1]))
  with tf.GradientTape() as tape:
    tape.watch(logits)
    loss = LOSS(y[:1], logits)
  delta = tape.gradient(loss, logits).numpy()[0]
  terms = [np.outer(x[0, t], delta) for t in range(T)]
  clipped = sum(term * min(1.0, 1.0 / np.linalg.norm(term)) for term in terms)
  assert np.linalg.norm(clipped) > 1.2  # one example moves the sum by more than the clip (1)
  before = [w.copy() for w in model.get_weights()]
  with pytest.raises(tf_dpnsgd.per_example.UnsupportedLayerError, match="first axis"):
    model.fit(x, y, batch_size=3, epochs=1, verbose=0, shuffle=False)
  assert model.privacy_ledger.steps == 0
  for a, b in zip(before, model.get_weights()):
    np.testing.assert_array_equal(a, b)
