"""What the launchers print: one line per epoch; TensorFlow's own INFO lines are left out."""

from __future__ import annotations

import logging as py_logging
import os

from absl import logging as absl_logging


def quiet_tensorflow_info() -> None:
  """TensorFlow's own INFO lines (``Sharding callback duration``, ``Assets written to``,
  signature-name notices while exporting) go to WARNING and above; the launchers' and
  tf_dpnsgd's INFO lines (the plan, the engine chosen) stay."""
  def keep(record) -> bool:
    path = record.pathname.replace(os.sep, "/")
    return record.levelno >= py_logging.WARNING or not any(
        f"/{package}/" in path for package in ("tensorflow", "tf_keras", "keras"))

  py_logging.getLogger("tensorflow").setLevel(py_logging.WARNING)  # its own stream handler
  for handler in {absl_logging.get_absl_handler(), *py_logging.getLogger().handlers}:
    if not any(getattr(f, "__name__", "") == keep.__name__ for f in handler.filters):
      handler.addFilter(keep)



def print_epoch(epoch: int, logs: dict) -> None:
  """One line per epoch: loss, train/test accuracy and epsilon spent."""
  eps = logs.get("epsilon")
  eps_text = f"epsilon {eps:6.3f}" if eps is not None else "non-private"
  print(f"epoch {epoch:3d}  loss {logs.get('loss', float('nan')):.4f}  "
        f"train acc {logs.get('accuracy', float('nan')):.4f}  "
        f"test acc {logs.get('val_accuracy', float('nan')):.4f}  {eps_text}", flush=True)


__all__ = ["print_epoch", "quiet_tensorflow_info"]
