r"""Fine-tune a keras-hub text classifier on GLUE SST-2 with DP (Yang et al. 2022, Sec. 5.2).

  python -m tf_dpnsgd.launch.sst2 --flagfile=configs/sst2/dpnsgd_eps8.flags \
      --preset=roberta_base_en --data_dir=$HOME/glue --model_dir=runs/sst2

--preset: a keras-hub preset name (the paper: RoBERTa-base, `roberta_base_en`)
or a local folder: a keras-hub preset or a Hugging Face BERT/RoBERTa
checkpoint (config.json + model.safetensors + vocab files), loaded offline.
Data: --data_dir with GLUE's SST-2 `train.tsv`/`dev.tsv`, else tfds
`glue/sst2`. The exported SavedModel takes raw sentences.
``--audit_canaries=N --audit_canary_kind=input`` audits the run with the last N
training sentences relabeled as canaries (:mod:`tf_dpnsgd.launch.canary_audit`;
the text models take two inputs, so the white-box kind is refused).

The model owns its privacy plan (``make_private(model, plan=...)``) and trains
with a plain ``fit(x, y, validation_data=...)``, the one-call path
(:mod:`tf_dpnsgd.runner`); ``--distribution_strategy`` or ``--max_steps`` takes the
explicit one.
"""

from __future__ import annotations

import dataclasses
import os
import time

from absl import app
from absl import flags
from absl import logging
import keras
import numpy as np
import tensorflow as tf

from tf_dpnsgd import export as export_lib
from tf_dpnsgd.data import glue
from tf_dpnsgd.launch import canary_audit
from tf_dpnsgd.launch import allocator
from tf_dpnsgd.launch import common
from tf_dpnsgd.models import text
from tf_dpnsgd.models import text_cache

# The paper's setting: batch 1000, 10 epochs, epsilon 8, delta 1e-5, embeddings frozen.
common.define_flags(optimizer="dpnsgd", learning_rate=0.5, regularizer=0.01, l2_norm_clip=1.0,
                    target_epsilon=8.0, delta=1e-5, batch_size=1000, physical_batch_size=50,
                    epochs=10, sampling="poisson", lr_schedule="constant", momentum=0.0)
flags.DEFINE_string("preset", "roberta_base_en", "keras-hub preset name or local folder.")
flags.DEFINE_boolean("freeze_embeddings", True, "Freeze the input embeddings (the paper does).")
flags.DEFINE_integer("sequence_length", 128, "Tokens per sentence.")
flags.DEFINE_string("data_dir", None, "GLUE folder (SST-2/train.tsv, dev.tsv); else tfds.")
flags.DEFINE_integer("max_train_examples", None, "Use only the first N training sentences.")
flags.DEFINE_integer("lora_rank", 0, "> 0: fine-tune LoRA factors of this rank on the "
                     "attention query/value projections, or those --lora_layers names "
                     "(backbone.enable_lora); the pretrained weights stay frozen.")
flags.DEFINE_list("lora_layers", None, "With --lora_rank: the sublayers that get LoRA factors: "
                  "'all' (query, key, value, attention_output, feedforward_intermediate_dense, "
                  "feedforward_output_dense) or a list of layer names. Default: keras-hub's "
                  "(attention query and value).")
flags.DEFINE_enum("pooling", "cls", ["cls", "mean"],
                  "cls: the preset's classifier (BERT's pooler on [CLS]); mean: masked mean of the "
                  "last layer, dropout, a new Dense head (sentence encoders such as "
                  "all-MiniLM-L6-v2 were trained with mean pooling).")
flags.DEFINE_integer("trainable_layers", None,
                     "Train only the top k transformer layers (and the head); the embeddings and "
                     "the lower layers stay frozen at the preset's weights. Default: all.")
flags.DEFINE_bool("cache_frozen_layers", False,
                  "With --trainable_layers: compute the frozen lower layers once per sentence "
                  "(inference mode, float16) and train the top layers on that cache "
                  "(tf_dpnsgd.models.text_cache); needs --pooling=mean. With --lora_rank, "
                  "the LoRA factors of the top k layers train. --trainable_layers=0 caches the "
                  "whole encoder and trains the head alone (a linear probe).")
flags.DEFINE_string("feature_cache_dir", None,
                    "With --cache_frozen_layers: keep the frozen layers' outputs in this folder, "
                    "keyed by a checksum of the token ids and the frozen weights, for later runs "
                    "(sweeps). It holds values computed from the training sentences: keep it as "
                    "private as the data.")
canary_audit.define_flags()


flags.DEFINE_bool("bucket_by_length", True,
                  "Cut each physical chunk (--physical_batch_size) of a logical batch to its own "
                  "longest sentence (rows ordered by length after the batch is drawn): the same "
                  "sum, noise and epsilon, less padding (docs/per_example.md).")
# `--help` lists the shared flags a run needs (target_epsilon, epochs, ...), not only ours.
flags.adopt_module_key_flags(common)
flags.adopt_module_key_flags(canary_audit)

def planned_dataset_size(flag_values) -> int:
  """Training-set size for these flags (used by the sweep's --dry_run)."""
  n = 67349  # GLUE SST-2 train
  if flag_values.data_dir:
    n = len(glue.load_sst2(flag_values.data_dir)[1])
  return min(n, flag_values.max_train_examples or n)


def tokenize(preprocessor, sentences, batch=256):
  """Runs the keras-hub preprocessor once over all sentences -> dict of int arrays."""
  parts = []
  for i in range(0, len(sentences), batch):
    out = preprocessor(tf.constant(list(sentences[i:i + batch])))
    parts.append({k: np.asarray(v) for k, v in out.items()})
  return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


def check_export(record, model_dir, export_dir, sentences, labels):
  """Adds the export's dev accuracy on raw sentences to the record and its reports."""
  accuracy = export_lib.serving_accuracy(export_dir, list(sentences), labels,
                                         input_name="sentences", batch_size=256)
  record = dataclasses.replace(record, extra={**record.extra,
                                              "exported_dev_accuracy": accuracy})
  for folder in (model_dir, export_dir):
    if folder:
      export_lib.write_privacy_report(os.path.join(folder, "privacy_report.json"),
                                      **record.to_dict())
  print(f"exported SavedModel on raw dev sentences: accuracy {accuracy:.4f}")
  return record


def main(argv):
  del argv
  FLAGS = flags.FLAGS
  cfg = common.config_from_flags()
  cache = FLAGS.cache_frozen_layers
  if cache and (FLAGS.trainable_layers is None or FLAGS.pooling != "mean"):
    raise common.LaunchError("--cache_frozen_layers needs --trainable_layers=k (the layers above "
                             "the cache) and --pooling=mean.")
  if FLAGS.feature_cache_dir and not cache:
    raise common.LaunchError("--feature_cache_dir keeps the frozen layers' outputs of "
                             "--cache_frozen_layers; add that flag or drop this one.")
  classifier, preprocessor = text.text_classifier(
      FLAGS.preset, num_classes=2, sequence_length=FLAGS.sequence_length,
      freeze_embeddings=FLAGS.freeze_embeddings, lora_rank=FLAGS.lora_rank,
      lora_layers=FLAGS.lora_layers,
      pooling="cls" if cache else FLAGS.pooling,
      trainable_layers=None if cache else FLAGS.trainable_layers)
  train_s, train_y, dev_s, dev_y = glue.load_sst2(FLAGS.data_dir)
  if FLAGS.max_train_examples:
    train_s, train_y = train_s[:FLAGS.max_train_examples], train_y[:FLAGS.max_train_examples]
  started = time.time()
  x_train, x_dev = tokenize(preprocessor, train_s), tokenize(preprocessor, dev_s)
  served = classifier
  if cache:
    lower, classifier, served = text_cache.split_classifier(
        classifier.backbone, FLAGS.trainable_layers, num_classes=2)
    cached_splits, cache_hit = text_cache.cache_lower_outputs_on_disk(
        lower, {"train": x_train, "dev": x_dev}, FLAGS.feature_cache_dir)
    x_train, x_dev = cached_splits["train"], cached_splits["dev"]
    cached = [layer.name for layer in lower.layers if layer.weights]
    not_covered = (f"Frozen lower layers {cached} of preset {FLAGS.preset!r}, run once per "
                   "sentence without dropout (--cache_frozen_layers; their float16 outputs are "
                   "the training rows): public weights, not covered by the epsilon.",)
  else:
    not_covered, cache_hit = (), False
  logging.info("Tokenized%s %d + %d sentences in %.0f s.", " and cached" if cache else "",
               len(train_s), len(dev_s), time.time() - started)

  def export_fn(model, export_dir):
    del model  # `served` holds the same (trained) layers, on token ids
    export_lib.export_text_classifier(served, preprocessor, export_dir)

  record, audit_block = canary_audit.run_experiment(
      cfg, canary_audit.spec_from_flags(), lambda: classifier,
      (x_train, common.as_numpy_labels(train_y)), (x_dev, common.as_numpy_labels(dev_y)),
      num_classes=2,
      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), export_fn=export_fn,
      length_key=("padding_mask" if FLAGS.bucket_by_length and "padding_mask" in x_train
                  else None),
      # Without the cache the model itself names its preset (make_private records it in the
      # ledger: models.text_classifier); the cached split does not carry the backbone.
      not_covered=not_covered + ((
          f"Pretrained weights of preset {FLAGS.preset!r}: the encoder starts from them (those "
          "frozen are listed above); the epsilon assumes they are public (pretrained on public "
          "data) and does not cover them.",) if cache else ()),
      extra_report={"dataset": (f"SST-2-format TSV files in {FLAGS.data_dir}" if FLAGS.data_dir
                                else "glue/sst2 (tensorflow-datasets)"), "preset": FLAGS.preset,
                    "freeze_embeddings": FLAGS.freeze_embeddings, "lora_rank": FLAGS.lora_rank,
                    "lora_layers": FLAGS.lora_layers,
                    "sequence_length": FLAGS.sequence_length, "pooling": FLAGS.pooling,
                    "trainable_layers": FLAGS.trainable_layers, "cache_frozen_layers": cache,
                    "feature_cache_hit": cache_hit})
  if FLAGS.export_dir:  # the served model on raw sentences, beside the Keras model's number
    record = check_export(record, FLAGS.model_dir, FLAGS.export_dir, dev_s, dev_y)
  print(f"dev accuracy {record.metric('accuracy', float('nan')):.4f}; "
        f"{record.epsilon_text()} after {record.steps} steps")
  canary_audit.print_audit(audit_block)


if __name__ == "__main__":
  allocator.maybe_reexec()  # tcmalloc where installed: see tf_dpnsgd.launch.allocator
  app.run(common.main_with_usage_errors(main))
