"""The engines' training forward pass writes no model state except Keras' random seeds.

Why: the Gaussian mechanism covers only the noised sum of clipped per-unit
gradients. A layer that assigns a variable while the DP step runs the model on
a batch (a running-mean normalizer, a data-dependent initialization on the
first call, a stateful RNN, a ``tf.random.Generator``, a summary or lookup
table written from inside the model) keeps an exact, unnoised statistic of the
batch in the weights that are saved and exported.

Every engine runs the model's training forward pass and the per-example loss
inside :class:`NoStateWrites` (the vectorized engine: per unit, inside
``tf.vectorized_map``, with the same recording scope and the same refusal):

1. the state of every Keras ``SeedGenerator`` of the model (and of Keras'
   global one, if it exists) is mapped into a recording ``keras.StatelessScope``
   (:class:`RecordingScope`) and the advanced seeds are assigned after the
   pass, so the random streams advance exactly as before: this is the only
   state the pass may change;
2. any other Keras variable assignment is diverted by the scope (even in eager
   mode none reaches the variable) and refused with :class:`StateWriteError`;
3. in graph mode (every ``fit``; raised while tracing, so nothing ran) the ops
   the pass created, and the bodies of the functions and loops they call, are
   scanned for ops that change a resource (:func:`resource_writes`): writes that
   bypass Keras (``tf.Variable.assign``, ``tf.random.Generator``, lookup-table
   inserts, summaries). Any op taking a resource handle that is not known to be
   read-only (:data:`READ_ONLY_RESOURCE_OPS`) counts as a write (fail closed).

Not detected here: a raw TensorFlow write (3.) in eager mode (``run_eagerly``)
runs before it could be seen; :func:`tf_dpnsgd.forward_checks.check_no_state_writes`
traces the pass in a graph first (the DP model's guard runs it on the host
before any step). State changed outside the traced pass (callbacks, Python
attributes of layers) is not a variable write and is not seen.
"""

from __future__ import annotations

import keras
import tensorflow as tf
from tensorflow.python.framework import op_def_registry  # op signatures, to find resource inputs

READ_ONLY_RESOURCE_OPS = frozenset({
    "ReadVariableOp", "_ReadVariablesOp", "ResourceGather", "ResourceGatherNd",
    "VariableShape", "VarIsInitializedOp", "DisableCopyOnRead", "ReadVariableXlaSplitND",
    "LookupTableFindV2", "LookupTableSizeV2", "LookupTableExportV2"})
"""Ops that take a resource handle and only read it (everything else with one writes)."""


class StateWriteError(ValueError):
  """The training forward pass writes model state other than Keras' random seeds."""


def seed_generators(model) -> list:
  """Keras ``SeedGenerator``s of all layers of ``model`` (Dropout and other random layers)."""
  gens = []
  for layer in model._flatten_layers(include_self=True, recursive=True):
    for gen in getattr(layer, "_seed_generators", ()):
      if all(gen is not g for g in gens):
        gens.append(gen)
  return gens


def random_state(model) -> list:
  """:func:`seed_generators` plus Keras' global one (``keras.random.*(seed=None)``) if it exists."""
  from keras.src.backend.common import global_state  # pylint: disable=import-outside-toplevel
  from keras.src.random import seed_generator  # pylint: disable=import-outside-toplevel
  gens = seed_generators(model)
  glob = global_state.get_global_attribute(seed_generator.GLOBAL_SEED_GENERATOR)
  if glob is not None and all(glob is not g for g in gens):
    gens.append(glob)
  return gens


class RecordingScope(keras.StatelessScope):
  """A ``keras.StatelessScope`` that also lists the variables assigned inside it.

  Attributes:
    assigned: each variable assigned in the scope, once, in order.
  """

  def __init__(self, state_mapping=None):
    super().__init__(state_mapping=state_mapping)
    self.assigned = []

  def add_update(self, update):
    super().add_update(update)
    variable = update[0]
    if all(variable is not v for v in self.assigned):
      self.assigned.append(variable)


# --- raw writes in a traced graph ------------------------------------------------------
_RESOURCE = tf.resource.as_datatype_enum


def _writes_resource(op_type: str) -> bool | None:
  """Whether ops of this type take a resource handle that they may change; None: not an op."""
  op_def = op_def_registry.get(op_type)
  if op_def is None:
    return None  # a call of a function by its name
  if op_type in READ_ONLY_RESOURCE_OPS:
    return False
  return any(arg.type == _RESOURCE for arg in op_def.input_arg)


def _called_functions(attrs) -> list:
  """Names of the functions a node calls through its attributes (loops, conds, calls)."""
  names = []
  for value in attrs.values():
    if value.HasField("func"):
      names.append(value.func.name)
    elif value.HasField("list"):
      names.extend(f.name for f in value.list.func)
  return names


def _function_def(name, graph):
  """The ``FunctionDef`` named ``name`` in ``graph``'s library or an outer graph's, or None."""
  g = graph
  while g is not None:
    fn = getattr(g, "_functions", {}).get(name)
    if fn is not None:
      return fn.definition
    g = getattr(g, "outer_graph", None)
  for fdef in graph.as_graph_def().library.function:
    if fdef.signature.name == name:
      return fdef
  return None


def resource_writes(operations, graph=None) -> list:
  """Ops among ``operations`` (and in every function they call) that may change a resource.

  Args:
    operations: graph operations (e.g. the ops one forward pass created).
    graph: the graph holding them (default: the first op's graph); its
      function library resolves nested functions.

  Returns:
    ``["OpType 'op name'"]`` of each op taking a resource handle that is not
    in :data:`READ_ONLY_RESOURCE_OPS`. A called function that cannot be found
    is listed too (it cannot be checked).
  """
  return _scan(operations, graph, _writes_resource)


STATEFUL_RANDOM_OPS = frozenset({
    "RandomUniform", "RandomUniformInt", "RandomStandardNormal", "TruncatedNormal",
    "ParameterizedTruncatedNormal", "RandomGamma", "RandomPoisson", "RandomPoissonV2",
    "RandomShuffle", "Multinomial"})
"""TensorFlow's random ops that draw from a hidden per-op state (``tf.random.uniform`` with
no seed or an op seed): a second run of the same graph draws other numbers."""


def stateful_random_ops(operations, graph=None) -> list:
  """Ops among ``operations`` (and the functions they call) in :data:`STATEFUL_RANDOM_OPS`.

  The two-pass engine (:mod:`tf_dpnsgd.per_example.layerwise`) runs the forward
  pass twice and needs the same random numbers both times; Keras' random
  layers and ``keras.random`` ops draw statelessly from a ``SeedGenerator``
  (mapped by :class:`NoStateWrites`, so both passes draw the same numbers),
  these ops do not.
  """
  def is_random(op_type):
    if op_def_registry.get(op_type) is None:
      return None
    return op_type in STATEFUL_RANDOM_OPS

  return _scan(operations, graph, is_random)


REPEATABLE_STATEFUL_OPS = READ_ONLY_RESOURCE_OPS | frozenset({
    "Assert", "CheckNumerics", "CheckNumericsV2", "If", "While", "Case",
    "StatefulPartitionedCall", "PartitionedCall"})
"""Ops TensorFlow registers as stateful that give the same outputs whenever a graph runs
them again on the same inputs and variables (reads, assertions; calls, conditionals and
loops, whose bodies :func:`unrepeatable_ops` scans)."""


def unrepeatable_ops(operations, graph=None) -> list:
  """Ops among ``operations`` (and in the functions they call) that TensorFlow registers as
  stateful and that are not in :data:`REPEATABLE_STATEFUL_OPS`: a second run of the same
  graph may give other outputs (a stateful random op, a ``py_function``, a queue or reader,
  an unknown stateful op). Empty: running the traced graph again on the same inputs and
  variables computes the same values, kernel determinism aside (fail closed: any stateful
  op not known to repeat is listed).
  """
  def flagged(op_type):
    op_def = op_def_registry.get(op_type)
    if op_def is None:
      return None
    return op_def.is_stateful and op_type not in REPEATABLE_STATEFUL_OPS

  return _scan(operations, graph, flagged)


def _scan(operations, graph, flagged) -> list:
  """Ops (also inside called functions) for which ``flagged(op_type)`` is True.

  ``flagged`` returns None for a type that is not an op (a call of a function by
  its name, which is then scanned too).
  """
  operations = list(operations)
  if not operations:
    return []
  graph = graph or operations[0].graph
  found, seen = [], set()
  pending = []
  for op in operations:
    hit = flagged(op.type)
    if hit is None:
      pending.append(op.type)
    elif hit:
      found.append(f"{op.type} '{op.name}'")
    pending.extend(_called_functions(op.node_def.attr))
  while pending:
    name = pending.pop()
    if name in seen:
      continue
    seen.add(name)
    fdef = _function_def(name, graph)
    if fdef is None:
      found.append(f"function '{name}' (not found, cannot be checked)")
      continue
    for node in fdef.node_def:
      hit = flagged(node.op)
      if hit is None:
        pending.append(node.op)
      elif hit:
        found.append(f"{node.op} '{node.name}' in function '{name}'")
      pending.extend(_called_functions(node.attr))
  return found


def refuse_state_writes(model, assigned, raw_writes, allowed=()) -> None:
  """Raises :class:`StateWriteError` for writes other than the ``allowed`` variables'.

  Args:
    model: the model (for the message).
    assigned: variables a :class:`RecordingScope` recorded as assigned.
    raw_writes: :func:`resource_writes` of the pass's ops.
    allowed: variables the pass may assign (the seed generators' states).
  """
  others = [v for v in assigned if all(v is not a for a in allowed)]
  if not others and not raw_writes:
    return
  what = [f"variable '{getattr(v, 'path', v.name)}'" for v in others] + list(raw_writes)
  shown = "; ".join(what[:6]) + (f"; and {len(what) - 6} more" if len(what) > 6 else "")
  raise StateWriteError(
      f"The training forward pass of model '{model.name}' writes model state: {shown}. The "
      "DP step privatizes only the gradient: a variable assigned from the batch (a running "
      "mean or variance, a data-dependent initialization on the first call, a stateful RNN's "
      "states, a tf.random.Generator, a lookup table or summary written from inside the "
      "model) would keep an exact, unnoised statistic of the training data in the saved and "
      "exported model. Training stopped before any update. Fix: compute such statistics "
      "without the training data or from public data before training (and freeze them), "
      "make the layer stateless in training mode, and draw randomness with Keras random "
      "layers (keras.layers.Dropout) or keras.random ops seeded by a "
      "keras.random.SeedGenerator attached to the layer (its state is the one write allowed).")


class NoStateWrites:
  """Context manager around one training forward pass (+ loss) of an engine.

  See the module docstring: seed generators are mapped and advanced after the
  pass; any other write raises :class:`StateWriteError` on exit (while
  tracing, in graph mode). Safe under ``tf.distribute`` replica threads (the
  scope is thread local in Keras).

  Args:
    model: the Keras model whose seed generators may advance.
    map_seeds: False when an inner scope (the vectorized engine's per-unit
      random state) maps and advances the seeds itself; then only raw writes
      are checked here.
    advance_seeds: False for a pass that must change nothing (a probe, or the
      first of the two-pass engine's passes, whose second pass must draw the
      same numbers): the seeds are mapped but not advanced. An attribute of
      the same name may be changed until the context exits.
  """

  def __init__(self, model, map_seeds: bool = True, advance_seeds: bool = True):
    self._model = model
    self._generators = random_state(model) if map_seeds else []
    self.advance_seeds = advance_seeds
    self._scope = None
    self._graph = None
    self._first = 0

  def __enter__(self):
    self._graph = None if tf.executing_eagerly() else tf.compat.v1.get_default_graph()
    self._first = len(self._graph.get_operations()) if self._graph is not None else 0
    self._mapping = [(g.state, g.state.value) for g in self._generators]
    self._scope = RecordingScope(state_mapping=self._mapping)
    self._scope.__enter__()
    return self

  def __exit__(self, exc_type, exc, tb):
    self._scope.__exit__(exc_type, exc, tb)
    if exc_type is not None:
      return False
    raw = []
    if self._graph is not None:
      raw = resource_writes(self._graph.get_operations()[self._first:], self._graph)
    states = [g.state for g in self._generators]
    refuse_state_writes(self._model, self._scope.assigned, raw, allowed=states)
    for state in states if self.advance_seeds else ():
      if any(state is v for v in self._scope.assigned):
        state.assign(self._scope.get_current_value(state))  # advance the random stream
    return False
