"""Host-side and static checks of the training forward pass, run before any update.

The DP step trains only on forward passes it can verify. Three properties are
checked on the host on a real batch (the DP model's guard runs
:func:`check_forward_pass` on the first batch after each ``compile`` and on
every batch whose shape signature it has not seen, :class:`ForwardVerifier`),
each by tracing or running the pass outside the compiled step, so no compiler
can drop them, and each raising a ``ValueError`` subclass that says what to do:

1. **No state writes** (:func:`check_no_state_writes`): the training forward
   pass and the per-example loss, traced in a graph (not run), assign no
   variable except Keras' seed-generator states (Keras assignments recorded by
   a ``keras.StatelessScope``; raw TensorFlow writes found as ops on resources,
   in nested functions and loops too: :mod:`tf_dpnsgd.per_example.stateless`).
   The engines enforce the same rule themselves while the step is traced, so
   even a skipped check cannot let a write through in ``fit``.
2. **Static step structure** (:func:`verify_step_structure`): the DP step's
   engine is traced (not run, not XLA) with every shape static, the batch's
   own, so the engines' structural checks (the layer-wise engine's "every
   registered layer sees one row per example", ``num_microbatches`` divides the
   batch) are decided in Python at trace time. Inside the step they are
   in-graph assertions for batches of dynamic size, which XLA
   (``jit_compile=True``) removes: a model folding tokens into the batch axis
   (``[B, T, d] -> [B*T, d]`` before a Dense) would have each token clipped
   separately. A check that cannot be decided statically is refused.
3. **Reproducible forward pass** (:func:`check_reproducible`): two passes with
   every random op frozen (:func:`frozen_forward_losses`) give the same
   per-example losses. The interaction probe
   (:mod:`tf_dpnsgd.interaction`) compares losses of such passes; if they are
   not reproducible the probe cannot tell interaction from noise, so training
   is refused instead of skipping the value check (fail closed).

Freezing every random op (:func:`frozen_forward_losses`): Keras seed
generators (the model's and Keras' global one) are mapped to their current
state in a ``keras.StatelessScope``; TensorFlow's own random ops (stateful
``tf.random.*`` / ``tf.nn.dropout`` with or without seeds, stateless ops
seeded by constants) get the same op seeds in every pass, because each pass is
traced afresh as its own function with a fixed graph-level seed
(:data:`PROBE_SEED`, set only inside that trace; the user's global seed is not
touched), so every random op gets the same (graph seed, op id) pair and its
own kernel, and draws the same values in every pass. (A pass after the second reruns
the second's trace where its graph holds no stateful op that could draw anew:
:func:`frozen_forward_losses`.)

What is not detected or not frozen: random values fixed when a pass is traced
(``numpy.random`` in ``call``) and random ops inside a ``tf.function`` the
model reuses across calls differ between passes: such models are refused as
not reproducible, not silently accepted. Non-deterministic kernels (GPU
atomics) pass if their differences stay within :data:`REPRODUCIBLE_RTOL`.
The checks see the batches they are given; a model that changes behaviour
later (Python state that changes after the first steps) is not seen.
State writes in eager mode (``run_eagerly=True``) are caught by check 1's
trace before the step, not by the engines.
"""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

from tf_dpnsgd import ledger as ledger_lib
from tf_dpnsgd.per_example import layerwise
from tf_dpnsgd.per_example import stateless
from tf_dpnsgd.per_example.stateless import StateWriteError

PROBE_SEED = 1_000_003
"""Graph-level seed of every frozen pass (any fixed value; only inside its own trace)."""
REPRODUCIBLE_RTOL = 1e-5
"""Two frozen passes may differ by this fraction of ``|loss| + mean |loss|``."""
_TINY = 1e-30


class ForwardNotReproducibleError(ValueError):
  """Two training forward passes with every random op frozen gave different losses."""


def not_reproducible_message(model_name: str) -> str:
  return (
      f"The training forward pass of model '{model_name}' is not reproducible: two passes on "
      "the same batch, with every Keras seed generator and every TensorFlow random op "
      "frozen, gave different per-example losses. The check that examples do not interact "
      "compares such passes and cannot run, so training is refused (fail closed). Fix: draw "
      "randomness with Keras random layers (keras.layers.Dropout, GaussianNoise) or "
      "keras.random ops seeded by a keras.random.SeedGenerator attached to the layer; do "
      "not use numpy.random or a reused tf.function or tf.random.Generator in call(); if a "
      "kernel is non-deterministic, enable tf.config.experimental.enable_op_determinism().")


# --- the batch as one replica sees it -----------------------------------------------------
def local_batch(data, strategy=None):
  """``(x, y, mask)`` of the first local replica's shard of a training batch.

  Args:
    data: a batch as the train function receives it: ``(x, y)`` or ``(x, y,
      sample_weight)``, leaves possibly distributed values.
    strategy: the ``tf.distribute`` strategy of distributed leaves (the
      model's ``distribute_strategy``).

  Returns:
    ``x``, ``y`` as tensors (nested structures kept) and the padding mask
    (``sample_weight["dp_mask"]``) or None.
  """
  def local(value):
    if isinstance(value, tf.distribute.DistributedValues):
      return (strategy or tf.distribute.get_strategy()).experimental_local_results(value)[0]
    return value

  data = tf.nest.map_structure(local, data)
  x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
  mask = sample_weight.get(ledger_lib.DP_MASK_KEY) if isinstance(sample_weight, dict) else None
  convert = lambda t: t if t is None or isinstance(t, tf.__internal__.CompositeTensor) \
      else tf.convert_to_tensor(t)  # noqa: E731
  return (tf.nest.map_structure(convert, x), tf.nest.map_structure(convert, y),
          None if mask is None else tf.convert_to_tensor(mask))


def shape_signature(data, strategy=None) -> tuple:
  """Hashable structure, shapes and dtypes of a batch (first local replica)."""
  x, y, mask = local_batch(data, strategy)
  leaves = tf.nest.flatten((x, y, mask))
  layout = str(tf.nest.map_structure(lambda _: 0, (x, y, mask)))
  return (layout,) + tuple((type(t).__name__, tuple(t.shape.as_list()), t.dtype.name)
                           for t in leaves if t is not None)


def _loss_fn(model, loss_fn):
  loss_fn = loss_fn or getattr(model, "_dp_loss_fn", None)
  if loss_fn is None:
    raise ValueError("Pass `loss_fn`, or compile the DP model first.")
  return loss_fn


def _first_rows(structure, n):
  return tf.nest.map_structure(lambda t: None if t is None else t[:n], structure)


# --- 3. frozen randomness ------------------------------------------------------------------
def frozen_forward_losses(model, loss_fn, training=True):
  """``fn(x, y) -> [B]``: ``loss_fn(y, model(x, training))`` with every random op frozen.

  The pass is a ``tf.function`` (nested in the caller's graph, or run at once when eager)
  traced with the graph-level seed :data:`PROBE_SEED` and the model's seed generators (and
  Keras' global one) mapped to their current states, so equal inputs draw equal random
  values (see the module docstring). No state changes: seeds are not advanced, and any
  other write raises :class:`StateWriteError` while tracing.

  The first two calls are traced afresh, each with the same op seeds and its own kernels:
  randomness fixed while tracing (``numpy.random`` in ``call``) then differs between them,
  and the comparison that follows refuses (:func:`check_reproducible`; the interaction
  probe's base and repeat passes). From the third call on (the probe's pass on changed
  rows), the second call's trace is run again when its graph is repeatable (no stateful op
  but reads, assertions and control flow:
  :func:`tf_dpnsgd.per_example.stateless.unrepeatable_ops`; a new input signature's trace
  is checked on its first call): it draws what its first run drew. A graph with a stateful
  random op (or any stateful op not known to repeat) is traced afresh for every call.
  """

  def run(x, y):
    if not tf.executing_eagerly():  # (run_functions_eagerly: not frozen, never the global seed)
      tf.random.set_seed(PROBE_SEED)  # inside a trace: this function graph's seed only
    with stateless.NoStateWrites(model, advance_seeds=False):
      return loss_fn(y, model(x, training=training))

  def traced():
    function = tf.function(run, autograph=False)
    # Traced afresh where a graph is not repeatable (one trace per pass): called eagerly (the
    # probe with one replica, check_reproducible), TensorFlow's frequent-retracing
    # detector, keyed on `run`'s code object, would warn after a few passes.
    function._omit_frequent_tracing_warning = True  # pylint: disable=protected-access
    return function

  calls = 0
  repeatable = None  # the function of the latest trace, if its graph is repeatable

  def forward(x, y):
    nonlocal calls, repeatable
    if tf.config.functions_run_eagerly():
      return traced()(x, y)
    calls += 1
    function = repeatable if calls > 2 and repeatable is not None else traced()
    traces = function.experimental_get_tracing_count()
    out = function(x, y)
    if function.experimental_get_tracing_count() != traces:  # this call traced: check it
      graph = function.get_concrete_function(x, y).graph
      repeatable = None if stateless.unrepeatable_ops(graph.get_operations(), graph) else function
    return out

  return forward


def check_reproducible(model, data, loss_fn=None) -> None:
  """Raises :class:`ForwardNotReproducibleError` unless two frozen passes agree.

  Runs :func:`frozen_forward_losses` twice on the host on the batch (at most
  ``physical_batch_size`` rows, the memory of one step) and compares the
  per-example losses: equal non-finite pattern and ``|a - b| <=
  REPRODUCIBLE_RTOL * (|a| + mean |a|)``.

  Args:
    model: a compiled DP model (or any Keras model, with ``loss_fn``).
    data: a training batch (see :func:`local_batch`).
    loss_fn: ``fn(y_true, y_pred) -> [B]``; default the DP model's.
  """
  loss_fn = _loss_fn(model, loss_fn)
  x, y, _ = local_batch(data, model.distribute_strategy)
  limit = getattr(model, "physical_batch_size", None)
  if limit:
    x, y = _first_rows(x, limit), _first_rows(y, limit)
  forward = frozen_forward_losses(model, loss_fn)
  a = np.reshape(np.asarray(forward(x, y), np.float64), [-1])
  b = np.reshape(np.asarray(forward(x, y), np.float64), [-1])
  if not losses_agree(a, b):
    raise ForwardNotReproducibleError(not_reproducible_message(model.name))


def losses_agree(a, b, rtol: float = REPRODUCIBLE_RTOL) -> bool:
  """Whether two per-example loss vectors agree (see :func:`check_reproducible`).

  >>> losses_agree(np.array([1.0, np.inf]), np.array([1.0 + 1e-7, np.inf]))
  True
  >>> losses_agree(np.array([1.0, 2.0]), np.array([1.0, 2.1]))
  False
  """
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  if a.shape != b.shape:
    return False
  fa, fb = np.isfinite(a), np.isfinite(b)
  if not np.array_equal(fa, fb) or not np.array_equal(a[~fa], b[~fb], equal_nan=True):
    return False
  if not fa.any():
    return True
  scale = np.abs(a[fa])
  return bool(np.all(np.abs(a[fa] - b[fb]) <= rtol * (scale + scale.mean()) + _TINY))


# --- 1. state writes --------------------------------------------------------------------------
def _specs(structure):
  return tf.nest.map_structure(lambda t: None if t is None else tf.type_spec_from_value(t),
                               structure)


def check_no_state_writes(model, data, loss_fn=None) -> None:
  """Raises :class:`StateWriteError` if the training forward pass writes model state.

  Traces (never runs) ``loss_fn(y, model(x, training=True))`` for the batch's
  shapes and refuses any variable write other than Keras' seed-generator
  states (see :mod:`tf_dpnsgd.per_example.stateless`).

  Args:
    model, data, loss_fn: as :func:`check_reproducible`.
  """
  loss_fn = _loss_fn(model, loss_fn)
  x, y, _ = local_batch(data, model.distribute_strategy)

  def trace(x, y):
    with stateless.NoStateWrites(model, advance_seeds=False):
      return loss_fn(y, model(x, training=True))

  tf.function(trace, autograph=False).get_concrete_function(*_specs((x, y)))


# --- 2. static structure -------------------------------------------------------------------
def verify_step_structure(model, data) -> None:
  """Traces the DP step's engine on the batch with static shapes; raises what it refuses.

  The engine (as compiled: ``per_example``, ``physical_batch_size``,
  ``num_microbatches``, loss scale) is traced, not run and not compiled by
  XLA, for the exact shapes of the batch, under
  :func:`tf_dpnsgd.per_example.layerwise.static_batch_checks_only`: every
  structural check is decided in Python, and one that cannot be decided
  statically is refused. Under ``jit_compile=True`` call it for every new
  batch shape signature (XLA compiles one program per signature too).

  Args:
    model: a compiled DP model (``tf_dpnsgd.DPModel`` / ``make_private``).
    data: a training batch (see :func:`local_batch`).

  Raises:
    tf_dpnsgd.per_example.UnsupportedLayerError: a registered layer sees a
      tensor whose first axis is not the batch (e.g. tokens folded into the
      batch axis), or this cannot be decided statically.
    ValueError: ``num_microbatches`` does not divide the batch; or any other
      refusal of the engine while tracing (e.g. :class:`StateWriteError`).
  """
  if getattr(model, "_dp_engine", None) is None:
    raise ValueError(f"Compile model '{model.name}' with a DP optimizer first.")
  x, y, mask = local_batch(data, model.distribute_strategy)
  microbatches = model._microbatches()

  def trace(x, y, mask):
    return model._contributions(x, y, mask, microbatches).summed

  with layerwise.static_batch_checks_only():
    tf.function(trace, autograph=False, jit_compile=False).get_concrete_function(
        *_specs((x, y, mask)))


# --- all of them ------------------------------------------------------------------------------
def check_forward_pass(model, data) -> None:
  """Checks 1-3 of the module docstring on one batch, on the host; None when all pass.

  Raises:
    StateWriteError, UnsupportedLayerError, ForwardNotReproducibleError (all
    ``ValueError``): see :func:`check_no_state_writes`,
    :func:`verify_step_structure`, :func:`check_reproducible`.
  """
  check_no_state_writes(model, data)
  verify_step_structure(model, data)
  check_reproducible(model, data)


class ForwardVerifier:
  """Runs :func:`check_forward_pass` once per batch shape signature (plain Python, never saved).

  Create one per ``compile`` (a new compile may change the engine or the
  loss) and call it on every batch before the step; batches whose signature
  passed return at once.
  """

  def __init__(self, model):
    self._model = model
    self._verified = set()

  def __call__(self, data) -> None:
    signature = shape_signature(data, self._model.distribute_strategy)
    if signature in self._verified:
      return
    check_forward_pass(self._model, data)
    self._verified.add(signature)


__all__ = ["ForwardNotReproducibleError", "ForwardVerifier", "PROBE_SEED", "REPRODUCIBLE_RTOL",
           "StateWriteError", "check_forward_pass", "check_no_state_writes",
           "check_reproducible", "frozen_forward_losses", "local_batch", "losses_agree",
           "shape_signature", "verify_step_structure"]
