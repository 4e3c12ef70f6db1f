"""Text batches at their real length: physical chunks cut to their longest row (issue 32, part 2).

The oracle is the same chunked DP step without cutting (every chunk at the
batch's padded length), which ``tests/test_layerwise.py`` checks against the
per-example loop; with a model that masks its padding, the summed
contributions, norms, factors, losses and predictions must agree to float
tolerance, in the batch's own order.
"""

from __future__ import annotations

import importlib
import types

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dpnsgd
from tf_dpnsgd import transforms

# The module (tf_dpnsgd.step re-exports its function `contributions` under the same name).
contributions_lib = importlib.import_module("tf_dpnsgd.step.contributions")

LENGTHS = (3, 10, 5, 2, 7, 4, 9)  # real tokens per row, padded to 12
SEQ = 12
VOCAB = 40


def _tiny_bert_classifier():
  keras_hub = pytest.importorskip("keras_hub")
  backbone = keras_hub.models.BertBackbone(vocabulary_size=VOCAB, num_layers=2, num_heads=2,
                                           hidden_dim=8, intermediate_dim=16,
                                           max_sequence_length=SEQ, dropout=0.0)
  return keras_hub.models.BertTextClassifier(backbone=backbone, num_classes=2,
                                             preprocessor=None, dropout=0.0)


def _padded_batch(lengths=LENGTHS):
  rng = np.random.default_rng(0)
  mask = np.arange(SEQ)[None, :] < np.asarray(lengths)[:, None]
  ids = np.where(mask, rng.integers(5, VOCAB, (len(lengths), SEQ)), 0)
  segments = np.where(mask, rng.integers(0, 2, (len(lengths), SEQ)), 0)
  x = {"token_ids": tf.constant(ids, tf.int32), "segment_ids": tf.constant(segments, tf.int32),
       "padding_mask": tf.constant(mask.astype("int32"))}
  return x, tf.constant(np.arange(len(lengths)) % 2, tf.int32)


def _private(physical):
  keras.utils.set_random_seed(2)
  model = tf_dpnsgd.make_private(_tiny_bert_classifier(), per_example="layerwise",
                                 physical_batch_size=physical,
                                 trust_untagged_batches=True)  # hand-made batches
  model.compile(optimizer=tf_dpnsgd.DPNSGD(learning_rate=0.1, regularizer=0.01,
                                           noise_multiplier=0.0),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  return model


def test_sequence_lengths_and_trim():
  x, _ = _padded_batch()
  np.testing.assert_array_equal(contributions_lib.sequence_lengths(x["padding_mask"]), LENGTHS)
  cut = contributions_lib.trim_to_longest({k: v[:1] for k, v in x.items()}, "padding_mask")
  assert all(t.shape == (1, 3) for t in cut.values())
  holes = {"padding_mask": tf.constant([[0, 1, 0, 1, 0, 0]]), "labels": tf.constant([[1]])}
  cut = contributions_lib.trim_to_longest(holes, "padding_mask")  # keeps up to the last real one
  assert cut["padding_mask"].shape == (1, 4) and cut["labels"].shape == (1, 1)
  empty = contributions_lib.trim_to_longest({"padding_mask": tf.zeros([2, 5], tf.int32)},
                                            "padding_mask")
  assert empty["padding_mask"].shape == (2, 1)
  with pytest.raises(ValueError, match="dict inputs"):
    contributions_lib.check_length_key(tf.zeros([2, 3]), "padding_mask")


@pytest.mark.slow
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_bucketed_chunks_give_the_same_contributions_on_a_tiny_bert(graph):
  model = _private(physical=3)
  x, y = _padded_batch()
  mask = tf.constant([True, True, True, False, True, True, True])  # a Poisson padding row
  transform = transforms.Normalize(0.01)
  seen = []

  def engine(*args, **kwargs):
    seen.append(args[2]["token_ids"].shape[1])
    return model._dp_engine(*args, **kwargs)

  def run(length_key):
    out = contributions_lib.chunked_contributions(model, engine, transform, x, y, mask, 3,
                                                  length_key=length_key)
    return {k: getattr(out, k) for k in ("summed", "norms", "factors", "losses", "y_pred")}

  if graph:
    run = tf.function(run)
  plain = types.SimpleNamespace(**run(None))
  bucketed = types.SimpleNamespace(**run("padding_mask"))
  if not graph:  # longest first, chunks of 3: lengths (10, 9, 7), (5, 4, 3), (2, 2, 2)
    assert seen[-3:] == [10, 5, 2] and seen[:3] == [SEQ] * 3
  for a, b, v in zip(bucketed.summed, plain.summed, model.trainable_variables):
    np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5,
                               atol=1e-6 * (1 + np.abs(b.numpy()).max()), err_msg=v.path)
  for name in ("norms", "factors", "losses"):
    np.testing.assert_allclose(getattr(bucketed, name).numpy(), getattr(plain, name).numpy(),
                               rtol=1e-5, err_msg=name)
  np.testing.assert_allclose(bucketed.y_pred.numpy(), plain.y_pred.numpy(), rtol=1e-5,
                             atol=1e-6)
  assert bucketed.factors.numpy()[3] == 0.0
  unchunked = model._dp_engine(model, model._dp_loss_fn, x, y, transform, mask=mask)
  for a, b in zip(bucketed.summed, unchunked.summed):
    np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5,
                               atol=1e-6 * (1 + np.abs(b.numpy()).max()))


@pytest.mark.slow
def test_make_private_length_key_trains_exactly_as_without_it():
  """The user-facing option: ``make_private(..., length_key="padding_mask")``; one DP step
  (noise 0) gives the same weights as the uncut chunked step, and the option survives a
  ``.keras`` config round trip."""
  x, y = _padded_batch()
  weights = []
  for key in (None, "padding_mask"):
    keras.utils.set_random_seed(2)
    model = tf_dpnsgd.make_private(_tiny_bert_classifier(), per_example="layerwise",
                                   physical_batch_size=3, trust_untagged_batches=True,
                                   length_key=key)
    model.compile(optimizer=tf_dpnsgd.DPNSGD(learning_rate=0.1, regularizer=0.01,
                                             noise_multiplier=0.0),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    before = [w.copy() for w in model.get_weights()]
    model.fit(tf.data.Dataset.from_tensors((x, y)), epochs=1, verbose=0)
    weights.append([w.copy() for w in model.get_weights()])
    assert any(np.abs(a - b).max() > 0 for a, b in zip(weights[-1], before))  # a step ran
    assert model.get_config()["length_key"] == key
  for a, b in zip(*weights):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_length_key_needs_physical_chunks():
  with pytest.raises(ValueError, match="physical_batch_size"):
    tf_dpnsgd.make_private(_tiny_bert_classifier(), length_key="padding_mask")
