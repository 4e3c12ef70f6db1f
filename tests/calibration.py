"""The machine's kind and one calibration number, so that test times can be compared.

    python tests/calibration.py
    # machine: AMD EPYC, 2 cores, avx512 yes; calibration 0.052 s (median of 7 ...)

The calibration is the median wall time of a fixed small TensorFlow workload:
a graph function that runs a few 3x3 convolutions and a matmul forward and
takes their gradients (the convolution's backprop-filter kernel is the one the
per-example engines lean on). It scales like the suite does: on the machines
without AVX-512, where TensorFlow's CPU kernels are about 5x slower, so is this
number. The test session computes it once in its controlling process
(``tests/conftest.py``), prints it in the header and sizes the quick tier's
time budget in its units; ``.ci/run`` prints it before the tests.

It is a median of short repeats taken at one moment: on a shared machine it
moves with the load (it measured 0.04-0.07 s on the fast kind), so compare
suite times across machines by the ratio, not to the second.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

#: Repeats of the timed workload (the median is reported).
REPEATS = 7
#: Calls of the compiled function per repeat.
CALLS = 5


def cpu_model() -> str:
  """The CPU's model name from ``/proc/cpuinfo`` (``platform.processor()`` elsewhere)."""
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith("model name"):
          return line.split(":", 1)[1].strip()
  except OSError:
    pass
  import platform

  return platform.processor() or platform.machine()


def has_avx512() -> bool:
  """Whether the CPU reports AVX-512 (``avx512f``); False where ``/proc/cpuinfo`` is absent."""
  try:
    with open("/proc/cpuinfo") as f:
      return any(line.startswith("flags") and " avx512f" in line for line in f)
  except OSError:
    return False


def cores() -> int:
  """Logical cores this process may run on."""
  try:
    return len(os.sched_getaffinity(0))
  except AttributeError:
    return os.cpu_count() or 1


def machine_kind() -> str:
  """``"<CPU model>, <n> cores, avx512 yes|no"``."""
  return f"{cpu_model()}, {cores()} cores, avx512 {'yes' if has_avx512() else 'no'}"


def calibrate(repeats: int = REPEATS, calls: int = CALLS) -> float:
  """Median seconds of ``calls`` runs of the fixed workload (traced once, beforehand)."""
  import tensorflow as tf

  rng = tf.random.Generator.from_seed(0)
  x = rng.normal((16, 16, 16, 32))
  kernels = [tf.Variable(rng.normal((3, 3, 32, 32)) * 0.1) for _ in range(4)]
  dense = tf.Variable(rng.normal((16 * 16 * 32, 64)) * 0.01)

  @tf.function
  def workload(x):
    with tf.GradientTape() as tape:
      h = x
      for k in kernels:
        h = tf.tanh(tf.nn.conv2d(h, k, strides=1, padding="SAME"))
      loss = tf.reduce_sum(tf.matmul(tf.reshape(h, (16, -1)), dense) ** 2)
    return tape.gradient(loss, kernels + [dense])

  tf.nest.map_structure(lambda t: t.numpy(), workload(x))  # trace and warm up
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    for _ in range(calls):
      out = workload(x)
    tf.nest.map_structure(lambda t: t.numpy(), out)
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def line(seconds: float) -> str:
  """The one-line summary ``.ci/run`` and the test session print."""
  return (f"machine: {machine_kind()}; calibration {seconds:.3f} s (median of {REPEATS} "
          f"repeats of {CALLS} conv+matmul gradient steps, tests/calibration.py)")


if __name__ == "__main__":
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
  # The suite's own setting (tests/conftest.py), so that the kernels timed are its kernels.
  os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
  os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
  if "--versions" in sys.argv[1:]:  # .ci/run: what was installed, in the same process
    import dp_accounting  # noqa: F401  pylint: disable=g-import-not-at-top,unused-import
    import keras  # pylint: disable=g-import-not-at-top
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    print("tensorflow", tf.__version__, "keras", keras.__version__, flush=True)
  print(line(calibrate()), flush=True)
