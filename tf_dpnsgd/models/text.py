"""Text classifiers from keras-hub presets, split from their preprocessor.

DP training needs per-example gradients of a model on token ids, so the
classifier is returned WITHOUT its preprocessor: tokenize once with the
returned preprocessor (``preprocessor(sentences)`` -> dict of token tensors),
then ``tf_dpnsgd.make_private(classifier)`` and ``fit`` on those dicts.

Accepted presets (checked before anything is loaded):
  * a keras-hub built-in preset name, e.g. ``"roberta_base_en"`` (the paper's
    SST-2 model) or ``"bert_tiny_en_uncased"``; downloaded from Kaggle on
    first use, then cached;
  * a remote handle ``kaggle://...``, ``hf://...``, ``gs://...`` or
    ``modelscope://...`` (resolved by keras-hub);
  * a local keras-hub preset directory (written by ``save_to_preset``; its
    ``config.json`` names a Keras class, and ``tokenizer.json`` is needed);
  * a local Hugging Face checkpoint folder of a BERT or RoBERTa model:
    ``config.json`` (with ``model_type`` and ``architectures``),
    ``model.safetensors`` (or a sharded ``model.safetensors.index.json``) and
    the tokenizer files: ``vocab.txt`` + ``tokenizer_config.json`` (with
    ``do_lower_case``) for BERT, ``vocab.json`` + ``merges.txt`` for RoBERTa.
    keras-hub 0.32 reads such a folder offline from its plain path
    (``keras_hub.src.utils.preset_utils.get_preset_loader`` sees ``model_type``
    in ``config.json`` and converts the weights on load).
"""

from __future__ import annotations

import difflib
import json
import os

import keras

REMOTE_SCHEMES = ("kaggle", "hf", "gs", "modelscope")
HF_MODEL_TYPES = {
    "bert": ("vocab.txt", "tokenizer_config.json"),
    "roberta": ("vocab.json", "merges.txt"),
}
HF_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")

ACCEPTED_HELP = (
    "Accepted presets: a keras-hub built-in TextClassifier preset name (e.g. 'roberta_base_en', "
    "'bert_tiny_en_uncased'; list them with "
    "`sorted(keras_hub.models.TextClassifier.presets)`), a remote handle "
    f"({', '.join(s + '://' for s in REMOTE_SCHEMES)}), a local keras-hub preset directory "
    "written by `save_to_preset` (config.json + tokenizer.json + weights), or a local Hugging "
    "Face BERT/RoBERTa checkpoint folder (config.json, model.safetensors, and vocab.txt + "
    "tokenizer_config.json for BERT or vocab.json + merges.txt for RoBERTa).")


POOLINGS = ("cls", "mean")
#: ``lora_layers="all"``: every projection of a keras-hub transformer layer (Keras'
#: MultiHeadAttention's four EinsumDense and the feed-forward block's two Dense).
ALL_LORA_LAYERS = ("query", "key", "value", "attention_output", "feedforward_intermediate_dense",
                   "feedforward_output_dense")


@keras.saving.register_keras_serializable(package="tf_dpnsgd")
class MaskedMeanPooling(keras.layers.Layer):
  """Mean of a sequence's vectors over its real tokens: ``[B, T, H], [B, T] -> [B, H]``.

  Padding (``padding_mask`` 0) contributes nothing, so a row cut to its own
  length gives the same output (the length bucketing of ``make_private``'s
  ``length_key``). No variables, and it mixes no rows of the batch.
  """

  def call(self, sequence, padding_mask):
    mask = keras.ops.expand_dims(keras.ops.cast(padding_mask, sequence.dtype), -1)
    total = keras.ops.sum(sequence * mask, axis=1)
    count = keras.ops.maximum(keras.ops.sum(mask, axis=1), 1.0)
    return total / count

  def compute_output_shape(self, sequence_shape, padding_mask_shape=None):
    return (sequence_shape[0], sequence_shape[-1])


def text_classifier(preset, num_classes=2, sequence_length=128, freeze_embeddings=True,
                    lora_rank=0, pooling="cls", trainable_layers=None, dropout=0.1,
                    lora_layers=None):
  """Builds a pretrained keras-hub text classifier and its preprocessor.

  The classification head is new (randomly initialised for ``num_classes``);
  the encoder carries the preset's pretrained weights.

  ``freeze_embeddings=True`` makes the input embedding tables non-trainable:
  every embedding layer directly under the backbone (BERT: token, position
  and segment embeddings; RoBERTa: the token-and-position embedding). The
  embedding LayerNorm stays trainable. Frozen variables are left out of
  ``trainable_variables``, so they get no per-example gradient and no noise.
  Reference: Yang et al. (2022) freeze the embeddings when fine-tuning
  RoBERTa-base on SST-2. For comparison, the ``--static_embedding`` option of
  Li et al. (2021)'s private-transformers freezes ``get_input_embeddings()``,
  the word embeddings only; the position (and segment) tables are ~1% of the
  embedding parameters of RoBERTa-base, and freezing them too keeps the
  embedding lookup fixed as a whole.

  Args:
    preset: preset name, remote handle or local directory (see the module doc).
    num_classes: number of logits.
    sequence_length: tokens per example after packing (truncate / pad); at
      most the backbone's ``max_sequence_length``.
    freeze_embeddings: freeze the input embedding layers (see above).
    lora_rank: > 0: ``backbone.enable_lora(lora_rank)`` (keras-hub: LoRA factors on the
      attention query and value projections; their pretrained kernels frozen, named in
      the report's ``not_covered``); the layer-wise engine computes the factors'
      per-example gradients exactly (``docs/per_example.md``, "LoRA").
    lora_layers: with ``lora_rank``, the names of the sublayers that get LoRA
      factors: ``None`` keras-hub's default (attention query and value), ``"all"``
      (or ``["all"]``) every projection (:data:`ALL_LORA_LAYERS`: also key, attention output and the
      feed-forward block), or a list of layer names.
    pooling: ``"cls"``: the preset's own classifier (BERT: the pooler on the first
      token; RoBERTa: its head); ``"mean"``: the mean of the last layer's vectors over
      the real tokens, then dropout and a new ``Dense(num_classes)`` (sentence encoders
      such as all-MiniLM-L6-v2 were trained with mean pooling; their first token and
      pooler were not). The unused pooler is frozen.
    trainable_layers: ``None``: every encoder layer trains; ``k``: only the top ``k``
      transformer layers (and the head) train; the embeddings, their LayerNorm and the
      lower layers are frozen (named in the report's ``not_covered`` as frozen
      weights), which is what makes caching their outputs possible.
    dropout: the dropout rate before the new head (``pooling="mean"`` only).

  Returns:
    ``(classifier, preprocessor)``: a functional ``keras.Model`` mapping the
    token dict (``token_ids``, ``padding_mask`` and, for BERT,
    ``segment_ids``) to logits ``[batch, num_classes]``, and the keras-hub
    ``TextClassifierPreprocessor`` mapping a batch of strings to that dict.

  Raises:
    ValueError / FileNotFoundError: unknown preset or incomplete directory
      (before anything is loaded); ``sequence_length`` out of range.
    RuntimeError: a remote preset could not be fetched (e.g. offline).
  """
  if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 2:
    raise ValueError(f"`num_classes` must be an integer >= 2; got {num_classes!r}.")
  if isinstance(sequence_length, bool) or not isinstance(sequence_length, int) \
      or sequence_length < 2:
    raise ValueError(f"`sequence_length` must be an integer >= 2; got {sequence_length!r}.")
  preset = resolve_preset(preset)
  import keras_hub

  try:
    classifier = keras_hub.models.TextClassifier.from_preset(
        preset, num_classes=num_classes, preprocessor=None)
    preprocessor = keras_hub.models.TextClassifierPreprocessor.from_preset(
        preset, sequence_length=sequence_length)
  except Exception as e:
    if os.path.isdir(preset):
      raise
    raise RuntimeError(
        f"Could not load keras-hub preset '{preset}' ({type(e).__name__}: {e}). Built-in "
        "presets are downloaded from Kaggle on first use; offline, pass a local directory "
        f"instead. {ACCEPTED_HELP}") from e
  check_sequence_length(classifier.backbone, sequence_length)
  if freeze_embeddings:
    freeze_input_embeddings(classifier.backbone)
  if isinstance(lora_rank, bool) or not isinstance(lora_rank, int) or lora_rank < 0:
    raise ValueError(f"`lora_rank` must be an integer >= 0; got {lora_rank!r}.")
  if lora_rank:
    classifier.backbone.enable_lora(lora_rank, lora_target_names(classifier.backbone,
                                                                 lora_layers))
  elif lora_layers is not None:
    raise ValueError(f"`lora_layers` ({lora_layers!r}) needs `lora_rank` > 0.")
  if pooling not in POOLINGS:
    raise ValueError(f"`pooling` must be one of {POOLINGS}; got {pooling!r}.")
  if trainable_layers is not None:
    freeze_lower_layers(classifier.backbone, trainable_layers)
  if pooling == "mean":
    classifier = mean_pooled_classifier(classifier.backbone, num_classes, dropout)
  # make_private names the source in the privacy report (tf_dpnsgd.coverage.PRETRAINED_ATTRIBUTE).
  classifier.dp_pretrained_source = f"keras-hub preset {preset}"
  return classifier, preprocessor


def lora_target_names(backbone, lora_layers) -> list[str] | None:
  """The names ``backbone.enable_lora`` gets for ``lora_layers`` (see :func:`text_classifier`).

  Raises:
    ValueError: a name that no LoRA-capable sublayer of ``backbone`` has (a typo
      would otherwise train nothing there, silently).
  """
  if lora_layers is None:
    return None
  all_ = lora_layers == "all" or list(lora_layers) == ["all"]  # a flag's list, too
  names = list(ALL_LORA_LAYERS) if all_ else list(lora_layers)
  # pylint: disable-next=protected-access
  capable = {layer.name for layer in backbone._flatten_layers(include_self=False)
             if hasattr(layer, "enable_lora") and layer.weights}
  unknown = [n for n in names if n not in capable]
  if unknown or not names:
    raise ValueError(f"`lora_layers` names no LoRA-capable layer of backbone '{backbone.name}': "
                     f"{unknown or names}; its LoRA-capable layers are {sorted(capable)} "
                     "(or pass 'all').")
  return names


def freeze_lower_layers(backbone, trainable_layers) -> list[str]:
  """Freezes all but the top ``trainable_layers`` transformer layers of ``backbone``
  (and, below them, the embeddings and their LayerNorm).

  Returns:
    Names of the layers frozen.

  Raises:
    ValueError: ``trainable_layers`` is not an integer in ``[0, number of layers]``,
      or the backbone has no ``transformer_layers``.
  """
  layers = list(getattr(backbone, "transformer_layers", None) or ())
  if not layers:
    raise ValueError(f"Backbone '{backbone.name}' ({type(backbone).__name__}) has no "
                     "`transformer_layers`; pass trainable_layers=None.")
  if isinstance(trainable_layers, bool) or not isinstance(trainable_layers, int) \
      or not 0 <= trainable_layers <= len(layers):
    raise ValueError(f"`trainable_layers` must be an integer in [0, {len(layers)}] (the "
                     f"backbone's layers); got {trainable_layers!r}.")
  if trainable_layers == len(layers):
    return []
  frozen = layers[:len(layers) - trainable_layers]
  frozen += [layer for layer in backbone.layers
             if isinstance(layer, _embedding_types()) or layer.name == "embeddings_layer_norm"]
  for layer in frozen:
    freeze(layer)
  return [layer.name for layer in frozen]


def freeze(layer) -> None:
  """Sets ``layer`` and every layer nested in it non-trainable (``layer.trainable = False``
  does not reach sublayers a layer made trainable later, e.g. ``enable_lora``'s)."""
  # pylint: disable-next=protected-access
  for sub in layer._flatten_layers(include_self=True, recursive=True):
    sub.trainable = False


def mean_pooled_classifier(backbone, num_classes, dropout=0.1) -> keras.Model:
  """``backbone`` -> masked mean of its last layer -> dropout -> ``Dense(num_classes)``."""
  inputs = {name: keras.Input(shape=(None,), dtype="int32", name=name)
            for name in backbone.input}
  outputs = backbone(inputs)
  sequence = outputs["sequence_output"] if isinstance(outputs, dict) else outputs
  for layer in backbone.layers:  # the pooler (BERT) reads only the first token: unused here
    if layer.name == "pooled_dense":
      layer.trainable = False
  pooled = MaskedMeanPooling(name="mean_pooling")(sequence, inputs["padding_mask"])
  if dropout:
    pooled = keras.layers.Dropout(dropout, name="head_dropout")(pooled)
  logits = keras.layers.Dense(num_classes, name="logits")(pooled)
  return keras.Model(inputs, logits, name=f"{backbone.name}_mean_classifier")


def resolve_preset(preset) -> str:
  """Checks that ``preset`` is a loadable text-classifier preset, without loading it.

  Args:
    preset: see :func:`text_classifier`.

  Returns:
    The preset as a string (a local path, a handle or a built-in name).

  Raises:
    TypeError: not a string or path.
    FileNotFoundError: a local path that does not exist, or a directory that
      lacks required files (the message lists them).
    ValueError: an unknown name or an unsupported checkpoint.
  """
  if not isinstance(preset, (str, os.PathLike)):
    raise TypeError(f"`preset` must be a string or path; got {type(preset).__name__}. "
                    f"{ACCEPTED_HELP}")
  preset = os.fspath(preset)
  if os.path.isdir(preset):
    validate_local_preset(preset)
    return preset
  if "://" in preset:
    scheme = preset.split("://", 1)[0].lower()
    if scheme in REMOTE_SCHEMES:
      return preset
    raise ValueError(f"Unknown preset scheme '{scheme}://' in '{preset}'. {ACCEPTED_HELP}")
  builtin = builtin_presets()
  if preset in builtin:
    return preset
  if os.sep in preset or preset.startswith((".", "~")):
    raise FileNotFoundError(f"Preset directory '{preset}' does not exist. {ACCEPTED_HELP}")
  close = difflib.get_close_matches(preset, builtin, n=3)
  hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
  raise ValueError(f"Unknown preset '{preset}'.{hint} {ACCEPTED_HELP}")


def builtin_presets() -> list[str]:
  """Names of keras-hub's built-in text-classifier presets."""
  import keras_hub
  return sorted(keras_hub.models.TextClassifier.presets)


def validate_local_preset(path) -> str:
  """Checks a local preset directory for the files keras-hub will read.

  Args:
    path: a keras-hub preset directory or a Hugging Face BERT/RoBERTa folder.

  Returns:
    ``"keras"`` or ``"transformers"``: the directory's format.

  Raises:
    FileNotFoundError: a required file is missing (all missing files named).
    ValueError: ``config.json`` is unreadable or of an unsupported model type.
  """
  config_path = os.path.join(path, "config.json")
  if not os.path.isfile(config_path):
    raise FileNotFoundError(f"'{path}' has no config.json, so it is not a model preset. "
                            f"{ACCEPTED_HELP}")
  try:
    with open(config_path, encoding="utf-8") as f:
      config = json.load(f)
  except (OSError, ValueError) as e:
    raise ValueError(f"{config_path} is not valid JSON ({e}).") from e
  if isinstance(config, dict) and "registered_name" in config:
    if not os.path.isfile(os.path.join(path, "tokenizer.json")):
      raise FileNotFoundError(
          f"keras-hub preset '{path}' has no tokenizer.json. Save the tokenizer with the model: "
          "`classifier.save_to_preset(dir)` on a classifier that has a preprocessor, or "
          "`preprocessor.save_to_preset(dir)` into the same directory.")
    return "keras"
  if isinstance(config, dict) and "model_type" in config:
    _validate_hf_folder(path, config)
    return "transformers"
  raise ValueError(f"Unrecognised config.json in '{path}' (neither a keras-hub preset nor a "
                   f"Hugging Face checkpoint). {ACCEPTED_HELP}")


def _validate_hf_folder(path, config):
  model_type = config["model_type"]
  if model_type not in HF_MODEL_TYPES:
    raise ValueError(
        f"Hugging Face checkpoint '{path}' has model_type '{model_type}'; supported: "
        f"{', '.join(sorted(HF_MODEL_TYPES))} (or convert it to a keras-hub preset).")
  if not config.get("architectures"):
    raise ValueError(f"{path}/config.json lacks 'architectures' (e.g. "
                     f"[\"{model_type.capitalize()}ForMaskedLM\"]); keras-hub needs it.")
  missing = [f for f in HF_MODEL_TYPES[model_type] if not os.path.isfile(os.path.join(path, f))]
  if not any(os.path.isfile(os.path.join(path, f)) for f in HF_WEIGHT_FILES):
    missing.append(" or ".join(HF_WEIGHT_FILES) + " (PyTorch .bin weights are not read; "
                   "save with safe_serialization=True)")
  if missing:
    raise FileNotFoundError(f"Hugging Face {model_type} checkpoint '{path}' is missing: "
                            f"{'; '.join(missing)}.")
  if model_type == "bert":
    with open(os.path.join(path, "tokenizer_config.json"), encoding="utf-8") as f:
      if "do_lower_case" not in json.load(f):
        raise ValueError(f"{path}/tokenizer_config.json must set \"do_lower_case\" (true for "
                         "uncased checkpoints); keras-hub reads it to build the tokenizer.")


def check_sequence_length(backbone, sequence_length):
  """Raises ``ValueError`` if ``sequence_length`` exceeds the backbone's position table."""
  limit = getattr(backbone, "max_sequence_length", None)
  if limit is not None and sequence_length > limit:
    raise ValueError(f"`sequence_length`={sequence_length} exceeds the backbone's "
                     f"max_sequence_length={limit}.")


def _embedding_types():
  import keras_hub
  return (keras.layers.Embedding, keras_hub.layers.PositionEmbedding,
          keras_hub.layers.TokenAndPositionEmbedding)


def freeze_input_embeddings(backbone) -> list[str]:
  """Sets the embedding layers directly under ``backbone`` non-trainable.

  Args:
    backbone: a keras-hub backbone (e.g. ``classifier.backbone``).

  Returns:
    Names of the frozen layers.

  Raises:
    ValueError: the backbone has no embedding layer at its top level.
  """
  frozen = [layer for layer in backbone.layers if isinstance(layer, _embedding_types())]
  if not frozen:
    raise ValueError(f"Backbone '{backbone.name}' ({type(backbone).__name__}) has no embedding "
                     "layer at its top level to freeze; pass freeze_embeddings=False.")
  for layer in frozen:
    layer.trainable = False
  return [layer.name for layer in frozen]


__all__ = ["ACCEPTED_HELP", "MaskedMeanPooling", "builtin_presets", "check_sequence_length",
           "freeze", "freeze_lower_layers", "mean_pooled_classifier",
           "freeze_input_embeddings", "resolve_preset", "text_classifier",
           "validate_local_preset"]
