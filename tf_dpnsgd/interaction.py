"""Refuses models whose examples interact, on the first batch, before any update.

Why: DP-SGD and DP-NSGD bound each example's contribution by the sensitivity
``S`` (the clip norm, or 1 for normalization) and assume that example ``i``'s
per-example gradient depends on example ``i`` alone. A parameter-free op that
mixes the batch (centring by the batch mean, batch statistics, a max or an
attention across the batch axis) or a loss whose value for example ``i``
depends on other rows (an in-batch contrastive loss: a softmax over the
batch's similarity matrix) passes :func:`tf_dpnsgd.validate_layers`, which
knows BatchNormalization only by type. With such a model one replaced example
changes the *other* examples' gradients too, so the summed contributions move
by more than ``2S``, and Poisson padding rows (mask False, factor 0) still
change the valid rows' gradients. This module finds interaction by behaviour.

The probe (:func:`probe_interaction`), on one real batch (per replica under
``tf.distribute``), in training mode with every random op frozen (Keras seed
generators and TensorFlow's own random ops:
:func:`tf_dpnsgd.forward_checks.frozen_forward_losses`):

1. rows are split into *perturbed* rows ``P`` (all padding rows and the first
   half of the valid rows) and *observer* rows ``O`` (the other valid rows);
2. **value check** (any input dtype, e.g. integer tokens): every row of ``P``
   is replaced, in ``x`` and ``y`` together, by a copy of the first observer
   row (the DP neighbouring relation: replacing examples by other real
   examples, so any model and label space accepts the result). The
   per-example losses of ``O`` must not change (relative tolerance
   ``VALUE_RTOL``). Replacing half the batch, not one row, makes the change of
   a batch statistic O(1) instead of O(1/B), so large batches are caught too.
   A repeated unperturbed pass measures non-reproducibility: if the repeat
   itself differs (randomness the freezing cannot reach, a non-deterministic
   kernel), the value check cannot run and the batch is refused
   (:attr:`ProbeReport.refused`, fail closed): the gradient check alone misses
   interaction behind ``stop_gradient`` (a REINFORCE loss with a batch-mean
   baseline);
3. **gradient check** (floating inputs and targets): the gradient of the sum
   of the observers' losses with respect to the rows of ``P`` must be exactly
   0 (non-finite entries ignored; tolerance ``GRADIENT_RTOL`` times the
   observers' own input gradient). Without interaction it is structurally
   0 whatever the values, so this also catches a mixing that only shows in
   gradients (a ``stop_gradient`` trick) and is immune to randomness.

What is not detected: interaction the batch does not exercise (the probe sees
one batch; e.g. a batch max attained in an observer row); mixing across
replicas inside the forward pass (each replica probes its own shard);
models that change behaviour after the first step. Within ``num_microbatches``
units, interaction inside a microbatch would be harmless but is refused too,
like BatchNormalization. Batches with fewer than 2 rows (or only identical
rows) cannot be probed; the probe then stays pending for the next batch.
With ``physical_batch_size`` the probe sees at most that many rows of the
batch (padding rows included, :func:`limit_rows`): the engines never run
more rows at once, so interaction beyond a chunk cannot occur and the probe
needs no more memory than the step.

Padding rows contribute exactly 0 whatever the model: every engine gives a
masked unit the factor 0 and zeroes its rows with ``tf.where`` (so even
inf/NaN from extreme padding values cannot leak), and a model through which
padding rows could still reach the valid rows' gradients is refused here
because padding rows are always among the perturbed rows.

Privacy of the probe itself: it outputs one bit (pass/fail) and never prints
data or deviations. For a model without interaction the bit is "pass" for
every batch (the observers' values are bit-identical), so it leaks nothing;
a failure stops training before any update.

Integration (:mod:`tf_dpnsgd.guard`): every ``compile`` marks the probe
pending; the guard around Keras' train function takes the first batch from
the iterator, runs the probe on it outside Keras' step (per replica, with
``strategy.run``; eagerly for one replica, else in its own compiled function:
:func:`make_probe_function`), raises :class:`ExampleInteractionError` if examples
interact (or the forward pass cannot be reproduced), and only then runs
Keras' train step on that batch; later calls skip the probe (no per-step
cost, no change to the traced train step). Why not an in-graph
``tf.cond`` + ``tf.debugging.Assert`` inside ``train_step``: an assertion
orders only what depends on its data, so a failing step still ran the
step's data-independent updates (``optimizer.iterations``, the noise
counter, the privacy ledger), and XLA (``jit_compile=True``) drops
``Assert`` altogether. There is no opt-out.
"""

from __future__ import annotations

import dataclasses

import keras
import tensorflow as tf

from tf_dpnsgd import forward_checks
from tf_dpnsgd import ledger as ledger_lib
from tf_dpnsgd.per_example import vectorized as _vectorized

VALUE_RTOL = 1e-5
"""Observer losses may differ by this fraction of (own + mean observer loss)."""
NOISE_FACTOR = 10.0
"""A change must exceed this multiple of the repeat-pass difference to count."""
GRADIENT_RTOL = 1e-6
"""Gradient leak allowed, relative to the observers' own input gradient."""
_TINY = 1e-30



class ExampleInteractionError(ValueError):
  """Examples of a batch interact: per-example DP would not hold."""


def interaction_message(model_name: str = "the model") -> str:
  return (
      f"Examples interact in {model_name}: on the first training batch, replacing "
      "some examples (and the masked padding rows) by other examples changed the per-example "
      "losses or gradients of the remaining examples. DP-SGD/DP-NSGD bound each example's "
      "contribution only if example i's gradient depends on example i alone; here one example "
      "moves the summed update by more than the sensitivity allows, so the privacy guarantee "
      "would not hold. Training stopped before any update. Fix: replace layers and ops that "
      "mix the batch (batch statistics: BatchNormalization -> GroupNormalization or "
      "LayerNormalization; means, sums, max or attention over the batch axis) by per-example "
      "ones, and use a loss whose value for example i depends only on example i's prediction "
      "and label: in-batch contrastive losses (softmax over the batch's similarity matrix, "
      "in-batch negatives, a batch-mean baseline even behind stop_gradient) are not "
      "compatible with per-example DP. (The same refusal when the training forward pass is "
      "not reproducible with every random op frozen, so the check could not run: draw "
      "randomness with keras.layers.Dropout or keras.random ops seeded by a "
      "keras.random.SeedGenerator attached to the layer.)")


@dataclasses.dataclass
class ProbeReport:
  """Outcome of :func:`probe_interaction` (scalar tensors).

  Attributes:
    tested: the batch allowed a test (>= 1 observer, >= 1 perturbed row that
      actually changed).
    value_score: max over observers of ``|loss change| / (tol + 10 * repeat
      difference)``; 0 when untested or when the forward pass is not
      reproducible.
    gradient_score: ``leak / (GRADIENT_RTOL * own gradient)``.
    reproducible: the repeated unperturbed pass matched within tolerance
      (else the value check could not run).
  """

  tested: tf.Tensor
  value_score: tf.Tensor
  gradient_score: tf.Tensor
  reproducible: tf.Tensor

  @property
  def score(self) -> tf.Tensor:
    """Interaction score: > 1 means the examples interact."""
    return tf.maximum(self.value_score, self.gradient_score)

  @property
  def interacting(self) -> tf.Tensor:
    return tf.logical_and(self.tested, self.score > 1.0)

  @property
  def refused(self) -> tf.Tensor:
    """Tested, and the examples interact or the value check could not run (fail closed)."""
    return tf.logical_and(self.tested, tf.logical_or(self.score > 1.0,
                                                     tf.logical_not(self.reproducible)))


def _leaves(structure):
  return [t for t in tf.nest.flatten(structure) if t is not None]


def _map(fn, structure):
  return tf.nest.map_structure(lambda t: None if t is None else fn(t), structure)


def _as_tensor(t):
  """``t`` as a tensor; a ``tf.RaggedTensor`` (e.g. bag-of-words ids) stays ragged."""
  return t if isinstance(t, tf.RaggedTensor) else tf.convert_to_tensor(t)


def _num_rows(t) -> tf.Tensor:
  """Rows of a tensor or ``tf.RaggedTensor`` (int32 scalar)."""
  if isinstance(t, tf.RaggedTensor):
    return t.nrows(out_type=tf.int32)
  return tf.shape(t)[0]


def _dense_rows(t):
  """A ragged ``t`` as dense rows that are equal iff the ragged rows are: the values padded
  with zeros, next to a padded mask of where values exist (row lengths at every level)."""
  present = t.with_flat_values(tf.ones_like(t.flat_values, tf.bool)).to_tensor(False)
  return t.to_tensor(), present


def _row_differs(t, ref):
  """``[B]`` bool: rows of ``t`` that differ from the one row of ``ref`` (ragged: exact)."""
  if not isinstance(t, tf.RaggedTensor):
    return _row_any(tf.not_equal(t, ref))
  values, present = _dense_rows(tf.concat([t, ref], axis=0))
  return tf.logical_or(_row_any(tf.not_equal(values[:-1], values[-1:])),
                       _row_any(tf.not_equal(present[:-1], present[-1:])))


def _row_any(t):
  """``[B, ...]`` bool -> ``[B]``: any over the non-batch axes."""
  if t.shape.rank is not None and t.shape.rank <= 1:
    return t
  return tf.reduce_any(tf.reshape(t, [tf.shape(t)[0], -1]), axis=1)


def _row_max(t):
  if t.shape.rank is not None and t.shape.rank <= 1:
    return t
  return tf.reduce_max(tf.reshape(t, [tf.shape(t)[0], -1]), axis=1)


def _absdiff(a, b):
  """``|a - b|``, 0 where both are non-finite, inf where exactly one is."""
  fa, fb = tf.math.is_finite(a), tf.math.is_finite(b)
  d = tf.abs(tf.where(fa, a, 0.0) - tf.where(fb, b, 0.0))
  d = tf.where(tf.logical_and(fa, fb), d, 0.0)
  return tf.where(tf.not_equal(fa, fb), tf.constant(float("inf")), d)


def _split_rows(batch, mask):
  """``(perturbed, observers)`` ``[B]`` bool: padding + first half of valid rows, the rest."""
  valid = tf.ones([batch], tf.bool) if mask is None else tf.reshape(tf.cast(mask, tf.bool), [-1])
  n_valid = tf.reduce_sum(tf.cast(valid, tf.int32))
  rank = tf.cumsum(tf.cast(valid, tf.int32)) - 1
  first_half = tf.logical_and(valid, rank < n_valid // 2)
  perturbed = tf.logical_or(tf.logical_not(valid), first_half)
  observers = tf.logical_and(valid, tf.logical_not(first_half))
  return perturbed, observers


def _untested():
  zero = tf.constant(0.0)
  return tf.constant(False), zero, zero, tf.constant(True)


def probe_interaction(forward_losses, x, y, mask=None) -> ProbeReport:
  """Probes whether the rows of one batch interact (see the module docstring).

  Args:
    forward_losses: ``fn(x, y) -> [B]`` per-example losses; must be
      deterministic for equal inputs (freeze random streams, e.g. with
      :func:`model_forward_losses`).
    x, y: the batch (nested structures of ``[B, ...]`` tensors or
      ``tf.RaggedTensor``s, whose rows are compared exactly, lengths included,
      and differentiated through their values; ``y`` may be None).
    mask: optional ``[B]`` bool; False rows are padding.

  Returns:
    :class:`ProbeReport`.

  Raises:
    ValueError: for ``tf.SparseTensor`` leaves (no engine supports them).
  """
  leaves = _leaves((x, y))
  if not leaves:
    raise ValueError("probe_interaction needs at least one input tensor.")
  _vectorized.check_no_sparse_inputs((x, y), "DP training")
  leaves = [_as_tensor(t) for t in leaves]
  x = _map(_as_tensor, x)
  y = _map(_as_tensor, y)
  batch = _num_rows(leaves[0])
  perturbed, observers = _split_rows(batch, mask)
  can_test = tf.logical_and(tf.reduce_any(perturbed), tf.reduce_any(observers))

  def with_rows():
    source = tf.cast(tf.argmax(tf.cast(observers, tf.int32)), tf.int32)  # first observer
    differs = tf.zeros([batch], tf.bool)
    for t in _leaves((x, y)):
      ref = tf.gather(t, source[None])
      differs = tf.logical_or(differs, _row_differs(t, ref))
    changed = tf.reduce_any(tf.logical_and(perturbed, differs))
    return tf.cond(changed, lambda: _probe(forward_losses, x, y, perturbed, observers, source),
                   _untested)

  tested, value, grad, reproducible = tf.cond(can_test, with_rows, _untested)
  return ProbeReport(tested=tested, value_score=value, gradient_score=grad,
                     reproducible=reproducible)


def _probe(forward_losses, x, y, perturbed, observers, source):
  batch = tf.shape(perturbed)[0]
  index = tf.where(perturbed, source, tf.range(batch))
  x_new = _map(lambda t: tf.gather(t, index), x)
  y_new = _map(lambda t: tf.gather(t, index), y)
  floating = [t for t in _leaves((x, y)) if t.dtype.is_floating]
  # A ragged leaf is differentiated through its values (the tensor the model reads).
  floats = [t.flat_values if isinstance(t, tf.RaggedTensor) else t for t in floating]

  with tf.GradientTape(watch_accessed_variables=False, persistent=False) as tape:
    for t in floats:
      tape.watch(t)
    base = tf.cast(tf.reshape(forward_losses(x, y), [-1]), tf.float32)
    kept = tf.logical_and(observers, tf.math.is_finite(base))
    target = tf.reduce_sum(tf.where(kept, base, 0.0))
  grads = tape.gradient(target, floats) if floats else []
  leak = tf.constant(0.0)
  own = tf.constant(0.0)
  for t, g in zip(floating, grads):
    if g is None:
      continue
    g = tf.abs(tf.cast(tf.convert_to_tensor(g), tf.float32))
    g = tf.where(tf.math.is_finite(g), g, 0.0)
    rows = _row_max(_dense_rows(t.with_flat_values(g))[0] if isinstance(t, tf.RaggedTensor)
                    else g)
    leak = tf.maximum(leak, tf.reduce_max(tf.where(perturbed, rows, 0.0)))
    own = tf.maximum(own, tf.reduce_max(tf.where(observers, rows, 0.0)))
  gradient_score = leak / (GRADIENT_RTOL * own + _TINY)

  with tf.control_dependencies([base, leak, own]):  # one pass at a time (memory)
    repeat = tf.cast(tf.reshape(forward_losses(x, y), [-1]), tf.float32)
  with tf.control_dependencies([repeat]):
    changed = tf.cast(tf.reshape(forward_losses(x_new, y_new), [-1]), tf.float32)
  scale = tf.where(tf.math.is_finite(base), tf.abs(base), 0.0)
  count = tf.maximum(tf.reduce_sum(tf.cast(observers, tf.float32)), 1.0)
  mean_scale = tf.reduce_sum(tf.where(observers, scale, 0.0)) / count
  tol = VALUE_RTOL * (scale + mean_scale) + _TINY
  noise = _absdiff(base, repeat)
  deviation = _absdiff(base, changed)
  reproducible = tf.reduce_all(tf.logical_or(tf.logical_not(observers), noise <= tol))
  ratio = tf.math.divide_no_nan(deviation, tol + NOISE_FACTOR * noise)
  ratio = tf.where(tf.math.is_nan(ratio), tf.constant(float("inf")), ratio)
  value_score = tf.where(reproducible, tf.reduce_max(tf.where(observers, ratio, 0.0)), 0.0)
  return tf.constant(True), value_score, gradient_score, reproducible


def interaction_deviation(forward_losses, x, y, mask=None) -> tf.Tensor:
  """Scalar interaction score of one batch: > 1 means the examples interact, 0 if untested.

  See :func:`probe_interaction` for the arguments.
  """
  report = probe_interaction(forward_losses, x, y, mask)
  return tf.where(report.tested, report.score, 0.0)


def model_forward_losses(model, loss_fn, training=True):
  """``fn(x, y) -> [B]``: ``loss_fn(y, model(x, training))`` with every random op frozen.

  :func:`tf_dpnsgd.forward_checks.frozen_forward_losses`: repeated calls draw
  the same random values (Keras seed generators and TensorFlow random ops; row
  ``i``'s dropout mask depends only on the seeds and the batch shape), no seed
  advances, and a pass that writes any other variable raises
  :class:`~tf_dpnsgd.forward_checks.StateWriteError` while tracing.
  """
  return forward_checks.frozen_forward_losses(model, loss_fn, training)


def assert_no_interaction(model, x, y, mask=None, loss_fn=None) -> None:
  """Eager check of one batch; raises :class:`ExampleInteractionError` if examples interact.

  Raises :class:`~tf_dpnsgd.forward_checks.ForwardNotReproducibleError` when the
  forward pass is not reproducible with every random op frozen (the check
  cannot run).

  Args:
    model: a Keras model (called with ``training=True``).
    x, y, mask: one batch (as in :func:`probe_interaction`).
    loss_fn: ``fn(y_true, y_pred) -> [B]``; default the compiled DP model's.
  """
  loss_fn = loss_fn or getattr(model, "_dp_loss_fn", None)
  if loss_fn is None:
    raise ValueError("Pass `loss_fn`, or compile the DP model first.")
  report = probe_interaction(model_forward_losses(model, loss_fn), x, y, mask)
  if bool(report.interacting):
    raise ExampleInteractionError(interaction_message(f"model '{model.name}'"))
  if bool(report.refused):
    raise forward_checks.ForwardNotReproducibleError(
        forward_checks.not_reproducible_message(model.name))


# --- integration with the DP train step ------------------------------------------------
def _mask_of(sample_weight):
  if isinstance(sample_weight, dict) and ledger_lib.DP_MASK_KEY in sample_weight:
    return sample_weight[ledger_lib.DP_MASK_KEY]
  return None  # anything else is rejected by the train step itself


def limit_rows(x, y, mask, size):
  """At most ``size`` rows of the batch: padding rows (up to half) and valid rows.

  With ``physical_batch_size`` the engines never run more rows at once, so
  the probe (three forward passes and one input-gradient pass) stays within
  the memory the training step needs, and still sees padding rows.
  """
  batch = _num_rows(_leaves((x, y))[0])
  valid = tf.ones([batch], tf.bool) if mask is None else tf.reshape(tf.cast(mask, tf.bool), [-1])
  padding = tf.reshape(tf.where(tf.logical_not(valid)), [-1])
  padding = padding[:tf.minimum(tf.size(padding), size // 2)]
  real = tf.reshape(tf.where(valid), [-1])
  real = real[:size - tf.size(padding)]
  index = tf.sort(tf.concat([real, padding], axis=0))
  take = lambda t: tf.gather(t, index)  # noqa: E731
  return _map(take, x), _map(take, y), None if mask is None else take(valid)


def _runs_eagerly(strategy) -> bool:
  """Whether ``strategy.run`` runs eagerly as it does in a graph: TensorFlow's default
  strategy (no ``tf.distribute``) or a ``OneDeviceStrategy``. Any other strategy, one
  replica or not, keeps the compiled probe (eager ``MirroredStrategy`` runs a thread per
  replica and warns; TPU and multi-worker strategies need a graph)."""
  default = type(strategy).__name__ == "_DefaultDistributionStrategy"  # unknown: compiled
  return strategy.num_replicas_in_sync == 1 and (
      default or isinstance(strategy, tf.distribute.OneDeviceStrategy))


def make_probe_function(model):
  """``fn(data) -> (tested, refused)``, per replica: eager without ``tf.distribute``, else
  compiled.

  ``refused`` (:attr:`ProbeReport.refused`): the examples interact, or the
  value check could not run (forward pass not reproducible).

  The probe runs once per ``compile``. Without ``tf.distribute`` (or under a
  ``OneDeviceStrategy``: :func:`_runs_eagerly`) it runs eagerly: its
  bookkeeping (row split, tolerances, a few dozen small ops) costs less
  eagerly than tracing it, its ``tf.cond`` branches and the enclosing graph
  for a single call (about 2.5x less CPU on a tiny model), and the forward
  passes are compiled functions anyway, with frozen seeds (:func:`model_forward_losses`:
  the base and repeat passes each traced afresh, the changed rows' pass rerunning the
  repeat's trace where its graph repeats), so the values, the gradient and the
  verdict are those of the compiled probe. Under any other strategy it stays
  one ``tf.function`` (``autograph=False``): ``strategy.run`` with a
  cross-replica ``all_reduce`` is traced. The probe is never XLA-compiled
  (``jit_compile`` applies to the train step only), eager or not.
  """
  strategy = model.distribute_strategy
  limit = getattr(model, "physical_batch_size", None)

  def replica_fn(data):
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    mask = _mask_of(sample_weight)
    if limit:
      x, y, mask = limit_rows(x, y, mask, limit)
    report = probe_interaction(model_forward_losses(model, model._dp_loss_fn), x, y, mask)
    ctx = tf.distribute.get_replica_context()
    if ctx is None or ctx.num_replicas_in_sync == 1:
      return report.tested, report.refused
    # One verdict for all replicas and workers: a worker that alone kept probing (or
    # raised) would run other collectives than the rest and stall or corrupt the job.
    counts = ctx.all_reduce(tf.distribute.ReduceOp.SUM, tf.cast(
        tf.stack([report.tested, report.refused]), tf.float32))  # float: device memory
    return counts[0] > 0, counts[1] > 0

  def probe(data):
    return strategy.run(replica_fn, args=(data,))

  if model.run_eagerly or _runs_eagerly(strategy):
    return probe
  function = tf.function(probe, autograph=False)
  # One probe per compile, called (and traced) once: TensorFlow's frequent-retracing
  # detector, keyed on this code object (shared by every model's probe), would warn
  # "triggered tf.function retracing" from the fifth private model in a process on,
  # about tracings that are one per model by design. (Saved functions that TF loads
  # set the same flag.)
  function._omit_frequent_tracing_warning = True  # pylint: disable=protected-access
  return function
