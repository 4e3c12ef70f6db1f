"""Layer-wise rules for ``keras.layers.Dense`` and ``keras.layers.EinsumDense``.

Both compute ``z = contract(x, W) + b`` and then ``activation(z)``. The rule
recomputes ``z`` exactly as the Keras ``call`` does (same ops, same order),
probes it, and applies the activation. Per example ``i`` the kernel gradient is
``sum_t x[i, t] (x) dz[i, t]`` over the positions ``t`` (the axes shared by
input and output other than the batch): an :class:`~..factored.Outer`.
EinsumDense equations whose kernel shares an axis with both input and output
(a per-position weight) get materialised per-example gradients instead.

With LoRA enabled (``layer.enable_lora(rank)``) Keras' ``kernel`` property is
``W + s A B``; the rule recomputes ``z`` with it as Keras does, and the
trainable factors ``A``, ``B`` get their per-example gradients from the same
``x`` and ``dz`` (:mod:`.lora`); the frozen ``W`` gets none (unless it was
made trainable again).
"""

from __future__ import annotations

import dataclasses
import math
import string

import keras
import tensorflow as tf
from keras import ops

from tf_dpnsgd.per_example import factored
from tf_dpnsgd.per_example import registry as registry_lib
from tf_dpnsgd.per_example.layers import lora as lora_lib


def _apply_activation(layer, z):
  return layer.activation(z) if layer.activation is not None else z


def _unsupported(layer):
  """Quantized or rematerialized layers; LoRA is handled (:mod:`.lora`)."""
  return registry_lib.common_unsupported(layer, lora=True)


def _lora_representations(layer, inputs, kernel, output, x, dz):
  """``[(lora_kernel_a, rep), (lora_kernel_b, rep)]``, or ``[]`` without LoRA."""
  if not layer.lora_enabled:
    return []
  out = []
  for g in lora_lib.factor_gradients(layer, inputs, kernel, output, x, dz):
    structure = einsum_structure(g.equation, len(g.x.shape))
    out.append((g.variable, einsum_kernel_representation(structure, g.x, g.dz,
                                                         tuple(g.variable.shape))))
  return out


# --- Dense -------------------------------------------------------------------

def _dense_variables(layer):
  return [lora_lib.base_kernel(layer), layer.bias] + _lora_variables(layer)


def _lora_variables(layer):
  return [layer.lora_kernel_a, layer.lora_kernel_b] if layer.lora_enabled else []


def _dense_capture(layer, call, args, kwargs, probe):
  inputs = registry_lib.bind_call_arguments(call, args, kwargs)["inputs"]
  z = ops.matmul(inputs, layer.kernel)  # under LoRA, Keras' merged W + s A B
  if layer.bias is not None:
    z = ops.add(z, layer.bias)
  z = probe(z)

  def finish(grads):
    (dz,) = grads
    batch = tf.shape(inputs)[0]
    d_in, d_out = layer.kernel.shape
    a = tf.reshape(inputs, [batch, -1, d_in])
    b = tf.reshape(dz, [batch, -1, d_out])
    kernel = lora_lib.base_kernel(layer)
    out = [(kernel, factored.Outer(a, b, [d_in], [d_out]))] if kernel.trainable else []
    out += _lora_representations(layer, "abc", "cd", "abd", a, b)
    if layer.bias is not None:
      out.append((layer.bias,
                  factored.Materialized(registry_lib.per_example_bias_grads(dz, layer.bias))))
    return out

  return _apply_activation(layer, z), finish


DENSE_RULE = registry_lib.LayerRule(variables=_dense_variables, capture=_dense_capture,
                                    unsupported=_unsupported)


# --- EinsumDense ---------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class EinsumStructure:
  """Letters of ``input,kernel->output`` grouped by role.

  Attributes:
    inputs, kernel, output: the specs with any ``...`` expanded.
    batch: the batch letter (first of input and output, absent from kernel).
    positions: letters of input and output but not kernel (besides batch).
    contracted: kernel letters contracted with the input.
    produced: kernel letters that reach the output.
    shared: kernel letters in input and output (per-position weights).
    input_only: input letters summed away before the kernel is applied.
  """

  inputs: str
  kernel: str
  output: str
  batch: str
  positions: str
  contracted: str
  produced: str
  shared: str
  input_only: str

  @property
  def factorable(self) -> bool:
    return not self.shared


def einsum_structure(equation: str, input_rank: int) -> EinsumStructure:
  """Parses an EinsumDense equation for ``input_rank``-d inputs.

  >>> s = einsum_structure("abc,cde->abde", 3)
  >>> (s.batch, s.positions, s.contracted, s.produced)
  ('a', 'b', 'c', 'de')

  Raises:
    UnsupportedLayerError: when the batch axis is not the first axis of both
      input and output, or a kernel letter appears in neither.
  """
  try:
    lhs, out = equation.replace(" ", "").split("->")
    inp, ker = lhs.split(",")
  except ValueError as e:
    raise registry_lib.UnsupportedLayerError(f"Cannot parse einsum equation {equation!r}.") from e
  if "..." in inp:
    free = [c for c in string.ascii_letters if c not in equation]
    n = input_rank - (len(inp) - 3)
    fill = "".join(free[:n])
    inp, out = inp.replace("...", fill), out.replace("...", fill)
  if "..." in ker or "..." in out:
    raise registry_lib.UnsupportedLayerError(f"Unsupported ellipsis in {equation!r}.")
  batch = inp[0]
  if out[:1] != batch or batch in ker:
    raise registry_lib.UnsupportedLayerError(
        f"EinsumDense equation {equation!r}: the batch axis must be the first axis of both the "
        "input and the output and must not appear in the kernel.")
  orphans = [c for c in ker if c not in inp and c not in out]
  if orphans:
    raise registry_lib.UnsupportedLayerError(
        f"EinsumDense equation {equation!r}: kernel letters {orphans} appear in neither input "
        "nor output.")
  return EinsumStructure(
      inputs=inp, kernel=ker, output=out, batch=batch,
      positions="".join(c for c in inp[1:] if c in out and c not in ker),
      contracted="".join(c for c in ker if c in inp and c not in out),
      produced="".join(c for c in ker if c in out and c not in inp),
      shared="".join(c for c in ker if c in inp and c in out),
      input_only="".join(c for c in inp if c not in ker and c not in out))


def einsum_kernel_representation(s: EinsumStructure, x, dz, kernel_shape):
  """Per-example kernel gradients of ``einsum(s, x, W)`` given ``dz``."""
  size = dict(zip(s.kernel, kernel_shape))
  x = tf.cast(x, tf.float32)
  dz = tf.cast(dz, tf.float32)
  if not s.factorable:
    grads = tf.einsum(f"{s.inputs},{s.output}->{s.batch}{s.kernel}", x, dz)
    return factored.Materialized(grads)
  batch = tf.shape(x)[0]
  a = tf.einsum(f"{s.inputs}->{s.batch}{s.positions}{s.contracted}", x)
  b = tf.einsum(f"{s.output}->{s.batch}{s.positions}{s.produced}", dz)
  in_dims = [size[c] for c in s.contracted]
  out_dims = [size[c] for c in s.produced]
  a = tf.reshape(a, [batch, -1, math.prod(in_dims)])
  b = tf.reshape(b, [batch, -1, math.prod(out_dims)])
  layout = s.contracted + s.produced
  perm = [layout.index(c) for c in s.kernel]
  return factored.Outer(a, b, in_dims, out_dims, perm)


def _einsum_variables(layer):
  return [lora_lib.base_kernel(layer), layer.bias] + _lora_variables(layer)


def _einsum_capture(layer, call, args, kwargs, probe):
  inputs = registry_lib.bind_call_arguments(call, args, kwargs)["inputs"]
  structure = einsum_structure(layer.equation, len(inputs.shape))
  z = ops.einsum(layer.equation, inputs, layer.kernel)  # under LoRA, Keras' merged W + s A B
  if layer.bias is not None:
    z = ops.add(z, layer.bias)
  z = probe(z)

  def finish(grads):
    (dz,) = grads
    kernel = lora_lib.base_kernel(layer)
    out = ([(kernel, einsum_kernel_representation(structure, inputs, dz, tuple(kernel.shape)))]
           if kernel.trainable else [])
    out += _lora_representations(layer, structure.inputs, structure.kernel, structure.output,
                                 inputs, dz)
    if layer.bias is not None:
      out.append((layer.bias,
                  factored.Materialized(registry_lib.per_example_bias_grads(dz, layer.bias))))
    return out

  return _apply_activation(layer, z), finish


EINSUM_DENSE_RULE = registry_lib.LayerRule(variables=_einsum_variables, capture=_einsum_capture,
                                           unsupported=_unsupported)

registry_lib.DEFAULT_REGISTRY.register(keras.layers.Dense, DENSE_RULE)
registry_lib.DEFAULT_REGISTRY.register(keras.layers.EinsumDense, EINSUM_DENSE_RULE)
