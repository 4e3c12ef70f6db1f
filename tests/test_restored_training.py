"""What trains is part of the privacy state: a reload cannot silently change it (issue 48.1).

Keras merges LoRA factors into the kernels when it saves a ``.keras`` file, and skips an
optimizer state whose variables do not match (a warning). A keras-hub backbone's LoRA is
not in its config, so a LoRA model reloaded from ``.keras`` would train every kernel with a
fresh optimizer. The ledger records what each step updated (shapes and dtypes of the
trainable variables, their count and size); after ``load_model`` the next ``fit`` is
refused until what trains matches the ledger or the user compiles again (accepting the
model as it is). The oracle is the model's own variable list, read by the test.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest

import tf_dpnsgd
from tf_dpnsgd import ledger as ledger_lib

import fixtures
import matrix_fixtures

N, B, SEQ = 32, 8, 6


Interrupt, StopAt = fixtures.Interrupt, fixtures.InterruptAt


def _text_data():
  rng = np.random.default_rng(0)
  ids = rng.integers(5, len(fixtures.TINY_VOCAB), (N, SEQ)).astype("int32")
  x = {"token_ids": ids, "segment_ids": np.zeros_like(ids),
       "padding_mask": np.ones_like(ids)}
  return x, (np.arange(N) % 2).astype("int32")


def _lora_classifier():
  keras_hub = pytest.importorskip("keras_hub")
  keras.utils.set_random_seed(1)
  backbone = fixtures.tiny_bert_backbone(max_sequence_length=SEQ)
  classifier = keras_hub.models.BertTextClassifier(backbone=backbone, num_classes=2,
                                                   preprocessor=None, dropout=0.0)
  backbone.enable_lora(2)
  return classifier


def _compile(model):
  model.compile(optimizer=tf_dpnsgd.DPSGD(learning_rate=0.1, l2_norm_clip=1.0, momentum=0.9),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))


def _trained_lora_model(tmp_path):
  model = tf_dpnsgd.make_private(_lora_classifier(), noise_multiplier=1.0, delta=1e-5,
                                 batch_size=B, epochs=2)
  _compile(model)
  trainable = ledger_lib.trainable_signature(model.trainable_variables)
  x, y = _text_data()
  with pytest.raises(Interrupt):
    model.fit(x, y, verbose=0, callbacks=[StopAt(3)])
  assert model.privacy_ledger.trained_signature == trainable  # what the steps updated
  model.save(tmp_path / "lora.keras")
  return model, trainable


@pytest.mark.slow
def test_a_reloaded_lora_model_does_not_silently_train_whole_kernels(tmp_path):
  model, trainable = _trained_lora_model(tmp_path)
  loaded = keras.models.load_model(tmp_path / "lora.keras")
  now = ledger_lib.trainable_signature(loaded.trainable_variables)
  assert now[2] > trainable[2]  # the merged kernels are trainable: Keras dropped the LoRA
  weights = [w.copy() for w in loaded.get_weights()]
  x, y = _text_data()
  with pytest.raises(ledger_lib.LedgerMismatchError, match="what trains changed"):
    loaded.fit(x, y, verbose=0)
  assert loaded.privacy_ledger.steps == 3
  for a, b in zip(weights, loaded.get_weights()):
    np.testing.assert_array_equal(a, b)
  # The fix the message names: LoRA again on the same layers, then the user's compile.
  backbone = [layer for layer in loaded._flatten_layers() if hasattr(layer, "enable_lora")
              and hasattr(layer, "token_embedding")]
  backbone[0].enable_lora(2)
  _compile(loaded)
  assert ledger_lib.trainable_signature(loaded.trainable_variables) == trainable
  loaded.fit(x, y, verbose=0)
  assert loaded.privacy_ledger.steps == loaded.privacy_plan.num_steps
  assert loaded.privacy_ledger.trained_signature == trainable


def _dense_model():
  keras.utils.set_random_seed(2)
  return keras.Sequential([keras.Input((5,)), keras.layers.Dense(4, activation="tanh"),
                           keras.layers.Dense(3)])


@pytest.fixture(scope="module")
def trained_dense_once(tmp_path_factory):
  """The dense model trained 3 of its 8 steps and saved as ``m.keras``, ONCE for the module
  (tests/matrix_fixtures.py); each test reloads the file after ``resume_after_the_save``."""
  once = matrix_fixtures.TrainedOnce(tmp_path_factory.mktemp("dense"))
  with once.training():
    base = _dense_model()
    model = tf_dpnsgd.make_private(base, noise_multiplier=1.0, delta=1e-5, batch_size=B,
                                   epochs=2)
    _compile(model)
    x, y = fixtures.tiny_data(N)
    with pytest.raises(Interrupt):
      model.fit(x, y, verbose=0, callbacks=[StopAt(3)])
    model.save(once.folder / "m.keras")
  once.saved(model)
  return once


def _trained_dense(once):
  """``(x, y, file)``: the data and the dense model's ``.keras`` file at step 3, this process
  and machine as right after its save."""
  once.resume_after_the_save()
  return (*fixtures.tiny_data(N), once.folder / "m.keras")


def test_a_reload_with_the_same_trainable_set_and_optimizer_continues(trained_dense_once):
  x, y, path = _trained_dense(trained_dense_once)
  loaded = keras.models.load_model(path)
  loaded.fit(x, y, verbose=0)
  assert loaded.privacy_ledger.steps == loaded.privacy_plan.num_steps


def test_a_reload_whose_trainable_set_changed_is_refused_until_the_user_compiles(
    trained_dense_once):
  x, y, path = _trained_dense(trained_dense_once)
  loaded = keras.models.load_model(path)
  inner = [layer for layer in loaded._flatten_layers() if isinstance(layer, keras.layers.Dense)]
  inner[0].trainable = False  # e.g. a frozen layer that the saved steps trained
  with pytest.raises(ledger_lib.LedgerMismatchError, match="what trains changed"):
    loaded.fit(x, y, verbose=0)
  assert loaded.privacy_ledger.steps == 3
  _compile(loaded)  # the user's compile accepts the model as it is
  loaded.fit(x, y, verbose=0)
  assert loaded.privacy_ledger.trained_signature[1] == 2  # only the last layer's kernel and bias


def test_an_optimizer_state_keras_skipped_is_not_silently_restarted(trained_dense_once):
  x, y, path = _trained_dense(trained_dense_once)
  loaded = keras.models.load_model(path)
  loaded.optimizer.iterations.assign(0)  # what Keras leaves when it skips the saved state
  with pytest.raises(ledger_lib.LedgerMismatchError, match="optimizer's state was not"):
    loaded.fit(x, y, verbose=0)
  assert loaded.privacy_ledger.steps == 3


# --- issue 48.3: the report names weights the ledger did not see -------------------------
def _warm_start_items(model):
  return [item for item in model.privacy_report().not_covered if "Warm start" in item]


def _backbone_model():
  pytest.importorskip("keras_hub")
  backbone = fixtures.tiny_bert_backbone(max_sequence_length=SEQ)
  return keras.Model(backbone.input,
                     keras.layers.Dense(2)(backbone.output["pooled_output"]))


@pytest.mark.parametrize("pretrained,expected", [
    (None, "initial weights of 2 keras-hub layers"),  # from_preset, undeclared
    ("my_bert_folder", "pretrained weights 'my_bert_folder'"),
    (False, None)])
def test_a_keras_hub_backbone_s_weights_are_named_on_the_library_path(pretrained, expected):
  model = tf_dpnsgd.make_private(_backbone_model(), pretrained=pretrained, noise_multiplier=1.0,
                                 delta=1e-5, batch_size=B, epochs=1, dataset_size=N)
  _compile(model)
  items = _warm_start_items(model)
  if expected is None:
    assert items == []
  else:
    assert len(items) == 1 and expected in items[0], items


def test_a_model_declares_its_preset_and_a_plain_model_is_not_called_pretrained():
  declared = _dense_model()
  declared.dp_pretrained_source = "keras-hub preset ./bert_tiny"  # models.text_classifier's
  model = tf_dpnsgd.make_private(declared, noise_multiplier=1.0, delta=1e-5, batch_size=B,
                                 epochs=1, dataset_size=N)
  _compile(model)
  assert "keras-hub preset ./bert_tiny" in _warm_start_items(model)[0]
  plain = tf_dpnsgd.make_private(_dense_model(), noise_multiplier=1.0, delta=1e-5,
                                 batch_size=B, epochs=1, dataset_size=N)
  _compile(plain)
  assert _warm_start_items(plain) == []
  with pytest.raises(TypeError, match="pretrained"):
    tf_dpnsgd.make_private(_dense_model(), pretrained=True)
