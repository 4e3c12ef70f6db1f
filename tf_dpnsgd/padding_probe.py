"""Length bucketing only for models whose rows ignore their padding: probed before any update.

Why: with ``make_private(..., physical_batch_size=..., length_key=...)`` the
step orders a text batch by length and cuts each physical chunk to its own
longest row (:func:`tf_dpnsgd.step.contributions.trim_to_longest`). The cut
length of a chunk is a function of its rows' lengths, so of other examples.
That is sound only if every row's output, loss and gradient are the same at
every length that keeps its real positions. A model that does not mask its
padding (``Embedding(mask_zero=False)`` + ``GlobalAveragePooling1D``: the
mean runs over the padding too) breaks it: replacing one example by one of
another length changes the cut of its chunk and with it every other row's
gradient there, so the summed contributions move by more than ``2S`` (the
replace-one bound for sensitivity ``S``: the clip norm, or 1 for
normalization). That is a privacy failure, not an accuracy one: the
accountant's epsilon would not describe the mechanism that ran.

The probe (:func:`probe_padding`), on one real batch (per replica under
``tf.distribute``), with every random op frozen
(:func:`tf_dpnsgd.forward_checks.frozen_forward_losses`):

1. picks the valid rows shorter than the batch's padded length ``L`` (at
   most ``physical_batch_size`` of them) and the cut ``m`` = the longest of
   their real lengths (at least 1), so ``m < L`` and every picked row is real
   up to ``m`` at most (:func:`comparable_rows`); if no valid row is shorter
   than ``L`` the batch cannot be tested, and then no chunk holding a valid
   row is cut either (a chunk is cut only below its longest row), so the step
   on it is exact; the probe stays pending for the next batch;
2. runs the picked rows at length ``L`` and cut to ``m`` with the step's own
   cut (:func:`tf_dpnsgd.step.contributions.cut_to_length`), and compares
   their per-example losses and per-row outputs (relative tolerance
   :data:`VALUE_RTOL`) and the gradient with respect to the trainable
   variables of ``sum_i w_i loss_i``, with weights ``w_i`` drawn uniformly in
   ``[0.5, 1.5]`` from a seed drawn on the host when the probe is built
   (public, independent of the data): if any row's gradient changes, the
   weighted sums differ with probability 1 (tolerance :data:`GRADIENT_RTOL`
   of the gradient's norm). The tolerances cover float32 rounding (sums over
   fewer zero terms, other matmul blockings), below 1e-9 relative on the
   tiny BERT of ``tests/test_length_buckets.py``; the unmasked model moves by
   tens of percent.

Training or inference mode: random draws depend on the shape (a dropout mask
for ``[n, m, d]`` is not the first ``m`` positions of the one for ``[n, L,
d]``), so frozen randomness cannot be compared across lengths. A model that
owns Keras seed generators (``Dropout`` with ``rate > 0``, ``GaussianNoise``,
...) is therefore probed in inference mode (``training=False``: the random
layers off), every other model in training mode, as the step runs it. Dropout
itself is sound under cutting: each kept position's mask is still i.i.d. and
independent of the data (docs/per_example.md). Randomness outside Keras seed
generators (raw ``tf.random`` ops in ``call``) differs between the two
lengths and is refused (fail closed).

What is not detected: a dependence the batch does not exercise (the probe
sees one cut of one batch; e.g. a model that reads its padding only beyond
some length), a dependence that appears only in training mode in a model
with random layers, and a model that changes behaviour after the first step.

Privacy of the probe itself: like :mod:`tf_dpnsgd.interaction`'s probe it
outputs one bit (pass/fail) and never prints data or deviations. For a model
whose rows ignore their padding the bit is "pass" on every batch (the
differences are float rounding, orders of magnitude below the tolerance), so
it leaks nothing; a failure stops training before any update. Which batch is
the first testable one only decides when the bit is computed.

Integration (:mod:`tf_dpnsgd.guard`): only for a model with ``length_key``.
Every ``compile`` marks the probe pending; the guard runs it on the call's
batches, in order, until one is testable, after the interaction probe and
before any op of the step; :class:`PaddingDependenceError` stops training
with nothing changed (weights, optimizer state, noise stream, ledger). There
is no opt-out: drop ``length_key`` instead.
"""

from __future__ import annotations

import dataclasses

import keras
import numpy as np
import tensorflow as tf

from tf_dpnsgd import forward_checks
from tf_dpnsgd import interaction
from tf_dpnsgd import ledger as ledger_lib
from tf_dpnsgd.per_example import stateless
from tf_dpnsgd.step.contributions import check_length_key, cut_to_length, sequence_lengths

VALUE_RTOL = 1e-4
"""Losses and outputs may differ by this fraction of (own + mean magnitude) between lengths."""
GRADIENT_RTOL = 1e-4
"""The weighted-sum gradients may differ by this fraction of the full-length one's norm."""
_TINY = 1e-30


class PaddingDependenceError(interaction.ExampleInteractionError):
  """The model's rows depend on their padding length: ``length_key`` would not be private."""


def padding_message(model_name: str, length_key: str) -> str:
  return (
      f"Length bucketing (length_key={length_key!r}) is refused for model '{model_name}': its "
      "outputs depend on the padding length. On the first training batch, rows cut from the "
      "padded length to a shorter one (removing padding only) gave different per-example "
      "losses, outputs or gradients. With length_key each physical chunk is cut to its "
      "longest row, so one example's length would change the gradients of the other rows in "
      "its chunk and move the summed update by more than the sensitivity allows: a privacy "
      "failure, not an accuracy one. Training stopped before any update. Fix: mask the "
      "padding (keras.layers.Embedding(mask_zero=True) with mask-aware layers such as "
      "GlobalAveragePooling1D, or a keras-hub backbone fed its padding_mask, e.g. "
      "BertBackbone), or drop length_key (every chunk then runs at the padded length). (The "
      "same refusal when the forward pass draws randomness outside Keras seed generators, "
      "e.g. raw tf.random ops in call(): their draws depend on the cut shape; use "
      "keras.layers.Dropout or keras.random ops with a keras.random.SeedGenerator.)")


@dataclasses.dataclass
class PaddingReport:
  """Outcome of :func:`probe_padding` (scalar tensors).

  Attributes:
    tested: the batch had a valid row shorter than its padded length.
    value_score: max over the compared rows (and output entries) of ``|full -
      cut| / (VALUE_RTOL * (|full| + mean |full|))``; 0 when untested.
    gradient_score: ``||g_full - g_cut|| / (GRADIENT_RTOL * ||g_full||)``.
  """

  tested: tf.Tensor
  value_score: tf.Tensor
  gradient_score: tf.Tensor

  @property
  def score(self) -> tf.Tensor:
    """Padding dependence: > 1 means the rows depend on their padding length."""
    return tf.maximum(self.value_score, self.gradient_score)

  @property
  def refused(self) -> tf.Tensor:
    return tf.logical_and(self.tested, tf.logical_not(self.score <= 1.0))  # NaN refuses


def comparable_rows(lengths, full_length: int, valid=None, limit=None):
  """``(rows, cut)``: valid rows shorter than ``full_length`` and the length to cut them to.

  ``rows`` (int64 ``[k]``, batch order, at most ``limit``) and ``cut`` (int32,
  the longest real length among them, at least 1). The batch is testable iff
  ``k > 0`` and ``cut < full_length``.

  >>> rows, cut = comparable_rows(tf.constant([12, 3, 12, 7, 0]), 12)
  >>> rows.numpy().tolist(), int(cut)
  ([1, 3, 4], 7)
  >>> rows, cut = comparable_rows(tf.constant([3, 7, 5]), 12, tf.constant([True, False, True]), 1)
  >>> rows.numpy().tolist(), int(cut)
  ([0], 3)
  """
  lengths = tf.cast(lengths, tf.int32)
  short = lengths < full_length
  if valid is not None:
    short = tf.logical_and(short, tf.reshape(tf.cast(valid, tf.bool), [-1]))
  rows = tf.reshape(tf.where(short), [-1])
  if limit:
    rows = rows[:limit]
  cut = tf.maximum(tf.reduce_max(tf.gather(lengths, rows)), 1)  # empty: int32 min -> 1
  return rows, cut


def _absdiff(a, b):
  """``|a - b|``, 0 where both are non-finite, inf where exactly one is."""
  fa, fb = tf.math.is_finite(a), tf.math.is_finite(b)
  d = tf.where(tf.logical_and(fa, fb), tf.abs(tf.where(fa, a, 0.0) - tf.where(fb, b, 0.0)), 0.0)
  return tf.where(tf.not_equal(fa, fb), tf.constant(float("inf")), d)


def _finite_abs(t):
  return tf.where(tf.math.is_finite(t), tf.abs(t), 0.0)


def value_score(full, cut) -> tf.Tensor:
  """``max |full - cut| / (VALUE_RTOL * (|full| + mean |full|))`` over the entries (0 if none).

  >>> float(value_score(tf.constant([1.0, 2.0]), tf.constant([1.0, 2.0 + 3e-5]))) < 1
  True
  >>> float(value_score(tf.constant([1.0, 2.0]), tf.constant([1.0, 2.5]))) > 1
  True
  """
  full = tf.reshape(tf.cast(full, tf.float32), [-1])
  cut = tf.reshape(tf.cast(cut, tf.float32), [-1])
  scale = _finite_abs(full)
  mean = tf.math.divide_no_nan(tf.reduce_sum(scale), tf.cast(tf.size(scale), tf.float32))
  ratio = _absdiff(full, cut) / (VALUE_RTOL * (scale + mean) + _TINY)
  return tf.reduce_max(tf.concat([ratio, [0.0]], axis=0))


def gradient_score(full, cut) -> tf.Tensor:
  """``||full - cut|| / (GRADIENT_RTOL * ||full||)`` over lists of tensors (None: zeros).

  >>> g = [tf.constant([3.0, 4.0])]
  >>> float(gradient_score(g, [tf.constant([3.0, 4.0 + 1e-5])])) < 1
  True
  >>> float(gradient_score(g, [tf.constant([3.0, 4.5])])) > 1
  True
  """
  gap, norm = tf.constant(0.0), tf.constant(0.0)
  for a, b in zip(full, cut):
    if a is None and b is None:
      continue
    a = tf.cast(tf.convert_to_tensor(a if a is not None else tf.zeros_like(b)), tf.float32)
    b = tf.cast(tf.convert_to_tensor(b if b is not None else tf.zeros_like(a)), tf.float32)
    gap += tf.reduce_sum(tf.square(_absdiff(a, b)))
    norm += tf.reduce_sum(tf.square(_finite_abs(a)))
  return tf.sqrt(gap) / (GRADIENT_RTOL * tf.sqrt(norm) + _TINY)


def _gather(structure, rows):
  return tf.nest.map_structure(lambda t: None if t is None else tf.gather(t, rows), structure)


def _outputs_score(full, cut) -> tf.Tensor:
  """:func:`value_score` over the output leaves whose static shapes agree (per-row outputs;
  a leaf with a sequence axis has other shapes at the two lengths and is compared through
  the losses and the gradient only)."""
  score = tf.constant(0.0)
  for a, b in zip(tf.nest.flatten(full), tf.nest.flatten(cut)):
    if a.dtype.is_floating and a.shape[1:].is_fully_defined() and a.shape[1:] == b.shape[1:]:
      score = tf.maximum(score, value_score(a, b))
  return score


def probe_padding(forward, variables, x, y, length_key, mask=None, limit=None,
                  seed=(0, 0)) -> PaddingReport:
  """Probes whether the rows of one batch depend on their padding length (module docstring).

  Args:
    forward: ``fn(x, y) -> (losses [B], y_pred)``, deterministic for equal
      inputs (random ops frozen, e.g. with
      :func:`tf_dpnsgd.forward_checks.frozen_forward_losses`).
    variables: the variables whose gradient is compared (the trainable ones).
    x: dict inputs with a ``[B, L]`` padding mask ``x[length_key]``, static L.
    y: the labels (per example; not cut), or None.
    length_key: the padding mask's key, as given to ``make_private``.
    mask: optional ``[B]`` bool; False rows are Poisson padding (not compared).
    limit: compare at most this many rows (``physical_batch_size``: the
      memory of one step).
    seed: the stateless seed of the public weights ``w_i``.

  Returns:
    :class:`PaddingReport`.

  Raises:
    ValueError: ``x`` is not such a dict (as the step itself would).
  """
  check_length_key(x, length_key)
  full_length = x[length_key].shape[1]
  rows, cut = comparable_rows(sequence_lengths(x[length_key]), full_length, mask, limit)
  testable = tf.logical_and(tf.size(rows) > 0, cut < full_length)

  def compare():
    xs, ys = _gather(x, rows), _gather(y, rows)
    weights = tf.random.stateless_uniform(tf.shape(rows), tf.constant(seed, tf.int64),
                                          minval=0.5, maxval=1.5)

    def run(inputs):
      with tf.GradientTape() as tape:
        losses, y_pred = forward(inputs, ys)
        losses = tf.reshape(tf.cast(losses, tf.float32), [-1])
        total = tf.reduce_sum(tf.where(tf.math.is_finite(losses), weights * losses, 0.0))
      return losses, y_pred, tape.gradient(total, variables)

    losses, y_pred, grads = run(xs)
    with tf.control_dependencies([losses]):  # one pass at a time (memory)
      cut_losses, cut_pred, cut_grads = run(cut_to_length(xs, length_key, cut))
    values = tf.maximum(value_score(losses, cut_losses), _outputs_score(y_pred, cut_pred))
    return tf.constant(True), values, gradient_score(grads, cut_grads)

  def untested():
    return tf.constant(False), tf.constant(0.0), tf.constant(0.0)

  tested, values, grads = tf.cond(testable, compare, untested)
  return PaddingReport(tested=tested, value_score=values, gradient_score=grads)


def probes_in_training_mode(model) -> bool:
  """Training mode unless the model owns Keras seed generators (module docstring)."""
  return not stateless.seed_generators(model)


def model_forward(model, loss_fn, training=True):
  """``fn(x, y) -> (losses, y_pred)`` with every random op frozen, nothing written."""
  return forward_checks.frozen_forward_losses(
      model, lambda y_true, y_pred: (loss_fn(y_true, y_pred), y_pred), training)


def make_padding_probe_function(model, seed=None):
  """``fn(data) -> (tested, refused)`` per replica, or None for a model without ``length_key``.

  Eager with one replica (or ``run_eagerly``), else compiled without XLA.
  ``seed``: of the public weights ``w_i``; default drawn on the host now
  (once per compile).
  """
  length_key = getattr(model, "_dp_length_key", None)
  if length_key is None:
    return None
  strategy = model.distribute_strategy
  limit = getattr(model, "physical_batch_size", None)
  if seed is None:
    seed = tuple(int(s) for s in np.random.default_rng().integers(0, 2**31 - 1, size=2))

  def replica_fn(data):
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    mask, _, _ = ledger_lib.parse_batch_weights(sample_weight)
    training = probes_in_training_mode(model)  # at the call: a subclassed model is built
    report = probe_padding(model_forward(model, model._dp_loss_fn, training),
                           model.trainable_variables, x, y, length_key, mask, limit, seed)
    ctx = tf.distribute.get_replica_context()
    if ctx is None or ctx.num_replicas_in_sync == 1:
      return report.tested, report.refused
    # One verdict for all replicas and workers (as the interaction probe: a worker that alone
    # raised or kept probing would run other collectives than the rest).
    counts = ctx.all_reduce(tf.distribute.ReduceOp.SUM, tf.cast(
        tf.stack([report.tested, report.refused]), tf.float32))
    return counts[0] > 0, counts[1] > 0

  def probe(data):
    return strategy.run(replica_fn, args=(data,))

  if model.run_eagerly or strategy.num_replicas_in_sync == 1:
    # Called about once per compile: tracing the whole probe as one function costs more than
    # running it eagerly (each frozen pass is its own function either way): 3.7 s vs 1.3 s
    # on the tiny BERT of tests/test_length_buckets.py.
    return probe
  function = tf.function(probe, autograph=False, jit_compile=False)
  function._omit_frequent_tracing_warning = True  # pylint: disable=protected-access
  return function


def check_batches(probe, model, batches) -> bool:
  """Runs ``probe`` on the call's batches in order until one is testable; True if none was
  (still pending). Raises :class:`PaddingDependenceError` if a batch's rows depend on their
  padding length; nothing of the step has run then."""
  strategy = model.distribute_strategy
  for data in batches:
    tested, refused = probe(data)
    if any(bool(t) for t in strategy.experimental_local_results(refused)):
      raise PaddingDependenceError(padding_message(model.name, model._dp_length_key))
    if any(bool(t) for t in strategy.experimental_local_results(tested)):
      return False
  return True


def assert_padding_independent(model, x, y, length_key, mask=None, loss_fn=None) -> None:
  """Eager check of one batch; raises :class:`PaddingDependenceError` if rows depend on their
  padding length (passes when the batch cannot be tested).

  Args:
    model: a Keras model.
    x, y, length_key, mask: as :func:`probe_padding`.
    loss_fn: ``fn(y_true, y_pred) -> [B]``; default the compiled DP model's.
  """
  loss_fn = loss_fn or getattr(model, "_dp_loss_fn", None)
  if loss_fn is None:
    raise ValueError("Pass `loss_fn`, or compile the DP model first.")
  forward = model_forward(model, loss_fn, probes_in_training_mode(model))
  report = probe_padding(forward, model.trainable_variables, x, y, length_key, mask)
  if bool(report.refused):
    raise PaddingDependenceError(padding_message(model.name, length_key))


__all__ = ["GRADIENT_RTOL", "PaddingDependenceError", "PaddingReport", "VALUE_RTOL",
           "assert_padding_independent", "check_batches", "comparable_rows", "gradient_score",
           "make_padding_probe_function", "model_forward", "padding_message", "probe_padding",
           "probes_in_training_mode", "value_score"]
