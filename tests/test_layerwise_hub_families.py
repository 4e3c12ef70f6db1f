"""Layer-wise rules for the keras-hub families of the model zoo (issue 49).

Rule under test (``tf_dpnsgd/per_example/layers/embedding.py``): DeBERTa-V3's
``RelativeEmbedding``, ``out = repeat(LN(E[None]), B)``, one table for every example. The
rule repeats the table first and normalizes each example's copy with the
``LayerNormalization`` rule; the table's per-example gradient is its copy's (materialised),
gamma's and beta's come from the ``LayerNormalization`` rule. With it every variable of a
``DebertaV3Backbone`` has a rule and ``"auto"`` picks the layer-wise engine. (DistilBERT,
RoBERTa and ALBERT need no new rule: their layers are ``Embedding``/``ReversibleEmbedding``,
``PositionEmbedding``, ``EinsumDense``, ``Dense``, ``LayerNormalization``;
``tests/test_model_zoo.py`` checks one step of each.)

Oracle as in ``tests/test_layerwise_vit.py``: the float64 loop of per-example tapes through
keras-hub's own layers (``fixtures.check_rule_against_the_loops``). Tiny backbones
built from config (width 8, one block, 4 relative buckets); nothing is downloaded.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from tf_dpnsgd.per_example import choose_engine
from tf_dpnsgd.per_example.layers import embedding
import fixtures

keras_hub = pytest.importorskip("keras_hub")
# Not exported by keras-hub; the rule is registered under this class's qualified name.
from keras_hub.src.models.deberta_v3.relative_embedding import RelativeEmbedding  # noqa: E402

L = keras.layers
R = 0.1
BATCH = 4
SEQ = 6
VOCAB = 20


def _randomize(model, seed=0):
  rng = np.random.default_rng(seed)
  model.set_weights([0.5 * rng.normal(size=w.shape).astype(w.dtype)
                     for w in model.get_weights()])


def _deberta_classifier():
  backbone = keras_hub.models.DebertaV3Backbone(
      vocabulary_size=VOCAB, num_layers=1, num_heads=2, hidden_dim=8, intermediate_dim=16,
      dropout=0.0, max_sequence_length=SEQ, bucket_size=4)
  # One input (the loop oracle slices a tensor): the padding mask is where the ids are not 0.
  ids = keras.Input((SEQ,), dtype="int32")
  mask = keras.ops.cast(keras.ops.not_equal(ids, 0), "int32")
  h = backbone({"token_ids": ids, "padding_mask": mask})
  model = keras.Model(ids, L.Dense(3)(L.Flatten()(h)))
  _randomize(model)
  return model


def _data(seed=1):
  rng = np.random.default_rng(seed)
  lengths = SEQ - np.arange(BATCH) % 3  # 6, 5, 4, 6; padded with id 0
  ids = rng.integers(1, VOCAB, (BATCH, SEQ)) * (np.arange(SEQ)[None] < lengths[:, None])
  return tf.constant(ids, tf.int32), tf.constant(rng.normal(size=(BATCH, 3)), tf.float32)


def _relative_layer(model):
  return next(l for l in model._flatten_layers() if type(l) is RelativeEmbedding)


def test_the_rule_is_registered_under_keras_hubs_class():
  layer = _relative_layer(_deberta_classifier())
  assert f"{type(layer).__module__}.{type(layer).__qualname__}" == embedding.RELATIVE_EMBEDDING


@pytest.mark.slow
def test_deberta_v3_backbone_matches_the_per_example_loop():
  model = _deberta_classifier()
  engine, why = choose_engine(model)
  assert engine == "layerwise", why
  x, y = _data()
  out = fixtures.check_rule_against_the_loops(model, x, y, R)
  np.testing.assert_allclose(out.y_pred, model(x, training=True), rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_deberta_v3_with_masked_rows():
  model = _deberta_classifier()
  x, y = _data(seed=2)
  out = fixtures.check_rule_against_the_loops(model, x, y, R,
                                              mask=tf.constant([True, False, True, False]))
  np.testing.assert_array_equal(out.factors.numpy()[[1, 3]], 0.0)


def _scaled_by_input(layer):
  """``RelativeEmbedding``'s output times the input: each example sees the shared table
  through its own values (the table's output alone is the same for every example)."""
  inputs = keras.Input((8, 3))
  model = keras.Model(inputs, L.Dense(2)(L.Flatten()(L.Multiply()([layer(inputs), inputs]))))
  _randomize(model)
  return model


def test_relative_embedding_alone_matches_the_per_example_loop():
  model = _scaled_by_input(RelativeEmbedding(hidden_dim=3, bucket_size=4))
  assert choose_engine(model)[0] == "layerwise"
  rng = np.random.default_rng(4)
  x = tf.constant(rng.normal(size=(BATCH, 8, 3)), tf.float32)
  y = tf.constant(rng.normal(size=(BATCH, 2)), tf.float32)
  fixtures.check_rule_against_the_loops(model, x, y, R)


def test_two_nearly_cancelling_uses_stay_within_the_sensitivity():
  """The layer used twice (its output does not depend on the input values) with output
  gradients ``c`` and ``-(1 - 1e-4) c``: each example's table, gamma and beta gradients
  nearly cancel; the clipped contribution stays within the clip."""
  fixtures.assert_cancelling_uses_stay_within_the_sensitivity(
      RelativeEmbedding(hidden_dim=3, bucket_size=2), (5, 3), BATCH, 1.0, _randomize)
