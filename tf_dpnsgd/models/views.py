"""Several fixed views of each training example, averaged inside its loss.

Augmentation multiplicity (De et al. 2022, "Unlocking High-Accuracy
Differentially Private Image Classification through Scale", Sec. 3.1): each
example's loss is the mean of its losses on ``V`` augmented copies, so its
gradient -- the one DP-SGD clips and DP-NSGD normalizes -- is the mean of the
``V`` copies' gradients. All ``V`` copies come from the one example, so adding
or removing it still changes the noisy sum by at most the sensitivity: the
privacy analysis is unchanged, and the averaged gradient has less variance
than one copy's.

For models on fixed features (the scattering models of
:mod:`tf_dpnsgd.models.scatternet`) the copies must be computed once, so the
views here are fixed image transforms, not random ones (:data:`VIEWS`):
the image itself, its mirror image, and shifts by 2 pixels with reflected
borders. The model is the head applied to each view's features with shared
weights (:func:`multi_view`), giving logits ``[batch, V, classes]``;
:func:`view_mean_loss` averages the per-view losses of one example;
prediction averages the views' logits (:class:`ViewMeanAccuracy`,
:func:`on_raw_pixels`, which is also what the exported model computes).

Random views from the sampler (:mod:`tf_dpnsgd.augmentation`): with
``plan.dataset(x, y, model=model, augment=fn, multiplicity=K)`` every batch
holds ``K`` augmentations of each example on axis 1, drawn fresh each step.
The model is built the same way: ``make_private(multi_view(head, K))``
compiled with ``loss=view_mean_loss()`` and ``metrics=[ViewMeanAccuracy()]``;
evaluate and export ``head``, which holds the weights, on plain inputs.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import keras
import numpy as np
import tensorflow as tf


@dataclasses.dataclass(frozen=True)
class View:
  """An image transform: optional mirror (left-right), then a shift by ``(dy, dx)`` pixels
  with reflected borders (``out[i, j] = mirrored[i + dy, j + dx]``, reflected at the
  edges). Shifts are at most :data:`MAX_SHIFT` pixels."""
  dy: int = 0
  dx: int = 0
  mirror: bool = False


MAX_SHIFT = 4
VIEWS = {
    "identity": View(),
    "flip": View(mirror=True),
    "shift": View(2, 2, False),
    "flip_shift": View(-2, -2, True),
}


def check_views(names: Sequence[str]) -> tuple:
  """``names`` as a tuple of known, distinct view names.

  Raises:
    ValueError: an unknown or repeated name, or none at all.
  """
  names = tuple(names)
  if not names:
    raise ValueError(f"Give at least one view (known: {', '.join(VIEWS)}).")
  unknown = [n for n in names if n not in VIEWS]
  if unknown:
    raise ValueError(f"Unknown view(s) {unknown}; known: {', '.join(VIEWS)}.")
  if len(set(names)) != len(names):
    raise ValueError(f"Views repeat in {list(names)}: a repeated view only weighs one copy "
                     "twice.")
  return names


def apply_view_numpy(images: np.ndarray, view: View) -> np.ndarray:
  """``view`` of a batch ``[N, H, W, C]`` of images (NumPy; same dtype)."""
  x = np.asarray(images)
  if view.mirror:
    x = x[:, :, ::-1, :]
  if view.dy or view.dx:
    p = MAX_SHIFT
    x = np.pad(x, ((0, 0), (p, p), (p, p), (0, 0)), mode="reflect")
    h, w = images.shape[1], images.shape[2]
    x = x[:, p + view.dy:p + view.dy + h, p + view.dx:p + view.dx + w, :]
  return np.ascontiguousarray(x)


@keras.saving.register_keras_serializable(package="tf_dpnsgd")
class ImageView(keras.layers.Layer):
  """:func:`apply_view_numpy` as a weightless Keras layer (for models on raw pixels)."""

  def __init__(self, dy=0, dx=0, mirror=False, **kwargs):
    super().__init__(**kwargs)
    if max(abs(dy), abs(dx)) > MAX_SHIFT:
      raise ValueError(f"Shifts are at most {MAX_SHIFT} pixels; got ({dy}, {dx}).")
    self.view = View(int(dy), int(dx), bool(mirror))

  def call(self, inputs):
    x = inputs
    if self.view.mirror:
      x = tf.reverse(x, axis=[2])
    if self.view.dy or self.view.dx:
      p, h, w = MAX_SHIFT, x.shape[1], x.shape[2]
      x = tf.pad(x, [[0, 0], [p, p], [p, p], [0, 0]], mode="REFLECT")
      x = x[:, p + self.view.dy:p + self.view.dy + h, p + self.view.dx:p + self.view.dx + w, :]
    return x

  def compute_output_shape(self, input_shape):
    return input_shape

  def get_config(self):
    return {**super().get_config(), "dy": self.view.dy, "dx": self.view.dx,
            "mirror": self.view.mirror}


def multi_view(head: keras.Model, num_views: int, name=None) -> keras.Model:
  """``head`` on each of ``num_views`` views, weights shared: ``[B, V, *features] ->
  [B, V, classes]``. The model's weights are ``head``'s."""
  if not (isinstance(num_views, int) and num_views >= 1):
    raise ValueError(f"`num_views` must be an int >= 1; got {num_views!r}.")
  inputs = keras.Input(shape=(num_views,) + tuple(head.input_shape[1:]), name="views")
  outputs = [head(inputs[:, v]) for v in range(num_views)]
  stacked = keras.ops.stack(outputs, axis=1)
  return keras.Model(inputs, stacked, name=name or f"{head.name}_x{num_views}_views")


def view_mean_loss(from_logits: bool = True):
  """Per-example loss of a multi-view model: the mean over views of the sparse
  categorical cross-entropy, ``(y [B], logits [B, V, C]) -> [B]``."""

  def loss(y_true, y_pred):
    y_true = tf.cast(tf.reshape(y_true, [-1]), tf.int64)
    labels = tf.broadcast_to(y_true[:, None], tf.shape(y_pred)[:2])
    per_view = keras.losses.sparse_categorical_crossentropy(labels, y_pred,
                                                            from_logits=from_logits)
    return tf.reduce_mean(per_view, axis=1)

  loss.__name__ = "view_mean_sparse_categorical_crossentropy"
  return loss


class ViewMeanAccuracy(keras.metrics.Mean):
  """Accuracy of the argmax of the views' mean logits (what the exported model predicts)."""

  def __init__(self, name="accuracy", **kwargs):
    super().__init__(name=name, **kwargs)

  def update_state(self, y_true, y_pred, sample_weight=None):
    predicted = tf.argmax(tf.reduce_mean(tf.cast(y_pred, tf.float32), axis=1), axis=-1)
    correct = tf.cast(tf.equal(predicted, tf.cast(tf.reshape(y_true, [-1]), tf.int64)),
                      tf.float32)
    return super().update_state(correct, sample_weight=sample_weight)


@keras.saving.register_keras_serializable(package="tf_dpnsgd")
class MeanOverViews(keras.layers.Layer):
  """``[B, V, ...] -> [B, ...]``: the mean over the views axis; no weights."""

  def call(self, inputs):
    return tf.reduce_mean(inputs, axis=1)

  def compute_output_shape(self, input_shape):
    return (input_shape[0],) + tuple(input_shape[2:])


def on_raw_pixels(model: keras.Model, extractor: keras.Model, view_names: Sequence[str],
                  name=None) -> keras.Model:
  """Raw pixels -> each view -> ``extractor`` -> the multi-view ``model`` -> the mean of
  the views' logits ``[B, classes]``: one model sharing ``model``'s weights, for evaluation
  and export.

  Raises:
    ValueError: the extractor's output or the number of views does not fit ``model``.
  """
  view_names = check_views(view_names)
  expected = (len(view_names),) + tuple(extractor.output_shape[1:])
  if tuple(model.input_shape[1:]) != expected:
    raise ValueError(f"Model '{model.name}' takes {model.input_shape[1:]}; "
                     f"{len(view_names)} views of the extractor's output are {expected}.")
  inputs = keras.Input(shape=extractor.input_shape[1:], name="pixels")
  features = []
  for n in view_names:
    v = VIEWS[n]
    features.append(extractor(ImageView(v.dy, v.dx, v.mirror, name=f"view_{n}")(inputs)))
  stacked = keras.ops.stack(features, axis=1)
  logits = MeanOverViews(name="mean_over_views")(model(stacked))
  return keras.Model(inputs, logits, name=name or f"{model.name}_raw_pixels")


__all__ = ["ImageView", "MAX_SHIFT", "MeanOverViews", "VIEWS", "View", "ViewMeanAccuracy",
           "apply_view_numpy", "check_views", "multi_view", "on_raw_pixels", "view_mean_loss"]
