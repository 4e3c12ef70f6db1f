"""Canary scores from the final model (higher: more likely trained on).

* Black-box (input-space canaries): :func:`loss_scores` (``-`` cross-entropy
  of the canary's label) or :func:`margin_scores` (logit of the canary's
  label minus the largest other logit), one forward pass over the ``m``
  canaries.
* White-box (gradient-space canaries): :func:`dirac_scores`, the change of
  each canary's table entry, i.e. the dot product of the parameter change
  with the canary's update direction (:mod:`tf_dpnsgd.audit.canaries`).
  No forward pass at all.

Scoring ``m = 1000`` canaries takes milliseconds (white-box) to well under a
second (black-box MLP on CPU); ``benchmarks/audit_overhead.py`` measures it.
"""

from __future__ import annotations

import numpy as np

from tf_dpnsgd.audit import canaries as canaries_lib

SCORES = ("loss", "margin")


def _logits(model, x, batch_size=1024) -> np.ndarray:
  return np.asarray(model.predict(x, batch_size=batch_size, verbose=0), np.float64)


def log_softmax(logits: np.ndarray) -> np.ndarray:
  z = logits - logits.max(axis=-1, keepdims=True)
  return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def loss_scores_from_logits(logits, y) -> np.ndarray:
  """``log p(y | x)`` per row (minus the cross-entropy).

  >>> loss_scores_from_logits(np.array([[0., 0.]]), np.array([1])).round(4).tolist()
  [-0.6931]
  """
  logits = np.asarray(logits, np.float64)
  y = np.asarray(y, np.int64)
  return log_softmax(logits)[np.arange(len(y)), y]


def margin_scores_from_logits(logits, y) -> np.ndarray:
  """``z_y - max_{k != y} z_k`` per row.

  >>> margin_scores_from_logits(np.array([[1., 3., 0.]]), np.array([1])).tolist()
  [2.0]
  """
  logits = np.asarray(logits, np.float64)
  y = np.asarray(y, np.int64)
  rows = np.arange(len(y))
  own = logits[rows, y]
  others = logits.copy()
  others[rows, y] = -np.inf
  return own - others.max(axis=-1)


def loss_scores(model, x, y, batch_size: int = 1024) -> np.ndarray:
  """Black-box scores: ``-loss`` of each canary under ``model``."""
  return loss_scores_from_logits(_logits(model, x, batch_size), y)


def margin_scores(model, x, y, batch_size: int = 1024) -> np.ndarray:
  """Black-box scores: the logit margin of each canary's label under ``model``."""
  return margin_scores_from_logits(_logits(model, x, batch_size), y)


def input_scores(model, x, y, score: str = "loss", batch_size: int = 1024) -> np.ndarray:
  if score not in SCORES:
    raise ValueError(f"`score` must be one of {SCORES}; got {score!r}.")
  fn = loss_scores if score == "loss" else margin_scores
  return fn(model, x, y, batch_size)


def dirac_scores(model, initial_table=None) -> np.ndarray:
  """White-box scores: ``<theta_T - theta_0, d_j>`` with ``d_j`` canary ``j``'s update direction.

  The canary's per-example gradient is ``-||g|| e_j`` in the canary table, so a
  step containing it moves ``E[j]`` by ``+lr * (clipped norm) / denominator``:
  the score is ``E_T[j] - E_0[j]`` (``E_0 = 0`` unless ``initial_table`` says otherwise).
  """
  table = canaries_lib.dirac_table(model).astype(np.float64)
  if initial_table is not None:
    table = table - np.asarray(initial_table, np.float64).reshape(-1)
  return table


__all__ = ["SCORES", "dirac_scores", "input_scores", "log_softmax", "loss_scores",
           "loss_scores_from_logits", "margin_scores", "margin_scores_from_logits"]
