"""Benchmark models of realistic size for the support table's families (issue 49).

``build(name)`` returns ``(make_model, x, y, batch)`` like
``benchmarks/per_example_engines.py`` (which delegates these names here), so that
``python benchmarks/engine_ratio.py --models=lstm,gpt2 --modes=bookkeeping`` measures the
DP/plain step ratio of each family at a size a user would train on a CPU: text models of
MiniLM-L6 size (6 layers, hidden 384, sequence 128, batch 32: the size of the table's BERT
row), the recurrent ones at IMDB-classifier size, images at 32 x 32 or 64 x 64. Random
weights and inputs (no download); a Dense(2) head on the first position or the pooled
output; BatchNormalization replaced by ``tf_dpnsgd.fix_layers`` where a keras-hub vision
backbone has it.
"""

from __future__ import annotations

SEQ, TEXT_BATCH = 128, 32
_ENCODER = dict(num_layers=6, num_heads=12, hidden_dim=384, intermediate_dim=1536,
                max_sequence_length=512)
_DECODER = dict(num_layers=6, num_query_heads=6, num_key_value_heads=2, hidden_dim=384,
                intermediate_dim=1024)

#: family -> its benchmark batch
BATCHES = {"lstm": 64, "gru": 64, "conv3d": 16, "distilbert": TEXT_BATCH, "roberta": TEXT_BATCH,
           "deberta_v3": TEXT_BATCH, "albert": TEXT_BATCH, "gpt2": TEXT_BATCH,
           "llama": TEXT_BATCH, "mistral": TEXT_BATCH, "gemma": TEXT_BATCH, "vit": 64,
           "resnet18_hub": 64, "bidirectional_gru": 64, "simple_rnn": 64, "separable": 64,
           "conv_transpose": 64, "rmsnorm_prelu": 256, "efficientnet_b0": 32}
FAMILIES = tuple(BATCHES)


def _tokens(rng, vocab, batch=TEXT_BATCH, seq=SEQ, segments=False):
  import numpy as np
  x = {"token_ids": rng.integers(1, vocab, size=(batch, seq)).astype("int32"),
       "padding_mask": np.ones((batch, seq), "int32")}
  if segments:
    x["segment_ids"] = np.zeros((batch, seq), "int32")
  return x


def _head(backbone, x):
  """Dense(2) on a keras-hub backbone's pooled output (or first position)."""
  import keras
  inputs = {k: keras.Input(v.shape[1:], dtype="int32", name=k) for k, v in x.items()}
  h = backbone(inputs)
  h = h["pooled_output"] if isinstance(h, dict) else h[:, 0, :]
  return keras.Model(inputs, keras.layers.Dense(2)(h))


def build(name):
  import keras
  import numpy as np

  rng = np.random.default_rng(0)
  labels = lambda batch, classes=2: rng.integers(0, classes, size=(batch,)).astype("int32")  # noqa: E731
  if name in ("lstm", "gru"):  # an IMDB-size classifier: 20k words, 128 units, 128 tokens
    layer = keras.layers.LSTM if name == "lstm" else keras.layers.GRU
    batch = BATCHES[name]

    def make():
      tokens = keras.Input((SEQ,), dtype="int32")
      h = layer(128)(keras.layers.Embedding(20000, 128)(tokens))
      return keras.Model(tokens, keras.layers.Dense(2)(h))

    return make, rng.integers(1, 20000, size=(batch, SEQ)).astype("int32"), labels(batch), batch
  if name in ("bidirectional_gru", "simple_rnn"):  # the same IMDB-size classifier
    batch = BATCHES[name]

    def make():
      tokens = keras.Input((SEQ,), dtype="int32")
      h = keras.layers.Embedding(20000, 128)(tokens)
      h = (keras.layers.Bidirectional(keras.layers.GRU(64)) if name == "bidirectional_gru"
           else keras.layers.SimpleRNN(128))(h)
      return keras.Model(tokens, keras.layers.Dense(2)(h))

    return make, rng.integers(1, 20000, size=(batch, SEQ)).astype("int32"), labels(batch), batch
  if name in ("separable", "conv_transpose"):
    batch = BATCHES[name]

    def make():
      images = keras.Input((32, 32, 3))
      if name == "separable":  # a MobileNet-style Keras stack on 32 x 32
        h = keras.layers.Conv2D(32, 3, strides=2, padding="same", activation="relu")(images)
        for filters in (64, 128, 128):
          h = keras.layers.DepthwiseConv2D(3, padding="same", activation="relu")(h)
          h = keras.layers.GroupNormalization(groups=8)(h)
          h = keras.layers.SeparableConv2D(filters, 3, strides=2 if filters == 128 else 1,
                                           padding="same", activation="relu")(h)
        h = keras.layers.GlobalAveragePooling2D()(h)
      else:  # an encoder-decoder whose decoder upsamples with transposed convolutions
        h = keras.layers.Conv2D(64, 3, strides=2, padding="same", activation="relu")(images)
        h = keras.layers.Conv2D(128, 3, strides=2, padding="same", activation="relu")(h)
        h = keras.layers.Conv2DTranspose(64, 3, strides=2, padding="same", activation="relu")(h)
        h = keras.layers.Conv2DTranspose(32, 3, strides=2, padding="same", activation="relu")(h)
        h = keras.layers.GlobalAveragePooling2D()(h)
      return keras.Model(images, keras.layers.Dense(10)(h))

    return make, rng.normal(size=(batch, 32, 32, 3)).astype("float32"), labels(batch, 10), batch
  if name == "rmsnorm_prelu":  # an MLP on 784 features: Dense 512 + RMSNorm + PReLU, x3
    batch = BATCHES[name]

    def make():
      features = keras.Input((784,))
      h = features
      for _ in range(3):
        h = keras.layers.PReLU()(keras.layers.RMSNormalization()(keras.layers.Dense(512)(h)))
      return keras.Model(features, keras.layers.Dense(10)(h))

    return make, rng.normal(size=(batch, 784)).astype("float32"), labels(batch, 10), batch
  if name == "conv3d":  # short clips: 8 frames of 32 x 32 RGB
    batch = BATCHES[name]

    def make():
      clips = keras.Input((8, 32, 32, 3))
      h = keras.layers.Conv3D(32, 3, padding="same", activation="relu")(clips)
      h = keras.layers.GroupNormalization(groups=8)(h)
      h = keras.layers.Conv3D(64, 3, strides=2, padding="same", activation="relu")(h)
      h = keras.layers.GlobalAveragePooling3D()(h)
      return keras.Model(clips, keras.layers.Dense(10)(h))

    x = rng.normal(size=(batch, 8, 32, 32, 3)).astype("float32")
    return make, x, labels(batch, 10), batch

  import keras_hub
  hub = keras_hub.models
  if name in ("distilbert", "roberta", "deberta_v3", "albert"):
    vocab = {"roberta": 50265, "deberta_v3": 128100}.get(name, 30522)
    x = _tokens(rng, vocab, segments=name == "albert")

    def make():
      if name == "distilbert":
        backbone = hub.DistilBertBackbone(vocabulary_size=vocab, **_ENCODER)
      elif name == "roberta":
        backbone = hub.RobertaBackbone(vocabulary_size=vocab, **_ENCODER)
      elif name == "deberta_v3":
        backbone = hub.DebertaV3Backbone(vocabulary_size=vocab, bucket_size=256, **_ENCODER)
      else:  # ALBERT: one group of shared weights, a factorized embedding 128 -> 384
        backbone = hub.AlbertBackbone(vocabulary_size=vocab, num_groups=1,
                                      num_inner_repetitions=1, embedding_dim=128, **_ENCODER)
      return _head(backbone, x)

    return make, x, labels(TEXT_BATCH), TEXT_BATCH
  if name == "gpt2":
    x = _tokens(rng, 50257)
    return (lambda: _head(hub.GPT2Backbone(vocabulary_size=50257, num_layers=6, num_heads=6,
                                           hidden_dim=384, intermediate_dim=1536,
                                           max_sequence_length=512), x),
            x, labels(TEXT_BATCH), TEXT_BATCH)
  if name in ("llama", "mistral", "gemma"):
    x = _tokens(rng, 32000)

    def make():
      if name == "llama":
        backbone = hub.LlamaBackbone(vocabulary_size=32000, **_DECODER)
      elif name == "mistral":
        backbone = hub.MistralBackbone(vocabulary_size=32000, **_DECODER)
      else:
        backbone = hub.GemmaBackbone(vocabulary_size=32000, head_dim=64, **_DECODER)
      return _head(backbone, x)

    return make, x, labels(TEXT_BATCH), TEXT_BATCH
  if name == "vit":  # ViT-Tiny width on CIFAR-size images, 4 x 4 patches
    batch = BATCHES[name]

    def make():
      images = keras.Input((32, 32, 3))
      h = hub.ViTBackbone(image_shape=(32, 32, 3), patch_size=4, num_layers=6, num_heads=3,
                          hidden_dim=192, mlp_dim=768)(images)
      return keras.Model(images, keras.layers.Dense(10)(h[:, 0, :]))

    return make, rng.normal(size=(batch, 32, 32, 3)).astype("float32"), labels(batch, 10), batch
  if name == "resnet18_hub":  # keras-hub ResNet-18 (basic blocks) on 64 x 64, GroupNorm
    import tf_dpnsgd
    batch = BATCHES[name]

    def make():
      images = keras.Input((64, 64, 3))
      h = hub.ResNetBackbone(
          input_conv_filters=[64], input_conv_kernel_sizes=[7],
          stackwise_num_filters=[64, 128, 256, 512], stackwise_num_blocks=[2, 2, 2, 2],
          stackwise_num_strides=[1, 2, 2, 2], block_type="basic_block",
          image_shape=(64, 64, 3))(images)
      model = keras.Model(images, keras.layers.Dense(10)(
          keras.layers.GlobalAveragePooling2D()(h)))
      return tf_dpnsgd.fix_layers(model)[0]

    return make, rng.normal(size=(batch, 64, 64, 3)).astype("float32"), labels(batch, 10), batch
  if name == "efficientnet_b0":  # keras-hub EfficientNet-B0's stages ("v1" blocks), 64 x 64
    import tf_dpnsgd
    batch = BATCHES[name]

    def make():
      images = keras.Input((64, 64, 3))
      h = hub.EfficientNetBackbone(
          stackwise_width_coefficients=[1.0] * 7, stackwise_depth_coefficients=[1.0] * 7,
          stackwise_kernel_sizes=[3, 3, 5, 3, 5, 5, 3], stackwise_num_repeats=[1, 2, 2, 3, 3, 4, 1],
          stackwise_input_filters=[32, 16, 24, 40, 80, 112, 192],
          stackwise_output_filters=[16, 24, 40, 80, 112, 192, 320],
          stackwise_expansion_ratios=[1, 6, 6, 6, 6, 6, 6],
          stackwise_squeeze_and_excite_ratios=[0.25] * 7, stackwise_strides=[1, 2, 2, 2, 1, 2, 1],
          stackwise_block_types=["v1"] * 7, dropout=0.0, input_shape=(64, 64, 3),
          num_features=1280)(images)
      model = keras.Model(images, keras.layers.Dense(10)(
          keras.layers.GlobalAveragePooling2D()(h)))
      return tf_dpnsgd.fix_layers(model)[0]

    return make, rng.normal(size=(batch, 64, 64, 3)).astype("float32"), labels(batch, 10), batch
  raise ValueError(f"unknown family {name!r}; one of {FAMILIES}")
