import os
import sys

# Bytecode caches (gitignored __pycache__) even where PYTHONDONTWRITEBYTECODE is set, here and
# in every process the session starts (xdist workers, launchers, child pytest sessions):
# without them every collection rewrites every test module's asserts anew, about 3.6 s of
# each worker's 9.3 s collection (fast kind, 2026-11-28; compiling tf_dpnsgd itself is about
# 0.15 s of a launcher's 5 s start). Python and pytest check each cache against its source's
# mtime and size, so an edited file is compiled again.
if os.environ.pop("PYTHONDONTWRITEBYTECODE", None) is not None:
  sys.dont_write_bytecode = False

# TensorFlow's C++ log: errors too are off (3), as every child process of the suite had it, so
# that they all share one import-time environment and one zygote per worker forks them
# (tests/zygote.py).
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
# oneDNN crashes per-example gradients of MultiHeadAttention under tf.vectorized_map on CPU.
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
# Launchers run in subprocesses keep glibc malloc (no re-exec under tcmalloc, no install
# hint): tests/test_allocator.py covers tf_dpnsgd.launch.allocator on its own.
os.environ.setdefault("TF_DPNSGD_ALLOCATOR", "system")
# XLA compiles without LLVM's expensive optimizations (compiling, not running, is what the
# suite's XLA tests and launchers spend their time on; the results are the same ops, so every
# XLA-vs-graph tolerance holds): test_xla.py 127 -> 109 s under -n 2 (fast kind, 2026-11-28).
# The same flags as benchmarks/gpu.py --smoke; a user's XLA_FLAGS win.
os.environ.setdefault("XLA_FLAGS",
                      "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true")

# dp-accounting's RDP curves shared by every process of the session (workers, launchers): a
# launcher calibrates its plan anew in each process, 10-20 curves of 0.1-0.4 s each, and many
# runs calibrate the same plans (tf_dpnsgd/accounting/curve_cache.py: exact values under an
# exact key; tests/test_curve_cache.py checks it). The controller makes the directory (the
# workers inherit the variable) and removes it at the end; a user's own directory wins.
_RDP_CACHE_MADE = None
if not os.environ.get("TF_DPNSGD_RDP_CACHE"):
  import tempfile  # noqa: E402
  _RDP_CACHE_MADE = os.environ["TF_DPNSGD_RDP_CACHE"] = tempfile.mkdtemp(prefix="tf_dpnsgd_rdp_")

import gc  # noqa: E402

import pytest  # noqa: E402

import time_budget  # noqa: E402


def pytest_configure(config):
  # The quick tier's time budget in calibration units (tests/time_budget.py).
  time_budget.register(config)


def pytest_unconfigure(config):
  if _RDP_CACHE_MADE:
    import shutil  # pylint: disable=import-outside-toplevel
    shutil.rmtree(_RDP_CACHE_MADE, ignore_errors=True)


def pytest_collection_finish(session):
  """Moves everything alive after the imports and the collection (TensorFlow, Keras,
  keras-hub: about 450,000 objects) out of the collector's reach: a full collection then
  walks only what the tests made since. Measured (fast kind, 2026-11-28): gc.collect()
  0.21 s with the imports alive, 0.6 s at a module's end, 2 microseconds after
  ``gc.freeze()``. Objects that were alive then stay alive (the imports would anyway).
  Keras is imported here at the latest (this runs only where tests were collected: not in
  the controlling process of ``-n 2``), so that its import is collection time, charged to
  no test's budget."""
  import keras  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import
  gc.collect()
  gc.freeze()


@pytest.fixture(autouse=True)
def _fresh_keras_session():
  # Keras is imported here, in the processes that run tests, not at this file's import: the
  # controlling process of ``-n 2`` loads this file too and never needs TensorFlow (its import
  # there delayed every worker's start by about 5 s, fast kind, 2026-11-28).
  import keras  # pylint: disable=import-outside-toplevel
  # No gc.collect() per test (about 0.3-0.7 s each with TensorFlow loaded, minutes over
  # the suite): Keras' global state and TF's graph are still reset; see _collect_garbage.
  keras.backend.clear_session(free_memory=False)
  keras.utils.set_random_seed(1234)
  yield


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
  """One full garbage collection per test module instead of one per test, after the
  module's last test. Its time (up to a minute after a module that built many models)
  is the module's, not that test's: it goes into the teardown report's
  ``user_properties`` as :data:`time_budget.MODULE_TEARDOWN`, which the quick tier's
  budget does not charge to the test."""
  result = yield
  time_budget.run_module_cleanup(item, nextitem, _collect_and_freeze)
  return result


def _collect_and_freeze():
  """A full collection, then what survived it out of the next ones' reach (see
  ``pytest_collection_finish``): each module's collection walks only what was made since
  the last one (0.35-0.7 s -> well under 0.1 s a module, fast kind, 2026-11-28). What
  survives a module is the session's (fixtures, TensorFlow's caches); a module-scoped
  fixture of a module interleaved by xdist that dies later is freed by its reference
  count, and only a cycle in it stays until the worker exits."""
  gc.collect()
  gc.freeze()


@pytest.fixture(autouse=True)
def _private_lineage_record(tmp_path, monkeypatch):
  """Each test its own machine-local lineage record (tf_dpnsgd.lineage): no test sees
  another's privately trained weights."""
  monkeypatch.setenv("TF_DPNSGD_LINEAGE_DIR", str(tmp_path / "lineages"))
  yield
