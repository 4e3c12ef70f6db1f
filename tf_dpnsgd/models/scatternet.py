"""Classifiers on scattering features (Tramer and Boneh, ICLR 2021).

"Differentially Private Learning Needs Better Features" trains, with DP-SGD, a
linear model or a small CNN on the fixed, public features of a scattering
network (:class:`~tf_dpnsgd.models.Scattering2D`, J=2, L=8: 81 maps of 8x8 per
colour channel of a CIFAR-10 image). The features have no trainable weights,
so training only the head on precomputed features is the same training as
through the whole network, at a fraction of the cost.

A model here is split in two:

* :func:`scattering_extractor`: raw pixels -> normalized features
  ``[8, 8, 243]``: pixels scaled by public constants, the scattering
  transform, then each example's features normalized by themselves
  (``GroupNormalization`` without scale or offset, as Tramer and Boneh's
  ``nn.GroupNorm(groups, 243, affine=False)``). No weights, and no statistic
  of any data set. Or Tramer and Boneh's "data normalization": each channel
  standardized by its mean and variance over the training set, released
  with the Gaussian mechanism (:mod:`tf_dpnsgd.private_stats`; two releases
  the plan composes with the steps and the ledger records), held by a
  :class:`ChannelStandardization` layer (constants, no trainable weights);
* a head on the normalized features, :func:`scatter_linear` or
  :func:`scatter_cnn`, the only part with weights, hence the only part DP
  training touches (training it on precomputed features is the same training
  as through the whole model, and about 4 times faster per step on a CPU,
  where the normalization of 15,552 features per example dominates a linear
  model's step);

and :func:`on_raw_pixels` joins them into one model (sharing the head's
weights) for evaluation and export on raw images.
"""

from __future__ import annotations

import keras

from tf_dpnsgd.data import cifar10 as cifar_lib
from tf_dpnsgd.models.scattering import Scattering2D
from tf_dpnsgd.models.scattering import num_channels

# The per-channel constants Tramer and Boneh normalize CIFAR-10 with before the
# scattering transform: ImageNet's (torchvision), i.e. no statistic of CIFAR-10.
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
GROUPNORM_EPSILON = 1e-5  # PyTorch's (Keras' default 1e-3 would swamp order-2 groups)


@keras.saving.register_keras_serializable(package="tf_dpnsgd")
class RoundToFloat16(keras.layers.Layer):
  """Rounds float32 values to the nearest float16 (and returns float32); no weights.

  The last layer of :func:`scattering_extractor`: features are cached and held
  in memory as float16 (half the memory: 1.6 GB instead of 3.1 GB for
  CIFAR-10's training set), and the served model rounds the same way, so it
  computes the features the head was trained on (exactly for the same batch;
  float32 rounding that differs between batch sizes can move a rare feature
  by one float16 step). Normalized features
  are about N(0, 1), so the rounding (relative error <= 2^-11) is far below
  the DP noise.
  """

  def call(self, inputs):
    return keras.ops.cast(keras.ops.cast(inputs, "float16"), "float32")

  def compute_output_shape(self, input_shape):
    return input_shape


@keras.saving.register_keras_serializable(package="tf_dpnsgd")
class ChannelStandardization(keras.layers.Layer):
  """``(x - mean) * scale`` over the last axis, with fixed (released, public) constants.

  The constants come from :func:`tf_dpnsgd.private_stats.release_channel_moments`
  (``scale`` is 0 for channels it dropped); they are stored as non-trainable
  weights so that saving and export keep them. Not part of any model DP
  training updates.
  """

  def __init__(self, mean, scale, **kwargs):
    super().__init__(**kwargs)
    self._mean_init = [float(v) for v in mean]
    self._scale_init = [float(v) for v in scale]
    if len(self._mean_init) != len(self._scale_init):
      raise ValueError(f"`mean` ({len(self._mean_init)}) and `scale` "
                       f"({len(self._scale_init)}) must have one value per channel.")

  def build(self, input_shape):
    channels = input_shape[-1]
    if channels != len(self._mean_init):
      raise ValueError(f"{len(self._mean_init)} channel constants for inputs with "
                       f"{channels} channels.")
    self.mean = self.add_weight(shape=(channels,), trainable=False, name="mean",
                                initializer=keras.initializers.Constant(self._mean_init))
    self.scale = self.add_weight(shape=(channels,), trainable=False, name="scale",
                                 initializer=keras.initializers.Constant(self._scale_init))

  def call(self, inputs):
    return (inputs - self.mean) * self.scale

  def compute_output_shape(self, input_shape):
    return input_shape

  def get_config(self):
    return {**super().get_config(), "mean": self._mean_init, "scale": self._scale_init}


def scattering_extractor(input_shape=(32, 32, 3), J: int = 2, L: int = 8, groups=27,
                         mean=IMAGENET_MEAN, std=IMAGENET_STD, chunk_size=None,
                         float16_features: bool = True, channel_moments=None,
                         name="scattering"):
  """Raw pixels (0..255) -> normalized scattering features, as a weightless Keras model.

  Args:
    input_shape: ``(H, W, C)`` of the images.
    J, L: scales and angles of :class:`Scattering2D` (order 2).
    groups: GroupNorm groups over the ``C K`` feature channels (a divisor of
      ``C K``; Tramer and Boneh tried 9, 27 and 81 for CIFAR-10's 243); the
      channels of a group are contiguous, i.e. paths of one colour. ``None``:
      no normalization.
    mean, std: public per-channel constants the pixels (in [0, 1]) are
      normalized with first (default: ImageNet's, as Tramer and Boneh).
    chunk_size: see :class:`Scattering2D`.
    float16_features: round the features to float16 values
      (:class:`RoundToFloat16`), so that they can be stored as float16
      without changing what the model computes.
    channel_moments: released per-channel statistics
      (:class:`tf_dpnsgd.private_stats.ChannelMoments`) to standardize the
      (float16-rounded) features with, instead of GroupNorm (``groups`` must
      be ``None``); the output is rounded to float16 values again, as
      :func:`tf_dpnsgd.private_stats.standardize` of cached features is.

  Returns:
    A functional ``keras.Model`` ``[None, H, W, C] -> [None, H/2^J, W/2^J, C K]``
    (float32).

  Raises:
    ValueError: ``groups`` does not divide the number of feature channels.
  """
  channels = input_shape[-1] * num_channels(J, L, 2)
  if groups is not None and not (isinstance(groups, int) and groups >= 1
                                 and channels % groups == 0):
    raise ValueError(f"`groups` ({groups!r}) must be a positive divisor of the {channels} "
                     "feature channels (e.g. 9, 27 or 81 for 243).")
  inputs = keras.Input(shape=input_shape, name="pixels")
  x = cifar_lib.PixelNormalization(mean, std, 255.0, name="pixel_normalization")(inputs)
  x = Scattering2D(J=J, L=L, max_order=2, scale=1.0, chunk_size=chunk_size,
                   name="scattering2d")(x)
  if groups is not None and channel_moments is not None:
    raise ValueError("Give `groups` (GroupNorm) or `channel_moments` (data normalization), "
                     "not both.")
  if groups is not None:
    x = keras.layers.GroupNormalization(groups=groups, center=False, scale=False,
                                        epsilon=GROUPNORM_EPSILON, name="feature_groupnorm")(x)
  if channel_moments is not None:
    if float16_features:
      x = RoundToFloat16(name="round_raw_to_float16")(x)
    x = ChannelStandardization(channel_moments.mean, channel_moments.scale(),
                               name="feature_standardization")(x)
  if float16_features:
    x = RoundToFloat16(name="round_to_float16")(x)
  return keras.Model(inputs, x, name=name)


def scatter_linear(feature_shape=(8, 8, 243), num_classes: int = 10, name="scatter_linear"):
  """A linear classifier on (normalized) scattering features.

  Args:
    feature_shape: shape of one example's features (``[8, 8, 243]`` for CIFAR-10).
    num_classes: logits returned.

  Returns:
    A functional ``keras.Model`` on features (``8 * 8 * 243 * 10 + 10 = 155,530``
    weights for CIFAR-10).
  """
  inputs = keras.Input(shape=feature_shape, name="features")
  x = keras.layers.Flatten(name="flatten")(inputs)
  outputs = keras.layers.Dense(num_classes, name="logits")(x)
  return keras.Model(inputs, outputs, name=name)


def scatter_cnn(feature_shape=(8, 8, 243), num_classes: int = 10, filters=(64, 64),
                name="scatter_cnn"):
  """Tramer and Boneh's CNN on (normalized) scattering features (their ``CIFAR10_CNN``
  with ``in_channels=243``): conv3x3(64)-tanh, max-pool 2, conv3x3(64)-tanh, linear.

  Args:
    feature_shape, num_classes: see :func:`scatter_linear`.
    filters: channels of the two convolutions.

  Returns:
    A functional ``keras.Model`` on features (``187,210`` weights for CIFAR-10).
  """
  inputs = keras.Input(shape=feature_shape, name="features")
  x = keras.layers.Conv2D(filters[0], 3, padding="same", activation="tanh", name="conv1")(inputs)
  x = keras.layers.MaxPooling2D(2, name="pool")(x)
  x = keras.layers.Conv2D(filters[1], 3, padding="same", activation="tanh", name="conv2")(x)
  x = keras.layers.Flatten(name="flatten")(x)
  outputs = keras.layers.Dense(num_classes, name="logits")(x)
  return keras.Model(inputs, outputs, name=name)


def on_raw_pixels(head, extractor, name=None):
  """``head`` behind ``extractor``: one model on raw pixels sharing ``head``'s weights.

  Raises:
    ValueError: the extractor's output does not fit the head's input.
  """
  if tuple(extractor.output_shape[1:]) != tuple(head.input_shape[1:]):
    raise ValueError(f"The extractor gives {extractor.output_shape[1:]}; head "
                     f"'{head.name}' takes {head.input_shape[1:]}.")
  inputs = keras.Input(shape=extractor.input_shape[1:], name="pixels")
  return keras.Model(inputs, head(extractor(inputs)), name=name or f"{head.name}_raw_pixels")


__all__ = ["ChannelStandardization", "IMAGENET_MEAN", "IMAGENET_STD", "RoundToFloat16", "on_raw_pixels", "scatter_cnn",
           "scatter_linear", "scattering_extractor"]
