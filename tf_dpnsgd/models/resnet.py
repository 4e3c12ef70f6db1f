"""ResNet20 with GroupNorm for 32x32 images (He et al. 2016, CIFAR variant).

BatchNorm is replaced by GroupNorm, which normalizes within each example and so
keeps per-example gradients well defined (Yang et al. 2022, Section 5).
"""

from __future__ import annotations

import keras


def _conv(filters, strides, name):
  return keras.layers.Conv2D(filters, 3, strides=strides, padding="same", use_bias=False,
                             kernel_initializer="he_normal", name=name)


def _basic_block(x, filters, strides, groups, name):
  shortcut = x
  y = _conv(filters, strides, f"{name}_conv1")(x)
  y = keras.layers.GroupNormalization(groups=min(groups, filters), name=f"{name}_gn1")(y)
  y = keras.layers.Activation("relu", name=f"{name}_relu1")(y)
  y = _conv(filters, 1, f"{name}_conv2")(y)
  y = keras.layers.GroupNormalization(groups=min(groups, filters), name=f"{name}_gn2")(y)
  if strides != 1 or shortcut.shape[-1] != filters:
    shortcut = keras.layers.Conv2D(filters, 1, strides=strides, use_bias=False,
                                   kernel_initializer="he_normal", name=f"{name}_proj")(shortcut)
    shortcut = keras.layers.GroupNormalization(groups=min(groups, filters),
                                               name=f"{name}_proj_gn")(shortcut)
  y = keras.layers.Add(name=f"{name}_add")([y, shortcut])
  return keras.layers.Activation("relu", name=f"{name}_out")(y)


def resnet20(input_shape=(32, 32, 3), num_classes=10, groups=16, depth=20, name="resnet20_gn"):
  """ResNet-(6n+2) with GroupNorm; ``depth=20`` has about 0.27M parameters.

  Args:
    input_shape: image shape (HWC), already normalized.
    num_classes: logits returned (no softmax: use ``from_logits=True``).
    groups: GroupNorm groups (capped at the channel count).
    depth: 6n+2 (20, 32, 44, 56, ...).

  Returns:
    A functional ``keras.Model`` (wrap with :func:`tf_dpnsgd.make_private`).
  """
  if (depth - 2) % 6:
    raise ValueError(f"`depth` must be 6n+2 (20, 32, 44, ...); got {depth}.")
  blocks = (depth - 2) // 6
  inputs = keras.Input(shape=input_shape, name="image")
  x = _conv(16, 1, "stem_conv")(inputs)
  x = keras.layers.GroupNormalization(groups=min(groups, 16), name="stem_gn")(x)
  x = keras.layers.Activation("relu", name="stem_relu")(x)
  for stage, filters in enumerate((16, 32, 64)):
    for block in range(blocks):
      strides = 2 if stage > 0 and block == 0 else 1
      x = _basic_block(x, filters, strides, groups, f"s{stage + 1}b{block + 1}")
  x = keras.layers.GlobalAveragePooling2D(name="pool")(x)
  outputs = keras.layers.Dense(num_classes, name="logits")(x)
  return keras.Model(inputs, outputs, name=name)
