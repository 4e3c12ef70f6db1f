"""A keras-hub task with its preprocessor trains privately on raw strings (issue 48.4).

The task's preprocessor runs on the host before the sampler (``owned_plan.preprocessed``),
so the sampler's rows, tags and identities are the model's inputs, one example per row.
The oracle: the same private model fed the preprocessor's outputs directly, with the same
seeds, reaches the same weights; and each string's row is what the preprocessor gives for
that string alone (row independence of the tokenizer + packer).
"""

from __future__ import annotations

import keras
import numpy as np
import pytest

import tf_dpnsgd

import fixtures

SEQ, B = 8, 4


def _task(tmp_path):
  keras_hub = pytest.importorskip("keras_hub")
  keras.utils.set_random_seed(5)
  vocab = fixtures.write_vocab(str(tmp_path / "vocab.txt"))
  tokenizer = keras_hub.models.BertTokenizer(vocabulary=vocab, lowercase=True)
  preprocessor = keras_hub.models.BertTextClassifierPreprocessor(tokenizer,
                                                                 sequence_length=SEQ)
  backbone = fixtures.tiny_bert_backbone(max_sequence_length=SEQ, dropout=0.0)
  return keras_hub.models.BertTextClassifier(backbone, num_classes=2, dropout=0.0,
                                             preprocessor=preprocessor)


def _sentences():
  pos, neg = fixtures.POSITIVE, fixtures.NEGATIVE
  x = np.array(list(pos) + list(neg))
  return x, np.array([1] * len(pos) + [0] * len(neg))


def _private(task, n=None):
  plan = {} if n is None else {"plan": tf_dpnsgd.PrivacyPlan(
      dataset_size=n, batch_size=B, sampling="poisson", delta=1e-3 / n, epochs=2,
      noise_multiplier=1.0, seed=7)}
  if not plan:
    plan = dict(noise_multiplier=1.0, delta=1e-4, batch_size=B, epochs=2)
  model = tf_dpnsgd.make_private(task, pretrained=False, **plan)
  model.compile(optimizer=tf_dpnsgd.DPSGD(learning_rate=0.1, l2_norm_clip=1.0, seed=3),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                metrics=["accuracy"])
  return model


def test_the_preprocessor_runs_in_chunks_before_the_sampler_and_passes_model_inputs():
  """owned_plan.preprocessed on a stand-in task (no TensorFlow model): chunks of strings map
  row by row, inputs that already are the model's pass unchanged, no preprocessor: as is."""
  import types
  from tf_dpnsgd import owned_plan
  calls = []

  def preprocessor(strings):
    calls.append(len(strings))
    return {"token_ids": np.array([[len(s), 0] for s in strings.tolist()])}

  model = types.SimpleNamespace(_dp_preprocessor=preprocessor, input={"token_ids": None})
  x = np.array(["a", "bb", "ccc", "dddd", "eeeee"])
  out = owned_plan.preprocessed(model, x, chunk=2)
  assert calls == [2, 2, 1] and out["token_ids"][:, 0].tolist() == [1, 2, 3, 4, 5]
  assert owned_plan.preprocessed(model, out) is out  # already the model's inputs
  assert owned_plan.preprocessed(types.SimpleNamespace(), x) is x  # no preprocessor


@pytest.mark.slow
def test_raw_strings_and_preprocessed_inputs_train_the_same_model(tmp_path):
  """Oracle: the same plan seed and noise seed on the preprocessor's outputs, fed directly."""
  x, y = _sentences()
  task = _task(tmp_path)
  features = {k: np.asarray(v) for k, v in task.preprocessor(x).items()}
  weights = [w.copy() for w in task.get_weights()]
  raw = _private(task, n=len(y))
  raw.fit(x, y, verbose=0)
  trained = [w.copy() for w in raw.get_weights()]
  assert any(not np.allclose(a, b) for a, b in zip(trained, weights))
  twin = _task(tmp_path)  # a fresh model (a second make_private of `task` continues its ledger)
  twin.set_weights(weights)
  direct = _private(twin, n=len(y))
  direct.privacy_ledger.adopt_lineage(raw.privacy_ledger.lineage)  # the same noise stream
  direct.fit(features, y, verbose=0)
  for a, b in zip(trained, direct.get_weights()):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_a_task_trains_on_raw_strings_keeps_its_preprocessor_in_keras_and_exports(tmp_path):
  """A keras-hub task trains privately on raw strings (validation data too), each string's
  row being what the preprocessor gives for it alone; saved as ``.keras`` and loaded, it keeps
  its preprocessor (the vocabulary too: the same token ids) and trains on raw strings again
  after its plan is extended (issue 48); ``export_private`` serves raw strings with the
  in-memory model's logits and writes its report."""
  import json
  import os

  import tensorflow as tf

  from tf_dpnsgd import export
  x, y = _sentences()
  task = _task(tmp_path)
  model = _private(task)
  history = model.fit(x, y, validation_data=(x, y), verbose=0)
  assert model.privacy_ledger.steps == model.privacy_plan.num_steps
  assert "val_accuracy" in history.history
  # Row independence: each string's row alone is its row in the batch.
  together = task.preprocessor(x)
  for i in (0, len(x) - 1):
    alone = task.preprocessor(x[i:i + 1])
    for key in together:
      np.testing.assert_array_equal(np.asarray(alone[key])[0], np.asarray(together[key])[i])
  path = str(tmp_path / "private.keras")
  model.save(path)
  loaded = keras.models.load_model(path)
  assert loaded._dp_preprocessor is not None
  for key, ids in task.preprocessor(x).items():
    np.testing.assert_array_equal(np.asarray(loaded._dp_preprocessor(x)[key]), np.asarray(ids))
  steps = loaded.privacy_ledger.steps
  loaded.extend_privacy_plan(epochs=3)
  loaded.fit(x, y, verbose=0)  # raw strings: fails where the reload lost the preprocessor
  assert loaded.privacy_ledger.steps == loaded.privacy_plan.num_steps > steps

  export_dir = export.export_private(loaded, str(tmp_path / "served"))
  out = export.load_serving_fn(export_dir)(sentences=tf.constant(x[:5]))
  logits = np.asarray(loaded(task.preprocessor(x[:5]), training=False))
  np.testing.assert_allclose(out["logits"].numpy(), logits, rtol=1e-5, atol=1e-5)
  with open(os.path.join(export_dir, "privacy_report.json"), encoding="utf-8") as f:
    written = json.load(f)
  assert written["steps"] == loaded.privacy_ledger.steps
  assert written["epsilon"] == pytest.approx(loaded.privacy_report().epsilon, rel=1e-12)


@pytest.mark.slow
def test_the_docs_recipe_runs_as_written_on_a_tiny_preset(tmp_path, capsys):
  """docs/text_library_path.md's recipe block, executed: only the preset folder, the
  elided hyperparameters (``...``) and the sizes are replaced for a tiny BERT preset and
  12 sentences; every call of the page runs as written and prints the report."""
  import os
  import re

  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  with open(os.path.join(root, "docs", "text_library_path.md"), encoding="utf-8") as f:
    page = f.read()
  block = re.search(r"```python\n(.*?)```", page, re.S).group(1)
  preset = fixtures.write_tiny_bert_preset(tmp_path / "preset")
  substitutions = {'"./my_minilm_preset"': repr(preset), "learning_rate=...": "learning_rate=0.1",
                   "regularizer=...": "regularizer=1.0", "batch_size=256": "batch_size=8",
                   "epochs=3": "epochs=1",
                   '"private_task.keras"': repr(str(tmp_path / "private_task.keras")),
                   '"served_task"': repr(str(tmp_path / "served_task"))}
  for old, new in substitutions.items():
    assert old in block, old  # the page still says what this test replaces
    block = block.replace(old, new)
  x, y = _sentences()
  namespace = {"sentences": x, "labels": y, "dev_sentences": x[:8], "dev_labels": y[:8]}
  exec(compile(block, "docs/text_library_path.md", "exec"), namespace)  # noqa: S102
  private = namespace["private"]
  assert private.privacy_ledger.steps > 0
  printed = capsys.readouterr().out
  assert "epsilon" in printed.lower() and "my_minilm_preset" in printed, printed[-2000:]
  assert (tmp_path / "private_task.keras").exists()
  assert (tmp_path / "served_task" / "privacy_report.json").exists()
