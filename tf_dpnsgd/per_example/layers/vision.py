"""Layer-wise rule for keras-hub's ViT patching and embedding layer (``ViTBackbone``'s first layer).

``ViTPatchingAndEmbedding`` (keras-hub, not exported publicly; registered by
its qualified name, no import of keras-hub) computes

``out = concat([class_token, reshape(conv(images))], axis=1) + pos[position_ids]``

with a patch ``Conv2D`` (kernel = stride = patch size), an optional class
token ``[1, 1, d]`` and a position ``Embedding`` looked up at the fixed
``position_ids`` ``[1, P]``. Its own variable (the class token) and the
position lookup, whose ids have no batch axis, are why its sublayers' rules
cannot be used one by one. The rule repeats the layer's ``call`` and probes
``out``; with ``dout`` its gradient (row ``i`` = example ``i``'s):

* patch convolution: the ``Conv2D`` rule (:mod:`.conv`) recomputes the
  convolution; its output gradient is ``dout`` at the patch positions,
  reshaped to the patch grid (the convolution's output reaches ``out`` only
  through the reshape, concatenation and addition), so the ``Conv2D`` rule's
  kernel (``ConvOuter``) and bias representations apply unchanged;
* class token: ``dout[i, 0]`` (:class:`~..factored.Materialized`);
* position table: ``dout[i, p]`` scattered into row ``position_ids[p]``
  (:class:`~..factored.Scattered`; the ids are distinct when they are the
  ``arange`` keras-hub builds, which is then used for the norm).
"""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf
from keras import ops

from tf_dpnsgd.per_example import factored
from tf_dpnsgd.per_example import registry as registry_lib
from tf_dpnsgd.per_example.layers import conv

#: keras-hub's class, by qualified name (keras-hub does not export it).
VIT_PATCHING_AND_EMBEDDING = "keras_hub.src.models.vit.vit_layers.ViTPatchingAndEmbedding"


def _vit_variables(layer):
  own = [layer.class_token] if layer.use_class_token else []
  return (own + conv.CONV_RULE.variables(layer.patch_embedding)
          + [layer.position_embedding.embeddings])


def _vit_unsupported(layer):
  if not layer.built:
    return "the layer is not built"
  why = registry_lib.common_unsupported(layer)
  if why:
    return why
  patch, position = layer.patch_embedding, layer.position_embedding
  if type(patch) is not keras.layers.Conv2D or type(position) is not keras.layers.Embedding:
    return (f"its patch projection is a {type(patch).__name__} and its position table a "
            f"{type(position).__name__} (the rule expects Conv2D and Embedding)")
  why = conv.CONV_RULE.unsupported(patch)
  if why:
    return f"its patch Conv2D: {why}"
  why = registry_lib.common_unsupported(position)
  if why:
    return f"its position Embedding: {why}"
  return None


def _distinct(ids) -> bool:
  value = tf.get_static_value(ids)
  return value is not None and np.unique(value).size == np.size(value)


def _vit_capture(layer, call, args, kwargs, probe):
  """Repeats ``ViTPatchingAndEmbedding.call`` with its output probed."""
  inputs = registry_lib.bind_call_arguments(call, args, kwargs)["inputs"]
  patch = layer.patch_embedding
  # The Conv2D rule's own capture (its probe is not needed: its output gradient is read
  # off this layer's output gradient).
  patches, conv_finish = conv.CONV_RULE.capture(patch, patch.call, (inputs,), {}, lambda t: t)
  channels_first = layer.data_format == "channels_first"
  if channels_first:
    patches = ops.transpose(patches, axes=(0, 2, 3, 1))
  grid_shape = ops.shape(patches)
  embeddings = ops.reshape(patches, [grid_shape[0], -1, grid_shape[-1]])
  position_ids = layer.position_ids
  positions = layer.position_embedding(position_ids)
  if layer.use_class_token:
    class_token = ops.tile(layer.class_token, (grid_shape[0], 1, 1))
    embeddings = ops.concatenate([class_token, embeddings], axis=1)
  outputs = probe(ops.add(embeddings, positions))

  def finish(grads):
    dout = tf.cast(grads[0], tf.float32)
    batch, dim = tf.shape(dout)[0], dout.shape[-1]
    first = 1 if layer.use_class_token else 0
    dz = tf.reshape(dout[:, first:], tf.shape(patches))  # the patch grid, channels last
    if channels_first:
      dz = tf.transpose(dz, [0, 3, 1, 2])
    out = list(conv_finish([dz]))
    ids = tf.broadcast_to(tf.cast(position_ids, tf.int32), tf.shape(dout)[:2])
    table = layer.position_embedding.embeddings
    out.append((table, factored.Scattered(ids, dout, table.shape[0],
                                          distinct=_distinct(position_ids))))
    if layer.use_class_token:
      out.append((layer.class_token,
                  factored.Materialized(tf.reshape(dout[:, 0], [batch, 1, 1, dim]))))
    return out

  return outputs, finish


VIT_PATCHING_RULE = registry_lib.LayerRule(variables=_vit_variables, capture=_vit_capture,
                                           unsupported=_vit_unsupported)

registry_lib.DEFAULT_REGISTRY.register(VIT_PATCHING_AND_EMBEDDING, VIT_PATCHING_RULE)
