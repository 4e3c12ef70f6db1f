"""Per-unit gradients of one variable, kept in factored form.

(A long module, about 950 lines, on purpose: each representation keeps its norm,
its rigorous rounding bound and its float64 recomputation together.)

The layer-wise engine never builds ``[U, *var_shape]`` per-unit gradients
unless that is the cheaper way to get their norms. A layer rule (see
:mod:`tf_dpnsgd.per_example.registry`) describes the per-unit gradient of each
of its variables by one of these objects, built from the layer's input and the
gradient of the summed loss with respect to the layer's output:

=====================  ==========================================  ======================
representation         per-unit gradient ``g_u``                   used by
=====================  ==========================================  ======================
:class:`Materialized`  ``g[u]`` (stored as is)                     biases, norm layers
:class:`Outer`         ``sum_t a[u, t] (x) b[u, t]``               Dense, EinsumDense, conv
:class:`Scattered`     ``sum_t onehot(ids[u, t]) (x) b[u, t]``     Embedding, positions
:class:`Sum`           sum of the above (shared / tied weights)    multiple calls, tying
=====================  ==========================================  ======================

Each one answers two questions, both pure functions of its tensors:

* ``squared_norms()``: ``[U]`` float64 **upper bounds** of ``||g_u||^2``.
  :class:`Outer` picks per call between the ghost-norm identity (Goodfellow
  2015; Li et al. 2021) ``||sum_t a_t b_t^T||^2 = sum_{t,s} <a_t, a_s> <b_t, b_s>``
  at cost ``T^2 (p + q)`` and materialising ``g_u`` at cost ``T p q``,
  whichever is cheaper for the shapes (:func:`use_ghost`).
* ``weighted_sum(factors)``: ``sum_u factors[u] g_u`` from the same tensors
  (book-keeping, Bu et al. 2022): no second backward pass.

Formal guarantees
-----------------

Why this needs care: the ghost identity and the cross terms of a weight used
several times (:class:`Sum`) add up *signed* terms. When a layer is called
twice on nearly equal inputs ``x, x'`` of magnitude ``M`` with nearly opposite
output gradients ``c, -(1 - d) c``, the terms are ``~M^2 |c|^2`` but
``||g||^2 ~ d^2 M^2 |c|^2``: evaluated in float32 the sum is rounding noise for
``d < 3e-4``, possibly negative, while ``||g||`` is large. An understated norm
gives a large factor (``1 / (r + ||g||)``, ``min(1, c / ||g||)``) and one example
then moves the sum by hundreds of times the sensitivity
(``tests/test_layerwise_adversarial.py``, inputs of magnitude 1e6, DP-NSGD
with ``r = 1``: up to ~600x for a shared Dense layer, ~300x for a tied
embedding, ~2700x for a shared convolution on the float32 code this replaced,
which clamped negative estimates to 0). So:

1. **Signed sums in float64, with a rigorous error bound.** Every
   representation's :meth:`Representation.estimate` returns an estimate
   ``v_u`` of ``||g_u||^2``, computed in float64 from the float32 tensors, and
   ``e_u >= |v_u - ||g_u||^2|`` from the standard bounds for float64 dot
   products and sums (Higham, *Accuracy and Stability of Numerical
   Algorithms*, 2002, ch. 3): for the ghost norm
   ``e = gamma(p + q + T^2) A^2`` with ``A = sum_t ||a_t|| ||b_t||`` (the sum of
   the norms of the rank-one terms; ``|<a_t, a_s><b_t, b_s>|`` summed over
   ``t, s`` is at most ``A^2``), likewise for the cross terms and the segment
   sums of :class:`Scattered`; ``gamma(n) = 2 (n + 2) 2^-53`` (twice the
   textbook ``n u / (1 - n u)``). ``v_u + e_u`` is an upper bound of the exact
   squared norm for every finite input: float32 values of magnitude up to
   ``3.4e38`` squared and summed stay finite in float64. A materialised
   float32 per-unit gradient (biases, norm layers, :class:`Outer` and
   convolutions where ``T p q`` is the cheaper path) has no signed sum left:
   its squares are added in float32 in blocks of 4 and the block sums in
   float64 (:func:`sum_of_squares`: relative error ``<= 7.2e-7 + gamma(n)``,
   no cancellation; rows that are tiny, zero or overflow float32 are summed
   in float64).
2. **No silent clamping; fall back to the materialised norm.** A unit whose
   bound is loose (``e_u > 1e-6 (v_u + e_u)``), negative, or whose gradient is
   ill-conditioned (``A_u > CONDITION_LIMIT ||g_u||``: its terms cancel) has its
   gradient materialised in float64, one unit at a time
   (:meth:`Representation.unit_gradient64`, error ``<= gamma(T) A_u``), and its
   bound recomputed from it. Only such units pay for this (one ``tf.while_loop``
   over their indices: zero iterations when there are none).
3. **The sum uses what the norm measured.** Units recomputed in step 2 are
   taken out of the float32 book-keeping sum (factor 0, rows zeroed) and added
   from their float64 gradients instead: a float32 sum of their cancelling
   terms would carry rounding errors of order ``2^-24 A_u``, which can exceed
   the sensitivity. Every other unit has ``A_u <= CONDITION_LIMIT ||g_u||``,
   so its float32 terms' rounding is at most ``~1e3 * 2^-24 = 6e-5`` of its
   contribution per rounding step: the order of the float32 rounding that
   per-example gradients and their sum have in every engine. Materialised
   float32 per-unit gradients that are kept (:class:`Materialized`, the
   materialised :class:`Outer` with static ``T``, convolutions whose
   per-example gradient is smaller than their input) are summed as stored,
   so their norm is exactly the norm of what enters the sum. Where they are
   not kept (larger convolution kernels, dynamic ``T``), the float32 norm
   and the float32 book-keeping sum are two float32 evaluations of the same
   products and differ by rounding of the same ``2^-24 A_u`` order.
4. The engine sums the bounds over variables in float64, takes the square
   root and rounds **up** to float32 (:func:`upper_norms`).

Cost: float64 Gram matrices (ghost norms) take about 4-5x the time of float32
ones on CPU. A float32 Gram matrix cannot be certified to ``LOOSENESS_LIMIT``:
rounding its entries to float32 alone errs by ``2^-24 A_u^2``, up to ``1e-5``
of ``||g_u||^2`` at ``A_u^2 / ||g_u||^2 ~ 100`` (BERT-size layers). So the
engine prefers, within :data:`KEEP_BYTES`, to materialise per-unit gradients
and *keep* them (:func:`plan_keeping`): their norm is a blocked float32 sum of
squares (tight, nothing signed), and the weighted sum over units replaces the
``T p q`` product that the ghost path still needs; on a MiniLM-size BERT this
took the engine's extra work from ~13.7 to ~6.8 CPU-seconds per step (batch 32,
2 cores). Ill-conditioned units (none in ordinary training:
``A_u / ||g_u||`` was at most 40 on ResNet20-GN and 9 on a small transformer
at initialisation) add one float64 per-unit gradient each, twice.

Edge cases (for every representation; ``A_u`` as above):

=======================================  ===============================================
per-unit input                           norm used for the factor; contribution
=======================================  ===============================================
``g_u = 0`` with all terms 0             exactly 0; factor ``1/r`` resp. 1, adds 0
terms cancel exactly (``g_u = 0``,       float64 materialised: ``<= 2 gamma(T) A_u``
``A_u > 0``)                             (~1e-15 ``A_u``); adds its float64 ``g_u = 0``
nearly cancelling, any magnitude         float64 materialised, ``>= ||g_u||``; adds
                                         ``h_u g_u`` from the float64 ``g_u``
finite, ``||g_u|| >= 3.4e38``            ``inf`` (float64 has the range, float32 not):
                                         factor 0, contributes exactly 0
NaN or inf in the unit's tensors         NaN/inf: factor 0, rows zeroed, exactly 0
negative bound (cannot happen)           recomputed as above; if still negative, NaN:
                                         factor 0, exactly 0 (never clamped to 0)
=======================================  ===============================================

A zero factor always means an exact zero contribution: the unit's rows are
replaced by zeros with ``tf.where`` before any product or reduction over
units (:func:`zero_dropped_units`), so ``0 * nan`` never reaches the sum.

References:
  Goodfellow (2015), "Efficient Per-Example Gradient Computations".
  Li, Tramer, Liang, Hashimoto (2021), "Large Language Models Can Be Strong
  Differentially Private Learners", Section 4 (ghost clipping).
  Bu, Mao, Xu (2022), "Scalable and Efficient Training of Large Convolutional
  Neural Networks with Differential Privacy" (mixed ghost clipping: the
  ``T^2`` vs ``p q`` rule); Bu, Wang, Zha, Karypis (2022), "Differentially
  Private Optimization on Large Model at Small Cost" (book-keeping).
  Higham (2002), "Accuracy and Stability of Numerical Algorithms", 2nd ed.,
  Section 3.1 (error bounds of inner products and sums).
"""

from __future__ import annotations

import math
from typing import NamedTuple, Sequence

import tensorflow as tf

#: Unit roundoff of float64 (round to nearest).
EPS64 = 2.0 ** -53

#: A unit whose gradient terms' norms add up to more than this many times its
#: norm (``A_u > CONDITION_LIMIT ||g_u||``) is "ill-conditioned": its norm and
#: its contribution to the sum are recomputed from its float64 materialised
#: gradient. Benign units have ``A_u / ||g_u||`` around ``sqrt(T)``.
CONDITION_LIMIT = 1e3

#: A bound ``v + e`` with ``e > LOOSENESS_LIMIT (v + e)`` is recomputed from the
#: materialised gradient (so a norm is never overstated by more than ~5e-7).
LOOSENESS_LIMIT = 1e-6


# --- helpers -----------------------------------------------------------------

def runtime_zeros(shape, dtype=tf.float32) -> tf.Tensor:
  """Zeros made when the step runs, never a constant of the traced function.

  Grappler folds ``tf.zeros`` of a static shape into a constant where it is
  under 10 MiB or is a loop's initial value; a function's constants stay
  allocated as long as the function lives (measured: 176 MiB held between
  steps by a MiniLM-size BERT's DP train function, a float64 zero per
  variable). ``Empty`` is not folded.

  >>> runtime_zeros([2, 3]).numpy().tolist()
  [[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
  """
  return tf.raw_ops.Empty(shape=tf.cast(shape, tf.int32), dtype=dtype, init=True)


def zero_dropped_units(t: tf.Tensor, keep: tf.Tensor) -> tf.Tensor:
  """Rows ``u`` of ``t`` with ``keep[u]`` False replaced by exact zeros.

  The copy is skipped (``tf.cond``) when every unit is kept, the common case.

  >>> zero_dropped_units(tf.constant([[1., 2.], [float("nan"), 3.]]), tf.constant([True, False])).numpy().tolist()
  [[1.0, 2.0], [0.0, 0.0]]
  """
  keep = tf.reshape(tf.cast(keep, tf.bool), [-1] + [1] * (len(t.shape) - 1))

  def zeroed():
    return tf.where(keep, t, tf.zeros([], t.dtype))  # broadcast: no batch-sized constant

  return tf.cond(tf.reduce_all(keep), lambda: tf.identity(t), zeroed)


def _units_first_reshape(t: tf.Tensor, num_units: int) -> tf.Tensor:
  """``[B, N, ...]`` -> ``[m, (B/m) N, ...]`` (examples of a unit become positions)."""
  shape = tf.shape(t)
  rest = t.shape[2:]
  out = tf.reshape(t, tf.concat([[num_units, -1], shape[2:]], axis=0))
  return tf.ensure_shape(out, [num_units, None] + list(rest))


def _static_or_dynamic(t: tf.Tensor, axis: int):
  dim = t.shape[axis]
  return dim if dim is not None else tf.shape(t)[axis]


def use_ghost(num_positions, p: int, q: int):
  """True where the ghost norm is cheaper than materialising the gradient.

  Ghost: ``[T, T]`` Gram matrices of both factors, ``T^2 (p + q)``
  multiply-adds per unit; materialise: ``b^T a``, ``T p q``. ``num_positions``
  may be a Python int (decided at trace time) or a scalar tensor.

  >>> use_ghost(128, 384, 1536), use_ghost(1024, 144, 16)
  (True, False)
  """
  if isinstance(num_positions, int):
    return num_positions * (p + q) < p * q
  t = tf.cast(num_positions, tf.int64)
  return t * (p + q) < p * q


# --- error bounds and the certified norm ---------------------------------------

def gamma(n) -> tf.Tensor:
  """``2 (n + 2) EPS64``: a safe relative error bound for ``n``-term float64 dot products/sums.

  ``n`` may be a Python number or a tensor; returns a float64 scalar tensor (a constant for
  a Python number: the same float64 operations, in the same order, done in Python).
  """
  if isinstance(n, (int, float)):
    return tf.constant(2.0 * (float(n) + 2.0) * EPS64, tf.float64)
  return 2.0 * (tf.cast(n, tf.float64) + 2.0) * EPS64


#: Unit roundoff of float32.
EPS32 = 2.0 ** -24

#: :func:`sum_of_squares` adds squares in float32 in blocks of this many before
#: adding the block sums in float64: relative error ``2 (4 + 2) 2^-24 = 7.2e-7``,
#: within :data:`LOOSENESS_LIMIT`, at a quarter of the float64 memory traffic.
SQUARE_BLOCK = 4

#: Rows whose float32 blocked sum is below this (or not finite) are summed in float64:
#: float32 squares below ``2^-126`` may be flushed to zero, an absolute error of at
#: most ``n 2^-126`` that is relatively ``<= n 2^-66`` above this threshold.
_SMALL32 = 2.0 ** -60


def sum_of_squares(g: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
  """``||g_u||^2`` of float32 ``g: [U, ...]`` and a rigorous error bound, float64 ``[U]`` each.

  Squares are added in float32 in blocks of :data:`SQUARE_BLOCK` (or of a
  divisor of the row length), the block sums in float64. For ``n`` elements
  and blocks of ``k``, in any order of summation (Higham 2002, Section 3.1):
  ``|value - ||g_u||^2| <= (2 (k + 2) 2^-24 + gamma(n) + n 2^-66) value``
  (the last term for float32 squares flushed to zero, see :data:`_SMALL32`).
  There is no cancellation (all terms are >= 0), so the bound is tight.

  Edge cases: rows whose float32 sum is below ``2^-60`` (e.g. exactly 0) or
  not finite (a float32 overflow of a finite row, ``|g| > 1.8e19``, or
  NaN/inf in ``g``) are summed in float64 (only those rows, gathered; none
  gathered when there are none): a zero row gives exactly 0, a row beyond
  float32 its float64 value, NaN/inf stay non-finite (the transform drops the
  unit).

  >>> v, e = sum_of_squares(tf.constant([[3., 4.], [2.0 ** 70, 0.], [0., 0.]]))  # 2^140: > float32
  >>> v.numpy().tolist() == [25.0, 2.0 ** 140, 0.0], bool(tf.reduce_all(e <= 1e-6 * v))
  (True, True)
  """
  g = tf.cast(g, tf.float32)
  units = tf.shape(g)[0]
  flat = tf.reshape(g, [units, -1])
  n = flat.shape[1]
  size = float(n) if n is not None else tf.cast(tf.shape(flat)[1], tf.float64)

  def in_float64(rows):
    return tf.reduce_sum(tf.square(tf.cast(rows, tf.float64)), axis=1)

  k = math.gcd(n, SQUARE_BLOCK) if n else 1
  if k == 1:
    value = in_float64(flat)
    return value, gamma(size) * value
  # Block j is {x_j, x_{j+n/k}, ...}: adding k contiguous slabs vectorises (a reduction over
  # a last axis of size k does not); the bound only depends on the block size.
  blocks = tf.reduce_sum(tf.square(tf.reshape(flat, [units, k, -1])), axis=1)
  value = tf.reduce_sum(tf.cast(blocks, tf.float64), axis=1)
  redo = tf.logical_not(tf.logical_and(value >= _SMALL32,
                                      tf.math.is_finite(value)))  # small, inf or NaN
  relative = 2.0 * (k + 2) * EPS32 * (1.0 + 4.0 * (k + 2) * EPS32) + size * 2.0 ** -66

  # Only the redone rows are gathered (none, usually: an empty gather and update cost
  # nothing); no tf.cond: its two branch functions per call (per conv chunk, per bias) were
  # hundreds of functions in a ResNet's step, each instantiated and optimised on its own.
  rows = tf.where(redo)
  value = tf.tensor_scatter_nd_update(value, rows, in_float64(tf.gather_nd(flat, rows)))
  error = (tf.where(redo, tf.zeros_like(value), relative) + gamma(size)) * value
  return value, error


def row_norms(t: tf.Tensor) -> tf.Tensor:
  """L2 norms over the last axis (in ``t``'s dtype)."""
  return tf.sqrt(tf.reduce_sum(tf.square(t), axis=-1))


class Estimate(NamedTuple):
  """A float64 estimate of ``||g_u||^2`` and a rigorous bound on its error.

  Attributes:
    value: ``[U]`` estimate ``v_u``.
    error: ``[U]`` ``e_u >= |v_u - ||g_u||^2|`` (for finite inputs).
    scale: ``[U]`` ``A_u``, the sum of the norms of the terms of ``g_u``
      (rank-one products, gathered rows), ``>= ||g_u||``; or None where no
      cancellation between terms is possible: then ``value`` is a sum of
      squares and ``error <= gamma(n) value`` (never loose, never negative),
      so there is nothing to recompute.
  """

  value: tf.Tensor
  error: tf.Tensor
  scale: tf.Tensor | None


def materialized_bound(g: tf.Tensor, error: tf.Tensor) -> tf.Tensor:
  """Upper bound of ``||g_exact||^2`` from a float64 ``g`` with ``||g - g_exact|| <= error``.

  ``2 * error`` also covers any other float64 evaluation of the same gradient
  (the weighted sum recomputes it).
  """
  g = tf.cast(g, tf.float64)
  norm = tf.sqrt(tf.reduce_sum(tf.square(g))) * (1.0 + gamma(tf.size(g))) + 2.0 * error
  return tf.square(norm) * (1.0 + 4.0 * EPS64)


def _bound_and_suspects(estimate: Estimate):
  """``v + e``, and the units to recompute: loose, negative or ill-conditioned, but finite."""
  value, error, scale = estimate
  bound = value + error
  suspect = tf.logical_or(error > LOOSENESS_LIMIT * bound, bound < 0.0)
  if scale is not None:
    suspect = tf.logical_or(suspect,
                            scale > CONDITION_LIMIT * tf.sqrt(tf.maximum(bound, 0.0)))
  return bound, tf.logical_and(suspect, tf.math.is_finite(bound))


def certify(estimate: Estimate, unit_gradient64) -> tuple[tf.Tensor, tf.Tensor]:
  """Upper bounds of the squared norms, and which units were recomputed.

  ``v + e`` for every unit, except units whose bound is loose or negative, or
  that are ill-conditioned (see the module docstring): for those the bound is
  recomputed from ``unit_gradient64(u)`` (float64, one unit at a time, only
  when there is such a unit). Non-finite estimates are left as they are (the
  transform drops the unit).

  Returns:
    ``(bounds, recomputed)``: ``[U]`` float64, ``[U]`` bool.
  """
  bound, suspect = _bound_and_suspects(estimate)
  # One loop over the suspect units only (none, usually: zero iterations). No tf.cond around
  # it or inside it: each cond's two branch functions are traced and instantiated on their own,
  # per variable, which was most of a small model's first-step cost.
  indices = tf.cast(tf.where(suspect)[:, 0], tf.int32)

  def body(j, bounds):
    u = indices[j]
    g, err = unit_gradient64(u)
    return j + 1, tf.tensor_scatter_nd_update(bounds, [[u]], [materialized_bound(g, err)])

  bound = tf.while_loop(lambda j, _: j < tf.size(indices), body, (tf.constant(0), bound))[1]
  # Unreachable for a correct bound; drop the unit (NaN norm -> factor 0) rather than clamp.
  bound = tf.where(bound < 0.0, tf.fill(tf.shape(bound), tf.constant(math.nan, tf.float64)),
                   bound)
  return bound, suspect


def upper_norms(squared_bounds: Sequence[tf.Tensor]) -> tf.Tensor:
  """``[U]`` float32 norms ``>=`` the square root of the summed float64 bounds.

  The float64 sum and square root are inflated by their own rounding bound,
  and the cast to float32 is rounded up (``nextafter``). NaN stays NaN, a
  norm beyond float32's range becomes ``inf``; either way the transform gives
  the unit factor 0.

  >>> n = upper_norms([tf.constant([1.0, 2.0], tf.float64), tf.constant([3.0, 7.0], tf.float64)])
  >>> bool(tf.reduce_all(n >= [2.0, 3.0])), [round(float(v), 5) for v in n]
  (True, [2.0, 3.0])
  """
  squared = tf.add_n([tf.cast(s, tf.float64) for s in squared_bounds])
  squared = squared * (1.0 + gamma(len(squared_bounds)))
  norms64 = tf.sqrt(squared) * (1.0 + 2.0 * EPS64)
  norms = tf.cast(norms64, tf.float32)
  below = tf.cast(norms, tf.float64) < norms64
  return tf.where(below, tf.math.nextafter(norms, tf.fill(tf.shape(norms), math.inf)), norms)


# --- representations ---------------------------------------------------------

class Representation:
  """Base class: the per-unit gradients of one variable.

  Subclasses implement:

  * :meth:`estimate`: the float64 :class:`Estimate` (value, rigorous error,
    scale);
  * :meth:`unit_gradient64`: unit ``u``'s gradient in float64, in the
    variable's layout, with a bound on its error (the fallback);
  * :meth:`gather_units`: the same representation restricted to some units;
  * :meth:`raw_weighted_sum`: ``sum_u factors[u] g_u`` in float32 (units with
    factor 0 contribute exactly 0);
  * :meth:`per_unit`: ``[U, *var_shape]`` float32.

  :meth:`squared_norms` and :meth:`weighted_sum` (used by the engine) combine
  them as described in the module docstring.
  """

  _recomputed = None  # (mask [U], indices [k], gather_units(indices)), set by squared_norms

  def estimate(self) -> Estimate:
    raise NotImplementedError

  def unit_gradient64(self, u) -> tuple[tf.Tensor, tf.Tensor]:
    raise NotImplementedError

  def gather_units(self, indices) -> "Representation":
    raise NotImplementedError

  def raw_weighted_sum(self, factors: tf.Tensor) -> tf.Tensor:
    raise NotImplementedError

  def per_unit(self) -> tf.Tensor:
    raise NotImplementedError

  def squared_norms(self) -> tf.Tensor:
    """``[U]`` float64 upper bounds of ``||g_u||^2`` (see :func:`certify`).

    Also keeps the tensors of the recomputed units (gathered now, so that the
    weighted sum does not hold on to the whole batch's tensors).
    """
    estimate = self.estimate()
    if estimate.scale is None:  # a sum of squares: no cancellation, nothing to recompute
      return estimate.value + estimate.error
    bounds, recomputed = certify(estimate, self.unit_gradient64)
    indices = tf.cast(tf.where(recomputed)[:, 0], tf.int32)
    self._recomputed = (recomputed, indices, self.gather_units(indices))
    return bounds

  def weighted_sum(self, factors: tf.Tensor) -> tf.Tensor:
    """``sum_u factors[u] g_u``; units recomputed by :meth:`squared_norms` added in float64."""
    return sum_with_recomputed(self.raw_weighted_sum, self._recomputed, factors)


def sum_with_recomputed(raw_weighted_sum, recomputed, factors: tf.Tensor) -> tf.Tensor:
  """``sum_u factors[u] g_u``: the float32 sum of the units not recomputed, plus the others.

  Args:
    raw_weighted_sum: a representation's :meth:`Representation.raw_weighted_sum`.
    recomputed: None, or ``(mask [U], indices [k], subset)`` as
      :meth:`Representation.squared_norms` leaves it: units whose norm came
      from their float64 gradient, and ``subset`` their representation. Their
      factor is 0 in the float32 sum and their float64 gradient is added
      instead (see the module docstring, item 3).
    factors: ``[U]``.

  The two-pass engine calls this with the ``raw_weighted_sum`` of its second
  pass's representation and the ``recomputed`` of its first pass's.
  """
  factors = tf.cast(factors, tf.float32)
  if recomputed is None:
    return raw_weighted_sum(factors)
  mask, indices, subset = recomputed
  fast = raw_weighted_sum(tf.where(mask, tf.zeros_like(factors), factors))
  h = tf.gather(factors, indices)

  def add_exact():
    def body(j, acc):
      g, _ = subset.unit_gradient64(j)
      added = acc + tf.cast(h[j], tf.float64) * tf.reshape(g, tf.shape(acc))
      return j + 1, tf.where(h[j] > 0, added, acc)  # factor 0: exactly acc, whatever g holds

    acc = runtime_zeros(tf.shape(fast), tf.float64)
    acc = tf.while_loop(lambda j, _: j < tf.size(indices), body, (tf.constant(0), acc))[1]
    return fast + tf.cast(acc, fast.dtype)

  return tf.cond(tf.size(indices) > 0, add_exact, lambda: tf.identity(fast))


class Materialized(Representation):
  """Per-unit gradients stored as a ``[U, *var_shape]`` tensor.

  The norm is the float64 sum of squares of exactly the float32 values that
  enter the weighted sum (no cancellation, nothing to fall back to).
  """

  def __init__(self, grads: tf.Tensor):
    self.grads = tf.cast(grads, tf.float32)

  def estimate(self) -> Estimate:
    return Estimate(*sum_of_squares(self.grads), None)

  def unit_gradient64(self, u):
    return tf.cast(self.grads[u], tf.float64), tf.zeros([], tf.float64)

  def gather_units(self, indices) -> "Materialized":
    return Materialized(tf.gather(self.grads, indices))

  def raw_weighted_sum(self, factors: tf.Tensor) -> tf.Tensor:
    g = zero_dropped_units(self.grads, factors > 0)
    return tf.tensordot(factors, g, axes=[[0], [0]])

  def per_unit(self) -> tf.Tensor:
    return self.grads

  def to_units(self, num_units: int) -> "Materialized":
    g = tf.cast(self.grads, tf.float64)  # examples of a unit may cancel: add in float64
    g = tf.reshape(g, tf.concat([[num_units, -1], tf.shape(g)[1:]], axis=0))
    return Materialized(tf.cast(tf.reduce_sum(g, axis=1), tf.float32))

  def merge(self, other: "Materialized") -> "Materialized":
    return Materialized(self.grads + other.grads)


def outer_scale(a: tf.Tensor, b: tf.Tensor) -> tf.Tensor:
  """``A_u = sum_t ||a[u, t]|| ||b[u, t]||`` in float64 (``>= ||sum_t a_t b_t^T||``)."""
  return tf.reduce_sum(row_norms(tf.cast(a, tf.float64)) * row_norms(tf.cast(b, tf.float64)),
                       axis=-1)


def ghost_estimate(a: tf.Tensor, b: tf.Tensor, scale: tf.Tensor):
  """Ghost norm ``sum_{t,s} <a_t, a_s> <b_t, b_s>`` in float64, with its error bound.

  Returns:
    ``(value, error)``, ``[U]`` float64 each; ``error = gamma(p + q + T^2) A^2``.
  """
  a = tf.cast(a, tf.float64)
  b = tf.cast(b, tf.float64)
  aa = tf.matmul(a, a, transpose_b=True)
  bb = tf.matmul(b, b, transpose_b=True)
  value = tf.reduce_sum(aa * bb, axis=[1, 2])
  t = tf.cast(tf.shape(a)[1], tf.float64)
  error = gamma(tf.cast(a.shape[-1] + b.shape[-1], tf.float64) + t * t) * tf.square(scale)
  return value, error


def ghost_estimate_and_scale(a: tf.Tensor, b: tf.Tensor):
  """:func:`ghost_estimate` with ``A`` read off the Gram matrices' diagonals (one pass less).

  ``diag(a a^T)_t`` is ``||a_t||^2`` up to a relative float64 error of
  ``gamma(p)``; inflating by ``1 + gamma(p)`` (and ``1 + gamma(q)``, and the
  rounding of the square root, product and sum) makes ``A`` an upper bound
  of ``sum_t ||a_t|| ||b_t||``, which is all the error bound needs.

  Returns:
    ``(value, error, scale)``, ``[U]`` float64 each.
  """
  a = tf.cast(a, tf.float64)
  b = tf.cast(b, tf.float64)
  p, q = a.shape[-1], b.shape[-1]
  aa = tf.matmul(a, a, transpose_b=True)
  bb = tf.matmul(b, b, transpose_b=True)
  value = tf.reduce_sum(aa * bb, axis=[1, 2])
  t = tf.cast(tf.shape(a)[1], tf.float64)
  norms2 = tf.linalg.diag_part(aa) * tf.linalg.diag_part(bb)  # ||a_t||^2 ||b_t||^2, rounded
  inflate = (1.0 + gamma(p)) * (1.0 + gamma(q)) * (1.0 + gamma(t + 4.0))
  scale = tf.reduce_sum(tf.sqrt(tf.maximum(norms2, 0.0)), axis=1) * inflate
  error = gamma(tf.cast(p + q, tf.float64) + t * t) * tf.square(scale)
  return value, error, scale


#: Bytes of per-unit float32 gradients the engine may keep from the norm pass
#: to the weighted sum, all variables together (see :func:`plan_keeping`).
#: A kept :class:`Outer` saves the ``T p q`` matrix product of its weighted sum
#: (the same product as a plain step's weight gradient) at ``4 U p q`` bytes.
KEEP_BYTES = 1536 * 2**20


def plan_keeping(reps, budget: int = KEEP_BYTES) -> int:
  """Marks which :class:`Outer` keep their materialised per-unit gradients; returns bytes used.

  Keeping replaces the weighted sum's ``T p q`` product by a ``U p q``
  weighted sum over units, so the saving per byte is proportional to ``T``:
  representations are granted in decreasing ``T`` while the ``4 U p q``
  bytes fit into ``budget``. Only :class:`Outer` with static ``U`` and ``T > 1``
  take part (others keep their own rule); precision is unaffected (a kept
  gradient is exactly what its norm measured, see the module docstring).
  """
  candidates = [r for r in reps if isinstance(r, Outer) and r.keep_bytes() is not None]
  used = 0
  for rep in sorted(candidates, key=lambda r: -r.a.shape[1]):
    need = rep.keep_bytes()
    rep.keep = used + need <= budget
    used += need if rep.keep else 0
  return used


class Outer(Representation):
  """``g_u = reshape_transpose(sum_t a[u, t]^T b[u, t])``, ``a: [U, T, p]``, ``b: [U, T, q]``.

  The ``[p, q]`` matrix maps to the variable by reshaping to
  ``in_dims + out_dims`` and transposing by ``perm`` (Dense: ``[d_in, d_out]``,
  identity; conv: ``[kh, kw, c_in, c_out]`` from flattened patches; EinsumDense:
  the kernel's letter order).

  Norms: ``T = 1``: ``||a||^2 ||b||^2`` (no cancellation); ghost: float64 Gram
  matrices with error ``gamma(p + q + T^2) A^2``; materialised: the float32
  ``b^T a`` (kept for the weighted sum when static shapes allow, so the norm is
  that of what is summed), squared and summed in float64.

  Args:
    a: ``[U, T, p]`` layer inputs (or input patches), ``b``: ``[U, T, q]``
      gradients of the summed loss w.r.t. the layer's pre-activation output.
    in_dims, out_dims: factorisations of ``p`` and ``q``.
    perm: permutation from ``in_dims + out_dims`` to the variable's axes.
    method: ``"auto"`` (per :func:`use_ghost`), ``"ghost"`` or ``"materialize"``.
  """

  def __init__(self, a, b, in_dims: Sequence[int], out_dims: Sequence[int],
               perm: Sequence[int] | None = None, method: str = "auto"):
    if method not in ("auto", "ghost", "materialize"):
      raise ValueError(f"`method` must be 'auto', 'ghost' or 'materialize'; got {method!r}.")
    self.a = tf.cast(a, tf.float32)
    self.b = tf.cast(b, tf.float32)
    self.in_dims = tuple(int(d) for d in in_dims)
    self.out_dims = tuple(int(d) for d in out_dims)
    self.p = math.prod(self.in_dims)
    self.q = math.prod(self.out_dims)
    if self.a.shape[-1] != self.p or self.b.shape[-1] != self.q:
      raise ValueError(f"Outer factors of widths {self.a.shape[-1]}, {self.b.shape[-1]} do not "
                       f"match in_dims {self.in_dims} / out_dims {self.out_dims}.")
    rank = len(self.in_dims) + len(self.out_dims)
    self.perm = tuple(perm) if perm is not None else tuple(range(rank))
    self.method = method
    self.keep = None  # True/False: set by plan_keeping; None: keep where not larger than a, b
    self._materialized = None  # [U, q, p], cached by estimate

  def keep_bytes(self):
    """Bytes of the ``[U, q, p]`` float32 per-unit gradients, or None (dynamic shape, ``T = 1``)."""
    units, positions = self.a.shape[0], self.a.shape[1]
    if units is None or positions is None or positions == 1:
      return None
    return 4 * units * self.p * self.q

  def _ghost(self) -> bool | tf.Tensor:
    if self.method != "auto":
      return self.method == "ghost"
    return use_ghost(_static_or_dynamic(self.a, 1), self.p, self.q)

  def _per_unit_qp(self) -> tf.Tensor:
    # b^T a ([q, T] x [T, p]) is markedly faster than a^T b on CPU batched GEMM.
    return tf.matmul(self.b, self.a, transpose_a=True)

  def estimate(self) -> Estimate:
    positions = self.a.shape[1]
    if positions == 1:  # ||a b^T||^2 = ||a||^2 ||b||^2: no cancellation
      a = tf.cast(self.a, tf.float64)
      b = tf.cast(self.b, tf.float64)
      value = (tf.reduce_sum(tf.square(a), axis=[1, 2])
               * tf.reduce_sum(tf.square(b), axis=[1, 2]))
      return Estimate(value, gamma(self.p + self.q + 1) * value, None)

    def ghost():
      return ghost_estimate_and_scale(self.a, self.b)

    def materialize():
      g = self._per_unit_qp()
      value, error = sum_of_squares(g)
      # The scale only decides which units are recomputed in float64: float32 suffices
      # (an overflow to inf marks the unit for recomputation, which is safe).
      scale = tf.cast(tf.reduce_sum(row_norms(self.a) * row_norms(self.b), axis=1), tf.float64)
      return g, value, error, scale

    if self.keep is None:  # not planned: keep where not larger than the factors a, b
      keep = isinstance(positions, int) and self.p * self.q <= positions * (self.p + self.q)
    else:
      keep = self.keep and isinstance(positions, int) and self.method != "ghost"
    choice = False if keep else self._ghost()
    if isinstance(choice, bool):
      if choice:
        value, error, scale = ghost()
      else:
        per_unit, value, error, scale = materialize()
        if keep:  # the weighted sum uses these per-unit gradients (no T p q product)
          self._materialized = per_unit
    else:
      value, error, scale = tf.cond(choice, ghost, lambda: materialize()[1:])
    return Estimate(value, error, scale)

  def unit_gradient64(self, u):
    a = tf.cast(tf.gather(self.a, u), tf.float64)  # [T, p]
    b = tf.cast(tf.gather(self.b, u), tf.float64)
    qp = tf.matmul(b, a, transpose_a=True)
    scale = tf.reduce_sum(row_norms(a) * row_norms(b))
    return self._to_variable_layout(qp, []), gamma(tf.shape(a)[0]) * scale

  def gather_units(self, indices) -> "Outer":
    return Outer(tf.gather(self.a, indices), tf.gather(self.b, indices), self.in_dims,
                 self.out_dims, self.perm, self.method)

  def _to_variable_layout(self, qp: tf.Tensor, leading: list) -> tf.Tensor:
    """``[..., q, p]`` -> ``[..., *var_shape]``."""
    n = len(leading)
    pq = tf.linalg.matrix_transpose(qp)
    full = tf.reshape(pq, leading + list(self.in_dims) + list(self.out_dims))
    if self.perm != tuple(range(len(self.perm))):
      full = tf.transpose(full, list(range(n)) + [n + i for i in self.perm])
    return full

  def raw_weighted_sum(self, factors: tf.Tensor) -> tf.Tensor:
    keep = factors > 0
    if self._materialized is not None:
      g = zero_dropped_units(self._materialized, keep)
      qp = tf.tensordot(factors, g, axes=[[0], [0]])
    else:
      a = zero_dropped_units(self.a, keep)
      b = zero_dropped_units(self.b, keep) * tf.reshape(factors, [-1, 1, 1])
      a2 = tf.reshape(a, [-1, self.p])
      b2 = tf.reshape(b, [-1, self.q])
      qp = tf.matmul(b2, a2, transpose_a=True)
    return self._to_variable_layout(qp, [])

  def per_unit(self) -> tf.Tensor:
    qp = self._materialized if self._materialized is not None else self._per_unit_qp()
    return self._to_variable_layout(qp, [tf.shape(qp)[0]])

  def to_units(self, num_units: int) -> "Outer":
    return Outer(_units_first_reshape(self.a, num_units), _units_first_reshape(self.b, num_units),
                 self.in_dims, self.out_dims, self.perm, self.method)

  def mergeable(self, other) -> bool:
    return (isinstance(other, Outer) and other.in_dims == self.in_dims
            and other.out_dims == self.out_dims and other.perm == self.perm)

  def merge(self, other: "Outer") -> "Outer":
    """Two calls of the same layer: concatenate their positions (exact)."""
    return Outer(tf.concat([self.a, other.a], axis=1), tf.concat([self.b, other.b], axis=1),
                 self.in_dims, self.out_dims, self.perm, self.method)


class Scattered(Representation):
  """``g_u[v] = sum_{t: ids[u, t] = v} b[u, t]`` for a ``[num_rows, d]`` table.

  Norms: rows of equal id are summed in float64 before squaring; error
  ``gamma(N (d + 3)) A^2`` with ``A = sum_t ||b_t||``.

  Args:
    ids: ``[U, N]`` integer row indices (token ids, positions).
    b: ``[U, N, d]`` gradients of the summed loss w.r.t. the gathered rows.
    num_rows: rows of the table (vocabulary size).
    distinct: True if the ids of one unit are known to be distinct
      (positions), which makes ``||g_u||^2 = sum_t ||b[u, t]||^2``.
  """

  def __init__(self, ids, b, num_rows: int, distinct: bool = False):
    self.ids = tf.cast(ids, tf.int32)
    self.b = tf.cast(b, tf.float32)
    self.num_rows = int(num_rows)
    self.distinct = distinct

  def estimate(self) -> Estimate:
    b = tf.cast(self.b, tf.float64)
    n = tf.cast(tf.shape(b)[1], tf.float64)
    d = float(self.b.shape[-1])
    if self.distinct:  # no two rows of a unit add up: no cancellation
      value = tf.reduce_sum(tf.square(b), axis=[1, 2])
      return Estimate(value, gamma(n * d) * value, None)
    value = scattered_squared_norms(self.ids, b)
    scale = tf.reduce_sum(row_norms(b), axis=1)
    return Estimate(value, gamma(n * (d + 3.0)) * tf.square(scale), scale)

  def unit_gradient64(self, u):
    b = tf.cast(tf.gather(self.b, u), tf.float64)  # [N, d]
    g = tf.math.unsorted_segment_sum(b, tf.gather(self.ids, u), self.num_rows)
    return g, gamma(tf.shape(b)[0]) * tf.reduce_sum(row_norms(b))

  def gather_units(self, indices) -> "Scattered":
    return Scattered(tf.gather(self.ids, indices), tf.gather(self.b, indices), self.num_rows,
                     self.distinct)

  def raw_weighted_sum(self, factors: tf.Tensor) -> tf.Tensor:
    b = zero_dropped_units(self.b, factors > 0) * tf.reshape(factors, [-1, 1, 1])
    d = self.b.shape[-1]
    return tf.math.unsorted_segment_sum(tf.reshape(b, [-1, d]), tf.reshape(self.ids, [-1]),
                                        self.num_rows)

  def per_unit(self) -> tf.Tensor:
    units = tf.shape(self.ids)[0]
    d = self.b.shape[-1]
    offsets = tf.range(units)[:, None] * self.num_rows
    flat = tf.math.unsorted_segment_sum(tf.reshape(self.b, [-1, d]),
                                        tf.reshape(self.ids + offsets, [-1]),
                                        units * self.num_rows)
    return tf.reshape(flat, [units, self.num_rows, d])

  def to_units(self, num_units: int) -> "Scattered":
    return Scattered(_units_first_reshape(self.ids, num_units),
                     _units_first_reshape(self.b, num_units), self.num_rows, distinct=False)

  def mergeable(self, other) -> bool:
    return isinstance(other, Scattered) and other.num_rows == self.num_rows

  def merge(self, other: "Scattered") -> "Scattered":
    return Scattered(tf.concat([self.ids, other.ids], axis=1), tf.concat([self.b, other.b], axis=1),
                     self.num_rows, distinct=False)


def scattered_squared_norms(ids: tf.Tensor, b: tf.Tensor) -> tf.Tensor:
  """``||sum_t onehot(ids[u, t]) b[u, t]^T||^2`` per unit, in ``O(U N (log N + d))``.

  Rows of one unit are sorted by id; rows with equal ids are summed
  (segment sum) and the squared norms of the sums are added up, in ``b``'s
  dtype (float64 in :class:`Scattered`). Static shapes throughout (no
  ``tf.unique``).

  >>> ids = tf.constant([[3, 1, 3]]); b = tf.constant([[[1., 0.], [0., 2.], [1., 1.]]])
  >>> scattered_squared_norms(ids, b).numpy().tolist()  # row 3: [2, 1], row 1: [0, 2]
  [9.0]
  """
  ids = tf.cast(ids, tf.int32)
  units, n = tf.shape(ids)[0], tf.shape(ids)[1]
  order = tf.argsort(ids, axis=1, stable=True)
  sorted_ids = tf.gather(ids, order, batch_dims=1)
  sorted_b = tf.gather(b, order, batch_dims=1)
  new_segment = tf.concat([tf.ones([units, 1], tf.int32),
                           tf.cast(sorted_ids[:, 1:] != sorted_ids[:, :-1], tf.int32)], axis=1)
  segment = tf.cumsum(new_segment, axis=1) - 1 + tf.range(units)[:, None] * n
  d = b.shape[-1]
  sums = tf.math.unsorted_segment_sum(tf.reshape(sorted_b, [-1, d]), tf.reshape(segment, [-1]),
                                      units * n)
  return tf.reduce_sum(tf.reshape(tf.square(sums), [units, -1]), axis=1)


# --- cross terms of a Sum ---------------------------------------------------------

def _cross_scattered_outer_t(s: Scattered, o: Outer):
  """``<g_u^S, g_u^O>`` for ``g^O = (a^T b)^T`` of shape ``[rows, d]`` (tied reverse embedding).

  ``g^O_u[v] = sum_s o.b[u, s, v] o.a[u, s]``; so
  ``<g^S_u, g^O_u> = sum_{t,s} o.b[u, s, ids[u, t]] <s.b[u, t], o.a[u, s]>``.
  Float64; each term is at most ``||o.b_s|| ||o.a_s|| ||s.b_t||`` in magnitude,
  so the error is ``gamma(d + S T) A_O A_S``.

  Returns:
    ``(value, error)``, ``[U]`` float64.
  """
  ob, oa, sb = (tf.cast(t, tf.float64) for t in (o.b, o.a, s.b))
  picked = tf.gather(ob, s.ids, axis=2, batch_dims=1)  # [U, S, T]
  dots = tf.matmul(oa, sb, transpose_b=True)  # [U, S, T]
  value = tf.reduce_sum(picked * dots, axis=[1, 2])
  terms = tf.cast(tf.shape(oa)[1] * tf.shape(sb)[1], tf.float64)
  scale_o = tf.reduce_sum(row_norms(oa) * row_norms(ob), axis=1)
  scale_s = tf.reduce_sum(row_norms(sb), axis=1)
  return value, gamma(terms + float(sb.shape[-1])) * scale_o * scale_s


def _cross_outer_outer(r1: Outer, r2: Outer):
  """``<g_u^1, g_u^2> = sum_{t,s} <a1_t, a2_s> <b1_t, b2_s>`` in float64, with its error."""
  a1, a2, b1, b2 = (tf.cast(t, tf.float64) for t in (r1.a, r2.a, r1.b, r2.b))
  aa = tf.matmul(a1, a2, transpose_b=True)
  bb = tf.matmul(b1, b2, transpose_b=True)
  value = tf.reduce_sum(aa * bb, axis=[1, 2])
  terms = tf.cast(tf.shape(a1)[1] * tf.shape(a2)[1], tf.float64)
  return value, gamma(terms + float(r1.p + r1.q)) * outer_scale(r1.a, r1.b) * outer_scale(
      r2.a, r2.b)


def _closed_form_cross(r1, r2):
  """A function computing ``(value, error)`` of ``<g^1, g^2>`` in closed form, or None."""
  for s, o in ((r1, r2), (r2, r1)):
    if (isinstance(s, Scattered) and isinstance(o, Outer) and o.perm == (1, 0)
        and len(o.in_dims) == 1 and len(o.out_dims) == 1 and o.out_dims[0] == s.num_rows):
      return lambda s=s, o=o: _cross_scattered_outer_t(s, o)
  if isinstance(r1, Outer) and r1.mergeable(r2):
    return lambda: _cross_outer_outer(r1, r2)
  return None


class Sum(Representation):
  """Per-unit gradient that is the sum of several representations (tied weights).

  ``||sum_k g^k||^2 = sum_k ||g^k||^2 + 2 sum_{k<l} <g^k, g^l>`` when every
  cross term has a closed form (embedding table used both as a lookup and as
  the transposed output projection; two :class:`Outer` of the same layout),
  all in float64 with the parts' error bounds added up. Otherwise the parts'
  float32 per-unit gradients are materialised and added in float64 before
  squaring (no cancellation of squares). Units whose parts cancel are
  recomputed from float64 gradients like any ill-conditioned unit.
  """

  def __init__(self, parts):
    self.parts = list(parts)

  def estimate(self) -> Estimate:
    crosses = [_closed_form_cross(p, r) for i, p in enumerate(self.parts)
               for r in self.parts[i + 1:]]
    estimates = [p.estimate() for p in self.parts]
    scale = tf.add_n([e.scale if e.scale is not None
                      else tf.sqrt(tf.maximum(e.value + e.error, 0.0)) for e in estimates])
    if all(c is not None for c in crosses):
      cross_terms = [c() for c in crosses]
      terms = [e.value for e in estimates] + [2.0 * v for v, _ in cross_terms]
      value = tf.add_n(terms)
      error = tf.add_n([e.error for e in estimates] + [2.0 * e for _, e in cross_terms])
      # Rounding of the sum itself: at most gamma(k) times the sum of the terms' magnitudes.
      error = error + gamma(len(terms)) * tf.add_n([tf.abs(t) for t in terms])
      return Estimate(value, error, scale)
    # Generic: materialise the float32 per-unit gradients, add them in float64.
    grads = [tf.cast(p.per_unit(), tf.float64) for p in self.parts]
    units = tf.shape(grads[0])[0]
    flat = [tf.reshape(g, [units, -1]) for g in grads]
    total = tf.add_n(flat)
    value = tf.reduce_sum(tf.square(total), axis=1)
    spread = gamma(len(flat)) * tf.add_n([row_norms(g) for g in flat])  # >= ||total - exact||
    error = gamma(tf.shape(total)[1]) * value + spread * (2.0 * tf.sqrt(value) + spread)
    return Estimate(value, error, scale)

  def unit_gradient64(self, u):
    pieces = [p.unit_gradient64(u) for p in self.parts]
    return tf.add_n([g for g, _ in pieces]), tf.add_n([e for _, e in pieces])

  def gather_units(self, indices) -> "Sum":
    return Sum([p.gather_units(indices) for p in self.parts])

  def raw_weighted_sum(self, factors: tf.Tensor) -> tf.Tensor:
    return tf.add_n([p.raw_weighted_sum(factors) for p in self.parts])

  def per_unit(self) -> tf.Tensor:
    return tf.add_n([p.per_unit() for p in self.parts])

  def per_unit64(self) -> tf.Tensor:
    """``[U, *var_shape]`` float64: the parts' float32 per-unit gradients added in float64."""
    return tf.add_n([tf.cast(p.per_unit(), tf.float64) for p in self.parts])

  def to_units(self, num_units: int) -> Representation:
    if all(getattr(p, "exact_regrouping", True) for p in self.parts):
      return Sum([p.to_units(num_units) for p in self.parts])
    return materialized_units(self, num_units)


def materialized_units(rep: Representation, num_units: int) -> Materialized:
  """Microbatch units of ``rep`` as materialised float32 gradients, accurate to float32 rounding.

  For representations whose examples cannot be regrouped into units in
  factored form (a convolution's patches are built per example). The
  per-example gradients are materialised, ill-conditioned or loosely bounded
  examples (see :func:`certify`) are recomputed in float64
  (``rep.unit_gradient64``), and each unit's examples are added in float64
  before the result is rounded once to float32: examples (or a shared
  layer's uses) that cancel each other do not leave float32 rounding noise
  of their size in the unit's gradient.
  """
  _, suspect = _bound_and_suspects(rep.estimate())
  grads = rep.per_unit64() if hasattr(rep, "per_unit64") else tf.cast(rep.per_unit(), tf.float64)

  indices = tf.cast(tf.where(suspect)[:, 0], tf.int32)  # one loop over these only (see certify)

  def body(j, grads):
    u = indices[j]
    g, _ = rep.unit_gradient64(u)
    return j + 1, tf.tensor_scatter_nd_update(grads, [[u]], [tf.reshape(g, tf.shape(grads)[1:])])

  grads = tf.while_loop(lambda j, _: j < tf.size(indices), body, (tf.constant(0), grads))[1]
  grads = tf.reshape(grads, tf.concat([[num_units, -1], tf.shape(grads)[1:]], axis=0))
  return Materialized(tf.cast(tf.reduce_sum(grads, axis=1), tf.float32))


def _can_merge(m, rep) -> bool:
  if isinstance(m, Materialized):
    return isinstance(rep, Materialized)
  return m.mergeable(rep) if hasattr(m, "mergeable") else False


def combine(reps):
  """One representation for several of the same variable (a layer called twice, tying)."""
  merged = []
  for rep in reps:
    target = next((i for i, m in enumerate(merged) if _can_merge(m, rep)), None)
    if target is None:
      merged.append(rep)
    else:
      merged[target] = merged[target].merge(rep)
  return merged[0] if len(merged) == 1 else Sum(merged)
