"""Layer-wise rules for embedding tables.

* ``keras.layers.Embedding``: the layer's own ``call`` runs unchanged; its
  output (the gathered rows) is probed. Per example the table gradient is the
  scatter-add of the output gradients into the rows of the example's ids
  (:class:`~..factored.Scattered`; repeated ids are summed before squaring).
* ``keras.layers.ReversibleEmbedding`` (and keras-hub's subclass of it): the
  lookup as above; ``reverse=True`` (logits ``x E^T`` or ``x R``) is recomputed
  like the Keras ``call`` (dtype cast, soft cap) and probed before the soft
  cap, giving an :class:`~..factored.Outer` for the table. With tied weights
  both uses add up in one per-example gradient; its norm includes the exact
  cross term (:class:`~..factored.Sum`).
* ``keras_hub.layers.PositionEmbedding``: the layer's ``call`` runs unchanged;
  the output gradient is scattered into the rows of the positions used
  (``start_index + arange(T)``, or the ``positions`` argument).
* keras-hub's DeBERTa-V3 ``RelativeEmbedding``: ``out = repeat(LN(E[None]), B)``,
  the same table ``E`` (``[2 k, d]``, no ids) layer-normalized and repeated
  for every example. The rule repeats ``E`` first and normalizes the
  ``[B, 2 k, d]`` copy with the ``LayerNormalization`` rule (the same
  per-row computation, so the same output); example ``i``'s table gradient is
  the gradient of its copy (probed, :class:`~..factored.Materialized`), and
  the norm's gamma and beta come from the ``LayerNormalization`` rule.
"""

from __future__ import annotations

import sys

import keras
import tensorflow as tf
from keras import ops

from tf_dpnsgd.per_example import factored
from tf_dpnsgd.per_example import registry as registry_lib
from tf_dpnsgd.per_example.layers import normalization


def _flat_rows(ids, grads):
  batch = tf.shape(grads)[0]
  d = grads.shape[-1]
  return (tf.reshape(tf.cast(ids, tf.int32), [batch, -1]),
          tf.reshape(tf.cast(grads, tf.float32), [batch, -1, d]))


def _lookup_representation(layer, inputs, grads):
  ids, b = _flat_rows(inputs, grads)
  return factored.Scattered(ids, b, num_rows=layer.input_dim)


# --- Embedding ---------------------------------------------------------------

def _embedding_variables(layer):
  return [layer.embeddings]


def _check_dense_ids(layer, inputs):
  if isinstance(inputs, (tf.RaggedTensor, tf.SparseTensor)):
    raise registry_lib.UnsupportedLayerError(
        f"Embedding '{layer.name}' got {type(inputs).__name__} ids; the layer-wise engine needs "
        "one dense row of ids per example. Use per_example='microbatch' (one example at a "
        "time), or pad the ids to a dense [batch, max_length] tensor with 0 as padding and "
        "use keras.layers.Embedding(..., mask_zero=True) with a masked reduction (e.g. "
        "GlobalAveragePooling1D).")


def _embedding_capture(layer, call, args, kwargs, probe):
  inputs = registry_lib.bind_call_arguments(call, args, kwargs)["inputs"]
  _check_dense_ids(layer, inputs)
  outputs = probe(call(*args, **kwargs))

  def finish(grads):
    return [(layer.embeddings, _lookup_representation(layer, inputs, grads[0]))]

  return outputs, finish


EMBEDDING_RULE = registry_lib.LayerRule(variables=_embedding_variables,
                                        capture=_embedding_capture,
                                        unsupported=registry_lib.common_unsupported)


# --- ReversibleEmbedding -----------------------------------------------------

def _reversible_variables(layer):
  if layer.tie_weights:
    return [layer.embeddings]
  return [layer.embeddings, layer.reverse_embeddings]


def _reversible_capture(layer, call, args, kwargs, probe):
  arguments = registry_lib.bind_call_arguments(call, args, kwargs)
  inputs = arguments["inputs"]
  if not arguments.get("reverse", False):
    _check_dense_ids(layer, inputs)
    outputs = probe(call(*args, **kwargs))

    def finish_lookup(grads):
      return [(layer.embeddings, _lookup_representation(layer, inputs, grads[0]))]

    return outputs, finish_lookup

  # Reverse projection, as keras.layers.ReversibleEmbedding.call computes it.
  kernel = ops.transpose(layer.embeddings) if layer.tie_weights else layer.reverse_embeddings
  x = inputs
  if layer.reverse_dtype is not None:
    x = ops.cast(x, layer.reverse_dtype)
    kernel = ops.cast(kernel, layer.reverse_dtype)
  logits = probe(ops.matmul(x, kernel))
  outputs = logits
  if layer.logit_soft_cap is not None:
    cap = layer.logit_soft_cap
    outputs = ops.multiply(ops.tanh(ops.divide(logits, cap)), cap)

  def finish_reverse(grads):
    (dlogits,) = grads
    batch = tf.shape(x)[0]
    d, vocab = layer.output_dim, layer.input_dim
    a = tf.reshape(x, [batch, -1, d])
    b = tf.reshape(dlogits, [batch, -1, vocab])
    if layer.tie_weights:  # grad of E = (x^T dlogits)^T: [vocab, d]
      return [(layer.embeddings, factored.Outer(a, b, [d], [vocab], perm=[1, 0]))]
    return [(layer.reverse_embeddings, factored.Outer(a, b, [d], [vocab]))]

  return outputs, finish_reverse


def _reversible_unsupported(layer):
  return registry_lib.common_unsupported(layer)


REVERSIBLE_EMBEDDING_RULE = registry_lib.LayerRule(variables=_reversible_variables,
                                                   capture=_reversible_capture,
                                                   unsupported=_reversible_unsupported)


# --- keras-hub PositionEmbedding ---------------------------------------------

def _position_variables(layer):
  return [layer.position_embeddings]


def _serving_positions(layer):
  module = sys.modules.get(type(layer).__module__)
  fn = getattr(module, "_vllm_serving_positions", None)
  return fn() if fn is not None else None


def _position_capture(layer, call, args, kwargs, probe):
  arguments = registry_lib.bind_call_arguments(call, args, kwargs)
  positions = arguments.get("positions")
  if positions is None and _serving_positions(layer) is not None:
    raise registry_lib.UnsupportedLayerError(
        f"PositionEmbedding '{layer.name}' is running under vLLM serving positions; the "
        "layer-wise engine is for training only.")
  outputs = probe(call(*args, **kwargs))

  def finish(grads):
    (g,) = grads
    shape = tf.shape(g)
    rows_shape = shape[:-1]
    if positions is None:
      length = shape[-2]
      ids = arguments.get("start_index", 0) + tf.range(length)
      distinct = len(g.shape) == 3  # [B, T, d]: each position once per example
    else:
      ids = positions
      if len(ids.shape) == 1:
        ids = ids[None, :]
      distinct = False
    ids = tf.broadcast_to(tf.cast(ids, tf.int32), rows_shape)
    ids, b = _flat_rows(ids, g)
    rows = layer.position_embeddings.shape[0]
    return [(layer.position_embeddings, factored.Scattered(ids, b, rows, distinct=distinct))]

  return outputs, finish


POSITION_EMBEDDING_RULE = registry_lib.LayerRule(variables=_position_variables,
                                                 capture=_position_capture)


# --- keras-hub RelativeEmbedding (DeBERTa-V3) --------------------------------

#: keras-hub's class, by qualified name (keras-hub does not export it).
RELATIVE_EMBEDDING = "keras_hub.src.models.deberta_v3.relative_embedding.RelativeEmbedding"


def _relative_variables(layer):
  return [layer.rel_embeddings] + normalization.LAYER_NORM_RULE.variables(layer.layer_norm)


def _relative_unsupported(layer):
  why = registry_lib.common_unsupported(layer)
  if why:
    return why
  if type(layer.layer_norm) is not keras.layers.LayerNormalization:
    return (f"its norm is a {type(layer.layer_norm).__name__} (the rule expects "
            "LayerNormalization)")
  return registry_lib.common_unsupported(layer.layer_norm)


def _relative_capture(layer, call, args, kwargs, probe):
  """``RelativeEmbedding.call`` with the repeat before the norm: each example's own copy."""
  inputs = registry_lib.bind_call_arguments(call, args, kwargs)["inputs"]
  table = ops.expand_dims(ops.convert_to_tensor(layer.rel_embeddings), axis=0)
  copies = probe(ops.repeat(table, repeats=ops.shape(inputs)[0], axis=0))  # [B, 2k, d]
  norm = layer.layer_norm
  norm_probes = []

  def norm_probe(t):
    norm_probes.append(t)
    return probe(t)

  outputs, norm_finish = normalization.LAYER_NORM_RULE.capture(norm, norm.call, (copies,), {},
                                                               norm_probe)

  def finish(grads):
    table_grad = tf.cast(grads[0], tf.float32)
    return ([(layer.rel_embeddings, factored.Materialized(table_grad))]
            + list(norm_finish(grads[1:1 + len(norm_probes)])))

  return outputs, finish


RELATIVE_EMBEDDING_RULE = registry_lib.LayerRule(variables=_relative_variables,
                                                 capture=_relative_capture,
                                                 unsupported=_relative_unsupported)

registry_lib.DEFAULT_REGISTRY.register(keras.layers.Embedding, EMBEDDING_RULE)
registry_lib.DEFAULT_REGISTRY.register(keras.layers.ReversibleEmbedding, REVERSIBLE_EMBEDDING_RULE)
# keras-hub types by name: no import of keras_hub is needed to register them.
registry_lib.DEFAULT_REGISTRY.register(
    "keras_hub.src.layers.modeling.reversible_embedding.ReversibleEmbedding",
    REVERSIBLE_EMBEDDING_RULE)
registry_lib.DEFAULT_REGISTRY.register(
    "keras_hub.src.layers.modeling.position_embedding.PositionEmbedding", POSITION_EMBEDDING_RULE)
registry_lib.DEFAULT_REGISTRY.register(RELATIVE_EMBEDDING, RELATIVE_EMBEDDING_RULE)
