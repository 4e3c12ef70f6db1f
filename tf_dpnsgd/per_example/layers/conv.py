"""Layer-wise rules for ``keras.layers.Conv1D``, ``Conv2D`` and ``Conv3D``.

The rule recomputes the convolution as Keras does (causal padding included),
probes the pre-activation output ``z`` and applies the activation. Per example
the kernel gradient is ``sum_t patch[i, t] (x) dz[i, t]`` over output positions
``t``, where ``patch[i, t]`` is the ``kh * kw * c_in`` receptive field of
position ``t`` (built by :func:`conv_patches` from strided slices: strides,
dilation, "same"/"valid"/"causal" padding). The norm is then the ghost norm or
the materialised one, whichever is cheaper for ``T = H' W'`` vs ``kh kw c_in``
and ``c_out`` (:func:`~..factored.use_ghost`): early layers of a CIFAR ResNet
(T = 1024) materialise, small-spatial wide layers use the ghost norm.

Grouped convolutions (``groups = G > 1``): group ``k`` convolves input
channels ``[k c_in/G, (k+1) c_in/G)`` with kernel columns
``[k c_out/G, (k+1) c_out/G)``, so the kernel gradient is the concatenation
(along the output channels) of ``G`` ungrouped ones, each a
:class:`ConvOuter` of its channel slices (:class:`GroupedConv`); its squared
norm is the sum of theirs.

Depthwise, separable and transposed convolutions: :mod:`.conv_more` (the
transposed ones reuse :class:`ConvOuter`).
"""

from __future__ import annotations

import itertools
import math

import keras
import numpy as np
import tensorflow as tf
from keras import ops

from tf_dpnsgd.per_example import factored
from tf_dpnsgd.per_example import registry as registry_lib


def _dim(x, axis):
  d = x.shape[axis]
  return d if d is not None else tf.shape(x)[axis]


def _maximum(a, b):
  if isinstance(a, int) and isinstance(b, int):
    return max(a, b)
  return tf.maximum(a, b)


def conv_output_size(size, kernel: int, stride: int, dilation: int, padding: str):
  """Spatial output size of a convolution (TF semantics)."""
  if padding == "same":
    return -(-size // stride)
  effective = (kernel - 1) * dilation + 1
  return (size - effective) // stride + 1


def _patch_indices(in_sizes, out_sizes, kernel_size, strides, dilation_rate):
  """Flat input index of every (output position, kernel offset), ``[T * K]`` (numpy)."""
  grids = np.meshgrid(*[np.arange(o) for o in out_sizes], indexing="ij")
  offsets = np.meshgrid(*[np.arange(k) for k in kernel_size], indexing="ij")
  flat = np.zeros([int(np.prod(out_sizes)), int(np.prod(kernel_size))], np.int64)
  for axis in range(len(in_sizes)):
    pos = (grids[axis].reshape(-1, 1) * strides[axis]
           + offsets[axis].reshape(1, -1) * dilation_rate[axis])
    flat = flat * in_sizes[axis] + pos
  return flat.reshape(-1)


def conv_patches(x, kernel_size, strides, dilation_rate, padding: str):
  """Receptive fields of a channels-last convolution, ``[B, T, prod(kernel_size) * C]``.

  The patch of output position ``t`` lists its inputs in the order of the
  kernel's leading axes (``kh, kw, c_in`` for 2D), so that
  ``patches[i]^T dz[i]`` reshapes to the kernel's shape. With static spatial
  sizes the patches are one ``tf.gather`` of precomputed indices (several
  times faster on CPU than strided slices); otherwise strided slices.

  Args:
    x: ``[B, *spatial, C]`` input (already padded for "causal").
    kernel_size, strides, dilation_rate: per spatial axis.
    padding: "same" or "valid" (TF's convention: extra "same" padding goes
      after).
  """
  rank = len(kernel_size)
  sizes = [_dim(x, 1 + k) for k in range(rank)]
  outs = [conv_output_size(s, k, st, d, padding)
          for s, k, st, d in zip(sizes, kernel_size, strides, dilation_rate)]
  if padding == "same":
    pads = [[0, 0]]
    for s, o, k, st, d in zip(sizes, outs, kernel_size, strides, dilation_rate):
      total = _maximum((o - 1) * st + (k - 1) * d + 1 - s, 0)
      pads.append([total // 2, total - total // 2])
    pads.append([0, 0])
    if any(not (isinstance(p, int) and p == 0) for pair in pads for p in pair):
      x = tf.pad(x, pads)
  channels = x.shape[-1]
  batch = tf.shape(x)[0]
  num_offsets = math.prod(kernel_size)
  padded = [x.shape[1 + k] for k in range(rank)]
  if all(isinstance(d, int) for d in padded + outs):
    if num_offsets == 1 and all(s == 1 for s in strides) and padded == outs:
      return tf.reshape(x, [batch, -1, channels])  # 1x1, stride 1: the input itself
    index = _patch_indices(padded, outs, kernel_size, strides, dilation_rate)
    flat = tf.reshape(x, [batch, -1, channels])
    patches = tf.gather(flat, index, axis=1)
    return tf.reshape(patches, [batch, -1, num_offsets * channels])
  pieces = []
  for offset in itertools.product(*[range(k) for k in kernel_size]):
    index = [slice(None)]
    for k, o, st, d in zip(offset, outs, strides, dilation_rate):
      index.append(slice(k * d, k * d + (o - 1) * st + 1, st))
    index.append(slice(None))
    pieces.append(x[tuple(index)])
  patches = pieces[0] if len(pieces) == 1 else tf.concat(pieces, axis=-1)
  return tf.reshape(patches, [batch, -1, num_offsets * channels])


# Upper bound on the patches (or Gram matrices) built at once: the batch is
# processed in chunks of at most this many bytes of temporaries.
CHUNK_BYTES = 16 * 2**20


#: Per-example kernel gradients of a 2D convolution with ``c_in * c_out`` at most this
#: are computed as one grouped backprop-filter (:func:`grouped_per_example_kernel_grads`)
#: where the kernels support it (:func:`grouped_filter_available`), else from patches.
#: Measured on the 2-core development CPU (oneDNN, chunks of 16 MB, ResNet20-GN shapes,
#: 3x3, ms per chunk, patches+matmul vs grouped): 16 -> 16 channels at 32x32: 3.3 vs 1.1;
#: 32 -> 32 at 16x16: 2.3 vs 1.5; 3 -> 16 at 32x32: 1.4 vs 1.0; 64 -> 64 at 8x8: 1.1 vs 1.5.
GROUPED_FILTER_MAX_CHANNELS = 32 * 32


def grouped_filter_available() -> bool:
  """Whether this process runs grouped convolution backprop-filters (TF's CPU kernels with oneDNN).

  TensorFlow's CPU ``Conv2DBackpropFilter`` without oneDNN refuses grouped
  convolutions; a GPU is not tried (kept on the patches path, untested there).
  """
  from tf_dpnsgd.per_example import vectorized  # noqa: PLC0415 (oneDNN probe, no cycle at import)

  if tf.config.list_logical_devices("GPU"):
    return False
  return vectorized.onednn_enabled(strict=True)


def use_grouped_filter(rank: int, c_in: int, c_out: int) -> bool:
  """The per-example kernel gradients of this convolution come from one grouped backprop-filter.

  2D, ``c_in * c_out <= GROUPED_FILTER_MAX_CHANNELS`` (where it was faster than
  patches and a batched matmul), and kernels that support it.
  """
  return (rank == 2 and c_in * c_out <= GROUPED_FILTER_MAX_CHANNELS
          and grouped_filter_available())


def grouped_per_example_kernel_grads(x, g, kernel_size, strides, dilation_rate, padding):
  """``[n, c_out, kh * kw * c_in]`` per-example kernel gradients of a 2D convolution, at once.

  The batch is folded into the channels: ``x [n, H, W, c_in]`` becomes one
  image with ``n * c_in`` channels, ``g [n, H', W', c_out]`` one with
  ``n * c_out``, and the backprop-filter of the convolution with ``n`` groups
  (group ``i``: example ``i``'s input channels to its output channels) is
  ``[kh, kw, c_in, n * c_out]``: block ``i`` is ``sum_t patch[i, t] (x) g[i, t]``,
  example ``i``'s kernel gradient, computed from example ``i``'s rows only (so a
  NaN in one example stays in its block). The same products as
  ``dz^T patches`` in float32, another order of summation. Layout as
  :class:`ConvOuter` stores it (``q = c_out`` rows, ``p`` in patch order).
  """
  n = tf.shape(x)[0]
  c_in, c_out = x.shape[-1], g.shape[-1]
  folded_x = tf.reshape(tf.transpose(x, [1, 2, 0, 3]), [1, x.shape[1], x.shape[2], -1])
  folded_g = tf.reshape(tf.transpose(g, [1, 2, 0, 3]), [1, g.shape[1], g.shape[2], -1])
  kh, kw = kernel_size
  grads = tf.raw_ops.Conv2DBackpropFilter(
      input=folded_x, filter_sizes=tf.stack([kh, kw, c_in, n * c_out]), out_backprop=folded_g,
      strides=[1, strides[0], strides[1], 1], padding=padding.upper(),
      dilations=[1, dilation_rate[0], dilation_rate[1], 1])  # [kh, kw, c_in, n * c_out]
  grads = tf.reshape(grads, [kh, kw, c_in, n, c_out])
  per_example = tf.transpose(grads, [3, 4, 0, 1, 2])  # [n, c_out, kh, kw, c_in]
  return tf.reshape(per_example, [n, c_out, kh * kw * c_in])


class ConvOuter(factored.Representation):
  """Per-example kernel gradients of a convolution, kept as (input, output gradient).

  ``g_i = sum_t patch[i, t] (x) dz[i, t]``. The norms use the ghost identity or
  the materialised gradient (:func:`~..factored.use_ghost` on ``T`` output
  positions, ``p = prod(kernel_size) * c_in``, ``q = c_out``), with patches
  built in chunks of the batch (at most :data:`CHUNK_BYTES` at a time). What
  is kept for the weighted sum is the smaller of the materialised per-example
  gradients (``p q`` per example) and the inputs plus output gradients (then
  the sum is one convolution backprop-filter of ``(x, h * dz)`` per use, as in
  a plain step). Convolutions do not take part in
  :func:`~..factored.plan_keeping`'s budget: keeping larger gradients gained
  no time (ScatterNet CNN, batch 512: 584 vs 590 ms on one view, 1101 vs
  1145 ms on two; ResNet20-GN, batch 256: 1.26x vs 1.24x a plain step) for
  0.44-0.85 GB more memory (``benchmarks/engine_ratio.py``, 2-core CPU).

  A convolution called several times (``uses``: the same kernel on several
  inputs, e.g. the views of one example) has ``g_i = sum_uses sum_t ...``: the
  uses' patches are concatenated along the positions, ``T = sum of the uses'
  positions`` (exact; :meth:`merge`), so it is one representation with one
  norm, not a :class:`~..factored.Sum` of per-use gradients with cross terms.

  Precision (see :mod:`tf_dpnsgd.per_example.factored`, "Formal guarantees"):
  the ghost norm's Gram matrices are float64 with the rigorous error bound
  ``gamma(p + q + T^2) A^2`` (``A = sum_t ||patch_t|| ||dz_t||`` over every
  use's positions); the materialised per-example gradient is the float32
  ``dz^T patches`` (the same product a plain step's weight gradient
  computes), squared and summed in float64. Where it is kept, exactly it
  enters the weighted sum (its norm is that of what is summed); otherwise the
  sum is a float32 backprop-filter. Either way, examples with
  ``A > CONDITION_LIMIT ||g||`` (terms that nearly cancel, e.g. two uses on
  nearly equal inputs with opposite output gradients) are recomputed in
  float64 (:meth:`unit_gradient64`) for both the norm and the weighted sum,
  so no norm is under the exact one.

  Args:
    x: ``[B, *spatial, c_in]`` channels-last input (padded for "causal").
    g: ``[B, *spatial_out, c_out]`` gradient of the summed loss w.r.t. the
      pre-activation output.
    kernel_size, strides, dilation_rate, padding: the convolution's.
    more_uses: further ``(x, g)`` pairs of the same kernel (other calls).
  """

  def __init__(self, x, g, kernel_size, strides, dilation_rate, padding, more_uses=()):
    uses = [(x, g)] + list(more_uses)
    for xu, gu in uses:
      if any(d is None for d in list(xu.shape[1:]) + list(gu.shape[1:])):
        raise registry_lib.UnsupportedLayerError(
            f"Convolution inputs need static spatial sizes for the layer-wise engine; got "
            f"{xu.shape} -> {gu.shape}. Use fixed-size inputs or per_example='vectorized'.")
    self.uses = [(tf.cast(xu, tf.float32), tf.cast(gu, tf.float32)) for xu, gu in uses]
    self.kernel_size = tuple(kernel_size)
    self.strides = tuple(strides)
    self.dilation_rate = tuple(dilation_rate)
    self.padding = padding
    self.c_in, self.c_out = int(x.shape[-1]), int(g.shape[-1])
    self.p = math.prod(self.kernel_size) * self.c_in
    self.q = self.c_out
    self.positions = sum(math.prod(int(d) for d in gu.shape[1:-1]) for _, gu in self.uses)
    self.ghost = bool(factored.use_ghost(self.positions, self.p, self.q))
    self._materialized = None  # [B, q, p]

  @property
  def keep_materialized(self) -> bool:
    """Keep the materialised per-example gradients for the sum (no larger than the uses'
    inputs plus output gradients)."""
    if self.ghost:
      return False
    kept_per_example = sum(math.prod(int(d) for d in xu.shape[1:]) for xu, _ in self.uses)
    return self.p * self.q <= kept_per_example + self.positions * self.q

  @property
  def kernel_shape(self):
    return list(self.kernel_size) + [self.c_in, self.c_out]

  def _patches(self, x):
    return conv_patches(x, self.kernel_size, self.strides, self.dilation_rate, self.padding)

  def _factors(self, uses):
    """``(patches [n, T, p], b [n, T, q])`` of some examples' uses, positions concatenated."""
    patches = [self._patches(xu) for xu, _ in uses]
    b = [tf.reshape(gu, [tf.shape(gu)[0], -1, self.q]) for _, gu in uses]
    if len(uses) == 1:
      return patches[0], b[0]
    return tf.concat(patches, axis=1), tf.concat(b, axis=1)

  def _chunk(self, uses, materialize):
    """``(value, error, scale, per_example or None)`` of one chunk of examples."""
    if not materialize:
      patches, b = self._factors(uses)
      patches, b = tf.cast(patches, tf.float64), tf.cast(b, tf.float64)
      scale = factored.outer_scale(patches, b)
      value, error = factored.ghost_estimate(patches, b, scale)
      return value, error, scale, None
    if use_grouped_filter(len(self.kernel_size), self.c_in, self.c_out):
      b = tf.concat([tf.reshape(gu, [tf.shape(gu)[0], -1, self.q]) for _, gu in uses], axis=1)
      per_example = tf.add_n([grouped_per_example_kernel_grads(
          xu, gu, self.kernel_size, self.strides, self.dilation_rate, self.padding)
                              for xu, gu in uses])  # [n, q, p]
    else:
      patches, b = self._factors(uses)
      per_example = tf.matmul(b, patches, transpose_a=True)  # [n, q, p]
    value, error = factored.sum_of_squares(per_example)
    # Examples whose terms cancel (within a use, or between uses) are recomputed in
    # float64, for the norm and the sum, whether or not the float32 gradients are kept:
    # float32 rounding of cancelling terms can leave a gradient whose norm is under the
    # exact one. The scale only decides which, so float32 suffices (an overflow to inf
    # marks the example for recomputation, which is safe). ||patch_t||^2 is the window
    # sum of the pixels' squared norms: a one-channel convolution with a kernel of ones.
    ones = tf.ones(list(self.kernel_size) + [1, 1], tf.float32)
    patch_norms = []
    for xu, _ in uses:
      pixels = tf.reduce_sum(tf.square(xu), axis=-1, keepdims=True)
      windows = tf.nn.convolution(pixels, ones, strides=self.strides,
                                  padding=self.padding.upper(), dilations=self.dilation_rate)
      patch_norms.append(tf.sqrt(tf.reshape(windows, [tf.shape(xu)[0], -1])))
    patch_norms = patch_norms[0] if len(uses) == 1 else tf.concat(patch_norms, axis=1)
    scale = tf.cast(tf.reduce_sum(patch_norms * factored.row_norms(b), axis=1), tf.float64)
    return value, error, scale, per_example

  def _run(self, materialize, keep):
    """``(value, error, scale, per-example [B, q, p] gradients if keep)``, in chunks.

    Chunks are unrolled (static batch) and chained with control dependencies
    so that one chunk's temporaries are freed before the next is built; a
    ``tf.while_loop`` here held far more memory. Patches are built only once
    ``dz`` exists: otherwise the executor may build every layer's patches
    right after the forward pass and hold them all through the backward pass.
    """
    t, p, q = self.positions, self.p, self.q
    if materialize and use_grouped_filter(len(self.kernel_size), self.c_in, self.c_out):
      # No patches: the folded (transposed) inputs and output gradients, the product, its
      # transposed copy and its float64 square. Counting patches here (as before) cut
      # ResNet20-GN's batch of 256 into 3-4x more chunks: a larger graph, whose host
      # memory (GraphDefs, Grappler) was most of the first step's peak RSS
      # (docs/per_example.md, "Where the first step's RSS goes").
      inputs = sum(math.prod(int(d) for d in xu.shape[1:]) for xu, _ in self.uses)
      bytes_per_example = 4 * (inputs + t * q) + 24 * p * q
    elif materialize:  # float32 patches and product, float64 copy of the product
      bytes_per_example = 4 * t * p + 4 * p * q + 16 * p * q
    else:  # float32 patches, float64 patches and dz, two Gram matrices and their product
      bytes_per_example = 4 * t * p + 8 * t * (p + q) + 24 * t * t
    chunk = max(1, CHUNK_BYTES // bytes_per_example)
    batch = self.uses[0][0].shape[0]
    bounds = [(0, None)] if batch is None or batch <= chunk else [
        (start, min(start + chunk, batch)) for start in range(0, batch, chunk)]
    results = []
    previous = [gu for _, gu in self.uses]
    for start, stop in bounds:
      with tf.control_dependencies(previous):
        uses = self.uses if stop is None else [(xu[start:stop], gu[start:stop])
                                               for xu, gu in self.uses]
        results.append(self._chunk(uses, materialize))
      previous = [results[-1][0]]

    def joined(k):
      parts = [r[k] for r in results]
      if parts[0] is None:
        return None
      return parts[0] if len(parts) == 1 else tf.concat(parts, axis=0)

    per_example = joined(3) if keep else None
    return joined(0), joined(1), joined(2), per_example

  def estimate(self) -> factored.Estimate:
    value, error, scale, self._materialized = self._run(materialize=not self.ghost,
                                                        keep=self.keep_materialized)
    return factored.Estimate(value, error, scale)

  def unit_gradient64(self, u):
    uses = [(tf.cast(tf.gather(xu, [u]), tf.float64), tf.cast(tf.gather(gu, [u]), tf.float64))
            for xu, gu in self.uses]
    patches, b = self._factors(uses)
    patches, b = patches[0], b[0]  # [T, p], [T, q]
    qp = tf.matmul(b, patches, transpose_a=True)
    scale = tf.reduce_sum(factored.row_norms(patches) * factored.row_norms(b))
    return self._to_kernel(qp, []), factored.gamma(self.positions) * scale

  def _with_uses(self, uses) -> "ConvOuter":
    (x, g), rest = uses[0], uses[1:]
    return ConvOuter(x, g, self.kernel_size, self.strides, self.dilation_rate, self.padding,
                     more_uses=rest)

  def gather_units(self, indices) -> "ConvOuter":
    return self._with_uses([(tf.gather(xu, indices), tf.gather(gu, indices))
                            for xu, gu in self.uses])

  def mergeable(self, other) -> bool:
    return (isinstance(other, ConvOuter) and other.kernel_size == self.kernel_size
            and other.strides == self.strides and other.dilation_rate == self.dilation_rate
            and other.padding == self.padding and other.c_in == self.c_in
            and other.c_out == self.c_out)

  def merge(self, other: "ConvOuter") -> "ConvOuter":
    """Another call of the same kernel: its positions join this one's (exact)."""
    return self._with_uses(self.uses + other.uses)

  def _to_kernel(self, qp, leading):
    pq = tf.linalg.matrix_transpose(qp)
    return tf.reshape(pq, leading + self.kernel_shape)

  def raw_weighted_sum(self, factors: tf.Tensor) -> tf.Tensor:
    keep = factors > 0
    if self._materialized is not None:
      g = factored.zero_dropped_units(self._materialized, keep)
      return self._to_kernel(tf.tensordot(factors, g, axes=[[0], [0]]), [])
    total = None
    for xu, gu in self.uses:
      x = factored.zero_dropped_units(xu, keep)
      hg = factored.zero_dropped_units(gu, keep) * tf.reshape(
          factors, [-1] + [1] * (len(gu.shape) - 1))
      kernel = tf.zeros(self.kernel_shape, tf.float32)
      with tf.GradientTape() as tape:  # backprop-filter of the convolution, as a plain step
        tape.watch(kernel)
        z = tf.nn.convolution(x, kernel, strides=self.strides, padding=self.padding.upper(),
                              dilations=self.dilation_rate)
      part = tape.gradient(z, kernel, output_gradients=hg)
      total = part if total is None else total + part
    return total

  def per_unit(self) -> tf.Tensor:
    per_example = self._materialized
    if per_example is None:
      per_example = self._run(materialize=True, keep=True)[3]
    return self._to_kernel(per_example, [tf.shape(per_example)[0]])

  #: to_units materialises (see :func:`~..factored.materialized_units`).
  exact_regrouping = False

  def to_units(self, num_units: int) -> factored.Materialized:
    return factored.materialized_units(self, num_units)


class GroupedConv(factored.Representation):
  """Per-example kernel gradients of a grouped convolution: ``G`` blocks side by side.

  ``g_u = concat_k(g_u^k)`` along the last (output channel) axis, where
  ``g_u^k`` is group ``k``'s kernel gradient (a :class:`ConvOuter` of its
  input channels and output-gradient channels). The blocks are disjoint, so
  ``||g_u||^2 = sum_k ||g_u^k||^2``: the estimate adds the groups' float64
  estimates and error bounds (plus the rounding of that sum,
  ``gamma(G) sum_k |v_k|``); the scale (sum of the norms of the rank-one
  terms) is the sum of the groups' scales. Everything else (float64
  recomputation, weighted sum, per-unit gradients) is the groups'
  concatenated.

  Args:
    parts: one :class:`ConvOuter` per group, in group order.
  """

  #: to_units materialises (see :func:`~..factored.materialized_units`).
  exact_regrouping = False

  def __init__(self, parts):
    self.parts = list(parts)

  def estimate(self) -> factored.Estimate:
    estimates = [p.estimate() for p in self.parts]
    value = tf.add_n([e.value for e in estimates])
    error = tf.add_n([e.error for e in estimates])
    error = error + factored.gamma(len(estimates)) * tf.add_n([tf.abs(e.value) for e in estimates])
    if all(e.scale is None for e in estimates):  # sums of squares: nothing can cancel
      return factored.Estimate(value, error, None)
    scale = tf.add_n([e.scale if e.scale is not None
                      else tf.sqrt(tf.maximum(e.value + e.error, 0.0)) for e in estimates])
    return factored.Estimate(value, error, scale)

  def unit_gradient64(self, u):
    pieces = [p.unit_gradient64(u) for p in self.parts]
    return (tf.concat([g for g, _ in pieces], axis=-1), tf.add_n([e for _, e in pieces]))

  def gather_units(self, indices) -> "GroupedConv":
    return GroupedConv([p.gather_units(indices) for p in self.parts])

  def raw_weighted_sum(self, factors: tf.Tensor) -> tf.Tensor:
    return tf.concat([p.raw_weighted_sum(factors) for p in self.parts], axis=-1)

  def per_unit(self) -> tf.Tensor:
    return tf.concat([p.per_unit() for p in self.parts], axis=-1)

  def to_units(self, num_units: int) -> factored.Materialized:
    return factored.materialized_units(self, num_units)


def conv_kernel_representation(x, g, groups, kernel_size, strides, dilation_rate, padding):
  """:class:`ConvOuter` (``groups == 1``) or :class:`GroupedConv` of channels-last ``x``, ``g``."""
  if groups == 1:
    return ConvOuter(x, g, kernel_size, strides, dilation_rate, padding)
  xs = tf.split(x, groups, axis=-1)
  gs = tf.split(g, groups, axis=-1)
  return GroupedConv([ConvOuter(xk, gk, kernel_size, strides, dilation_rate, padding)
                      for xk, gk in zip(xs, gs)])


def _conv_unsupported(layer):
  why = registry_lib.common_unsupported(layer)
  if why:
    return why
  if layer.rank not in (1, 2, 3):
    return f"{layer.rank}D convolution"
  return None


def _conv_variables(layer):
  return [layer.kernel, layer.bias if layer.use_bias else None]


def _causal_padding(layer):
  left = layer.dilation_rate[0] * (layer.kernel_size[0] - 1)
  if layer.data_format == "channels_last":
    return [[0, 0], [left, 0], [0, 0]]
  return [[0, 0], [0, 0], [left, 0]]


def _conv_capture(layer, call, args, kwargs, probe):
  inputs = registry_lib.bind_call_arguments(call, args, kwargs)["inputs"]
  padding = layer.padding
  if padding == "causal":
    inputs = ops.pad(inputs, _causal_padding(layer))
    padding = "valid"
  bias_shape = None
  z = ops.conv(inputs, layer.kernel, strides=list(layer.strides), padding=padding,
               dilation_rate=layer.dilation_rate, data_format=layer.data_format)
  if layer.use_bias:
    if layer.data_format == "channels_last":
      bias_shape = (1,) * (layer.rank + 1) + (layer.filters,)
    else:
      bias_shape = (1, layer.filters) + (1,) * layer.rank
    bias = ops.reshape(layer.bias, bias_shape)
    z = ops.add(z, bias)
  z = probe(z)

  def finish(grads):
    (dz,) = grads
    x, g = tf.cast(inputs, tf.float32), tf.cast(dz, tf.float32)
    if layer.data_format == "channels_first":
      perm = [0] + list(range(2, layer.rank + 2)) + [1]
      x, g = tf.transpose(x, perm), tf.transpose(g, perm)
    out = [(layer.kernel, conv_kernel_representation(x, g, layer.groups, layer.kernel_size,
                                                     layer.strides, layer.dilation_rate,
                                                     padding))]
    if layer.use_bias:
      out.append((layer.bias,
                  factored.Materialized(
                      registry_lib.per_example_bias_grads(dz, layer.bias, bias_shape))))
    return out

  return (layer.activation(z) if layer.activation is not None else z), finish


CONV_RULE = registry_lib.LayerRule(variables=_conv_variables, capture=_conv_capture,
                                   unsupported=_conv_unsupported)

registry_lib.DEFAULT_REGISTRY.register(keras.layers.Conv1D, CONV_RULE)
registry_lib.DEFAULT_REGISTRY.register(keras.layers.Conv2D, CONV_RULE)
registry_lib.DEFAULT_REGISTRY.register(keras.layers.Conv3D, CONV_RULE)
