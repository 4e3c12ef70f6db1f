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

from absl import app
from absl import flags
import keras
import numpy as np
import tensorflow as tf

from tf_dpnsgd import export as export_lib
from tf_dpnsgd.data import glue
from tf_dpnsgd.launch import canary_audit
from tf_dpnsgd.launch import allocator
from tf_dpnsgd.launch import common
from tf_dpnsgd.models import text

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
                     "attention query/value projections (backbone.enable_lora); the "
                     "pretrained weights stay frozen.")
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


def main(argv):
  del argv
  FLAGS = flags.FLAGS
  cfg = common.config_from_flags()
  classifier, preprocessor = text.text_classifier(
      FLAGS.preset, num_classes=2, sequence_length=FLAGS.sequence_length,
      freeze_embeddings=FLAGS.freeze_embeddings, lora_rank=FLAGS.lora_rank)
  train_s, train_y, dev_s, dev_y = glue.load_sst2(FLAGS.data_dir)
  if FLAGS.max_train_examples:
    train_s, train_y = train_s[:FLAGS.max_train_examples], train_y[:FLAGS.max_train_examples]
  x_train, x_dev = tokenize(preprocessor, train_s), tokenize(preprocessor, dev_s)

  def export_fn(model, export_dir):
    export_lib.export_text_classifier(model, preprocessor, export_dir)

  record, audit_block = canary_audit.run_experiment(
      cfg, canary_audit.spec_from_flags(), lambda: classifier,
      (x_train, common.as_numpy_labels(train_y)), (x_dev, common.as_numpy_labels(dev_y)),
      num_classes=2,
      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), export_fn=export_fn,
      length_key=("padding_mask" if FLAGS.bucket_by_length and "padding_mask" in x_train
                  else None),
      not_covered=(f"Pretrained weights of preset {FLAGS.preset!r}: the encoder starts from "
                   "them (those frozen are listed above); the epsilon assumes they are public "
                   "(pretrained on public data) and does not cover them.",),
      extra_report={"dataset": "glue/sst2", "preset": FLAGS.preset,
                    "freeze_embeddings": FLAGS.freeze_embeddings, "lora_rank": FLAGS.lora_rank,
                    "sequence_length": FLAGS.sequence_length})
  print(f"dev accuracy {record.metric('accuracy', float('nan')):.4f}; "
        f"{record.epsilon_text()} after {record.steps} steps")
  canary_audit.print_audit(audit_block)


if __name__ == "__main__":
  allocator.maybe_reexec()  # tcmalloc where installed: see tf_dpnsgd.launch.allocator
  app.run(common.main_with_usage_errors(main))
