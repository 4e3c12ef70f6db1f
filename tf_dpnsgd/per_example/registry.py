"""Per-layer rules for the layer-wise engine: one function per layer type, open to users.

A :class:`LayerRule` tells the engine (a) which variables of a layer it
accounts for, (b) why a particular instance cannot be handled (LoRA, a
quantized kernel, a channels-first transposed convolution, ...) and (c) how to
run one call of the layer so that the engine can read the per-example
gradients:

``capture(layer, call, args, kwargs, probe) -> (outputs, finish)``

* ``call`` is the layer's own ``call`` (bound), ``args``/``kwargs`` what Keras
  passed to it;
* the rule computes the layer's outputs and passes every tensor whose
  per-example loss gradient it needs (e.g. a Dense layer's pre-activation
  ``z = x W + b``) through ``probe``: ``z = probe(z)``. Probed tensors must
  have the batch on axis 0;
* ``finish(grads)`` receives, in probe order, the gradients of the SUMMED
  per-example losses w.r.t. the probed tensors (row ``i`` is example ``i``'s
  own gradient, since examples do not interact) and returns
  ``[(variable, representation)]`` with representations from
  :mod:`tf_dpnsgd.per_example.factored`.

Layer types are matched exactly (``type(layer)``), never by ``isinstance``: a
subclass may change ``call`` and silently invalidate a rule. Types from
optional packages (keras-hub) can be registered by their qualified class name
so that no import is needed. A layer that holds trainable variables and has no
rule is reported by :func:`coverage` and makes ``per_example="layerwise"``
raise (``"auto"`` then uses the vectorized engine and logs why).

Register a rule for your own layer with::

    tf_dpnsgd.per_example.registry.DEFAULT_REGISTRY.register(MyLayer, LayerRule(...))

The rule's ``capture`` must reproduce the layer's ``call`` exactly; test it
against :func:`tf_dpnsgd.per_example.microbatch.microbatch_engine` (the
per-example loop), as ``tests/test_layerwise.py`` does for the built-in rules.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Callable

import keras
import numpy as np
import tensorflow as tf
from keras import ops


class UnsupportedLayerError(ValueError):
  """A layer (or a use of it) that the layer-wise engine cannot handle."""


@dataclasses.dataclass(frozen=True)
class LayerRule:
  """How the layer-wise engine handles one layer type.

  Attributes:
    variables: ``fn(layer) -> list`` of the variables whose per-example
      gradients ``capture`` accounts for.
    capture: see the module docstring.
    unsupported: optional ``fn(layer) -> str | None``: why this instance is not
      handled (then its variables count as uncovered), or None.
  """

  variables: Callable[[keras.layers.Layer], list]
  capture: Callable[..., tuple[Any, Callable]]
  unsupported: Callable[[keras.layers.Layer], str | None] | None = None


def _qualified_name(cls) -> str:
  return f"{cls.__module__}.{cls.__qualname__}"


class Registry:
  """Maps layer types (exact) to :class:`LayerRule` s."""

  def __init__(self):
    self._rules: dict[str, LayerRule] = {}

  def register(self, layer_type: type | str, rule: LayerRule, override: bool = False) -> None:
    """Registers ``rule`` for ``layer_type`` (a class or its ``"module.QualName"``)."""
    if not isinstance(rule, LayerRule):
      raise TypeError(f"`rule` must be a LayerRule; got {rule!r}.")
    key = layer_type if isinstance(layer_type, str) else _qualified_name(layer_type)
    if key in self._rules and not override:
      raise ValueError(f"A layer-wise rule for {key} is already registered; pass override=True.")
    self._rules[key] = rule

  def lookup(self, layer) -> LayerRule | None:
    return self._rules.get(_qualified_name(type(layer)))

  def registered_types(self) -> list[str]:
    return sorted(self._rules)

  def copy(self) -> "Registry":
    new = Registry()
    new._rules = dict(self._rules)
    return new


DEFAULT_REGISTRY = Registry()


# --- helpers for rules -------------------------------------------------------

def bind_call_arguments(call, args, kwargs) -> dict:
  """Named arguments of a ``call`` invocation, defaults applied."""
  bound = inspect.signature(call).bind(*args, **kwargs)
  bound.apply_defaults()
  return dict(bound.arguments)


def common_unsupported(layer, lora: bool = False) -> str | None:
  """Reasons shared by Keras core layers: LoRA, quantization, rematerialisation.

  Args:
    layer: the layer.
    lora: True for rules that handle LoRA (``Dense``, ``EinsumDense``:
      :mod:`tf_dpnsgd.per_example.layers.lora`); else LoRA is a reason.
  """
  if getattr(layer, "lora_enabled", False) and not lora:
    return "LoRA is enabled (the effective kernel is W + A B)"
  if getattr(layer, "quantization_mode", None) is not None:
    return f"the layer is quantized ({layer.quantization_mode})"
  if getattr(layer, "_remat_mode", None) is not None:
    return "the layer is rematerialized (keras.RematScope)"
  return None


def trainable(variables) -> list:
  return [v for v in variables if v is not None and v.trainable]


# --- model traversal and coverage --------------------------------------------

@dataclasses.dataclass(frozen=True)
class Coverage:
  """Which trainable variables of a model the registry can handle.

  Attributes:
    plans: ``[(layer, rule)]`` for the registered layers holding trainable
      variables (outermost registered layer; its sublayers are not visited).
    uncovered: ``[(variable, reason)]`` for trainable variables no rule handles.
  """

  plans: list
  uncovered: list

  @property
  def complete(self) -> bool:
    return not self.uncovered

  def explain(self, limit: int = 8) -> str:
    if self.complete:
      return (f"all trainable variables are in layers with layer-wise rules "
              f"({len(self.plans)} layers)")
    lines = [f"'{getattr(v, 'path', v.name)}': {reason}" for v, reason in self.uncovered[:limit]]
    more = len(self.uncovered) - limit
    if more > 0:
      lines.append(f"... and {more} more")
    return "no layer-wise rule for " + "; ".join(lines)


def _direct_sublayers(layer):
  return list(layer._flatten_layers(include_self=False, recursive=False))


def coverage(model, registry: Registry | None = None) -> Coverage:
  """Finds the registered layers of ``model`` (nested models/layers included).

  Layers are visited from ``model`` down; a registered layer's sublayers are
  not visited (its rule accounts for them). A variable claimed by several
  registered layers (shared weights) is covered; the engine then adds the
  per-example gradients of all its uses (:func:`factored.combine`).

  Returns:
    :class:`Coverage`.
  """
  registry = registry or DEFAULT_REGISTRY
  plans, reasons, claimed = [], {}, {}
  seen = set()

  def visit(layer):
    if id(layer) in seen:
      return
    seen.add(id(layer))
    rule = registry.lookup(layer)
    if rule is not None:
      why = rule.unsupported(layer) if rule.unsupported else None
      own = trainable(rule.variables(layer)) if why is None else []
      if why is not None:
        for v in trainable(layer.trainable_variables):
          reasons.setdefault(id(v), f"{type(layer).__name__} '{layer.name}': {why}")
        return
      if own:
        plans.append((layer, rule))
      for v in own:
        claimed.setdefault(id(v), []).append(layer)
      # Variables of the registered layer that its rule does not handle.
      for v in trainable(layer.trainable_variables):
        if id(v) not in claimed:
          reasons.setdefault(id(v), f"{type(layer).__name__} '{layer.name}': its rule does "
                                    "not account for this variable")
      return
    own = trainable(getattr(layer, "_trainable_variables", []))
    for v in own:
      reasons.setdefault(id(v), f"layer '{layer.name}' of type {type(layer).__name__} has no "
                                "layer-wise rule")
    for sub in _direct_sublayers(layer):
      visit(sub)

  visit(model)
  uncovered = []
  for v in model.trainable_variables:
    if id(v) in claimed:
      continue
    uncovered.append((v, reasons.get(id(v), "not owned by any registered layer")))
  return Coverage(plans=plans, uncovered=uncovered)


# --- biases ------------------------------------------------------------------

def bias_layout(output_shape, bias_shape) -> list[int]:
  """Output axes along which ``keras.ops.add(output, bias)`` varies the bias, in bias order.

  Keras' TF ``add`` does not always broadcast like numpy: a bias that squeezes
  to a vector matching the output's last (or second) axis is added with
  ``tf.nn.bias_add`` along that axis, whatever its own shape (e.g. an
  EinsumDense bias of shape ``[d, 1]`` on a ``[B, t, d, d]`` output varies
  along the last axis). So the layout is read off Keras itself: the op is
  applied to an index-valued bias, eagerly, on a one-example output.

  Args:
    output_shape: non-batch output shape; an unknown dimension (a sequence
      cut to its batch's length) never matches a bias dimension in Keras'
      trace-time choice, so it is read as a size larger than every bias
      dimension (the bias cannot vary along it).
    bias_shape: the bias variable's shape.

  Returns:
    The (1-based, batch = 0) output axes the bias elements run along; the
    per-example bias gradient is ``dz`` summed over every other non-batch axis.

  Raises:
    UnsupportedLayerError: if the addition is not an axis-aligned broadcast
      in the bias's own element order.
  """
  unknown = max([int(d) for d in bias_shape] + [1]) + 2
  output_shape = [unknown if d is None else int(d) for d in output_shape]
  size = int(np.prod(bias_shape)) if len(bias_shape) else 1
  with tf.init_scope():
    index = np.arange(size, dtype="float32").reshape(bias_shape)
    mapped = ops.convert_to_numpy(ops.add(np.zeros([1] + output_shape, "float32"), index))[0]
  axes = [a for a in range(len(output_shape))
          if mapped.shape[a] > 1 and not np.all(np.diff(mapped, axis=a) == 0)]
  expected_shape = [output_shape[a] if a in axes else 1 for a in range(len(output_shape))]
  expected = np.arange(size, dtype="float32").reshape([output_shape[a] for a in axes] or [1])
  expected = np.broadcast_to(expected.reshape(expected_shape), output_shape)
  if int(np.prod([output_shape[a] for a in axes] or [1])) != size or not np.array_equal(
      mapped, expected):
    raise UnsupportedLayerError(
        f"Cannot map a bias of shape {tuple(bias_shape)} onto outputs of shape "
        f"{tuple(output_shape)} as an axis-aligned broadcast.")
  return [a + 1 for a in axes]


def per_example_bias_grads(dz, bias, added_shape=None):
  """``[B, *bias.shape]`` per-example gradients of a bias added with ``keras.ops.add``.

  Args:
    dz: ``[B, ...]`` gradient of the summed loss w.r.t. the sum.
    bias: the bias variable.
    added_shape: the shape the bias had when added (if reshaped), else its own.
  """
  axes = bias_layout(dz.shape[1:], tuple(added_shape or bias.shape))
  reduce = [a for a in range(1, len(dz.shape)) if a not in axes]
  g = tf.cast(dz, tf.float32)
  g = tf.reduce_sum(g, axis=reduce) if reduce else g
  return tf.reshape(g, [-1] + list(bias.shape))
