"""Train the top layers of a text encoder on cached outputs of its frozen lower layers.

When only the top ``k`` transformer layers (and the head) train, everything
below them is a fixed function of each example alone: the pretrained, frozen
embeddings and lower layers, run without dropout. Their output for a sentence
is computed once (:func:`cache_lower_outputs`) and the DP step runs only the
top ``k`` layers on it (:func:`split_classifier`'s ``upper`` model).

Why this keeps the guarantee: the cache is per-example preprocessing with
public weights (the preset's, named in the report's ``not_covered``). It holds
nothing that depends on a trainable weight (:func:`split_classifier` refuses a
trainable variable below the cut) or on another example, so the neighbouring
relation, the sampler, the noise and the ledger are those of training the
whole model with its lower layers frozen and their dropout off. The cached
rows are what the sampler draws, tags and digests. Numerically the cache is
stored in float16 (half the memory): the top layers see the lower layers'
outputs rounded to 11 significant bits, in training and in the evaluation
that the launcher reports; the exported model recomputes them in float32 from
raw sentences (its dev accuracy is reported beside the cached one).
"""

from __future__ import annotations

import keras
import numpy as np

from tf_dpnsgd.data import cache as cache_lib
from tf_dpnsgd.models import text

HIDDEN_KEY = "hidden"
MASK_KEY = "padding_mask"


def split_classifier(backbone, trainable_layers, num_classes=2, dropout=0.1):
  """Cuts ``backbone`` below its top ``trainable_layers`` transformer layers.

  Args:
    backbone: a keras-hub backbone with ``transformer_layers`` (BERT, RoBERTa),
      carrying its pretrained weights.
    trainable_layers: how many top layers train; ``0`` caches the whole encoder
      and trains only the head on its mean-pooled output (a linear probe).
    num_classes: logits of the new head.
    dropout: dropout before the head.

  Returns:
    ``(lower, upper, full)``: ``lower`` maps the token dict to the hidden states
    below the cut (frozen); ``upper`` maps ``{"hidden", "padding_mask"}`` to logits
    (the top layers, masked mean pooling, dropout, ``Dense``); ``full`` composes
    them on the token dict (the same layer objects: what is exported).

  Raises:
    ValueError: ``trainable_layers`` out of range, or a trainable variable left
      below the cut after freezing it (it would be baked into the cache).
  """
  layers = list(getattr(backbone, "transformer_layers", None) or ())
  if isinstance(trainable_layers, bool) or not isinstance(trainable_layers, int) \
      or not 0 <= trainable_layers <= len(layers):
    raise ValueError(f"`trainable_layers` must be an integer in [0, {len(layers)}] to cache "
                     f"the layers below them; got {trainable_layers!r}.")
  cut = len(layers) - trainable_layers
  below = (backbone.get_layer(f"transformer_layer_{cut - 1}").output if cut else
           _embeddings_output(backbone))
  lower = keras.Model(backbone.input, below, name=f"{backbone.name}_frozen_lower")
  for layer in lower.layers:  # all below the cut (k = all layers: the embeddings' LayerNorm)
    text.freeze(layer)
  if lower.trainable_weights:
    raise ValueError("Trainable variables below the cut would be baked into the cache: "
                     f"{[v.path for v in lower.trainable_weights]}. Freeze them.")
  hidden = keras.Input(shape=(None, below.shape[-1]), dtype="float16", name=HIDDEN_KEY)
  mask = keras.Input(shape=(None,), dtype="int32", name=MASK_KEY)
  x = keras.layers.Activation("linear", dtype="float32", name="cache_to_float32")(hidden)
  for layer in layers[cut:]:
    x = layer(x, padding_mask=mask)
  pooled = text.MaskedMeanPooling(name="mean_pooling")(x, mask)
  if dropout:
    pooled = keras.layers.Dropout(dropout, name="head_dropout")(pooled)
  logits = keras.layers.Dense(num_classes, name="logits")(pooled)
  upper = keras.Model({HIDDEN_KEY: hidden, MASK_KEY: mask}, logits,
                      name=f"{backbone.name}_top{trainable_layers}")
  tokens = {name: keras.Input(shape=(None,), dtype="int32", name=name) for name in backbone.input}
  below_out = keras.layers.Activation("linear", dtype="float16", name="as_cached")(
      lower(tokens, training=False))
  full = keras.Model(tokens, upper({HIDDEN_KEY: below_out, MASK_KEY: tokens[MASK_KEY]}),
                     name=f"{backbone.name}_cached_top{trainable_layers}")
  return lower, upper, full


def _embeddings_output(backbone):
  for name in ("embeddings_dropout", "embeddings_layer_norm"):
    try:
      return backbone.get_layer(name).output
    except ValueError:
      continue
  raise ValueError(f"Backbone '{backbone.name}' has no embeddings output to cut at; use "
                   "trainable_layers < number of layers.")


def cache_lower_outputs(lower, tokens, batch_size=512):
  """``lower``'s float16 outputs on every row of ``tokens`` (inference mode).

  Rows are run in order of length, each batch cut to its longest row; the
  result is padded back to the token arrays' length (zeros past each row's
  end, which the masked top layers ignore).

  Args:
    lower: the frozen lower model of :func:`split_classifier`.
    tokens: dict of ``[N, L]`` int arrays with a ``"padding_mask"``.
    batch_size: rows per forward pass.

  Returns:
    ``{"hidden": float16 [N, L, H], "padding_mask": int32 [N, L]}``.
  """
  mask = np.asarray(tokens[MASK_KEY])
  n, length = mask.shape
  lengths = np.where(mask.any(1), mask.shape[1] - np.argmax(mask[:, ::-1] != 0, axis=1), 1)
  order = np.argsort(-lengths, kind="stable")
  out = None
  for start in range(0, n, batch_size):
    rows = order[start:start + batch_size]
    cut = int(lengths[rows].max())
    h = np.asarray(lower({k: np.asarray(v)[rows, :cut] for k, v in tokens.items()},
                         training=False), np.float16)
    if out is None:
      out = np.zeros((n, length, h.shape[-1]), np.float16)
    out[rows, :cut] = h * mask[rows, :cut, None].astype(np.float16)
  return {HIDDEN_KEY: out, MASK_KEY: mask.astype(np.int32)}


def cache_lower_outputs_on_disk(lower, splits, cache_dir, batch_size=512):
  """:func:`cache_lower_outputs` of every split, kept in ``cache_dir`` for later runs.

  The entry's key is a SHA-256 of every split's token arrays and of the frozen
  ``lower`` model's weights (names, dtypes, shapes and bytes), so other
  sentences, another tokenization or another preset (or cut) give another entry,
  never a stale one. The entry holds outputs computed from the training
  sentences: keep ``cache_dir`` as private as the data.

  Args:
    lower: the frozen lower model of :func:`split_classifier` (no trainable weight).
    splits: ``{name: token dict}``, e.g. ``{"train": ..., "dev": ...}``.
    cache_dir: the cache folder; ``None``: compute, keep nothing.
    batch_size: rows per forward pass.

  Returns:
    ``({name: {"hidden", "padding_mask"}}, hit)``.

  Raises:
    ValueError: ``lower`` has a trainable weight (its outputs would go stale).
  """
  if lower.trainable_weights:
    raise ValueError("Only a frozen model's outputs can be cached; trainable: "
                     f"{[v.path for v in lower.trainable_weights]}.")
  names = sorted(splits)
  arrays = [np.asarray(splits[n][k]) for n in names for k in sorted(splits[n])]
  weights = [np.asarray(w) for w in lower.weights]
  key = cache_lib.digest(*arrays, settings={
      "format": 1, "splits": {n: sorted(splits[n]) for n in names},
      "weights": cache_lib.digest(*weights, settings=[w.path for w in lower.weights])})

  def compute():
    out = []
    for n in names:
      c = cache_lower_outputs(lower, splits[n], batch_size=batch_size)
      out += [c[HIDDEN_KEY], c[MASK_KEY]]
    return out

  files = [f"{n}_{k}" for n in names for k in (HIDDEN_KEY, MASK_KEY)]
  values, hit = cache_lib.cached(cache_dir, "text_lower", key, files, compute)
  return {n: {HIDDEN_KEY: values[2 * i], MASK_KEY: values[2 * i + 1]}
          for i, n in enumerate(names)}, hit


__all__ = ["HIDDEN_KEY", "MASK_KEY", "cache_lower_outputs", "cache_lower_outputs_on_disk",
           "split_classifier"]
