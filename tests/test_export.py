"""SavedModel exports reproduce the in-memory model and never hold optimizer state."""

import json
import os
import platform

import keras
import numpy as np
import pytest
import tensorflow as tf

import fixtures
import tf_dpnsgd
from tf_dpnsgd import export
from tf_dpnsgd.data import cifar10

MEAN, STD = (0.5, 0.4, 0.3), (0.25, 0.2, 0.3)


def _dp_optimizer():
  return tf_dpnsgd.DPNSGD(learning_rate=0.1, regularizer=0.1, noise_multiplier=1.0, seed=1234)


def _trained_image_model():
  """A tiny CNN after two DP steps (so its optimizer holds dp_noise_seed)."""
  model = tf_dpnsgd.make_private(fixtures.tiny_image_model())
  model.compile(optimizer=_dp_optimizer(),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  rng = np.random.default_rng(0)
  pixels = rng.integers(0, 256, (8, 8, 8, 3)).astype(np.uint8)
  model.fit(np.asarray(cifar10.normalize(pixels, MEAN, STD)), rng.integers(0, 3, 8),
            batch_size=4, verbose=0)
  return model


def test_image_export_matches_in_memory_model_on_raw_pixels(tmp_path):
  model = _trained_image_model()
  export_dir = export.export_image_classifier(model, tmp_path / "cifar", MEAN, STD)

  pixels = np.random.default_rng(1).integers(0, 256, (5, 8, 8, 3)).astype(np.uint8)
  logits = np.asarray(model(cifar10.normalize(pixels, MEAN, STD), training=False))
  loaded = tf.saved_model.load(export_dir)
  for name, images in (("serving_default", tf.constant(pixels, tf.float32)),
                       ("serving_uint8", tf.constant(pixels))):
    out = loaded.signatures[name](images=images)
    np.testing.assert_allclose(out["logits"].numpy(), logits, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out["probabilities"].numpy(),
                               tf.nn.softmax(logits).numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(out["class_ids"].numpy(), logits.argmax(-1))


@pytest.mark.slow
def test_export_holds_no_optimizer_state(tmp_path):
  model = _trained_image_model()
  export_dir = export.export_image_classifier(model, tmp_path / "cifar", MEAN, STD)
  names = set(export.exported_variable_names(export_dir))
  assert names == {v.path for v in model.variables}  # the weights, and nothing else
  assert not any("dp_noise" in n or n.startswith("dpnsgd/") for n in names)
  loaded_names = {v.name for v in tf.saved_model.load(export_dir).variables}
  assert not any("dp_noise" in n for n in loaded_names)


def test_optimizer_state_check_catches_a_leak(tmp_path):
  model = _trained_image_model()
  module = tf.Module()
  module.seed = tf.Variable([1234, 0x5EED], dtype=tf.int64, name="dpnsgd/dp_noise_seed")
  tf.saved_model.save(module, str(tmp_path / "leaky"))
  with pytest.raises(RuntimeError, match=r"optimizer state \['dpnsgd/dp_noise_seed'\]"):
    export.check_no_optimizer_state(tmp_path / "leaky")
  with pytest.raises(RuntimeError, match="must never be released"):
    export.check_no_optimizer_state(tmp_path / "leaky", model.optimizer)


def test_image_export_refuses_double_normalization_and_overwrite(tmp_path):
  model = fixtures.tiny_image_model()
  raw = cifar10.with_normalization(model, MEAN, STD)
  with pytest.raises(ValueError, match="already normalizes pixels"):
    export.export_image_classifier(raw, tmp_path / "a", MEAN, STD)
  export_dir = export.export_image_classifier(raw, tmp_path / "a", None, None)
  pixels = np.full((1, 8, 8, 3), 128.0, np.float32)
  np.testing.assert_allclose(
      tf.saved_model.load(export_dir).signatures["serving_default"](
          images=tf.constant(pixels))["logits"].numpy(),
      np.asarray(model(cifar10.normalize(pixels, MEAN, STD))), rtol=1e-5, atol=1e-6)
  with pytest.raises(FileExistsError, match="exists"):
    export.export_image_classifier(raw, tmp_path / "a", None, None)


@pytest.mark.slow
def test_text_export_takes_raw_sentences(tmp_path):
  pytest.importorskip("keras_hub")
  pytest.importorskip("tensorflow_text")
  from tf_dpnsgd.models import text

  preset = fixtures.write_tiny_bert_preset(tmp_path / "preset")
  classifier, preprocessor = text.text_classifier(preset, sequence_length=16)
  classifier.compile(optimizer=_dp_optimizer())  # an optimizer that must not be exported
  classifier.optimizer.build(classifier.trainable_variables)
  export_dir = export.export_text_classifier(classifier, preprocessor, tmp_path / "sst2")

  sentences = ["a great movie", "the plot was dull and slow .", "unknownword !"]
  logits = np.asarray(classifier(preprocessor(tf.constant(sentences)), training=False))
  out = export.load_serving_fn(export_dir)(sentences=tf.constant(sentences))
  np.testing.assert_allclose(out["logits"].numpy(), logits, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(out["probabilities"].numpy().sum(-1), 1.0, rtol=1e-6)
  np.testing.assert_array_equal(out["class_ids"].numpy(), logits.argmax(-1))
  assert not any("dp_noise" in n for n in export.exported_variable_names(export_dir))


# --- privacy report -----------------------------------------------------------------
def test_write_privacy_report_adds_versions(tmp_path):
  path = export.write_privacy_report(
      tmp_path, epsilon=np.float32(2.5), delta=1e-5, noise_multiplier=1.1, steps=np.int64(900),
      epsilon_per_epoch=[0.5, 1.0], unbounded=float("inf"), data_seed=3,
      sampling={"kind": "poisson", "rate": 0.004}, not_covered=[])
  assert path == os.path.join(tmp_path, "privacy_report.json")
  with open(path) as f:
    report = json.load(f)
  assert report["epsilon"] == pytest.approx(2.5) and report["steps"] == 900
  assert report["unbounded"] == "inf" and report["sampling"]["kind"] == "poisson"
  versions = report["versions"]
  assert versions["tensorflow"] == tf.__version__ and versions["keras"] == keras.__version__
  assert versions["tf_dpnsgd"] == tf_dpnsgd.__version__
  assert versions["python"] == platform.python_version()
  assert "dp_accounting" in versions and "keras_hub" in versions


@pytest.mark.parametrize("fields, error, match", [
    ({"seed": 0}, ValueError, "noise seed must never be released"),
    ({"optimizer": {"noise_seed": 0}}, ValueError, r"report.optimizer.noise_seed"),
    ({"versions": {}}, ValueError, "filled in"),
    ({"model": object()}, TypeError, "report.model has type object"),
    ({"epsilon": 1.0, "delta": 1e-5}, ValueError, "must say what the epsilon does not cover"),
    ({"epsilon": 1.0, "not_covered": "one string"}, TypeError, "list of sentences"),
])
def test_write_privacy_report_refuses(tmp_path, fields, error, match):
  with pytest.raises(error, match=match):
    export.write_privacy_report(tmp_path / "r.json", **fields)
  assert not (tmp_path / "r.json").exists()


# --- RNG state ------------------------------------------------------------------------
@pytest.mark.slow
def test_export_holds_no_rng_state_of_dropout(tmp_path):
  """Dropout's SeedGenerator state (derived from the run's seed) is not exported; serving
  (training=False) still reproduces the model."""
  keras.utils.set_random_seed(7)
  inputs = keras.Input((8, 8, 3), name="image")
  x = keras.layers.Conv2D(4, 3, padding="same")(inputs)
  x = keras.layers.Dropout(0.5)(keras.layers.GlobalAveragePooling2D()(x))
  x = keras.layers.Dense(8, activation="tanh")(x)
  outputs = keras.layers.Dense(3)(keras.layers.Dropout(0.3)(x))
  base = keras.Model(inputs, outputs)
  model = tf_dpnsgd.make_private(base)
  model.compile(optimizer=_dp_optimizer(),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  rng = np.random.default_rng(0)
  model.fit(rng.normal(size=(8, 8, 8, 3)).astype("float32"), rng.integers(0, 3, 8),
            batch_size=4, epochs=2, verbose=0)
  rng_state = export.rng_state_variables(model)
  assert len(rng_state) == 2 and all("seed_generator" in v.path for v in rng_state)

  # The DP model's export (it also holds the privacy ledger: counters, no seed) ...
  dp_dir = export.export_image_classifier(model, tmp_path / "dp", None, None)
  assert not any(export.RNG_STATE_VARIABLE.search(n) or n in {v.path for v in rng_state}
                 for n in export.exported_variable_names(dp_dir))
  # ... and the trained Keras model's (what the launchers export): weights only.
  export_dir = export.export_image_classifier(base, tmp_path / "dropout", None, None)
  loaded = tf.saved_model.load(export_dir)
  names = [v.name for v in loaded.variables] + export.exported_variable_names(export_dir)
  assert names and not any("seed" in n for n in names), names
  assert all(v.dtype.is_floating for v in loaded.variables)  # no int/uint RNG counters
  pixels = rng.normal(size=(5, 8, 8, 3)).astype("float32")
  logits = np.asarray(model(pixels, training=False))
  out = loaded.signatures["serving_default"](images=tf.constant(pixels))
  np.testing.assert_allclose(out["logits"].numpy(), logits, rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(out["class_ids"].numpy(), logits.argmax(-1))


def test_rng_state_check_catches_a_leak(tmp_path):
  layer = keras.layers.Dropout(0.5, seed=3)
  layer.build((None, 2))
  module = tf.Module()
  module.state = layer.seed_generator.state.value
  tf.saved_model.save(module, str(tmp_path / "leaky"))
  with pytest.raises(RuntimeError, match="RNG state"):
    export.check_no_rng_state(tmp_path / "leaky")


def _two_step_private_model():
  keras.utils.set_random_seed(0)
  inputs = keras.Input((6,), name="features")
  model = tf_dpnsgd.make_private(keras.Model(inputs, keras.layers.Dense(3)(inputs)),
                                 noise_multiplier=1.0, delta=1e-3, batch_size=8, steps=2)
  model.compile(optimizer=tf_dpnsgd.DPNSGD(learning_rate=0.1, regularizer=0.1),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  rng = np.random.default_rng(0)
  x = rng.normal(size=(32, 6)).astype("float32")
  model.fit(x, rng.integers(0, 3, 32), verbose=0)
  return model, x


def test_a_private_model_exports_on_its_own_inputs_with_its_own_report(tmp_path):
  """export_private, the library path's export (issue 48): the SavedModel on the model's own
  inputs gives the in-memory model's logits; privacy_report.json is the ledger's claim (the
  model's report: epsilon, steps, what it does not cover) plus the given fields, and neither
  file holds the secret noise seed."""
  model, x = _two_step_private_model()
  export_dir = export.export_private(model, tmp_path / "e", final_metrics={"accuracy": 0.25})
  out = export.load_serving_fn(export_dir)(features=tf.constant(x[:4]))
  logits = np.asarray(model(x[:4], training=False))
  np.testing.assert_allclose(out["logits"].numpy(), logits, rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(out["class_ids"].numpy(), logits.argmax(-1))
  with open(os.path.join(export_dir, "privacy_report.json"), encoding="utf-8") as f:
    written = json.load(f)
  own = model.privacy_report()
  assert written["steps"] == model.privacy_ledger.steps == 2
  assert written["epsilon"] == pytest.approx(own.epsilon, rel=1e-12) and own.epsilon > 0
  assert written["not_covered"] == list(own.not_covered)
  assert written["final_metrics"] == {"accuracy": 0.25} and "versions" in written
  names = export.exported_variable_names(export_dir)
  assert names and not any("dp_noise" in n or "seed" in n for n in names), names
  assert "noise_seed" not in json.dumps(written)
  with pytest.raises(FileExistsError, match="never written over"):
    export.export_private(model, export_dir)


def test_export_private_refuses_a_model_that_is_not_private(tmp_path):
  plain = keras.Sequential([keras.Input((6,)), keras.layers.Dense(3)])
  with pytest.raises(TypeError, match="make_private"):
    export.export_private(plain, tmp_path / "e")
  assert not os.path.exists(tmp_path / "e")


@pytest.mark.slow
def test_a_private_model_loaded_from_a_keras_file_exports(tmp_path):
  """Issue 31: a wrapped private model (Sequential) saved as .keras and loaded in a new
  session was never called, and Keras' export refused it; both exports work now."""
  keras.utils.set_random_seed(0)
  base = keras.Sequential([keras.Input((8, 8, 1)), keras.layers.Flatten(),
                           keras.layers.Dense(3)])
  model = tf_dpnsgd.make_private(base, noise_multiplier=1.0, delta=1e-5, batch_size=8,
                                 steps=2)
  model.compile(optimizer=tf_dpnsgd.DPNSGD(learning_rate=0.1, regularizer=0.01),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  rng = np.random.default_rng(0)
  x = rng.uniform(0, 16, size=(32, 8, 8, 1)).astype("float32")
  model.fit(x, rng.integers(0, 3, size=32), verbose=0)
  model.save(str(tmp_path / "m.keras"))
  loaded = keras.models.load_model(str(tmp_path / "m.keras"))
  expected = loaded.predict(x[:4], verbose=0)

  loaded = keras.models.load_model(str(tmp_path / "m.keras"))  # fresh: never called
  loaded.export(str(tmp_path / "plain"), verbose=False)
  restored = tf.saved_model.load(str(tmp_path / "plain"))  # kept: it owns the variables
  np.testing.assert_allclose(restored.serve(tf.constant(x[:4])), expected, rtol=1e-5,
                             atol=1e-6)

  loaded = keras.models.load_model(str(tmp_path / "m.keras"))
  export.export_image_classifier(loaded, str(tmp_path / "images"), mean=None, std=None)
  logits = export.load_serving_fn(str(tmp_path / "images"))(images=tf.constant(x[:4]))["logits"]
  np.testing.assert_allclose(logits, expected, rtol=1e-5, atol=1e-6)
