"""Layer-wise rules for depthwise, separable and transposed convolutions.

``Conv1D`` / ``Conv2D`` / ``Conv3D`` are in :mod:`.conv`; this module reuses its
:class:`~.conv.ConvOuter` and :func:`~.conv.conv_patches`. Depthwise layers
may be channels-first (their tensors are transposed to channels-last before any
per-example computation, as in :mod:`.conv`); separable and transposed ones
must be channels-last (else the layer counts as unsupported, with the reason:
TensorFlow's CPU kernels have no NCHW separable or transposed convolution, so
such a rule could not be tested).

**Depthwise** (``DepthwiseConv1D`` / ``DepthwiseConv2D``, kernel
``[*k, C, m]``, ``m`` the depth multiplier): output channel ``c m + j`` only
sees input channel ``c``, so example ``i``'s kernel gradient is
``g_i[k, c, j] = sum_t patch[i, t, k, c] dz[i, t, c m + j]`` over output
positions ``t``. It is the size of the kernel (``K C m``, small), so it is
materialised (:class:`DepthwiseKernel`): for the whole batch at once by one
backprop-filter of Keras' own depthwise convolution with the batch folded
into the channels (example ``i``'s channels are ``[i C, (i+1) C)``, so block
``i`` of the folded kernel gradient is example ``i``'s), and kept for the
weighted sum, so the norm is that of exactly what is summed.

**Separable** (``SeparableConv1D`` / ``SeparableConv2D``): Keras computes
``u = depthwise(x, D)`` then ``z = conv_1x1(u, P)``. The rule recomputes both
with Keras' ops and probes ``u`` and ``z``: ``D`` gets the depthwise rule's
:class:`DepthwiseKernel` of ``(x, du)``, ``P`` an :class:`~..factored.Outer`
of ``(u, dz)`` over the output positions (ghost or materialised, as a Dense
layer over a sequence).

**Transposed** (``Conv1DTranspose`` / ``Conv2DTranspose`` / ``Conv3DTranspose``,
kernel ``[*k, filters, C]``): TensorFlow computes ``y = conv_transpose(x, K)``
as the input gradient of the convolution ``v -> conv(v, K)`` from ``y``'s
space to ``x``'s (same strides, dilation and padding, the padding derived
from ``y``'s size), so ``<conv_transpose(x, K), dy> = <x, conv(dy, K)>`` and
the kernel gradient is that of a convolution whose *input* is ``dy`` and
whose *output gradient* is ``x``: a :class:`~.conv.ConvOuter` of ``(dy, x)``
(ghost or materialised, float64 certification and recomputation, merging of
uses: all as for ``Conv2D``).

Precision of :class:`DepthwiseKernel` (see :mod:`~..factored`, "Formal
guarantees"): the float32 per-example gradients are squared and summed in
float64 (:func:`~..factored.sum_of_squares`) and enter the sum as stored.
Examples whose terms nearly cancel (``A > CONDITION_LIMIT ||g||`` with
``A = sum_{t,c} ||patch[t, :, c]|| ||dz[t, c, :]||``, e.g. a layer used twice
on nearly equal inputs with opposite output gradients) are recomputed in
float64 from patches (error ``<= gamma(T) A``) for the norm and the sum.
"""

from __future__ import annotations

import math

import keras
import tensorflow as tf
from keras import ops

from tf_dpnsgd.per_example import factored
from tf_dpnsgd.per_example import registry as registry_lib
from tf_dpnsgd.per_example.layers import conv


def _channels_last(t, data_format):
  """``t`` with its channel axis moved last (a no-op for channels-last)."""
  if data_format == "channels_last":
    return t
  rank = len(t.shape)
  return tf.transpose(t, [0] + list(range(2, rank)) + [1])


def _fold(t):
  """``[n, *S, C]`` -> ``[1, *S, n C]``: example ``i``'s channels become ``[i C, (i+1) C)``."""
  rank = len(t.shape)
  t = tf.transpose(t, list(range(1, rank - 1)) + [0, rank - 1])
  return tf.reshape(t, [1] + [int(d) for d in t.shape[:-2]] + [-1])


def _static_spatial(name, *tensors):
  for t in tensors:
    if any(d is None for d in t.shape[1:]):
      raise registry_lib.UnsupportedLayerError(
          f"{name} needs static spatial sizes for the layer-wise engine; got {t.shape}. Use "
          "fixed-size inputs or per_example='vectorized'.")


class DepthwiseKernel(factored.Representation):
  """Per-example kernel gradients of a depthwise convolution, materialised and kept.

  ``g_i[k, c, j] = sum_uses sum_t patch[i, t, k, c] dz[i, t, c m + j]``.
  Norms: the float32 gradients' squares summed in float64; the scale ``A``
  (sum of the norms of the rank-one terms ``patch[t, :, c] (x) dz[t, c, :]``)
  marks examples to recompute in float64 (:meth:`unit_gradient64`, from
  patches). The weighted sum uses the kept gradients; without them (a second
  pass) it is one backprop-filter of ``(x, h dz)`` per use, as in a plain step.

  Args:
    x: ``[B, *spatial, C]`` channels-last input.
    g: ``[B, *spatial_out, C m]`` gradient of the summed loss w.r.t. the
      depthwise convolution's output.
    kernel_size, strides, dilation_rate, padding: the layer's.
    more_uses: further ``(x, g)`` pairs of the same kernel (other calls).
  """

  #: to_units materialises (see :func:`~..factored.materialized_units`).
  exact_regrouping = False

  def __init__(self, x, g, kernel_size, strides, dilation_rate, padding, more_uses=()):
    uses = [(x, g)] + list(more_uses)
    for xu, gu in uses:
      _static_spatial("A depthwise convolution", xu, gu)
    self.uses = [(tf.cast(xu, tf.float32), tf.cast(gu, tf.float32)) for xu, gu in uses]
    self.kernel_size = tuple(kernel_size)
    self.strides = tuple(strides)
    self.dilation_rate = tuple(dilation_rate)
    self.padding = padding
    self.channels = int(x.shape[-1])
    self.multiplier = int(g.shape[-1]) // self.channels
    self.kernel_shape = list(self.kernel_size) + [self.channels, self.multiplier]
    self.offsets = math.prod(self.kernel_size)
    self.positions = sum(int(tf.TensorShape(gu.shape[1:-1]).num_elements())
                         for _, gu in self.uses)
    self._materialized = None  # [B, *kernel_shape]

  def _conv(self, x, kernel):
    return ops.depthwise_conv(x, kernel, strides=self.strides, padding=self.padding,
                              dilation_rate=self.dilation_rate, data_format="channels_last")

  def _filter_grad(self, x, g, channels):
    """``d/dK <depthwise_conv(x, K), g>`` for a ``[*k, channels, m]`` kernel (Keras' op)."""
    # Made at run time: a folded kernel of zeros (K n C m) is not kept as a graph constant.
    kernel = factored.runtime_zeros(list(self.kernel_size) + [channels, self.multiplier],
                                    x.dtype)
    with tf.GradientTape() as tape:
      tape.watch(kernel)
      z = self._conv(x, kernel)
    return tape.gradient(z, kernel, output_gradients=g)

  def _per_example(self, uses):
    """``[n, *kernel_shape]`` float32 per-example gradients: one folded backprop-filter per use."""
    total = None
    for xu, gu in uses:
      n = xu.shape[0] if xu.shape[0] is not None else tf.shape(xu)[0]
      grads = self._filter_grad(_fold(xu), _fold(gu), n * self.channels)  # [*k, n C, m]
      rank = len(self.kernel_size)
      grads = tf.reshape(grads, tf.concat([list(self.kernel_size), [n, self.channels,
                                                                     self.multiplier]], 0))
      grads = tf.transpose(grads, [rank] + list(range(rank)) + [rank + 1, rank + 2])
      total = grads if total is None else total + grads
    return tf.ensure_shape(total, [None] + self.kernel_shape)

  def _scale(self):
    """``[B]`` ``A_i = sum_{uses, t, c} ||patch[i, t, :, c]|| ||dz[i, t, c, :]||`` (float32
    suffices: it only decides which examples are recomputed; inf marks one, which is safe)."""
    ones = tf.ones(list(self.kernel_size) + [self.channels, 1], tf.float32)
    total = None
    for xu, gu in self.uses:
      patch_norms = tf.sqrt(tf.maximum(self._conv(tf.square(xu), ones), 0.0))  # [B, *S', C]
      g_norms = factored.row_norms(tf.reshape(gu, tf.concat(
          [tf.shape(gu)[:-1], [self.channels, self.multiplier]], 0)))  # [B, *S', C]
      term = tf.reduce_sum(tf.reshape(patch_norms * g_norms, [tf.shape(xu)[0], -1]), axis=1)
      total = term if total is None else total + term
    return tf.cast(total, tf.float64)

  def estimate(self) -> factored.Estimate:
    self._materialized = self._per_example(self.uses)
    value, error = factored.sum_of_squares(self._materialized)
    return factored.Estimate(value, error, self._scale())

  def unit_gradient64(self, u):
    patches, grads = [], []
    for xu, gu in self.uses:
      x = tf.cast(tf.gather(xu, [u]), tf.float64)
      g = tf.cast(tf.gather(gu, [u]), tf.float64)
      p = conv.conv_patches(x, self.kernel_size, self.strides, self.dilation_rate,
                            self.padding)  # [1, T, K C]
      patches.append(tf.reshape(p, [-1, self.offsets, self.channels]))
      grads.append(tf.reshape(g, [-1, self.channels, self.multiplier]))
    patches = tf.concat(patches, axis=0)  # [T, K, C]
    grads = tf.concat(grads, axis=0)  # [T, C, m]
    g64 = tf.einsum("tkc,tcj->kcj", patches, grads)
    scale = tf.reduce_sum(tf.norm(patches, axis=1) * tf.norm(grads, axis=2))
    return tf.reshape(g64, self.kernel_shape), factored.gamma(self.positions) * scale

  def _with_uses(self, uses) -> "DepthwiseKernel":
    (x, g), rest = uses[0], uses[1:]
    return DepthwiseKernel(x, g, self.kernel_size, self.strides, self.dilation_rate,
                           self.padding, more_uses=rest)

  def gather_units(self, indices) -> "DepthwiseKernel":
    return self._with_uses([(tf.gather(xu, indices), tf.gather(gu, indices))
                            for xu, gu in self.uses])

  def mergeable(self, other) -> bool:
    return (isinstance(other, DepthwiseKernel) and other.kernel_size == self.kernel_size
            and other.strides == self.strides and other.dilation_rate == self.dilation_rate
            and other.padding == self.padding and other.kernel_shape == self.kernel_shape)

  def merge(self, other: "DepthwiseKernel") -> "DepthwiseKernel":
    """Another call of the same kernel: its uses join this one's (exact)."""
    return self._with_uses(self.uses + other.uses)

  def raw_weighted_sum(self, factors: tf.Tensor) -> tf.Tensor:
    keep = factors > 0
    if self._materialized is not None:
      g = factored.zero_dropped_units(self._materialized, keep)
      return tf.tensordot(factors, g, axes=[[0], [0]])
    total = None
    for xu, gu in self.uses:  # backprop-filter of (x, h dz), as a plain step
      x = factored.zero_dropped_units(xu, keep)
      hg = factored.zero_dropped_units(gu, keep) * tf.reshape(
          factors, [-1] + [1] * (len(gu.shape) - 1))
      part = self._filter_grad(x, hg, self.channels)
      total = part if total is None else total + part
    return total

  def per_unit(self) -> tf.Tensor:
    return self._materialized if self._materialized is not None else self._per_example(
        self.uses)

  def to_units(self, num_units: int) -> factored.Materialized:
    return factored.materialized_units(self, num_units)


# --- rules ------------------------------------------------------------------------

def _bias_shape(layer, channels):
  if layer.data_format == "channels_last":
    return (1,) * (layer.rank + 1) + (channels,)
  return (1, channels) + (1,) * layer.rank


def _add_bias(layer, z, channels):
  """``z + bias`` as Keras adds it; returns ``(z, bias_shape or None)``."""
  if not layer.use_bias:
    return z, None
  shape = _bias_shape(layer, channels)
  return ops.add(z, ops.reshape(layer.bias, shape)), shape


def _bias_rep(layer, dz, bias_shape):
  return (layer.bias, factored.Materialized(
      registry_lib.per_example_bias_grads(dz, layer.bias, bias_shape)))


def _activate(layer, z):
  return layer.activation(z) if layer.activation is not None else z


def _depthwise_rep(layer, x, dz):
  """:class:`DepthwiseKernel` of channels-last ``x`` and the depthwise output's ``dz``."""
  return DepthwiseKernel(x, dz, layer.kernel_size, layer.strides, layer.dilation_rate,
                         layer.padding)


# Depthwise ----------------------------------------------------------------------

def _depthwise_variables(layer):
  return [layer.kernel, layer.bias if layer.use_bias else None]


def _depthwise_capture(layer, call, args, kwargs, probe):
  """Repeats ``BaseDepthwiseConv.call`` with the pre-activation output probed."""
  inputs = registry_lib.bind_call_arguments(call, args, kwargs)["inputs"]
  z = ops.depthwise_conv(inputs, layer.kernel, strides=layer.strides, padding=layer.padding,
                         dilation_rate=layer.dilation_rate, data_format=layer.data_format)
  z, bias_shape = _add_bias(layer, z, int(layer.kernel.shape[-2] * layer.kernel.shape[-1]))
  z = probe(z)

  def finish(grads):
    (dz,) = grads
    x = _channels_last(tf.cast(inputs, tf.float32), layer.data_format)
    g = _channels_last(tf.cast(dz, tf.float32), layer.data_format)
    out = [(layer.kernel, _depthwise_rep(layer, x, g))]
    if layer.use_bias:
      out.append(_bias_rep(layer, dz, bias_shape))
    return out

  return _activate(layer, z), finish


# Separable ----------------------------------------------------------------------

def _separable_variables(layer):
  return [layer.depthwise_kernel, layer.pointwise_kernel, layer.bias if layer.use_bias else None]


def _separable_capture(layer, call, args, kwargs, probe):
  """Repeats ``BaseSeparableConv.call`` as Keras' op computes it: the depthwise convolution
  ``u`` (probed), the pointwise 1x1 convolution ``z`` plus bias (probed)."""
  inputs = registry_lib.bind_call_arguments(call, args, kwargs)["inputs"]
  u = ops.depthwise_conv(inputs, layer.depthwise_kernel, strides=layer.strides,
                         padding=layer.padding, dilation_rate=layer.dilation_rate,
                         data_format=layer.data_format)
  u = probe(u)
  z = ops.conv(u, layer.pointwise_kernel, strides=1, padding="valid",
               data_format=layer.data_format)
  z, bias_shape = _add_bias(layer, z, layer.filters)
  z = probe(z)

  def finish(grads):
    du, dz = grads  # channels-last (channels-first is refused)
    _static_spatial(f"SeparableConv '{layer.name}'", u, dz)
    width = int(u.shape[-1])
    positions = int(tf.TensorShape(u.shape[1:-1]).num_elements())
    a = tf.reshape(tf.cast(u, tf.float32), [-1, positions, width])
    b = tf.reshape(tf.cast(dz, tf.float32), [-1, positions, layer.filters])
    out = [(layer.depthwise_kernel, _depthwise_rep(layer, tf.cast(inputs, tf.float32),
                                                   tf.cast(du, tf.float32))),
           (layer.pointwise_kernel, factored.Outer(a, b, [1] * layer.rank + [width],
                                                   [layer.filters]))]
    if layer.use_bias:
      out.append(_bias_rep(layer, dz, bias_shape))
    return out

  return _activate(layer, z), finish


# Transposed ---------------------------------------------------------------------

def _transpose_variables(layer):
  return [layer.kernel, layer.bias if layer.use_bias else None]


def _transpose_capture(layer, call, args, kwargs, probe):
  """Repeats ``BaseConvTranspose.call`` with the pre-activation output probed."""
  inputs = registry_lib.bind_call_arguments(call, args, kwargs)["inputs"]
  z = ops.conv_transpose(inputs, layer.kernel, strides=list(layer.strides),
                         padding=layer.padding, output_padding=layer.output_padding,
                         dilation_rate=layer.dilation_rate, data_format=layer.data_format)
  z, bias_shape = _add_bias(layer, z, layer.filters)
  z = probe(z)

  def finish(grads):
    (dz,) = grads  # channels-last (channels-first is refused)
    # The adjoint convolution's input is dz, its output gradient x (module docstring).
    out = [(layer.kernel, conv.ConvOuter(tf.cast(dz, tf.float32), tf.cast(inputs, tf.float32),
                                         layer.kernel_size, layer.strides, layer.dilation_rate,
                                         layer.padding))]
    if layer.use_bias:
      out.append(_bias_rep(layer, dz, bias_shape))
    return out

  return _activate(layer, z), finish


def _unsupported(layer):
  why = registry_lib.common_unsupported(layer)
  if why:
    return why
  if layer.padding not in ("valid", "same"):
    return f"padding={layer.padding!r} (the rule knows 'valid' and 'same')"
  return None


def _channels_last_only(layer):
  """Separable and transposed convolutions: channels-first is refused (TensorFlow's CPU
  kernels have no NCHW separable or transposed convolution, so the rule is untested there)."""
  why = _unsupported(layer)
  if why:
    return why
  if layer.data_format != "channels_last":
    return (f"data_format={layer.data_format!r}: the layer-wise rule for "
            f"{type(layer).__name__} supports 'channels_last' only")
  return None


DEPTHWISE_RULE = registry_lib.LayerRule(variables=_depthwise_variables,
                                        capture=_depthwise_capture,
                                        unsupported=_unsupported)
SEPARABLE_RULE = registry_lib.LayerRule(variables=_separable_variables,
                                        capture=_separable_capture,
                                        unsupported=_channels_last_only)
TRANSPOSE_RULE = registry_lib.LayerRule(variables=_transpose_variables,
                                        capture=_transpose_capture,
                                        unsupported=_channels_last_only)

for _type, _rule in ((keras.layers.DepthwiseConv1D, DEPTHWISE_RULE),
                     (keras.layers.DepthwiseConv2D, DEPTHWISE_RULE),
                     (keras.layers.SeparableConv1D, SEPARABLE_RULE),
                     (keras.layers.SeparableConv2D, SEPARABLE_RULE),
                     (keras.layers.Conv1DTranspose, TRANSPOSE_RULE),
                     (keras.layers.Conv2DTranspose, TRANSPOSE_RULE),
                     (keras.layers.Conv3DTranspose, TRANSPOSE_RULE)):
  registry_lib.DEFAULT_REGISTRY.register(_type, _rule)
