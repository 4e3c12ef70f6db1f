"""The layer-wise engine: per-example norms and the weighted sum from one forward/backward.

This module is long (about 660 lines): the capture, the backward, the norms and
both weighted-sum modes (book-keeping, two passes) share one capture's state.

DP-NSGD and DP-SGD need each unit's gradient norm ``||g_u||`` and then
``sum_u h_u g_u``, not the per-unit gradients themselves. For the layers with
a rule in :mod:`tf_dpnsgd.per_example.registry` both follow from each layer's
input and the gradient of the loss with respect to its output:

1. **forward** (one pass, ``training=True``): while the model runs, every
   registered layer's ``call`` is routed through its rule, which recomputes
   the layer's output and marks ("probes") the tensors it needs the gradient
   of (e.g. a Dense layer's pre-activation ``z``). The routing is a context
   manager around this one forward pass (:class:`CallCapture`): it sets an
   instance attribute ``call`` on the registered layers and removes it on
   exit, even on error; nothing in Keras or the model is modified after it.
2. **backward** (one pass): the gradient of ``sum_i loss_i`` with respect to
   the probes. Because examples do not interact (BatchNorm is rejected by
   :func:`tf_dpnsgd.validate_layers`), row ``i`` of each is example ``i``'s
   own gradient. No weight gradient is computed here.
3. **norms**: per layer and variable, an upper bound of ``||g_i||^2`` by the
   ghost-norm identity or by materialising the per-example gradient,
   whichever is cheaper for its shapes (:mod:`tf_dpnsgd.per_example.factored`):
   signed sums (ghost norms, cross terms of shared weights) in float64 with a
   rigorous rounding-error bound, and units whose terms cancel recomputed
   from their float64 materialised gradient; summed over variables in
   float64, square-rooted and rounded up to float32.
4. **weighted sum** (book-keeping): ``sum_i h_i g_i`` per variable from the
   same captured tensors, with ``h = transform.factors(norms, mask)``; where
   step 3 materialised and kept the per-example gradients (Dense/EinsumDense
   kernels, within the keep budget, longest sequences first:
   :func:`~tf_dpnsgd.per_example.factored.plan_keeping`), from those, which
   saves the ``T p q`` product of a plain weight gradient.

Book-keeping holds every layer's output gradient from the backward pass until
all norms exist. ``mode="two_pass"`` (``per_example="two_pass"``) holds none:
steps 1-3 run with nothing kept (each layer's tensors are freed once its norm
is computed), then a second forward and backward pass recomputes the same
tensors (same weights, inputs and random numbers) and each layer's weighted
sum is built as soon as its output gradient exists, as a plain step builds its
weight gradient (:func:`_second_pass`). ``mode="auto"`` picks two passes where
the output gradients book-keeping would hold exceed the keep budget
(:func:`choose_mode`). The result is the same (tested against single-example
loops); the guarantees below hold for both (the second pass's sum is computed
by the same formulas from bit-identical tensors; see :func:`_second_pass`).

Units: without ``num_microbatches`` a unit is an example. With ``m``
microbatches, unit ``u`` is the gradient of the mean loss of ``B/m``
consecutive examples: the captured tensors are regrouped so that the examples
of a microbatch become positions of one unit, which is exact for the factored
representations; convolutions materialise their per-example gradients and
add them per unit in float64 (:func:`~tf_dpnsgd.per_example.factored.materialized_units`).
With ``loss_weights`` (user-level units, :mod:`tf_dpnsgd.per_example.units`) the
unit loss is ``sum_i w_i loss_i`` over the unit's rows instead of their mean
(rows of weight 0 selected away), and ``unit_mask`` says which units count.

Formal guarantees (as for every engine, see :mod:`tf_dpnsgd.transforms`), for
every finite input whatever its magnitude:

==================================  ==================================================
unit                                contribution to ``summed``
==================================  ==================================================
finite norm                         ``h_u g_u`` with ``||h_u g_u|| <= transform.sensitivity``
``g_u = 0``                         exactly 0 (factor ``1/r`` resp. 1)
terms of ``g_u`` cancel (a layer    norm and contribution from the float64
called twice on nearly equal        materialised ``g_u``: never understated
inputs, tied weights)
norm beyond float32 (``> 3.4e38``)  exactly 0 (norm ``inf``, factor 0)
NaN/inf gradient or norm            exactly 0 (its captured rows are zeroed with ``tf.where``)
masked out (padding)                exactly 0
==================================  ==================================================

``norms`` are upper bounds of the exact norms of the per-unit gradients the
weighted sum is computed from (float64 error bounds, no clamping of negative
estimates, rounded up to float32); the details and the one remaining float32
effect (rounding of the book-keeping sum, at most ``~6e-5`` of a
well-conditioned unit's contribution per rounding step) are in
:mod:`tf_dpnsgd.per_example.factored`, "Formal guarantees".

Limits (each fails loudly): every trainable variable must belong to a layer
with a rule (else :class:`~tf_dpnsgd.per_example.registry.UnsupportedLayerError`
naming the layers; ``per_example="auto"`` then picks the vectorized engine);
a registered layer must see the batch on axis 0 (a layer folding time into
the batch is caught by a shape check); a registered layer's variables must
only be used inside that layer's ``call`` (true of Keras and keras-hub
layers; a custom layer reading another layer's kernel directly is caught on
the traced graph by :func:`check_variable_uses`, i.e. in any ``fit``, but not
in eager mode).
"""

from __future__ import annotations

import contextlib
import logging
import threading

import tensorflow as tf
from tensorflow.python.framework import config as tf_config  # is_op_determinism_enabled

from tf_dpnsgd.per_example import dropout as dropout_lib
from tf_dpnsgd.per_example import factored
from tf_dpnsgd.per_example import registry as registry_lib
from tf_dpnsgd.per_example import stateless
from tf_dpnsgd.per_example import layers as _builtin_rules  # noqa: F401  (registers rules)
from tf_dpnsgd.per_example.base import CallOverrides, EngineOutput
from tf_dpnsgd.per_example.vectorized import (batch_size_of, check_mask_and_microbatches,
                                              check_microbatches, check_no_sparse_inputs)

_log = logging.getLogger(__name__)


class _Call:
  __slots__ = ("layer", "probes", "finish")

  def __init__(self, layer, probes, finish):
    self.layer, self.probes, self.finish = layer, probes, finish


# Routing state shared by all captures. Layers are shared between the replica
# threads of a tf.distribute strategy, so the instance attribute is installed
# once (reference counted under a lock) and dispatches to the capture that is
# active in the calling thread; a call from any other thread runs the layer's
# own `call` unchanged.
_ROUTES = CallOverrides()
_ACTIVE = threading.local()


def _router(layer, original):
  def call(*args, **kwargs):
    stack = getattr(_ACTIVE, "captures", None)
    capture = stack[-1] if stack else None
    if capture is None or id(layer) not in capture._rules:
      return original(*args, **kwargs)
    return capture._route(layer, original, args, kwargs)

  return call


class CallCapture:
  """Context manager routing registered layers' ``call`` through their rules.

  On entry every planned layer gets an instance attribute ``call`` (set with
  ``object.__setattr__``, bypassing Keras' attribute tracking) that shadows
  its class's ``call``; on exit it is removed again (or the previous instance
  attribute is restored), also when the forward pass raises. While the
  context is active in a thread, calls of those layers from that thread go to
  their rules; calls from other threads are not affected.

  Args:
    plans: ``[(layer, rule)]`` from :func:`registry.coverage`.
    tape: the ``tf.GradientTape`` recording the forward pass; probed tensors
      are watched on it.

  Attributes:
    calls: one record per layer call, in call order.
  """

  def __init__(self, plans, tape):
    self._plans = list(plans)
    self._rules = {id(layer): rule for layer, rule in self._plans}
    self._tape = tape
    self._depth = 0
    self._installed = []
    self._graph = None if tf.executing_eagerly() else tf.compat.v1.get_default_graph()
    self._first_op = self._num_ops()
    self._last_op = None
    self._intervals = []  # (layer, first op index, end op index) of each routed call
    self.calls: list[_Call] = []

  def _route(self, layer, original, args, kwargs):
    if self._depth:
      raise registry_lib.UnsupportedLayerError(
          f"Layer '{layer.name}' ({type(layer).__name__}) was called inside another "
          "registered layer's rule: registered layers must not be nested.")
    probes = []

    def probe(t):
      self._tape.watch(t)
      probes.append(t)
      return t

    first_op = self._num_ops()
    self._depth += 1
    try:
      outputs, finish = self._rules[id(layer)].capture(layer, original, args, kwargs, probe)
    finally:
      self._depth -= 1
    if first_op is not None:
      self._intervals.append((layer, first_op, self._num_ops()))
    self.calls.append(_Call(layer, probes, finish))
    return outputs

  def _num_ops(self):
    return None if self._graph is None else len(self._graph.get_operations())

  def __enter__(self):
    self._installed = _ROUTES.install(
        [layer for layer, _ in self._plans], lambda layer: _router(layer, layer.call))
    if not hasattr(_ACTIVE, "captures"):
      _ACTIVE.captures = []
    _ACTIVE.captures.append(self)
    return self

  def __exit__(self, *exc):
    self._last_op = self._num_ops()
    _ACTIVE.captures.remove(self)
    _ROUTES.uninstall(self._installed)
    return False


_NON_READING_OPS = frozenset({"VarIsInitializedOp", "VariableShape", "AssignVariableOp",
                              "AssignAddVariableOp", "AssignSubVariableOp", "DestroyResourceOp"})


def _resolve_handle(handle, graph):
  """The tensor through which ``graph`` reads the (eager) variable ``handle``, or None."""
  captures = getattr(graph, "captures", None)
  if captures is None:
    return None
  inside = {id(external): internal for external, internal in captures}
  if id(handle) in inside:
    return inside[id(handle)]
  outer = getattr(graph, "outer_graph", None)
  outer_handle = _resolve_handle(handle, outer) if outer is not None else None
  return inside.get(id(outer_handle)) if outer_handle is not None else None


def _internal_handles(graph, variables):
  """``{id(handle tensor in graph): variable}`` for the variables ``graph`` reads."""
  handles = {}
  for v in variables:
    try:
      handle = v.handle
    except (AttributeError, ValueError, TypeError):
      continue
    internal = _resolve_handle(handle, graph)
    if internal is not None:
      handles[id(internal)] = v
  return handles


def check_variable_uses(capture: CallCapture, plans) -> None:
  """Raises if a covered variable was used outside the calls of the layers claiming it.

  A rule accounts only for uses of its variables inside its layer's ``call``;
  any other use (e.g. a custom layer multiplying by another layer's kernel)
  would make the per-example norm too small, and the clipping/normalization
  bound would not hold. Checked on the traced graph (the forward pass's ops
  that read each variable); not available in eager mode.

  Raises:
    UnsupportedLayerError: naming the variable and the op that used it.
  """
  graph = capture._graph
  if graph is None or capture._last_op is None:
    return
  claims = {}
  for layer, rule in plans:
    for v in registry_lib.trainable(rule.variables(layer)):
      claims.setdefault(id(v), set()).add(id(layer))
  handles = _internal_handles(graph, [v for layer, rule in plans
                                      for v in registry_lib.trainable(rule.variables(layer))])
  if not handles:
    return
  ops = graph.get_operations()[capture._first_op:capture._last_op]
  owner = [None] * len(ops)
  for layer, first, end in capture._intervals:
    for i in range(max(first - capture._first_op, 0), end - capture._first_op):
      owner[i] = id(layer)
  for i, op in enumerate(ops):
    if op.type in _NON_READING_OPS:
      continue
    for t in op.inputs:
      v = handles.get(id(t))
      if v is not None and owner[i] not in claims[id(v)]:
        raise registry_lib.UnsupportedLayerError(
            f"Variable '{getattr(v, 'path', v.name)}' is used by op '{op.name}' outside the "
            "call of the layer whose layer-wise rule accounts for it (e.g. a layer reusing "
            "another layer's kernel). Per-example norms would be too small. Use "
            "per_example='vectorized', or register a rule for the layer that uses it.")


_STATIC_ONLY = threading.local()


@contextlib.contextmanager
def static_batch_checks_only():
  """Inside, the batch-axis checks never become in-graph assertions: undecided ones raise.

  Used by :func:`tf_dpnsgd.forward_checks.verify_step_structure`, which traces
  the engine on the host with the batch's static shapes: XLA
  (``jit_compile=True``) removes in-graph assertions, so a check that cannot
  be decided while tracing is refused (fail closed). Thread local.
  """
  previous = getattr(_STATIC_ONLY, "on", False)
  _STATIC_ONLY.on = True
  try:
    yield
  finally:
    _STATIC_ONLY.on = previous


def _batch_checks(calls, batch):
  """Static or in-graph checks that every probe has the batch on axis 0.

  Decided in Python when the probe's first axis and the batch size are both
  static (a mismatch raises while tracing); otherwise an in-graph assertion,
  or, inside :func:`static_batch_checks_only`, an error.
  """
  static_batch = tf.get_static_value(batch)
  static_only = getattr(_STATIC_ONLY, "on", False)
  checks = []
  for c in calls:
    for p in c.probes:
      lead = p.shape[0] if len(p.shape) else None
      message = (f"Layer '{c.layer.name}' ({type(c.layer).__name__}) was called on a tensor "
                 "whose first axis is not the batch (e.g. inside TimeDistributed, or after a "
                 "reshape that folds tokens or time into the batch axis): the layer-wise "
                 "engine needs one row per example, else each row would be clipped as an "
                 "example of its own. Use per_example='vectorized' (or keep the batch axis).")
      if lead is not None and static_batch is not None:
        if lead != static_batch:
          raise registry_lib.UnsupportedLayerError(message + f" Got {lead} rows for batch "
                                                   f"{static_batch}.")
        continue
      if static_only:
        raise registry_lib.UnsupportedLayerError(
            message + f" Its first axis ({lead}) could not be compared with the batch size "
            f"({static_batch}) while tracing with the batch's static shapes (a data-dependent "
            "shape), so it cannot be verified outside the compiled step.")
      checks.append(tf.debugging.assert_equal(tf.shape(p)[0], tf.cast(batch, tf.int32),
                                              message=message))
  return checks


def _scope_name(name: str) -> str:
  return "".join(ch if ch.isalnum() or ch in "._-" else "_" for ch in name) or "layer"


def _var_scope(v) -> str:
  return _scope_name(getattr(v, "path", v.name).replace("/", "."))


def representations(calls, grads):
  """Per-variable representations (``{id(var): (var, rep)}``) from all layer calls."""
  by_var = {}
  offset = 0
  for c in calls:
    n = len(c.probes)
    with tf.name_scope(_scope_name(c.layer.name)):
      produced = c.finish(grads[offset:offset + n])
    for var, rep in produced:
      by_var.setdefault(id(var), (var, []))[1].append(rep)
    offset += n
  return {k: (var, factored.combine(reps)) for k, (var, reps) in by_var.items()}


def check_coverage(model, registry=None) -> registry_lib.Coverage:
  """Coverage of ``model``; raises if some trainable variable has no rule."""
  cov = registry_lib.coverage(model, registry)
  if not cov.complete:
    raise registry_lib.UnsupportedLayerError(
        f"per_example='layerwise' cannot handle model '{model.name}': {cov.explain()}. Use "
        "per_example='vectorized' or 'microbatch' (or 'auto', which picks them), or register a "
        "rule for the layer in tf_dpnsgd.per_example.registry.DEFAULT_REGISTRY.")
  return cov


#: Modes of :func:`layerwise_engine`: how the weighted sum gets the layers' tensors.
MODES = ("bookkeeping", "two_pass", "auto")


def held_bytes(calls):
  """Bytes of the output gradients book-keeping holds at once, or None (a dynamic shape).

  Four bytes per element of every probed tensor of every registered layer call
  (each probe's gradient is held from the backward pass until the weighted sum).
  An estimate of what book-keeping holds beyond a plain step, which frees each
  of them once its layer's gradients are done.
  """
  total = 0
  for c in calls:
    for p in c.probes:
      if not p.shape.is_fully_defined():
        return None
      total += 4 * p.shape.num_elements()
  return total


def _mib(n):
  return f"{n / 2 ** 20:.0f} MiB"


def nondeterministic_kernels() -> bool:
  """Whether a GPU is visible while TensorFlow's op determinism is off.

  Some GPU kernels (atomics in reductions, scatters, autotuned convolutions)
  round differently from run to run; the two-pass engine's second pass must
  recompute exactly the first pass's tensors (see :func:`_second_pass`).
  TensorFlow's CPU kernels are deterministic.
  """
  if tf_config.is_op_determinism_enabled():
    return False
  return bool(tf.config.list_logical_devices("GPU"))


def choose_mode(model, mode: str, held, budget: int, random_ops=()) -> str:
  """``"bookkeeping"`` or ``"two_pass"`` for one traced batch (logged for ``"auto"``).

  ``"auto"``: two passes when the output gradients book-keeping would hold
  (``held`` bytes, :func:`held_bytes`) exceed ``budget`` (the keep budget), else
  book-keeping; book-keeping when ``held`` is unknown (dynamic shapes), the
  forward pass draws from stateful random ops (``random_ops``: a second pass
  would draw other numbers) or the kernels may not be deterministic
  (:func:`nondeterministic_kernels`).

  Raises:
    ValueError: ``mode="two_pass"`` on a forward pass with stateful random ops,
      or with a GPU and op determinism off.
  """
  if mode == "bookkeeping":
    return mode
  if mode == "auto":
    if held is None:
      _log.info("per_example='auto' uses book-keeping for model '%s': the batch shape is not "
                "static while tracing, so the memory it holds cannot be estimated.", model.name)
      return "bookkeeping"
    over = held > budget
    _log.info(
        "per_example='auto' uses %s for model '%s': book-keeping would hold %s of per-example "
        "output gradients at this batch size, %s the budget of %s (keep_per_example_mib).",
        "two passes (a second forward and backward pass, less memory, measured: not yet a plain step's)"
        if over else "book-keeping (one backward pass)",
        model.name, _mib(held), "over" if over else "within", _mib(budget))
    if not over:
      return "bookkeeping"
  why = None
  if random_ops:
    why = (f"its forward pass draws from stateful random ops ({', '.join(random_ops[:4])}), "
           "so a second pass would not see the random numbers the first measured the norms "
           "with. Draw randomness with Keras random layers or keras.random ops seeded by a "
           "keras.random.SeedGenerator")
  elif nondeterministic_kernels():
    why = ("a GPU is visible and TensorFlow's op determinism is off: the second pass must "
           "recompute exactly the tensors whose norms the first pass certified, and GPU "
           "kernels may round differently from run to run. Call "
           "tf.config.experimental.enable_op_determinism() first")
  if why is None:
    return "two_pass"
  if mode == "two_pass":
    raise ValueError(f"per_example='two_pass' cannot run model '{model.name}': {why}, or use "
                     "per_example='layerwise'.")
  _log.warning("per_example='auto' uses book-keeping (one backward pass, more memory) for "
               "model '%s' after all: %s.", model.name, why)
  return "bookkeeping"


def _capture_pass(model, loss_fn, x, y, cov, batch, num_microbatches, first, decide=None,
                  loss_weights=None):
  """One forward pass with the rules' capture and one backward pass to the probes.

  Returns:
    ``(reps, losses, y_pred)``: ``{id(var): (var, representation)}`` of the
    trainable variables (regrouped into microbatch units if asked).
  ``first``: run the graph checks (variable uses, batch axis). ``decide(capture)``,
  called after the forward pass, returns whether the random seeds advance
  (False: a second pass follows that must draw the same numbers). ``loss_weights``:
  ``[B]``, the backward pass differentiates ``sum_i w_i loss_i`` (rows with ``w_i = 0``
  selected away with ``tf.where``) instead of the units' mean losses.
  """
  with tf.GradientTape(watch_accessed_variables=False) as tape:
    with stateless.NoStateWrites(model) as no_writes:  # only the seed generators may advance
      with CallCapture(cov.plans, tape) as capture, dropout_lib.PhiloxDropout(model):
        y_pred = model(x, training=True)  # Dropout masks: Philox, drawn once (see dropout.py)
      losses = loss_fn(y, y_pred)
      if decide is not None:
        no_writes.advance_seeds = decide(capture)
    if first:
      check_variable_uses(capture, cov.plans)
    if loss_weights is not None:  # unit loss = sum of its rows' weighted losses
      rows = tf.reshape(tf.cast(losses, tf.float32), [-1])
      w = tf.cast(loss_weights, tf.float32)
      total = tf.reduce_sum(tf.where(w != 0, rows * w, tf.zeros_like(rows)))
    else:
      total = tf.reduce_sum(tf.cast(losses, tf.float32))
      if num_microbatches:  # unit loss = mean over its B/m examples
        total = total * (num_microbatches / tf.cast(batch, tf.float32))
  probes = [p for c in capture.calls for p in c.probes]
  grads = tape.gradient(total, probes, unconnected_gradients=tf.UnconnectedGradients.ZERO)
  if first:
    # Decided while tracing whenever the shapes are static (the guard traces every new batch
    # shape on the host, tf_dpnsgd.guard.make_structure_check): XLA cannot drop a Python error.
    checks = _batch_checks(capture.calls, batch_size_of(x))
    with tf.control_dependencies(checks):  # before anything combines rows of different probes
      grads = [tf.identity(tf.convert_to_tensor(g)) for g in grads]
  else:
    grads = [tf.convert_to_tensor(g) for g in grads]
  trainable_ids = {id(v) for v in model.trainable_variables}
  reps = {k: e for k, e in representations(capture.calls, grads).items() if k in trainable_ids}
  if num_microbatches:
    reps = {k: (v, r.to_units(num_microbatches)) for k, (v, r) in reps.items()}
  return reps, losses, y_pred


def _forward_ops(capture):
  graph = capture._graph
  if graph is None or capture._last_op is None:
    return []
  return graph.get_operations()[capture._first_op:capture._last_op]


@tf.autograph.experimental.do_not_convert
def layerwise_engine(model, loss_fn, x, y, transform, mask=None, num_microbatches=None,
                     registry=None, keep_bytes=None, mode="bookkeeping", loss_weights=None,
                     unit_mask=None) -> EngineOutput:
  """Transformed sum of per-unit gradients from each layer's inputs and output gradients.

  Args:
    model: a Keras model (called with ``training=True``, once, or twice in two passes).
    loss_fn: ``fn(y_true, y_pred) -> [B]`` per-example losses.
    x, y: the batch (nested structures allowed).
    transform: :class:`~tf_dpnsgd.transforms.Normalize` or ``Clip``.
    mask: optional ``[B]`` bool; False rows (padding) contribute 0. Not
      combinable with microbatches.
    num_microbatches: if set, units are ``m`` equal microbatches (their mean
      loss's gradient).
    registry: the layer rules (default
      :data:`~tf_dpnsgd.per_example.registry.DEFAULT_REGISTRY`).
    keep_bytes: budget for per-unit tensors kept from the norm pass to the
      weighted sum (default :data:`~tf_dpnsgd.per_example.factored.KEEP_BYTES`):
      book-keeping's held output gradients (:func:`held_bytes`) first, then
      per-unit weight gradients in what is left
      (:func:`~tf_dpnsgd.per_example.factored.plan_keeping`).
    mode: ``"bookkeeping"`` (one forward and one backward pass; holds every
      layer's output gradient until all norms exist), ``"two_pass"`` (a first
      pass computes the norms only, freeing each layer's tensors as it goes; a
      second forward and backward pass computes each layer's weighted sum as
      soon as its output gradient exists) or ``"auto"`` (two passes where the
      held output gradients would exceed ``keep_bytes``; :func:`choose_mode`).
    loss_weights: optional ``[B]`` float with ``num_microbatches``: unit ``u``'s loss is
      ``sum_{i in u} w_i loss_i`` (rows of weight 0 selected away) instead of the mean.
    unit_mask: optional ``[num_microbatches]`` bool: False units contribute 0 (factor 0).

  Returns:
    :class:`EngineOutput`; ``summed`` is aligned with ``model.trainable_variables``.

  Raises:
    UnsupportedLayerError: a trainable variable without a rule, or a
      registered layer used in a way its rule cannot represent.
    ValueError: ``mode="two_pass"`` on a model whose traced forward pass draws
      from stateful random ops.
  """
  if mode not in MODES:
    raise ValueError(f"`mode` must be one of {MODES}; got {mode!r}.")
  cov = check_coverage(model, registry)
  check_no_sparse_inputs(x, "per_example='layerwise'")
  check_mask_and_microbatches(mask, num_microbatches)
  if (loss_weights is not None or unit_mask is not None) and not num_microbatches:
    raise ValueError("`loss_weights` and `unit_mask` weigh the rows of microbatch units: "
                     "give `num_microbatches`.")
  batch = batch_size_of(x)
  with tf.control_dependencies(check_microbatches(batch, num_microbatches)):
    batch = tf.identity(batch)
  budget = factored.KEEP_BYTES if keep_bytes is None else int(keep_bytes)
  plan = {}

  def decide(capture):
    held = held_bytes(capture.calls)
    random_ops = stateless.stateful_random_ops(_forward_ops(capture)) if mode != "bookkeeping" \
        else []
    plan["mode"] = choose_mode(model, mode, held, budget, random_ops)
    plan["keep"] = 0 if plan["mode"] == "two_pass" else max(0, budget - (held or 0))
    return plan["mode"] == "bookkeeping"  # the seeds advance after the last pass

  reps, losses, y_pred = _capture_pass(model, loss_fn, x, y, cov, batch, num_microbatches,
                                       first=True, decide=decide, loss_weights=loss_weights)
  if reps:
    # Per-unit gradients kept for the weighted sum (saves its T p q products), within a budget.
    factored.plan_keeping([r for _, r in reps.values()], plan["keep"])
    parts = []
    for v, r in reps.values():
      with tf.name_scope("norm_" + _var_scope(v)):
        parts.append(r.squared_norms())  # float64 upper bounds, never clamped
  else:  # nothing trainable was used: every gradient is 0
    parts = [tf.zeros([num_microbatches or batch], tf.float64)]
  # Summed and square-rooted in float64, rounded up to float32: never below the true norm.
  norms = factored.upper_norms(parts)
  factors = transform.factors(norms, mask if unit_mask is None else unit_mask)
  if plan["mode"] == "two_pass":
    sums = _second_pass(model, loss_fn, x, y, cov, batch, num_microbatches, reps, factors,
                        loss_weights)
  else:
    sums = {}
    for k, (v, r) in reps.items():
      with tf.name_scope("sum_" + _var_scope(v)):
        sums[k] = r.weighted_sum(factors)
  summed = []
  for v in model.trainable_variables:
    if id(v) not in sums:  # in a registered layer that was not called: gradient 0
      summed.append(factored.runtime_zeros(v.shape, v.dtype))
    else:
      summed.append(tf.cast(tf.reshape(sums[id(v)], v.shape), v.dtype))
  return EngineOutput(summed=summed, norms=norms, factors=factors,
                      losses=tf.reshape(tf.cast(losses, tf.float32), [-1]), y_pred=y_pred)


def _second_pass(model, loss_fn, x, y, cov, batch, num_microbatches, first_reps, factors,
                 loss_weights=None):
  """``{id(var): sum_u factors[u] g_u}`` from a second forward and backward pass.

  The second pass recomputes the first's tensors (same weights, inputs and
  random numbers: the seeds advance only after it) and each variable's
  weighted sum is built from its layer's input and output gradient as soon as
  those exist, so the executor frees them as a plain backward pass does. Units
  the first pass recomputed in float64 (ill-conditioned) are added from the
  first pass's float64 gradients, exactly as book-keeping adds them
  (:func:`~tf_dpnsgd.per_example.factored.sum_with_recomputed`).

  Why not ``d/dw sum_i stop_gradient(h_i) loss_i``: that backward pass scales
  every example's output gradients by ``h_i``, which changes their rounding;
  where an example's gradient cancels inside the network (residual branches,
  shared layers), its float32 gradient can then differ from the one whose norm
  was certified by more than the transform's safety margin. Scaling only the
  last step (``a^T (h * b)`` per layer, as book-keeping) keeps every tensor the
  norm saw. Deterministic kernels recompute them bit for bit (TensorFlow's CPU
  kernels; XLA on CPU was bit-identical in our checks; a GPU needs
  ``tf.config.experimental.enable_op_determinism()``, else :func:`choose_mode`
  refuses two passes), so each contribution's norm is bounded exactly as in
  book-keeping.
  """
  recomputed = {k: r._recomputed for k, (_, r) in first_reps.items()}
  first_reps.clear()  # eager mode: the first pass's tensors can go
  # After every norm: otherwise the executor may run the second forward pass beside the
  # first one's backward pass, holding both passes' activations.
  with tf.control_dependencies([factors]):
    reps, _, _ = _capture_pass(model, loss_fn, tf.nest.map_structure(tf.identity, x), y, cov,
                               batch, num_microbatches, first=False,
                               loss_weights=loss_weights)
  sums = {}
  for k, (v, r) in reps.items():
    with tf.name_scope("sum_" + _var_scope(v)):
      sums[k] = factored.sum_with_recomputed(r.raw_weighted_sum, recomputed.get(k), factors)
  return sums


@tf.autograph.experimental.do_not_convert
def two_pass_engine(model, loss_fn, x, y, transform, mask=None, num_microbatches=None,
                    registry=None, keep_bytes=None) -> EngineOutput:
  """:func:`layerwise_engine` with ``mode="two_pass"``: a second pass instead of held gradients.

  ``per_example="two_pass"``. Norms from a first forward and backward pass
  (ghost or materialised per layer, certified as in book-keeping, nothing kept),
  then ``sum_u h_u g_u`` from a second pass (see :func:`_second_pass`).
  """
  return layerwise_engine(model, loss_fn, x, y, transform, mask=mask,
                          num_microbatches=num_microbatches, registry=registry,
                          keep_bytes=keep_bytes, mode="two_pass")
