"""Writers of tiny on-disk datasets and models in their real formats (for tests).

Each writer puts files where a user's download would put them, so a loader
test exercises the real parsing path:

  * :func:`write_cifar10_batches`: ``cifar-10-batches-py`` pickles.
  * :func:`write_sst2_tsv`: GLUE ``SST-2/{train,dev}.tsv``.
  * :func:`write_tiny_bert_preset`: a keras-hub preset directory of a tiny,
    randomly initialised BERT classifier (``save_to_preset``).
  * :func:`write_tiny_hf_bert`: the same kind of model as a Hugging Face
    checkpoint folder (config.json, model.safetensors, vocab.txt,
    tokenizer_config.json).
"""

from __future__ import annotations

import json
import os
import pickle

import keras
import numpy as np
import zygote  # children forked from a pre-imported process (tests/zygote.py)

TINY_WORDS = ("the a an movie film story plot actors it is was not very really too so and but "
              "good great fun funny moving brilliant bad boring dull terrible awful slow "
              "loved hated , . !").split()
TINY_VOCAB = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]") + tuple(TINY_WORDS)

POSITIVE = ("a great movie", "the film was fun", "really moving and brilliant !",
            "loved it", "good actors , good story", "so funny")
NEGATIVE = ("a boring film", "the plot was dull", "really terrible and slow .",
            "hated it", "bad actors , awful story", "too slow")


# --- CIFAR-10 ---------------------------------------------------------------
def cifar_rows(images: np.ndarray) -> np.ndarray:
  """``[n, 32, 32, 3]`` -> ``[n, 3072]`` rows in the file's order (all red, green, blue)."""
  return images.transpose(0, 3, 1, 2).reshape(len(images), -1)


def write_cifar10_batches(root, images_per_batch=20, seed=0, subfolder=True):
  """Writes a small ``cifar-10-batches-py`` (5 training batches + test batch).

  Args:
    root: folder to write into.
    images_per_batch: images in each of the six batch files.
    seed: RNG seed of the random images and labels.
    subfolder: write into ``root/cifar-10-batches-py`` (as the tarball
      extracts) rather than ``root`` itself.

  Returns:
    ``(folder, ((x_train, y_train), (x_test, y_test)))``: where the batch files
    are, and what a loader must return (uint8 HWC images, int64 labels).
  """
  rng = np.random.default_rng(seed)
  folder = os.path.join(os.fspath(root), "cifar-10-batches-py") if subfolder else os.fspath(root)
  os.makedirs(folder, exist_ok=True)
  names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
  parts = []
  for name in names:
    images = rng.integers(0, 256, size=(images_per_batch, 32, 32, 3), dtype=np.uint8)
    labels = rng.integers(0, 10, size=images_per_batch)
    batch = {b"batch_label": name.encode(), b"labels": [int(l) for l in labels],
             b"data": cifar_rows(images),
             b"filenames": [f"{name}_{i}.png".encode() for i in range(images_per_batch)]}
    with open(os.path.join(folder, name), "wb") as f:
      pickle.dump(batch, f, protocol=2)
    parts.append((images, labels.astype(np.int64)))
  with open(os.path.join(folder, "batches.meta"), "wb") as f:
    pickle.dump({b"label_names": [b"airplane", b"automobile", b"bird", b"cat", b"deer", b"dog",
                                  b"frog", b"horse", b"ship", b"truck"]}, f, protocol=2)
  train = (np.concatenate([x for x, _ in parts[:5]]), np.concatenate([y for _, y in parts[:5]]))
  return folder, (train, parts[5])


# --- GLUE SST-2 ----------------------------------------------------------------
def write_sst2_tsv(root, train=None, dev=None, subfolder=True):
  """Writes GLUE-style ``train.tsv`` and ``dev.tsv`` (header ``sentence<TAB>label``).

  Args:
    root: folder to write into.
    train, dev: lists of ``(sentence, label)``; default: :data:`POSITIVE` /
      :data:`NEGATIVE` sentences.
    subfolder: write into ``root/SST-2`` (as the GLUE zip extracts).

  Returns:
    ``(folder, train_rows, dev_rows)``.
  """
  if train is None:
    train = [(s, 1) for s in POSITIVE] + [(s, 0) for s in NEGATIVE]
  if dev is None:
    dev = [("a fun movie", 1), ("a dull film", 0), ('it is " not " so bad', 1)]
  folder = os.path.join(os.fspath(root), "SST-2") if subfolder else os.fspath(root)
  os.makedirs(folder, exist_ok=True)
  for name, rows in (("train.tsv", train), ("dev.tsv", dev)):
    with open(os.path.join(folder, name), "w", encoding="utf-8", newline="") as f:
      f.write("sentence\tlabel\n")
      for sentence, label in rows:
        f.write(f"{sentence}\t{label}\n")
  return folder, list(train), list(dev)


def _numpy(value):
  return keras.ops.convert_to_numpy(value)


# --- tiny BERT ---------------------------------------------------------------------
TINY_BERT = {"num_layers": 1, "num_heads": 2, "hidden_dim": 16, "intermediate_dim": 32,
             "max_sequence_length": 16}


def write_vocab(path, vocab=TINY_VOCAB):
  with open(path, "w", encoding="utf-8") as f:
    f.write("\n".join(vocab) + "\n")
  return path


def tiny_bert_backbone(vocabulary_size=len(TINY_VOCAB), **overrides):
  """A randomly initialised keras-hub ``BertBackbone`` of ~10k parameters."""
  import keras_hub
  return keras_hub.models.BertBackbone(vocabulary_size=vocabulary_size,
                                       **{**TINY_BERT, **overrides})


def write_tiny_bert_preset(path, num_classes=2, sequence_length=16):
  """Saves a tiny BERT classifier + tokenizer + preprocessor as a keras-hub preset.

  Returns:
    ``path`` (usable as ``text_classifier(path)`` offline).
  """
  import keras_hub
  path = os.fspath(path)
  os.makedirs(path, exist_ok=True)
  vocab = write_vocab(os.path.join(path, "..", os.path.basename(path) + "_vocab.txt"))
  tokenizer = keras_hub.models.BertTokenizer(vocabulary=vocab, lowercase=True)
  preprocessor = keras_hub.models.BertTextClassifierPreprocessor(
      tokenizer, sequence_length=sequence_length)
  classifier = keras_hub.models.BertTextClassifier(tiny_bert_backbone(), num_classes=num_classes,
                                                   preprocessor=preprocessor)
  classifier.save_to_preset(path)
  return path


def hf_bert_state_dict(backbone, prefix="bert."):
  """A Hugging Face ``BertModel`` state dict (numpy) holding ``backbone``'s weights.

  The inverse of keras-hub's ``convert_bert.convert_weights``: torch Linear
  weights are ``[out, in]`` (the transposed Keras kernel).
  """
  hidden = backbone.hidden_dim

  def kernel(variable):
    """Keras kernel (input axes first) -> torch ``[out, in]``."""
    value = _numpy(variable)
    if value.ndim == 3:  # attention [in, heads, head_dim] or [heads, head_dim, out]
      value = value.reshape(hidden, hidden)
    return value.T

  def norm(layer, name):
    return {f"{name}.weight": _numpy(layer.gamma), f"{name}.bias": _numpy(layer.beta)}

  state = {
      "embeddings.word_embeddings.weight": _numpy(
          backbone.get_layer("token_embedding").embeddings),
      "embeddings.position_embeddings.weight": _numpy(
          backbone.get_layer("position_embedding").position_embeddings),
      "embeddings.token_type_embeddings.weight": _numpy(
          backbone.get_layer("segment_embedding").embeddings),
      **norm(backbone.get_layer("embeddings_layer_norm"), "embeddings.LayerNorm"),
      "pooler.dense.weight": kernel(backbone.get_layer("pooled_dense").kernel),
      "pooler.dense.bias": _numpy(backbone.get_layer("pooled_dense").bias),
  }
  for i in range(backbone.num_layers):
    block = backbone.get_layer(f"transformer_layer_{i}")
    attn = block._self_attention_layer
    p = f"encoder.layer.{i}."
    for name, dense in (("attention.self.query", attn.query_dense),
                        ("attention.self.key", attn.key_dense),
                        ("attention.self.value", attn.value_dense),
                        ("attention.output.dense", attn.output_dense)):
      state[p + name + ".weight"] = kernel(dense.kernel)
      state[p + name + ".bias"] = _numpy(dense.bias).reshape(-1)
    state.update(norm(block._self_attention_layer_norm, p + "attention.output.LayerNorm"))
    state[p + "intermediate.dense.weight"] = kernel(block._feedforward_intermediate_dense.kernel)
    state[p + "intermediate.dense.bias"] = _numpy(block._feedforward_intermediate_dense.bias)
    state[p + "output.dense.weight"] = kernel(block._feedforward_output_dense.kernel)
    state[p + "output.dense.bias"] = _numpy(block._feedforward_output_dense.bias)
    state.update(norm(block._feedforward_layer_norm, p + "output.LayerNorm"))
  return {prefix + k: np.ascontiguousarray(v, dtype=np.float32) for k, v in state.items()}


def write_tiny_hf_bert(path, backbone=None):
  """Writes a tiny BERT as a Hugging Face checkpoint folder.

  Returns:
    ``(path, backbone)``: the folder and the Keras backbone whose weights it
    holds (the oracle for a loader).
  """
  from safetensors.numpy import save_file
  path = os.fspath(path)
  os.makedirs(path, exist_ok=True)
  backbone = backbone or tiny_bert_backbone()
  config = {"model_type": "bert", "architectures": ["BertForMaskedLM"],
            "vocab_size": backbone.vocabulary_size, "hidden_size": backbone.hidden_dim,
            "num_hidden_layers": backbone.num_layers, "num_attention_heads": backbone.num_heads,
            "intermediate_size": backbone.intermediate_dim,
            "max_position_embeddings": backbone.max_sequence_length, "type_vocab_size": 2,
            "hidden_act": "gelu", "layer_norm_eps": 1e-12}
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(config, f, indent=2)
  with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
    json.dump({"do_lower_case": True, "tokenizer_class": "BertTokenizer"}, f)
  write_vocab(os.path.join(path, "vocab.txt"))
  save_file(hf_bert_state_dict(backbone), os.path.join(path, "model.safetensors"))
  return path, backbone


# --- tiny image model ---------------------------------------------------------------
def tiny_image_model(input_shape=(8, 8, 3), num_classes=3, name="tiny_cnn"):
  """Conv -> GroupNorm -> ReLU -> pool -> Dense: a DP-compatible image classifier."""
  inputs = keras.Input(input_shape, name="image")
  x = keras.layers.Conv2D(4, 3, padding="same", name="conv")(inputs)
  x = keras.layers.GroupNormalization(groups=2, name="gn")(x)
  x = keras.layers.Activation("relu")(x)
  x = keras.layers.GlobalAveragePooling2D()(x)
  return keras.Model(inputs, keras.layers.Dense(num_classes, name="logits")(x), name=name)


def normalized_sum_by_loop(variables, example_loss, num_examples: int, r: float):
  """Oracle for a DP-NSGD engine: each example's gradient from its own tape of
  ``example_loss(i)`` (:func:`per_example_gradients_by_loop`), its norm, and
  ``sum_i g_i / (r + ||g_i||)`` (float64).

  Returns:
    ``(norms, summed)``: a list of ``num_examples`` floats, a list of arrays shaped like
    ``variables``.
  """
  norms, summed = [], [np.zeros(v.shape) for v in variables]
  for grads in per_example_gradients_by_loop(variables, example_loss, num_examples):
    norm = float(np.sqrt(sum(np.sum(g**2) for g in grads)))
    norms.append(norm)
    summed = [s + g / (r + norm) for s, g in zip(summed, grads)]
  return norms, summed


def assert_engine_output(out, norms, summed, norm_rtol=1e-4, sum_rtol=1e-3, sum_atol=1e-6):
  """An engine's ``EngineOutput`` against :func:`normalized_sum_by_loop`'s oracle."""
  np.testing.assert_allclose(out.norms.numpy(), norms, rtol=norm_rtol)
  for got, expected in zip(out.summed, summed):
    np.testing.assert_allclose(got.numpy(), expected, rtol=sum_rtol, atol=sum_atol)


def one_noiseless_step(make, x, y, **private_kwargs):
  """Trainable weights of ``make()`` made private with ``private_kwargs`` after one DP-NSGD
  step at noise 0 (lr 1, r 0.1, seed 3) on one hand-made batch ``(x, y)``."""
  import tf_dpnsgd  # pylint: disable=import-outside-toplevel
  keras.utils.set_random_seed(3)
  model = tf_dpnsgd.make_private(make(), trust_untagged_batches=True, **private_kwargs)
  model.compile(optimizer=tf_dpnsgd.DPNSGD(learning_rate=1.0, regularizer=0.1,
                                           noise_multiplier=0.0),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  model.train_on_batch(x, y)
  return [v.numpy() for v in model.trainable_variables]


# --- tiny models of every Keras kind (the save-path matrices) -------------------------------
MODEL_KINDS = ("sequential", "functional", "nested", "subclassed")


@keras.saving.register_keras_serializable(package="tf_dpnsgd_test_fixtures")
class TinySubclassed(keras.Model):
  """A subclassed 5 -> 4 (tanh) -> 3 model."""

  def __init__(self, **kwargs):
    super().__init__(**kwargs)
    self.hidden = keras.layers.Dense(4, activation="tanh")
    self.out = keras.layers.Dense(3)

  def call(self, x):
    return self.out(self.hidden(x))


def tiny_model(kind, seed=None):
  """A 5 -> 4 -> 3 model of ``kind`` (one of :data:`MODEL_KINDS`), built; ``seed``: the same
  initial weights on every call."""
  if seed is not None:
    keras.utils.set_random_seed(seed)
  if kind == "sequential":
    return keras.Sequential([keras.Input((5,)), keras.layers.Dense(4, activation="tanh"),
                             keras.layers.Dense(3)])
  if kind == "functional":
    inputs = keras.Input((5,))
    return keras.Model(inputs, keras.layers.Dense(3)(keras.layers.Dense(4)(inputs)))
  if kind == "nested":
    inner_in = keras.Input((5,))
    inner = keras.Model(inner_in, keras.layers.Dense(4, activation="tanh")(inner_in),
                        name="inner")
    inputs = keras.Input((5,))
    return keras.Model(inputs, keras.layers.Dense(3)(inner(inputs)))
  model = TinySubclassed()
  model(np.zeros((1, 5), np.float32))  # built: load_weights needs variables to load into
  return model


def tiny_data(n):
  """``n`` rows of 5 normal features and 3-class labels (fixed seed)."""
  rng = np.random.default_rng(0)
  return rng.normal(size=(n, 5)).astype(np.float32), rng.integers(0, 3, n)


def applied_noise_prefix_sums(n, dim, seed, momentum=0.0, lineage=7, **noise):
  """Parameters of DP-SGD (lr 1) on zero gradients, sigma = 1, S = 1, D = 1, with the
  correlated ``noise`` (``band_coefficients=`` or ``blt_parameters=``): minus the prefix sums
  of the applied noise (the momentum workload for momentum > 0), ``[n, dim]``."""
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  import tf_dpnsgd  # pylint: disable=import-outside-toplevel
  opt = tf_dpnsgd.DPSGD(learning_rate=1.0, l2_norm_clip=1.0, noise_multiplier=1.0, seed=seed,
                        momentum=momentum, **noise)
  v = keras.Variable(np.zeros(dim, np.float32))
  out = []
  for t in range(n):
    opt.apply_private_gradients([tf.zeros(dim)], 1.0, [v],
                                step=tf.constant([lineage, 0, t], tf.int64))
    out.append(-v.numpy())
  return np.stack(out)


# --- the in-process launcher runs (test_resume, test_launch_correlated) ---------------------
def tiny_image_data():
  """64 4x4x1 images, label 1 where the mean pixel is positive."""
  rng = np.random.default_rng(0)
  x = rng.normal(size=(64, 4, 4, 1)).astype("float32")
  return x, (x.mean(axis=(1, 2, 3)) > 0).astype("int32")


def tiny_image_mlp():
  """Flatten -> Dense(8, tanh) -> Dense(2) on :func:`tiny_image_data`'s images."""
  inputs = keras.Input((4, 4, 1))
  h = keras.layers.Dense(8, activation="tanh")(keras.layers.Flatten()(inputs))
  return keras.Model(inputs, keras.layers.Dense(2)(h))


class Interrupt(Exception):
  """Ctrl-C in the middle of a fit (raised by :class:`InterruptAt`)."""


class InterruptAt(keras.callbacks.Callback):
  """Raises :class:`Interrupt` once the model's privacy ledger reaches ``step`` (an
  interrupted ``fit``; it reads no training metric)."""

  dp_observes_only = True

  def __init__(self, step):
    super().__init__()
    self.step = step

  def on_train_batch_end(self, batch, logs=None):
    if self.model.privacy_ledger.steps == self.step:
      raise Interrupt()


def result_lines(script: str, timeout: int = 300) -> tuple:
  """Runs ``script`` in a fresh Python process; returns ``(rows, stderr)``: the words after
  ``RESULT`` of each stdout line that starts with it (subprocess tests of the probes)."""
  import sys  # pylint: disable=g-import-not-at-top
  out = zygote.run([sys.executable, "-c", script], capture_output=True, text=True,
                   timeout=timeout)
  return [l.split()[1:] for l in out.stdout.splitlines() if l.startswith("RESULT")], out.stderr


def linear_loss(y_true, y_pred):
  """``<y_true_i, y_pred_i>`` per example: the output gradient is ``y_true`` exactly."""
  import tensorflow as tf
  return tf.reduce_sum(tf.cast(y_true, y_pred.dtype) * y_pred, axis=-1)


def assert_cancelling_uses_stay_within_the_sensitivity(layer, shape, batch, magnitude,
                                                       randomize, normalize_too=False):
  """One ``layer`` on ``x`` and ``x (1 + 1e-7)`` (inputs of ``magnitude``) with output
  gradients ``c`` and ``-(1 - 1e-4) c``: each example's gradient nearly cancels. Each
  example's contribution from the layer-wise engine, read off the batch with the others
  masked out, must have norm at most the clip and be within float32 rounding of the
  float64 tape oracle's (one tape per example). ``randomize(model)`` sets the weights;
  ``normalize_too``: the normalized contribution is checked as well as the clipped one."""
  import tensorflow as tf
  from tf_dpnsgd import transforms
  from tf_dpnsgd.per_example.layerwise import layerwise_engine

  L = keras.layers
  a, b = keras.Input(shape), keras.Input(shape)
  model = keras.Model([a, b], L.Concatenate()([L.Flatten()(layer(a)), L.Flatten()(layer(b))]))
  randomize(model)
  rng = np.random.default_rng(3)
  x1 = (magnitude * rng.normal(size=(batch,) + tuple(shape))).astype(np.float32)
  x2 = (x1 * np.float32(1 + 1e-7)).astype(np.float32)
  width = model.output_shape[-1] // 2
  c = rng.normal(size=(batch, width)).astype(np.float32)
  y_true = tf.constant(np.concatenate([c, (-(1 - 1e-4) * c).astype(np.float32)], axis=1))
  x = [tf.constant(x1), tf.constant(x2)]
  grads = []
  for i in range(batch):
    with tf.GradientTape() as tape:
      loss = tf.reduce_sum(linear_loss(y_true[i:i + 1], model([x1[i:i + 1], x2[i:i + 1]])))
    grads.append(np.concatenate([g.numpy().astype(np.float64).ravel()
                                 for g in tape.gradient(loss, model.trainable_variables)]))
  true_norms = np.linalg.norm(np.stack(grads), axis=1)
  assert np.all(true_norms > 0)
  scale = 1e-2 * float(np.median(true_norms))
  kinds = (transforms.Clip, transforms.Normalize) if normalize_too else (transforms.Clip,)
  for transform in (kind(scale) for kind in kinds):
    for i in range(batch):
      mask = tf.constant(np.arange(batch) == i)
      out = layerwise_engine(model, linear_loss, x, y_true, transform, mask=mask)
      got = np.concatenate([s.numpy().astype(np.float64).ravel() for s in out.summed])
      h = float(out.factors.numpy()[i])
      assert np.linalg.norm(got) <= transform.sensitivity * (1 + 1e-6)
      # Within float32 rounding of the exact gradient's contribution (relative 2^-24 / 1e-4
      # of the cancelling uses' size).
      np.testing.assert_allclose(got, h * grads[i], rtol=0, atol=1e-2 * transform.sensitivity)


def half_squared_error(y_true, y_pred):
  """Half the squared error per example: its output gradient ``y_pred - y_true`` is well
  conditioned (a saturated softmax's ``p - 1`` loses relative precision, differently in
  each engine)."""
  import tensorflow as tf
  return 0.5 * tf.reduce_sum(tf.square(y_pred - y_true), axis=-1)


def per_example_gradients_by_loop(variables, example_loss, num_examples: int):
  """Each example's gradient from its own ``tf.GradientTape`` of ``example_loss(i)``, as
  float64 numpy (a variable the loss does not use: zeros): ``num_examples`` lists shaped
  like ``variables``."""
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  out = []
  for i in range(num_examples):
    with tf.GradientTape() as tape:
      loss = example_loss(i)
    out.append([np.zeros(v.shape) if g is None else
                tf.convert_to_tensor(g).numpy().astype(np.float64)
                for g, v in zip(tape.gradient(loss, variables), variables)])
  return out


def check_rule_against_the_loops(model, x, y, r, engine=None, mask=None,
                                 loss=half_squared_error, clip=1.0):
  """``engine`` (the layer-wise engine by default) for the normalized (regularizer ``r``)
  and the clipped (``clip``) sums against one float64 oracle: each example's gradient from
  its own tape through the whole model (:func:`per_example_gradients_by_loop`), its norm,
  the paper's factors ``1 / (r + ||g_i||)`` and ``min(1, c / ||g_i||)`` (0 where ``mask``
  is False) and the factored sums; the engine's norms, factors and sums must match them.
  Returns the normalized output.

  (Until 2026-11-28 the oracle was the library's microbatch engine, run once per transform,
  plus this loop for the normalized sum: three passes over the examples where one does;
  about half of test_layerwise_rnn's time. The loop is the independent one.)"""
  import tensorflow as tf
  from tf_dpnsgd import transforms
  from tf_dpnsgd.per_example.layerwise import layerwise_engine

  engine = engine or layerwise_engine
  batch = int(tf.shape(tf.nest.flatten(x)[0])[0])
  rows = lambda t, i: tf.nest.map_structure(lambda a: a[i:i + 1], t)
  grads = per_example_gradients_by_loop(
      model.trainable_variables,
      lambda i: tf.reduce_sum(loss(rows(y, i), model(rows(x, i), training=True))), batch)
  norms = np.array([np.sqrt(sum(np.sum(g**2) for g in gs)) for gs in grads])
  keep = np.ones(batch, bool) if mask is None else np.asarray(mask, bool)
  expected_factors = {
      "normalize": keep / (r + norms),
      "clip": keep * np.minimum(1.0, clip / np.maximum(norms, 1e-300)),
  }
  outs = {}
  for name, transform in (("normalize", transforms.Normalize(r)),
                          ("clip", transforms.Clip(clip))):
    out = outs[name] = engine(model, loss, x, y, transform, mask=mask)
    factors = expected_factors[name]
    np.testing.assert_allclose(out.norms, norms, rtol=1e-5, err_msg=name)
    np.testing.assert_allclose(out.factors, factors, rtol=1e-5, err_msg=name)
    for k, got in enumerate(out.summed):
      expected = sum(f * gs[k] for f, gs in zip(factors, grads))
      np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-6, err_msg=name)
  return outs["normalize"]
