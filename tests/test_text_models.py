"""text_classifier on tiny local presets (keras-hub and Hugging Face formats), offline."""

import json
import os
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

pytest.importorskip("keras_hub")

import fixtures  # noqa: E402
import tf_dpnsgd  # noqa: E402
from tf_dpnsgd.models import text  # noqa: E402
import zygote  # children forked from a pre-imported process (tests/zygote.py)

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def bert_preset(tmp_path_factory):
  return fixtures.write_tiny_bert_preset(tmp_path_factory.mktemp("presets") / "tiny_bert")


def test_keras_preset_builds_classifier_and_preprocessor(bert_preset):
  classifier, preprocessor = text.text_classifier(bert_preset, num_classes=3, sequence_length=12)
  assert classifier.preprocessor is None
  tokens = preprocessor(tf.constant(["a great movie", "a boring film"]))
  assert set(tokens) == {"token_ids", "segment_ids", "padding_mask"}
  assert tokens["token_ids"].shape == (2, 12)
  assert classifier(tokens).shape == (2, 3)


def test_freeze_embeddings_freezes_token_position_segment_tables(bert_preset):
  classifier, _ = text.text_classifier(bert_preset, sequence_length=16)
  frozen = {layer.name for layer in classifier.backbone.layers if not layer.trainable}
  assert frozen == {"token_embedding", "position_embedding", "segment_embedding"}
  trainable = {v.path for v in classifier.trainable_variables}
  assert not any("embedding/" in path for path in trainable)  # tables excluded ...
  assert any(p.startswith("embeddings_layer_norm/") for p in trainable)  # ... not their norm
  unfrozen, _ = text.text_classifier(bert_preset, sequence_length=16, freeze_embeddings=False)
  assert len(unfrozen.trainable_variables) == len(classifier.trainable_variables) + 3


def test_freeze_roberta_token_and_position_embedding():
  import keras_hub
  backbone = keras_hub.models.RobertaBackbone(vocabulary_size=20, num_layers=1, num_heads=2,
                                              hidden_dim=8, intermediate_dim=16,
                                              max_sequence_length=8)
  assert text.freeze_input_embeddings(backbone) == ["embeddings"]
  trainable = {v.path for v in backbone.trainable_variables}
  assert not any(p.startswith("embeddings/") for p in trainable)
  assert {"embeddings_layer_norm/gamma", "embeddings_layer_norm/beta"} <= trainable


def test_hf_bert_folder_loads_offline_with_its_weights(tmp_path):
  folder, source = fixtures.write_tiny_hf_bert(tmp_path / "hf_bert")
  classifier, preprocessor = text.text_classifier(folder, sequence_length=8)
  loaded = classifier.backbone.weights
  assert len(loaded) == len(source.weights)
  for want, got in zip(source.weights, loaded):
    assert want.path.split("/", 1)[1] == got.path.split("/", 1)[1]
    np.testing.assert_array_equal(got.numpy(), want.numpy(), err_msg=got.path)
  ids = preprocessor(tf.constant(["A great movie"]))["token_ids"].numpy()[0]
  vocab = fixtures.TINY_VOCAB
  expected = [vocab.index(w) for w in ("[CLS]", "a", "great", "movie", "[SEP]")]
  np.testing.assert_array_equal(ids[:5], expected)  # lower-cased by tokenizer_config.json
  assert (ids[5:] == vocab.index("[PAD]")).all()


# --- errors before loading ---------------------------------------------------------
def test_unknown_preset_name_suggests_and_lists_accepted():
  with pytest.raises(ValueError) as info:
    text.text_classifier("roberta_bas_en")
  message = str(info.value)
  assert "Unknown preset 'roberta_bas_en'" in message and "'roberta_base_en'" in message
  assert "save_to_preset" in message and "Hugging Face" in message


@pytest.mark.parametrize("preset, error, match", [
    ("./no/such/dir", FileNotFoundError, "does not exist"),
    ("s3://bucket/model", ValueError, "Unknown preset scheme 's3://'"),
    (42, TypeError, "string or path"),
])
def test_bad_preset_forms(preset, error, match):
  with pytest.raises(error, match=match):
    text.resolve_preset(preset)


def test_incomplete_directories_are_rejected(tmp_path, bert_preset):
  with pytest.raises(FileNotFoundError, match="no config.json"):
    text.resolve_preset(tmp_path)
  folder, _ = fixtures.write_tiny_hf_bert(tmp_path / "hf")
  os.remove(os.path.join(folder, "vocab.txt"))
  os.remove(os.path.join(folder, "model.safetensors"))
  with pytest.raises(FileNotFoundError, match=r"missing: vocab.txt; model.safetensors"):
    text.resolve_preset(folder)
  with open(os.path.join(folder, "config.json"), "w") as f:
    json.dump({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}, f)
  with pytest.raises(ValueError, match="model_type 'gpt2'; supported: bert, roberta"):
    text.resolve_preset(folder)
  keras_dir = tmp_path / "keras_preset"
  keras_dir.mkdir()
  with open(os.path.join(bert_preset, "config.json")) as f:
    (keras_dir / "config.json").write_text(f.read())
  with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
    text.resolve_preset(keras_dir)


def test_sequence_length_beyond_position_table(bert_preset):
  with pytest.raises(ValueError, match="exceeds the backbone's max_sequence_length=16"):
    text.text_classifier(bert_preset, sequence_length=32)


# --- DP training ---------------------------------------------------------------------
def fit_private_text(preset, batch_size=8, steps=2):
  """make_private + DPNSGD fit on a tiny preset; returns facts to check (JSON-able)."""
  keras.utils.set_random_seed(0)
  classifier, preprocessor = text.text_classifier(preset, sequence_length=16)
  tables = [v for v in classifier.non_trainable_variables if v.path.endswith("/embeddings")]
  frozen = [v.numpy() for v in tables]
  trainable = [v.numpy() for v in classifier.trainable_variables]
  sentences = list(fixtures.POSITIVE + fixtures.NEGATIVE) * 2
  labels = np.array([1] * 6 + [0] * 6 + [1] * 6 + [0] * 6)[:batch_size * steps]
  tokens = preprocessor(tf.constant(sentences[:batch_size * steps]))
  model = tf_dpnsgd.make_private(classifier)
  model.compile(optimizer=tf_dpnsgd.DPNSGD(learning_rate=0.1, regularizer=0.1,
                                           noise_multiplier=1.0, seed=0),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  history = model.fit(tokens, labels, batch_size=batch_size, epochs=1, verbose=0)
  return {
      "loss": float(history.history["loss"][-1]),
      "noise_draws": model.privacy_ledger.steps,
      "frozen_unchanged": len(tables) == 3 and all(
          np.array_equal(a, v.numpy()) for a, v in zip(frozen, tables)),
      "trainable_changed": all(not np.array_equal(a, v.numpy())
                               for a, v in zip(trainable, classifier.trainable_variables)),
  }


@pytest.mark.slow
def test_make_private_fits_tiny_bert_with_dpnsgd(bert_preset):
  # With oneDNN on (TF's CPU default), per-example gradients of keras
  # MultiHeadAttention under tf.vectorized_map crash the process (segfault or
  # dnnl::error), so the fit runs in a child process with oneDNN off unless
  # this one already has it off.
  if os.environ.get("TF_ENABLE_ONEDNN_OPTS") == "0":
    facts = fit_private_text(str(bert_preset))
  else:
    code = ("import json, sys; sys.path.insert(0, sys.argv[1]); "
            "from test_text_models import fit_private_text; "
            "print('FACTS' + json.dumps(fit_private_text(sys.argv[2])))")
    env = dict(os.environ, TF_ENABLE_ONEDNN_OPTS="0", CUDA_VISIBLE_DEVICES="",
               TF_CPP_MIN_LOG_LEVEL="3", KERAS_BACKEND="tensorflow")
    run = zygote.run([sys.executable, "-c", code, TESTS_DIR, str(bert_preset)], env=env,
                     capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    facts = json.loads(run.stdout.split("FACTS", 1)[1])
  assert np.isfinite(facts["loss"])
  assert facts["noise_draws"] == 2  # one noise draw per logical batch
  assert facts["frozen_unchanged"] and facts["trainable_changed"]
