"""``fix_layers(model)``: a copy of a model with the layers that break per-example privacy
replaced (like Opacus' ``ModuleValidator.fix``).

BatchNormalization normalizes each example with statistics of the whole batch,
so one example's gradient depends on the others and its contribution is no
longer bounded by the clip (:func:`tf_dpnsgd.validate_layers` refuses it).
GroupNormalization normalizes each example by itself, over groups of channels:

>>> import keras
>>> inputs = keras.Input((8, 8, 3))
>>> h = keras.layers.Conv2D(48, 3, name="conv")(inputs)
>>> h = keras.layers.BatchNormalization(name="bn")(h)
>>> model = keras.Model(inputs, keras.layers.Dense(2)(keras.layers.Flatten()(h)))
>>> fixed, changes = fix_layers(model)
>>> changes
[LayerChange(name='bn', old='BatchNormalization', new='GroupNormalization(groups=16)')]

The copy keeps every other layer's weights; each GroupNormalization starts
fresh (scale 1, offset 0: the BatchNormalization's statistics and affine
weights describe another normalization). Functional and Sequential models
only (nested ones included): a subclassed model's layers are made by its code.
"""

from __future__ import annotations

from typing import NamedTuple

import keras
from keras.src.models.functional import Functional  # no public name for the class

GROUP_CHOICES = (32, 16, 8, 4, 2, 1)


class LayerChange(NamedTuple):
  """One replaced layer: its name, what it was and what it is now."""

  name: str
  old: str
  new: str


def group_count(channels: int) -> int:
  """The largest of :data:`GROUP_CHOICES` that divides ``channels``.

  >>> group_count(64), group_count(48), group_count(12), group_count(7)
  (32, 16, 4, 1)
  """
  return next(g for g in GROUP_CHOICES if channels % g == 0)


def _is_rebuildable(model) -> bool:
  """Functional (``keras.Model(inputs, outputs)``) or Sequential: ``clone_model`` can rebuild
  it layer by layer."""
  return isinstance(model, (keras.Sequential, Functional))


def _group_norm(layer: keras.layers.BatchNormalization) -> keras.layers.GroupNormalization:
  axis = layer.axis if isinstance(layer.axis, int) else None
  if axis is None or not layer.built:
    raise ValueError(f"Cannot replace BatchNormalization '{layer.name}': "
                     + ("build the model first (its channel count is unknown)."
                        if not layer.built else f"it normalizes over several axes {layer.axis}."))
  channels = int(layer.moving_mean.shape[0])
  return keras.layers.GroupNormalization(
      groups=group_count(channels), axis=axis, epsilon=layer.epsilon, center=layer.center,
      scale=layer.scale, beta_regularizer=layer.beta_regularizer,
      gamma_regularizer=layer.gamma_regularizer, beta_constraint=layer.beta_constraint,
      gamma_constraint=layer.gamma_constraint, name=layer.name, dtype=layer.dtype_policy,
      trainable=layer.trainable)


def fix_layers(model: keras.Model) -> tuple:
  """Returns ``(fixed, changes)``: a copy of ``model`` with every BatchNormalization
  replaced by a GroupNormalization, and the list of what changed.

  The group count is the largest of 32, 16, 8, 4, 2, 1 that divides the
  channels; axis, epsilon, centering, scaling, regularizers, constraints,
  name and ``trainable`` are kept. Every other layer is a copy with the
  original's weights.

  Args:
    model: a built functional or Sequential Keras model (nested ones included).

  Returns:
    ``(fixed, changes)``: the new model and a list of :class:`LayerChange`
    ``(name, old, new)`` tuples, one per replaced layer (empty: nothing to fix;
    ``fixed`` is then a plain copy).

  Raises:
    TypeError: a subclassed model (its code makes its layers: replace them there,
      e.g. ``keras.layers.GroupNormalization(groups=...)``).
    ValueError: a BatchNormalization that cannot be replaced (not built, or
      inside a nested subclassed model).
  """
  if not _is_rebuildable(model):
    raise TypeError(
        f"fix_layers rebuilds functional and Sequential models; '{getattr(model, 'name', model)}'"
        f" is a {type(model).__name__} (subclassed): replace keras.layers.BatchNormalization "
        "in its code by keras.layers.GroupNormalization(groups=...) (e.g. the largest of 32, "
        "16, 8, 4, 2, 1 dividing the channels) or LayerNormalization.")
  changes, copies = [], []

  def clone(layer):
    if isinstance(layer, keras.layers.BatchNormalization):
      new = _group_norm(layer)
      changes.append(LayerChange(layer.name, type(layer).__name__,
                                 f"GroupNormalization(groups={new.groups})"))
      return new
    new = layer.__class__.from_config(layer.get_config())
    if isinstance(layer, keras.layers.Layer):  # not an op called in a model (keras.ops.pad)
      copies.append((layer, new))
    return new

  def call(layer, *args, **kwargs):
    if isinstance(layer, keras.layers.GroupNormalization):
      kwargs.pop("mask", None)  # BatchNormalization's call took one; GroupNormalization's not
    return layer(*args, **kwargs)

  # A Sequential model calls its layers on one argument (and takes no call_function).
  calls = {} if isinstance(model, keras.Sequential) else {"call_function": call}
  fixed = keras.models.clone_model(model, clone_function=clone, recursive=True, **calls)
  for old, new in copies:
    weights = old.get_weights()
    if weights:
      new.set_weights(weights)
  left = [layer.name for layer in fixed._flatten_layers(include_self=False, recursive=True)
          if isinstance(layer, keras.layers.BatchNormalization)]
  if left:
    raise ValueError(f"BatchNormalization layers {left} are inside a nested subclassed model, "
                     "which fix_layers cannot rebuild: replace them in its code.")
  return fixed, changes


__all__ = ["GROUP_CHOICES", "LayerChange", "fix_layers", "group_count"]
