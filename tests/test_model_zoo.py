"""The models users bring (issue 49): small models built from config, one DP step each.

Each case is a model a new user might bring (Keras recurrent, 3-D, depthwise,
separable and transposed convolutions, RMS normalization, PReLU; keras-hub
backbones built from config with tiny sizes, random weights, nothing
downloaded; the convolutional ones with their BatchNormalization replaced by
:func:`tf_dpnsgd.fix_layers`). For each:

* the engine ``per_example="auto"`` picks (:data:`AUTO_ENGINE`, recorded in
  ``docs/per_example.md``, "Model zoo"); where oneDNN changes the choice the
  table gives both;
* ONE DP-SGD step at noise 0 through ``make_private`` + ``train_on_batch``
  equals the independent oracle (:func:`clipped_mean_by_loop`): each
  example's gradient from its own ``tf.GradientTape``, clipped to ``CLIP``,
  summed and divided by the batch size;
* the private model's ``.keras`` round trip: the loaded copy holds the
  stepped weights and its ledger, and predicts what the private model does.

keras-hub's ``MobileNetBackbone`` (and EfficientNet-V2's ``"fused"`` /
``"unfused"`` blocks) keep their BatchNormalization inside subclassed blocks,
which ``fix_layers`` cannot rebuild: that case checks the refusal names them.

The quick tier holds three tiny cases (an LSTM, which crashed the vectorized
engine and now has a layer-wise rule; RMS normalization + PReLU; a transposed
convolution); the others are ``slow``.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dpnsgd
from tf_dpnsgd import ledger as ledger_lib
from tf_dpnsgd.per_example import choose_engine, vectorized

BATCH = 4
SEQ = 6
VOCAB = 20
CLIP = 0.05  # small: most examples are clipped
LR = 1.0


# --- the oracle ---------------------------------------------------------------------
def _take(x, i):
  return tf.nest.map_structure(lambda t: t[i:i + 1], x)


def _loss(model, x, y):
  return tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(
      y, model(x, training=True), from_logits=True))


def clipped_mean_by_loop(model, x, y, clip):
  """``sum_i min(1, c / ||g_i||) g_i / B`` (float64), ``g_i`` from one tape per example."""
  variables = model.trainable_variables
  total = [np.zeros(v.shape) for v in variables]
  for i in range(BATCH):
    with tf.GradientTape() as tape:
      loss = _loss(model, _take(x, i), _take(y, i))
    grads = [np.zeros(v.shape) if g is None else  # None: a variable the loss does not use
             tf.convert_to_tensor(g).numpy().astype(np.float64)
             for g, v in zip(tape.gradient(loss, variables), variables)]
    norm = np.sqrt(sum(np.sum(g ** 2) for g in grads))
    factor = min(1.0, clip / norm) if norm > 0 else 1.0
    total = [t + factor * g for t, g in zip(total, grads)]
  return [t / BATCH for t in total]


def one_dp_step(model, x, y):
  """The change of every trainable variable after one DP-SGD step at noise 0 (auto engine),
  and the private model that took it."""
  before = [v.numpy().astype(np.float64) for v in model.trainable_variables]
  private = tf_dpnsgd.make_private(model, trust_untagged_batches=True)
  private.compile(optimizer=tf_dpnsgd.DPSGD(learning_rate=LR, l2_norm_clip=CLIP,
                                            noise_multiplier=0.0),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  private.train_on_batch(x, y)
  change = [v.numpy().astype(np.float64) - b for v, b in zip(model.trainable_variables, before)]
  return change, private


# --- the models -------------------------------------------------------------------------
def _ids(seed=0):
  return tf.constant(np.random.default_rng(seed).integers(1, VOCAB, (BATCH, SEQ)), tf.int32)


def _floats(shape, seed=0):
  return tf.constant(np.random.default_rng(seed).normal(size=(BATCH,) + shape), tf.float32)


def _padding_mask():
  lengths = SEQ - np.arange(BATCH) % 4  # 6, 5, 4, 3, 6, ...
  return tf.constant(np.arange(SEQ)[None] < lengths[:, None], tf.int32)


def _sequence_head(layer):
  tokens = keras.Input((SEQ,), dtype="int32")
  h = layer(keras.layers.Embedding(VOCAB, 4)(tokens))
  return keras.Model(tokens, keras.layers.Dense(2)(h)), _ids()


def _image_head(input_shape, *layers):
  inputs = keras.Input(input_shape)
  h = inputs
  for layer in layers:
    h = layer(h)
  return keras.Model(inputs, keras.layers.Dense(2)(keras.layers.Flatten()(h))), \
      _floats(input_shape)


def _token_backbone_head(backbone, segments=False):
  """Dense(2) on the first position of a keras-hub backbone (ids, padding mask)."""
  inputs = {name: keras.Input((SEQ,), dtype="int32", name=name)
            for name in ("token_ids", "padding_mask")}
  x = {"token_ids": _ids(), "padding_mask": _padding_mask()}
  if segments:
    inputs["segment_ids"] = keras.Input((SEQ,), dtype="int32", name="segment_ids")
    x["segment_ids"] = tf.zeros((BATCH, SEQ), tf.int32)
  h = backbone(inputs)
  h = h["pooled_output"] if isinstance(h, dict) else h[:, 0, :]
  return keras.Model(inputs, keras.layers.Dense(2)(h)), x


def _fixed(make):
  """``make()``'s model with every BatchNormalization replaced (:func:`tf_dpnsgd.fix_layers`)."""
  model, x = make()
  fixed, changes = tf_dpnsgd.fix_layers(model)
  assert changes  # the backbone had BatchNormalization
  return fixed, x


def _hub():
  import keras_hub  # pylint: disable=import-outside-toplevel  (heavy; only the hub cases need it)
  return keras_hub.models


_ENCODER = dict(vocabulary_size=VOCAB, num_layers=1, num_heads=2, hidden_dim=8,
                intermediate_dim=16, dropout=0.0, max_sequence_length=SEQ)
_DECODER = dict(vocabulary_size=VOCAB, num_layers=2, num_query_heads=2, num_key_value_heads=1,
                hidden_dim=8, intermediate_dim=16)

MODELS = {
    "lstm": lambda: _sequence_head(keras.layers.LSTM(4)),
    "gru": lambda: _sequence_head(keras.layers.GRU(4)),
    "bidirectional_gru": lambda: _sequence_head(keras.layers.Bidirectional(keras.layers.GRU(3))),
    "simple_rnn": lambda: _sequence_head(keras.layers.SimpleRNN(4)),
    "conv3d": lambda: _image_head((4, 4, 4, 1), keras.layers.Conv3D(2, 2, activation="relu")),
    "depthwise_separable_groupnorm": lambda: _image_head(
        (6, 6, 3), keras.layers.DepthwiseConv2D(3, padding="same"),
        keras.layers.GroupNormalization(groups=3), keras.layers.SeparableConv2D(4, 3)),
    "conv2d_transpose": lambda: _image_head(
        (3, 3, 2), keras.layers.Conv2DTranspose(2, 2, strides=2, activation="relu")),
    "dense_rmsnorm_prelu": lambda: _image_head(
        (5,), keras.layers.Dense(6), keras.layers.RMSNormalization(), keras.layers.PReLU()),
    "bert": lambda: _token_backbone_head(_hub().BertBackbone(
        vocabulary_size=VOCAB, num_layers=1, num_heads=2, hidden_dim=8, intermediate_dim=16,
        dropout=0.0, max_sequence_length=SEQ), segments=True),
    "gpt2": lambda: _token_backbone_head(_hub().GPT2Backbone(
        vocabulary_size=VOCAB, num_layers=1, num_heads=2, hidden_dim=8, intermediate_dim=16,
        dropout=0.0, max_sequence_length=SEQ)),
    "llama": lambda: _token_backbone_head(_hub().LlamaBackbone(**_DECODER)),
    "mistral": lambda: _token_backbone_head(_hub().MistralBackbone(**_DECODER)),
    "gemma": lambda: _token_backbone_head(_hub().GemmaBackbone(head_dim=4, **_DECODER)),
    "vit": lambda: _image_head((8, 8, 3), _hub().ViTBackbone(
        image_shape=(8, 8, 3), patch_size=4, num_layers=1, num_heads=2, hidden_dim=8,
        mlp_dim=16)),
    "distilbert": lambda: _token_backbone_head(_hub().DistilBertBackbone(**_ENCODER)),
    "roberta": lambda: _token_backbone_head(_hub().RobertaBackbone(**_ENCODER)),
    # Relative position buckets: 2 * bucket_size rows of the relative table.
    "deberta_v3": lambda: _token_backbone_head(_hub().DebertaV3Backbone(
        bucket_size=4, **_ENCODER)),
    # Two layers sharing one group's weights; a factorized embedding (4 -> 8).
    "albert": lambda: _token_backbone_head(_hub().AlbertBackbone(
        num_groups=1, num_inner_repetitions=1, embedding_dim=4,
        **dict(_ENCODER, num_layers=2)), segments=True),
    # The first stack must have 64 filters; the stem too, for the identity shortcut of the
    # first basic block; the second stack has a convolution shortcut. 16 x 16 images: 2 x 2
    # positions reach the head (at 1 x 1, GroupNorm with one channel per group outputs 0).
    "resnet": lambda: _fixed(lambda: _image_head((16, 16, 3), _hub().ResNetBackbone(
        input_conv_filters=[64], input_conv_kernel_sizes=[3], stackwise_num_filters=[64, 8],
        stackwise_num_blocks=[1, 1], stackwise_num_strides=[1, 2], block_type="basic_block",
        image_shape=(16, 16, 3)))),
    # EfficientNet (V1 blocks: functional layers): stem, one MBConv block with expansion and
    # squeeze-and-excite, top convolution.
    "efficientnet": lambda: _fixed(lambda: _image_head((8, 8, 3), _hub().EfficientNetBackbone(
        stackwise_width_coefficients=[1.0], stackwise_depth_coefficients=[1.0],
        stackwise_kernel_sizes=[3], stackwise_num_repeats=[1], stackwise_input_filters=[8],
        stackwise_output_filters=[8], stackwise_expansion_ratios=[2],
        stackwise_squeeze_and_excite_ratios=[0.25], stackwise_strides=[1],
        stackwise_block_types=["v1"], dropout=0.0, input_shape=(8, 8, 3), num_features=8,
        min_depth=4, depth_divisor=4))),
}

# The engine "auto" picks: (oneDNN off, oneDNN on). oneDNN is TensorFlow's CPU default on x86
# Linux with AVX512-VNNI/AMX; with it on, "auto" avoids the vectorized engine for attention.
_LAYERWISE = ("layerwise", "layerwise")  # every trainable variable has a rule
AUTO_ENGINE = {
    "lstm": _LAYERWISE, "gru": _LAYERWISE, "bidirectional_gru": _LAYERWISE,
    "simple_rnn": _LAYERWISE,
    "conv3d": _LAYERWISE, "depthwise_separable_groupnorm": _LAYERWISE,
    "conv2d_transpose": _LAYERWISE, "dense_rmsnorm_prelu": _LAYERWISE,
    "bert": _LAYERWISE, "gpt2": _LAYERWISE,
    "llama": _LAYERWISE, "mistral": _LAYERWISE, "gemma": _LAYERWISE,
    "vit": _LAYERWISE,
    "distilbert": _LAYERWISE, "roberta": _LAYERWISE, "deberta_v3": _LAYERWISE,
    "albert": _LAYERWISE, "resnet": _LAYERWISE, "efficientnet": _LAYERWISE,
}

QUICK = ("lstm",)  # the quick tier: one (issue 47); every model in CI
CASES = [name if name in QUICK else pytest.param(name, marks=pytest.mark.slow)
         for name in MODELS]


def test_every_case_has_an_expected_engine():
  assert set(AUTO_ENGINE) == set(MODELS)


@pytest.mark.parametrize("name", CASES)
def test_auto_engine_one_dp_step_and_keras_round_trip(name, tmp_path):
  keras.utils.set_random_seed(0)
  model, x = MODELS[name]()
  y = tf.constant(np.arange(BATCH) % 2, tf.int32)
  engine, why = choose_engine(model)
  assert engine == AUTO_ENGINE[name][vectorized.onednn_enabled()], why

  expected = [-LR * g for g in clipped_mean_by_loop(model, x, y, CLIP)]
  got, private = one_dp_step(model, x, y)
  assert any(np.abs(g).max() > 0 for g in got)  # the step did something
  for g, e, v in zip(got, expected, model.trainable_variables):
    np.testing.assert_allclose(g, e, rtol=1e-4, atol=1e-6 * (1 + np.abs(e).max()),
                               err_msg=f"{name}: {v.path}")

  path = str(tmp_path / f"{name}.keras")
  private.save(path)
  loaded = keras.models.load_model(path)
  assert ledger_lib.ledger_of(loaded).steps == ledger_lib.ledger_of(private).steps == 1
  for a, b in zip(loaded.trainable_variables, private.trainable_variables):
    np.testing.assert_array_equal(a.numpy(), b.numpy(), err_msg=f"{name}: {b.path}")
  np.testing.assert_allclose(loaded.predict_on_batch(x), private.predict_on_batch(x),
                             rtol=1e-5, atol=1e-6)


def _mobilenet():
  return _image_head((8, 8, 3), _hub().MobileNetBackbone(
      stackwise_expansion=[[2]], stackwise_num_blocks=[1], stackwise_num_filters=[[8]],
      stackwise_kernel_size=[[3]], stackwise_num_strides=[[1]], stackwise_se_ratio=[[0.25]],
      stackwise_activation=[["relu"]], stackwise_padding=[[1]], output_num_filters=8,
      depthwise_filters=8, depthwise_stride=1, depthwise_residual=False, last_layer_filter=8,
      squeeze_and_excite=0.5, image_shape=(8, 8, 3), input_num_filters=8))


@pytest.mark.slow
def test_mobilenet_batchnorm_inside_subclassed_blocks_is_refused_by_name():
  """keras-hub's MobileNet blocks (``DepthwiseConvBlock``, ``InvertedResidualBlock``,
  ``ConvBnActBlock``) are subclassed layers holding BatchNormalization: ``fix_layers``
  cannot rebuild them and says which; ``make_private`` refuses the unfixed model."""
  model, _ = _mobilenet()
  with pytest.raises(ValueError, match=r"block_1_0_bn1.*nested subclassed model"):
    tf_dpnsgd.fix_layers(model)
  with pytest.raises(ValueError, match="mixes examples within a batch"):
    tf_dpnsgd.make_private(model)
