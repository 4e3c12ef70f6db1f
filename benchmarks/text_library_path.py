"""The new user's library path on real sentences, measured (issue 48).

all-MiniLM-L6-v2 (a local Hugging Face folder, ``scripts/sst2_setup.sh``) fine-tuned on
GLUE SST-2 sentences with ``tf_dpnsgd.models.text_classifier`` + ``make_private`` + plain
``fit`` + ``privacy_report`` (docs/text_library_path.md): no launcher, no feature cache.
Prints and appends one CSV row: dev accuracy, epsilon, seconds per step (median of the
steps after the first), the first step (tracing), peak RSS, wall time.

    python benchmarks/text_library_path.py --preset=$ROOT/all-MiniLM-L6-v2 \
        --data_dir=$ROOT/glue --train_examples=8192 --csv=results.csv
"""

from __future__ import annotations

import argparse
import csv
import os
import resource
import statistics
import time


def peak_rss_mb() -> float:
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--preset", required=True)
  parser.add_argument("--data_dir", required=True)
  parser.add_argument("--train_examples", type=int, default=8192,
                      help="the first N training sentences (0: all 67,349)")
  parser.add_argument("--batch_size", type=int, default=512)
  parser.add_argument("--epochs", type=int, default=3)
  parser.add_argument("--target_epsilon", type=float, default=8.0)
  parser.add_argument("--delta", type=float, default=1e-5)
  parser.add_argument("--learning_rate", type=float, default=1.0)
  parser.add_argument("--regularizer", type=float, default=1.0)
  parser.add_argument("--momentum", type=float, default=0.9)
  parser.add_argument("--trainable_layers", type=int, default=3)
  parser.add_argument("--sequence_length", type=int, default=66)
  parser.add_argument("--csv", default=None)
  args = parser.parse_args(argv)

  start = time.perf_counter()
  import keras
  import numpy as np

  import tf_dpnsgd
  from tf_dpnsgd.data import glue

  train_x, train_y, dev_x, dev_y = glue.load_sst2(args.data_dir)
  if args.train_examples:
    train_x, train_y = train_x[:args.train_examples], train_y[:args.train_examples]
  classifier, preprocessor = tf_dpnsgd.models.text_classifier(
      args.preset, num_classes=2, sequence_length=args.sequence_length, pooling="mean",
      trainable_layers=args.trainable_layers)

  def tokens(sentences):  # the task's own preprocessor, 1,024 strings at a time
    parts = [preprocessor(list(sentences[i:i + 1024])) for i in range(0, len(sentences), 1024)]
    return {k: np.concatenate([np.asarray(p[k]) for p in parts]) for k in parts[0]}

  x, x_dev = tokens(train_x), tokens(dev_x)
  y, y_dev = np.asarray(train_y, "int32"), np.asarray(dev_y, "int32")
  private = tf_dpnsgd.make_private(classifier, target_epsilon=args.target_epsilon,
                                   delta=args.delta, batch_size=args.batch_size,
                                   epochs=args.epochs,
                                   pretrained=os.path.basename(args.preset.rstrip("/")))
  private.compile(optimizer=tf_dpnsgd.DPNSGD(learning_rate=args.learning_rate,
                                             regularizer=args.regularizer,
                                             momentum=args.momentum),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])

  class StepTimes(keras.callbacks.Callback):
    dp_observes_only = True  # reads clocks, never the logs (tf_dpnsgd.coverage)

    def __init__(self):
      super().__init__()
      self.times, self._t = [], None

    def on_train_batch_begin(self, batch, logs=None):
      self._t = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
      self.times.append(time.perf_counter() - self._t)

  steps = StepTimes()
  fit_start = time.perf_counter()
  private.fit(x, y, verbose=2, callbacks=[steps])
  fit_s = time.perf_counter() - fit_start
  _, accuracy = private.evaluate(x_dev, y_dev, batch_size=256, verbose=0)
  report = private.privacy_report()
  row = {"model": "all-MiniLM-L6-v2 (mean pooling, top %d layers)" % args.trainable_layers,
         "train_examples": len(y), "batch_size": args.batch_size, "epochs": args.epochs,
         "steps": len(steps.times),
         "dev_accuracy": round(float(accuracy), 4), "epsilon": round(float(report.epsilon), 4),
         "delta": args.delta, "first_step_s": round(steps.times[0], 2),
         "median_step_s": round(statistics.median(steps.times[1:]), 3),
         "fit_s": round(fit_s, 1), "wall_s": round(time.perf_counter() - start, 1),
         "peak_rss_mb": round(peak_rss_mb())}
  print(report.statement())
  print(row)
  if args.csv:
    new = not os.path.exists(args.csv)
    with open(args.csv, "a", newline="") as f:
      writer = csv.DictWriter(f, fieldnames=list(row))
      if new:
        writer.writeheader()
      writer.writerow(row)


if __name__ == "__main__":
  main()
