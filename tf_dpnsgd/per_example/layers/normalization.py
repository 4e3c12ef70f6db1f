"""Layer-wise rules for ``LayerNormalization``, ``GroupNormalization`` and RMS norms.

Keras computes both as ``y = x * inv + res`` with ``inv = gamma / sqrt(var + eps)``
and ``res = beta - mean * inv`` (statistics per example). The rule repeats
exactly that computation (same ops, same order, so the forward pass is
unchanged) and probes ``inv`` and ``res``. The backward pass then delivers,
at no extra cost (Keras' own backward computes the same reductions for the
input gradient):

* ``d res``: ``sum dy`` over the normalized positions, which is example
  ``i``'s gradient of ``beta``;
* ``d inv``: the total derivative through ``y`` and ``res``,
  ``sum dy * (x - mean)``, which times ``1 / sqrt(var + eps)`` is example
  ``i``'s gradient of ``gamma``.

Both are small (``[B, *param_shape]``) and are materialised
(:class:`~..factored.Materialized`). ``LayerNormalization(rms_scaling=True)``
(deprecated in Keras) probes its output instead.

RMS normalizations (``keras.layers.RMSNormalization``; keras-hub's
``LlamaLayerNorm``, ``MistralLayerNormalization`` and Gemma's
``RMSNormalization``, whose output is ``xhat * (1 + scale)``) compute
``y = xhat * s`` with ``xhat = x / sqrt(mean(x^2) + eps)`` per example and
``s`` the scale (or ``1 + scale``). The rule repeats the layer's own ops,
probes ``y`` and materialises example ``i``'s scale gradient
``sum dy * xhat`` over the positions the scale is broadcast along.
"""

from __future__ import annotations

import keras
import tensorflow as tf
from keras import ops

from tf_dpnsgd.per_example import factored
from tf_dpnsgd.per_example import registry as registry_lib


def _affine_variables(layer):
  return [getattr(layer, "gamma", None), getattr(layer, "beta", None)]


def _sum_to(t, rank, keep_axes):
  """Sums ``t`` (broadcastable to rank ``rank``) over all non-batch axes not in ``keep_axes``."""
  axes = [a for a in range(1, rank) if a not in keep_axes and t.shape[a] != 1]
  t = tf.reduce_sum(t, axis=axes, keepdims=True) if axes else t
  return t


def _affine_probe(x, mean, inv0, gamma, beta, probe):
  """``y = x * inv + res`` as Keras computes it, with ``inv`` and ``res`` probed.

  Returns ``(y, record)``; ``record`` maps "inv"/"res" to the probe index.
  """
  record = {}
  inv = inv0
  if gamma is not None:
    inv = inv * gamma
    record["inv"] = len(record)
    inv = probe(inv)
  res = -mean * inv
  if beta is not None:
    res = res + beta
    record["res"] = len(record)
    res = probe(res)
  return x * inv + res, record


def _affine_representations(layer, record, grads, inv0, rank, param_axes):
  out = []
  if "inv" in record:
    d_gamma = _sum_to(tf.cast(grads[record["inv"]], tf.float32) * tf.cast(inv0, tf.float32),
                      rank, param_axes)
    out.append((layer.gamma, factored.Materialized(
        tf.reshape(d_gamma, [-1] + list(layer.gamma.shape)))))
  if "res" in record:
    d_beta = _sum_to(tf.cast(grads[record["res"]], tf.float32), rank, param_axes)
    out.append((layer.beta, factored.Materialized(
        tf.reshape(d_beta, [-1] + list(layer.beta.shape)))))
  return out


# --- LayerNormalization ------------------------------------------------------

def _layer_norm_capture(layer, call, args, kwargs, probe):
  """Repeats ``keras.ops.layer_normalization`` (TF backend) with probes."""
  inputs = registry_lib.bind_call_arguments(call, args, kwargs)["inputs"]
  original_dtype = inputs.dtype
  compute_dtype = keras.backend.result_type(inputs.dtype, "float32")
  x = ops.convert_to_tensor(inputs, dtype=compute_dtype)
  rank = len(x.shape)
  axes = sorted(a % rank for a in layer.axis)
  if 0 in axes:
    raise registry_lib.UnsupportedLayerError(
        f"LayerNormalization '{layer.name}' normalizes over the batch axis.")
  broadcast_shape = [1] * rank
  for a in axes:
    broadcast_shape[a] = x.shape[a]

  def param(v):
    if v is None:
      return None
    v = ops.convert_to_tensor(v, x.dtype)
    if len(v.shape) != rank and axes != [rank - 1]:
      v = ops.reshape(v, broadcast_shape)
    return v

  gamma, beta = param(layer.gamma), param(layer.beta)
  if getattr(layer, "rms_scaling", False):
    variance = ops.var(x, axis=axes, keepdims=True)
    inv0 = ops.rsqrt(variance + layer.epsilon)
    xhat = x * inv0
    outputs = probe(xhat * ops.cast(gamma, x.dtype)) if gamma is not None else xhat

    def finish_rms(grads):
      if gamma is None:
        return []
      d_gamma = _sum_to(tf.cast(grads[0], tf.float32) * tf.cast(xhat, tf.float32), rank, axes)
      return [(layer.gamma, factored.Materialized(
          tf.reshape(d_gamma, [-1] + list(layer.gamma.shape))))]

    y = ops.cast(ops.cast(outputs, original_dtype), layer.compute_dtype)
    return y, finish_rms

  mean, variance = ops.moments(x, axes=axes, keepdims=True)
  inv0 = ops.rsqrt(variance + layer.epsilon)
  outputs, record = _affine_probe(x, mean, inv0, gamma, beta, probe)
  y = ops.cast(ops.cast(outputs, original_dtype), layer.compute_dtype)

  def finish(grads):
    return _affine_representations(layer, record, grads, inv0, rank, axes)

  return y, finish


LAYER_NORM_RULE = registry_lib.LayerRule(variables=_affine_variables, capture=_layer_norm_capture)


# --- GroupNormalization ------------------------------------------------------

def _group_norm_capture(layer, call, args, kwargs, probe):
  """Repeats ``keras.layers.GroupNormalization.call`` with probes."""
  inputs = registry_lib.bind_call_arguments(call, args, kwargs)["inputs"]
  rank = len(inputs.shape)
  axis = layer.axis % rank
  channels = inputs.shape[axis]
  shape = ops.shape(inputs)
  group_shape = list(inputs.shape)
  group_shape[0] = -1
  for i, e in enumerate(group_shape[1:]):
    if e is None:
      group_shape[i + 1] = shape[i + 1]
  group_shape[axis] = channels // layer.groups
  group_shape.insert(axis, layer.groups)
  reshaped = ops.reshape(inputs, group_shape)

  inputs_dtype = reshaped.dtype
  compute_dtype = keras.backend.result_type(inputs_dtype, "float32")
  reshaped = ops.cast(reshaped, compute_dtype)
  reduction_axes = [a for a in range(1, rank + 1) if a != axis]
  broadcast_shape = [1] * rank
  broadcast_shape[axis] = channels // layer.groups
  broadcast_shape.insert(axis, layer.groups)

  mean, variance = ops.moments(reshaped, axes=reduction_axes, keepdims=True)
  inv0 = ops.rsqrt(variance + layer.epsilon)
  gamma = beta = None
  if layer.scale:
    gamma = ops.cast(ops.reshape(layer.gamma, broadcast_shape), reshaped.dtype)
  if layer.center:
    beta = ops.cast(ops.reshape(layer.beta, broadcast_shape), reshaped.dtype)
  normalized, record = _affine_probe(reshaped, mean, inv0, gamma, beta, probe)
  normalized = ops.cast(normalized, inputs_dtype)
  outputs = ops.cast(ops.reshape(normalized, ops.shape(inputs)), layer.compute_dtype)

  def finish(grads):
    # Parameters live on the (group, channel-in-group) axes of the grouped shape.
    return _affine_representations(layer, record, grads, inv0, rank + 1, [axis, axis + 1])

  return outputs, finish


GROUP_NORM_RULE = registry_lib.LayerRule(variables=_affine_variables, capture=_group_norm_capture)


# --- RMS normalizations ------------------------------------------------------

def reduce_to_parameter(t, param_shape):
  """``[B, ...]`` products summed to ``[B, *param_shape]`` as numpy broadcasting maps them.

  ``t`` is ``dy * (the tensor the parameter multiplies)``; the parameter is
  broadcast right-aligned against the non-batch axes (Keras' elementwise
  multiply), so its gradient sums ``t`` over the leading axes it lacks and the
  axes where it has size 1.

  Raises:
    UnsupportedLayerError: if the parameter would broadcast along the batch axis.
  """
  rank, param_rank = len(t.shape), len(param_shape)
  if param_rank > rank - 1:
    raise registry_lib.UnsupportedLayerError(
        f"A parameter of shape {tuple(param_shape)} would broadcast along the batch axis of "
        f"a rank-{rank} tensor.")
  lead = rank - param_rank
  axes = list(range(1, lead)) + [lead + k for k, d in enumerate(param_shape)
                                 if d == 1 and t.shape[lead + k] != 1]
  t = tf.reduce_sum(t, axis=axes, keepdims=True) if axes else t
  return tf.reshape(t, [-1] + [int(d) for d in param_shape])


def _scale_variables(layer):
  return [getattr(layer, "scale", None)]


def _scale_finish(layer, xhat):
  def finish(grads):
    d_scale = reduce_to_parameter(tf.cast(grads[0], tf.float32) * tf.cast(xhat, tf.float32),
                                  layer.scale.shape)
    return [(layer.scale, factored.Materialized(d_scale))]

  return finish


def _keras_rms_norm_capture(layer, call, args, kwargs, probe):
  """Repeats ``keras.ops.rms_normalization`` (TF backend) with the scaled output probed."""
  inputs = registry_lib.bind_call_arguments(call, args, kwargs)["x"]
  original_dtype = keras.backend.standardize_dtype(inputs.dtype)
  compute_dtype = keras.backend.result_type(inputs.dtype, "float32")
  x = ops.convert_to_tensor(inputs, dtype=compute_dtype)
  if len(x.shape) < 2:
    raise registry_lib.UnsupportedLayerError(
        f"RMSNormalization '{layer.name}' called without a batch axis.")
  axis = sorted(layer.axis) if isinstance(layer.axis, (list, tuple)) else layer.axis
  if 0 in [a % len(x.shape) for a in (axis if isinstance(axis, list) else [axis])]:
    raise registry_lib.UnsupportedLayerError(
        f"RMSNormalization '{layer.name}' normalizes over the batch axis.")
  scale = ops.convert_to_tensor(layer.scale, x.dtype)
  rrms = ops.rsqrt(ops.mean(ops.square(x), axis=axis, keepdims=True) + layer.epsilon)
  xhat = ops.multiply(x, rrms)
  outputs = probe(ops.multiply(xhat, scale))
  return ops.cast(outputs, original_dtype), _scale_finish(layer, xhat)


def _llama_rms_norm_capture(layer, call, args, kwargs, probe):
  """Repeats keras-hub's ``LlamaLayerNorm.call`` (also ``MistralLayerNormalization``)."""
  x = ops.cast(registry_lib.bind_call_arguments(call, args, kwargs)["x"], "float32")
  var = ops.mean(ops.power(x, 2), axis=-1, keepdims=True)
  xhat = x * ops.rsqrt(var + layer.epsilon)
  outputs = probe(xhat * layer.scale)
  return ops.cast(outputs, layer.compute_dtype), _scale_finish(layer, xhat)


def _gemma_rms_norm_capture(layer, call, args, kwargs, probe):
  """Repeats keras-hub's Gemma ``RMSNormalization.call``: ``xhat * (1 + scale)``."""
  x = ops.cast(registry_lib.bind_call_arguments(call, args, kwargs)["x"], "float32")
  scale = ops.cast(layer.scale, "float32")
  var = ops.mean(ops.square(x), axis=-1, keepdims=True)
  xhat = x * ops.reciprocal(ops.sqrt(var + layer.epsilon))
  outputs = probe(xhat * (1 + scale))  # d(1 + scale) / d scale = 1
  return ops.cast(outputs, layer.compute_dtype), _scale_finish(layer, xhat)


KERAS_RMS_NORM_RULE = registry_lib.LayerRule(
    variables=_scale_variables, capture=_keras_rms_norm_capture,
    unsupported=registry_lib.common_unsupported)
LLAMA_RMS_NORM_RULE = registry_lib.LayerRule(
    variables=_scale_variables, capture=_llama_rms_norm_capture,
    unsupported=registry_lib.common_unsupported)
GEMMA_RMS_NORM_RULE = registry_lib.LayerRule(
    variables=_scale_variables, capture=_gemma_rms_norm_capture,
    unsupported=registry_lib.common_unsupported)

registry_lib.DEFAULT_REGISTRY.register(keras.layers.LayerNormalization, LAYER_NORM_RULE)
registry_lib.DEFAULT_REGISTRY.register(keras.layers.GroupNormalization, GROUP_NORM_RULE)
registry_lib.DEFAULT_REGISTRY.register(keras.layers.RMSNormalization, KERAS_RMS_NORM_RULE)
# keras-hub types by qualified name (no import of keras-hub needed); matched exactly.
registry_lib.DEFAULT_REGISTRY.register(
    "keras_hub.src.models.llama.llama_layernorm.LlamaLayerNorm", LLAMA_RMS_NORM_RULE)
registry_lib.DEFAULT_REGISTRY.register(
    "keras_hub.src.models.mistral.mistral_layer_norm.MistralLayerNormalization",
    LLAMA_RMS_NORM_RULE)
registry_lib.DEFAULT_REGISTRY.register(
    "keras_hub.src.models.gemma.rms_normalization.RMSNormalization", GEMMA_RMS_NORM_RULE)
