"""The value every per-example engine returns."""

from __future__ import annotations

import dataclasses
from typing import Any

import keras
import tensorflow as tf


@dataclasses.dataclass
class EngineOutput:
  """Result of one engine call on a batch (or a chunk of one).

  Attributes:
    summed: per trainable variable, ``sum_u h_u g_u`` (same shapes as the
      variables); each unit's contribution has norm <= the transform's
      sensitivity.
    norms: ``[U]`` per-unit gradient L2 norms before the transform.
    factors: ``[U]`` factors ``h_u`` (0 for masked or non-finite units).
    losses: ``[B]`` per-example losses (for logging only).
    y_pred: the model's outputs for the ``B`` examples (for metrics only).
  """

  summed: list[tf.Tensor]
  norms: tf.Tensor
  factors: tf.Tensor
  losses: tf.Tensor
  y_pred: Any


def output_spec(model, x):
  """The model's symbolic output for a batch like ``x`` (any batch size).

  Used to create ``tf.TensorArray``s of the right dtypes before a loop over
  units or chunks.
  """
  x_spec = tf.nest.map_structure(
      lambda t: keras.KerasTensor((None,) + tuple(t.shape[1:]), dtype=t.dtype.name), x)
  return model.compute_output_spec(x_spec)
