r"""Speed of the scattering transform: tf_dpnsgd.models.Scattering2D vs Kymatio's NumPy frontend.

  python benchmarks/scattering_speed.py [--batch=256] [--repeats=5] \
      [--kymatio_python=/tmp/venv-kymatio/bin/python]

Prints milliseconds per 32x32 RGB image (J=2, L=8, order 2) for the TF layer with
and without XLA, and, when --kymatio_python names an interpreter with
kymatio==0.3.0 installed (see scripts/make_scattering_fixture.py), for
Kymatio's NumPy frontend on the same batch size, timed in alternation with
the TF runs so that a shared machine's load affects both alike.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402

KYMATIO_SNIPPET = r"""
import sys, time, numpy as np
from kymatio.numpy import Scattering2D
batch, repeats = int(sys.argv[1]), int(sys.argv[2])
x = np.random.default_rng(0).uniform(0, 1, (batch, 3, 32, 32)).astype(np.float32)
s = Scattering2D(J=2, shape=(32, 32), L=8)
s(x[:2])
best = float("inf")
for _ in range(repeats):
  t = time.perf_counter(); s(x); best = min(best, time.perf_counter() - t)
print(best / batch * 1000)
"""


def time_tf(layer_kwargs, batch, repeats):
  import tensorflow as tf
  from tf_dpnsgd.models import Scattering2D
  layer = Scattering2D(**layer_kwargs)
  x = tf.constant(np.random.default_rng(0).uniform(0, 255, (batch, 32, 32, 3)), tf.float32)
  fn = tf.function(lambda images: layer(images))
  fn(x).numpy()
  best = float("inf")
  for _ in range(repeats):
    start = time.perf_counter()
    fn(x).numpy()
    best = min(best, time.perf_counter() - start)
  return best / batch * 1000


def time_kymatio(python, batch, repeats):
  out = subprocess.run([python, "-c", KYMATIO_SNIPPET, str(batch), str(repeats)],
                       capture_output=True, text=True, check=True)
  return float(out.stdout.strip().splitlines()[-1])


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--batch", type=int, default=256)
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--rounds", type=int, default=2, help="alternations of all timings")
  parser.add_argument("--kymatio_python", default=None)
  args = parser.parse_args()
  rows = {"TF, XLA (default)": [], "TF, no XLA": []}
  if args.kymatio_python:
    rows["Kymatio 0.3.0 NumPy"] = []
  for _ in range(args.rounds):
    rows["TF, XLA (default)"].append(time_tf({}, args.batch, args.repeats))
    rows["TF, no XLA"].append(time_tf({"jit_compile": False}, args.batch, args.repeats))
    if args.kymatio_python:
      rows["Kymatio 0.3.0 NumPy"].append(time_kymatio(args.kymatio_python, args.batch,
                                                      args.repeats))
  print(f"scattering J=2 L=8 order 2, 32x32x3 images, batch {args.batch}, best of "
        f"{args.repeats} per round, {os.cpu_count()} CPU cores")
  print("| implementation | ms / image (each round) |")
  print("|---|---|")
  for name, values in rows.items():
    print(f"| {name} | {' / '.join(f'{v:.2f}' for v in values)} |")
  sys.stdout.flush()


if __name__ == "__main__":
  main()
