import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
# oneDNN crashes per-example gradients of MultiHeadAttention under tf.vectorized_map on CPU.
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")

import keras  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _fresh_keras_session():
  keras.backend.clear_session()
  keras.utils.set_random_seed(1234)
  yield


@pytest.fixture(autouse=True)
def _private_lineage_record(tmp_path, monkeypatch):
  """Each test its own machine-local lineage record (tf_dpnsgd.lineage): no test sees
  another's privately trained weights."""
  monkeypatch.setenv("TF_DPNSGD_LINEAGE_DIR", str(tmp_path / "lineages"))
  yield
