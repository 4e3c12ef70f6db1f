"""Layer-wise rule for ``keras.layers.PReLU``.

Keras computes ``y = relu(x) - alpha * relu(-x)`` (``alpha`` broadcast over
``shared_axes``). The rule repeats exactly that computation, probes ``y``,
and materialises example ``i``'s ``alpha`` gradient ``sum dy * (-relu(-x))``
over the shared axes (:class:`~..factored.Materialized`, as the
normalization layers' parameters).
"""

from __future__ import annotations

import keras
import tensorflow as tf

from tf_dpnsgd.per_example import factored
from tf_dpnsgd.per_example import registry as registry_lib
from tf_dpnsgd.per_example.layers import normalization


def _prelu_variables(layer):
  return [getattr(layer, "alpha", None)]


def _prelu_capture(layer, call, args, kwargs, probe):
  """Repeats ``keras.layers.PReLU.call`` with its output probed."""
  inputs = registry_lib.bind_call_arguments(call, args, kwargs)["inputs"]
  if len(inputs.shape) != len(layer.alpha.shape) + 1:
    raise registry_lib.UnsupportedLayerError(
        f"PReLU '{layer.name}' called on inputs of rank {len(inputs.shape)} with an alpha "
        f"of shape {tuple(layer.alpha.shape)}: no batch axis of its own.")
  pos = keras.activations.relu(inputs)
  negative_part = keras.activations.relu(-inputs)
  neg = -layer.alpha * negative_part
  outputs = probe(pos + neg)

  def finish(grads):
    d_alpha = normalization.reduce_to_parameter(
        -tf.cast(grads[0], tf.float32) * tf.cast(negative_part, tf.float32), layer.alpha.shape)
    return [(layer.alpha, factored.Materialized(d_alpha))]

  return outputs, finish


PRELU_RULE = registry_lib.LayerRule(variables=_prelu_variables, capture=_prelu_capture,
                                    unsupported=registry_lib.common_unsupported)

registry_lib.DEFAULT_REGISTRY.register(keras.layers.PReLU, PRELU_RULE)
