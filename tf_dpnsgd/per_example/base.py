"""The value every per-example engine returns."""

from __future__ import annotations

import dataclasses
import threading
from typing import Any, Callable

import keras
import tensorflow as tf

from tf_dpnsgd.per_example.factored import runtime_zeros


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
    unit_mask: ``[U]`` bool, the units with a real row, when units are not rows
      (user-level slots, :mod:`~tf_dpnsgd.per_example.units`); None otherwise.
  """

  summed: list[tf.Tensor]
  norms: tf.Tensor
  factors: tf.Tensor
  losses: tf.Tensor
  y_pred: Any
  unit_mask: Any = None


def output_spec(model, x):
  """The model's symbolic output for a batch like ``x`` (any batch size).

  Used to create ``tf.TensorArray``s of the right dtypes before a loop over
  units or chunks.
  """
  x_spec = tf.nest.map_structure(
      lambda t: keras.KerasTensor((None,) + tuple(t.shape[1:]), dtype=t.dtype.name), x)
  return model.compute_output_spec(x_spec)


def variable_gradients(tape, target, variables) -> list:
  """Dense gradients of ``target`` w.r.t. ``variables``; zeros for one ``target`` does not use.

  Not ``tape.gradient(..., unconnected_gradients=tf.UnconnectedGradients.ZERO)``:
  TensorFlow's tape builds those zeros from ``source.dtype``, which for a Keras 3
  ``Variable`` is a string (``"float32"``), and fails inside the C++ tape with
  ``AttributeError: 'str' object has no attribute '_type_enum'`` (eager and graph).
  Any model with a trainable variable its loss does not reach hits it, e.g. a
  keras-hub ``LlamaBackbone`` with a head: its untied ``reverse_embeddings`` is
  used only by ``LlamaCausalLM``. The zeros here are made when the step runs
  (:func:`~tf_dpnsgd.per_example.factored.runtime_zeros`), never a constant of the
  traced function (an untied output embedding can be hundreds of MiB).

  Args:
    tape: a ``tf.GradientTape`` that recorded ``target``.
    target: a scalar tensor.
    variables: the variables to differentiate (Keras or TensorFlow variables).

  Returns:
    One dense tensor per variable, of its shape and dtype (``IndexedSlices``, e.g. an
    ``Embedding``'s, made dense).
  """
  grads = tape.gradient(target, variables)
  return [runtime_zeros(v.shape, tf.as_dtype(v.dtype)) if g is None else tf.convert_to_tensor(g)
          for g, v in zip(grads, variables)]


_MISSING = object()


class CallOverrides:
  """Instance-attribute ``call`` overrides of layers, reference counted under a lock.

  Layers are shared between the replica threads of a ``tf.distribute``
  strategy, so an override is installed once (set with ``object.__setattr__``,
  bypassing Keras' attribute tracking) and removed when its last user leaves,
  restoring any previous instance attribute. Used by the layer-wise engine's
  call capture and the vectorized engine's explicit bias add.
  """

  def __init__(self):
    self._lock = threading.Lock()
    self._entries: dict = {}  # id(layer) -> [layer, previous instance attribute, count]

  def __len__(self):
    return len(self._entries)

  def install(self, layers, make_call: Callable) -> list:
    """Overrides ``call`` of each layer with ``make_call(layer)`` (reads the current
    ``layer.call``); returns the layers to pass to :meth:`uninstall`. All or nothing."""
    installed = []
    with self._lock:
      try:
        for layer in layers:
          entry = self._entries.get(id(layer))
          if entry is None:
            previous = layer.__dict__.get("call", _MISSING)
            object.__setattr__(layer, "call", make_call(layer))
            self._entries[id(layer)] = [layer, previous, 1]
          else:
            entry[2] += 1
          installed.append(layer)
      except BaseException:
        self._release(installed)
        raise
    return installed

  def uninstall(self, installed: list) -> None:
    """Releases the layers :meth:`install` returned (emptying the list)."""
    with self._lock:
      self._release(installed)

  def _release(self, installed):
    while installed:
      layer = installed.pop()
      entry = self._entries[id(layer)]
      entry[2] -= 1
      if entry[2] == 0:
        del self._entries[id(layer)]
        if entry[1] is _MISSING:
          object.__delattr__(layer, "call")
        else:
          object.__setattr__(layer, "call", entry[1])
