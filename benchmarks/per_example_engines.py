"""DP step time and peak memory relative to a non-private step, per engine.

Usage (from the repository root)::

    python benchmarks/per_example_engines.py                      # layer-wise engine, 3 models
    python benchmarks/per_example_engines.py --engines layerwise,vectorized --steps 12

For each (model, engine) pair a fresh subprocess builds the model twice (a
plain ``keras.Model`` compiled with SGD, and ``tf_dpnsgd.make_private`` of a
copy compiled with DPNSGD, noise multiplier 1) and then alternates one
non-private and one DP ``train_on_batch`` on the same random batch, so that
both see the same machine load. After ``--warmup`` steps of each (tracing
included), ``--steps`` steps of each are timed; the table reports medians and
the ratio of medians.

Memory: TensorFlow's allocator statistics (``tf.config.experimental
.get_memory_info``), reset before each step. "step MB" is the peak during the
step minus what was allocated before it (weights, optimizer state, inputs),
i.e. the step's working memory; "peak MB" is the absolute peak. Memory that
oneDNN allocates outside TensorFlow's allocator is not counted (for either).

Models (issue 5): (a) ResNet20-GN, CIFAR shapes, batch 256; (b) transformer
classifier, vocabulary 8000, width 128, 2 layers, 2 heads, sequence 64,
batch 64; (c) keras-hub BERT of MiniLM-L6 size (6 layers, hidden 384, 12
heads, intermediate 1536, sequence 128, random weights), batch 32.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

MODELS = ("resnet20", "transformer", "bert")


def build(name):
  """Returns ``(make_model, x, y, batch)``; ``make_model()`` builds a fresh copy."""
  import keras
  import numpy as np

  rng = np.random.default_rng(0)
  if name == "resnet20":
    from tf_dpnsgd.models import resnet20

    batch = 256
    x = rng.normal(size=(batch, 32, 32, 3)).astype("float32")
    y = rng.integers(0, 10, size=(batch,)).astype("int32")
    return (lambda: resnet20()), x, y, batch
  if name == "transformer":
    import keras_hub

    batch, seq, vocab, width = 64, 64, 8000, 128

    def make():
      tokens = keras.Input((seq,), dtype="int32", name="tokens")
      h = keras_hub.layers.TokenAndPositionEmbedding(vocab, seq, width)(tokens)
      for _ in range(2):
        h = keras_hub.layers.TransformerEncoder(intermediate_dim=4 * width, num_heads=2,
                                                dropout=0.1)(h)
      h = keras.layers.GlobalAveragePooling1D()(h)
      return keras.Model(tokens, keras.layers.Dense(2)(h), name="transformer")

    x = rng.integers(0, vocab, size=(batch, seq)).astype("int32")
    y = rng.integers(0, 2, size=(batch,)).astype("int32")
    return make, x, y, batch
  if name == "bert":
    import keras_hub

    batch, seq, vocab = 32, 128, 30522

    def make():
      backbone = keras_hub.models.BertBackbone(
          vocabulary_size=vocab, num_layers=6, num_heads=12, hidden_dim=384,
          intermediate_dim=1536, max_sequence_length=512)
      return keras_hub.models.BertTextClassifier(backbone=backbone, num_classes=2,
                                                 preprocessor=None)

    x = {"token_ids": rng.integers(0, vocab, size=(batch, seq)).astype("int32"),
         "segment_ids": np.zeros((batch, seq), "int32"),
         "padding_mask": np.ones((batch, seq), "int32")}
    y = rng.integers(0, 2, size=(batch,)).astype("int32")
    return make, x, y, batch
  if name == "bert_lora":
    # LoRA fine-tuning (issue 32): a small BERT (4 layers, hidden 256, 4 heads), sequence 64,
    # backbone.enable_lora(8): only the query/value LoRA factors, their biases and the
    # classifier head are trainable, in the plain model as in the DP one.
    import keras_hub

    batch, seq, vocab = 32, 64, 30522

    def make():
      backbone = keras_hub.models.BertBackbone(
          vocabulary_size=vocab, num_layers=4, num_heads=4, hidden_dim=256,
          intermediate_dim=1024, max_sequence_length=seq)
      model = keras_hub.models.BertTextClassifier(backbone=backbone, num_classes=2,
                                                  preprocessor=None)
      backbone.enable_lora(8)
      return model

    x = {"token_ids": rng.integers(0, vocab, size=(batch, seq)).astype("int32"),
         "segment_ids": np.zeros((batch, seq), "int32"),
         "padding_mask": np.ones((batch, seq), "int32")}
    y = rng.integers(0, 2, size=(batch,)).astype("int32")
    return make, x, y, batch
  if name in ("scatter_cnn", "scatter_cnn_2views"):
    # Tramer and Boneh's CNN on CIFAR-10 scattering features ([8, 8, 243], random here),
    # the physical batch of configs/cifar10/scatter_cnn_*.flags; 2 views: the head on each
    # view with shared weights (tf_dpnsgd.models.views), loss = mean over views (see LOSSES).
    from tf_dpnsgd.models import scatternet
    from tf_dpnsgd.models import views

    batch, num_views = 512, (2 if name.endswith("2views") else 1)
    shape = (batch, num_views, 8, 8, 243) if num_views > 1 else (batch, 8, 8, 243)
    x = rng.normal(size=shape).astype("float32")
    y = rng.integers(0, 10, size=(batch,)).astype("int32")

    def make():
      head = scatternet.scatter_cnn()
      return views.multi_view(head, num_views) if num_views > 1 else head

    return make, x, y, batch
  import families  # the support table's families at realistic size (benchmarks/families.py)

  if name in families.FAMILIES:
    return families.build(name)
  raise ValueError(f"unknown model {name!r}")


def loss_for(name):
  """The per-example loss of ``build(name)``'s model."""
  import keras

  if name.endswith("views"):
    from tf_dpnsgd.models import views

    return views.view_mean_loss()
  return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def run_one(model_name, engine, steps, warmup):
  """Measures one (model, engine) pair in this process; returns a dict."""
  import keras
  import tensorflow as tf

  import tf_dpnsgd

  keras.utils.set_random_seed(0)
  make, x, y, batch = build(model_name)
  loss = loss_for(model_name)
  plain = make()
  plain.compile(optimizer=keras.optimizers.SGD(0.01), loss=loss)
  private = tf_dpnsgd.make_private(make(), per_example=engine,
                                   trust_untagged_batches=True)  # timing: synthetic batches
  private.compile(optimizer=tf_dpnsgd.DPNSGD(learning_rate=0.01, regularizer=0.1,
                                             noise_multiplier=1.0, seed=0), loss=loss)
  x = tf.nest.map_structure(tf.convert_to_tensor, x)
  y = tf.convert_to_tensor(y)

  def step(model):
    tf.config.experimental.reset_memory_stats("CPU:0")
    before = tf.config.experimental.get_memory_info("CPU:0")["current"]
    start = time.perf_counter()
    model.train_on_batch(x, y)
    elapsed = time.perf_counter() - start
    peak = tf.config.experimental.get_memory_info("CPU:0")["peak"]
    return elapsed, peak - before, peak

  for _ in range(warmup):
    step(plain)
    step(private)
  times = {"plain": [], "dp": []}
  work = {"plain": [], "dp": []}
  peaks = {"plain": [], "dp": []}
  for _ in range(steps):
    for key, model in (("plain", plain), ("dp", private)):
      t, w, p = step(model)
      times[key].append(t)
      work[key].append(w)
      peaks[key].append(p)
  med = {k: statistics.median(v) for k, v in times.items()}
  mem = {k: max(v) for k, v in work.items()}
  peak = {k: max(v) for k, v in peaks.items()}
  return {"model": model_name, "engine": engine, "batch": batch, "steps": steps,
          "plain_s": med["plain"], "dp_s": med["dp"], "time_ratio": med["dp"] / med["plain"],
          "plain_step_mb": mem["plain"] / 2**20, "dp_step_mb": mem["dp"] / 2**20,
          "mem_ratio": mem["dp"] / mem["plain"],
          "plain_peak_mb": peak["plain"] / 2**20, "dp_peak_mb": peak["dp"] / 2**20}


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--models", default=",".join(MODELS))
  parser.add_argument("--engines", default="layerwise")
  parser.add_argument("--steps", type=int, default=15)
  parser.add_argument("--warmup", type=int, default=2)
  parser.add_argument("--child", help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.steps < 1 or args.warmup < 1:
    parser.error("--steps and --warmup must be >= 1")

  if args.child:
    model_name, engine = args.child.split(":")
    print("RESULT " + json.dumps(run_one(model_name, engine, args.steps, args.warmup)))
    return 0

  rows = []
  for model_name in args.models.split(","):
    for engine in args.engines.split(","):
      cmd = [sys.executable, os.path.abspath(__file__), "--child", f"{model_name}:{engine}",
             "--steps", str(args.steps), "--warmup", str(args.warmup)]
      proc = subprocess.run(cmd, capture_output=True, text=True)
      lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
      if proc.returncode != 0 or not lines:
        if proc.returncode < 0:
          error = f"crashed (signal {-proc.returncode})"
        else:
          tail = [l for l in (proc.stderr or "").strip().splitlines() if "Error" in l][-1:]
          error = f"exit {proc.returncode}: {' '.join(tail)}"
        rows.append({"model": model_name, "engine": engine, "error": error})
      else:
        rows.append(json.loads(lines[-1][len("RESULT "):]))
      print(json.dumps(rows[-1]), file=sys.stderr, flush=True)

  import platform

  print(f"\nCPU: {platform.processor() or platform.machine()}, {os.cpu_count()} logical cores; "
        f"medians over {args.steps} steps after {args.warmup} warm-up steps.\n")
  print("| model | batch | engine | non-private step (s) | DP step (s) | time ratio "
        "| non-private step MB | DP step MB | memory ratio |")
  print("|---|---|---|---|---|---|---|---|---|")
  for r in rows:
    if "error" in r:
      print(f"| {r['model']} | | {r['engine']} | failed: {r['error']} | | | | | |")
      continue
    print(f"| {r['model']} | {r['batch']} | {r['engine']} | {r['plain_s']:.3f} | {r['dp_s']:.3f} "
          f"| {r['time_ratio']:.2f}x | {r['plain_step_mb']:.0f} | {r['dp_step_mb']:.0f} "
          f"| {r['mem_ratio']:.2f}x |")
  return 0


if __name__ == "__main__":
  sys.exit(main())
