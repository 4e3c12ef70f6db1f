"""Per-example (or per-microbatch) gradients with ``tf.vectorized_map``.

The loss of one unit is differentiated inside ``tf.vectorized_map``, which the
pfor converter turns into batched ops: one traced graph, about 2x the cost of a
plain step on ResNet20-GN on CPU (``tape.jacobian`` is ~60x). The gradients
are materialised (``[U, *var_shape]`` per variable), transformed and summed by
:func:`tf_dpnsgd.transforms.transform_and_sum`.

Three TensorFlow problems are handled here, each with a test in
``tests/test_engine_coverage.py``:

* **oneDNN** (TensorFlow's default CPU kernels on x86 Linux): its batch
  matmul crashes the process or silently returns wrong values (and corrupts
  memory for later computations) on the broadcasting batch matmuls
  ``[U, 1, T, d] x [d, k]`` that pfor makes of a rank-3 ``tf.matmul`` with a
  2-D kernel, e.g. every ``EinsumDense`` of ``MultiHeadAttention``. With
  oneDNN on, the engine refuses such a model before anything runs
  (:func:`onednn_matmul_hazards` on the traced graph) and ``"auto"`` uses
  the microbatch engine instead (:func:`onednn_risky_layers`,
  :func:`onednn_hazards`).
* **pfor and ``tf.nn.bias_add(..., "NCHW")``**: Keras adds an
  ``EinsumDense`` bias that varies along the output's second axis (e.g.
  ``"abc,cd->abd"`` with ``bias_axes="b"``) with an NCHW ``bias_add``, whose
  pfor gradient converter assumes 4-D tensors and fails. While the engine
  traces, ``EinsumDense`` layers add their bias with an explicit broadcast
  (:class:`ExplicitBiasAdd`): the same values, no ``BiasAdd`` op.
* **pfor and ``tf.while_loop``**: pfor cannot convert the gradient of the
  loop Keras runs a recurrent layer in (:func:`while_loop_layers`); such
  models are refused before tracing, and any other graph pfor cannot convert
  is refused while tracing, before anything runs (:func:`_vectorize`).
"""

from __future__ import annotations

import os
import platform

import keras
import tensorflow as tf
from keras import ops

from tf_dpnsgd import transforms
from tf_dpnsgd.per_example import registry as registry_lib
from tf_dpnsgd.per_example import stateless
from tf_dpnsgd.per_example.base import CallOverrides, EngineOutput, variable_gradients
from tf_dpnsgd.per_example.stateless import seed_generators  # noqa: F401  (public here too)

try:  # TensorFlow's own answer to "are oneDNN kernels used in this process?"
  from tensorflow.python.util import _pywrap_util_port
except ImportError:  # pragma: no cover (other TensorFlow builds)
  _pywrap_util_port = None


def batch_size_of(x) -> tf.Tensor:
  """Leading dimension of the first tensor in ``x``: a constant when static, else dynamic.

  A constant lets the engines decide their structural checks while tracing
  (``tf.get_static_value`` does not see through ``tf.shape(x)[0]``).
  """
  t = tf.nest.flatten(x)[0]
  shape = tf.TensorShape(getattr(t, "shape", None))
  if shape.rank and shape[0] is not None:
    return tf.constant(shape[0], tf.int32)
  return tf.shape(t)[0]


RAGGED_ADVICE = ("Use per_example='microbatch' (which runs one example at a time and handles "
                 "them), or pad the ids to a dense [batch, max_length] tensor with 0 as padding "
                 "and use keras.layers.Embedding(..., mask_zero=True) with a masked reduction "
                 "(e.g. GlobalAveragePooling1D), which every engine handles.")


SPARSE_ADVICE = ("Convert them to dense rows in the input pipeline (tf.sparse.to_dense; every "
                 "engine handles those), or give ids as a tf.RaggedTensor (per_example="
                 "'microbatch' or 'auto').")


def check_no_sparse_inputs(x, where: str) -> None:
  """Raises for ``tf.SparseTensor`` leaves of ``x``: no engine slices them per example.

  Raises:
    ValueError: naming ``where`` and what to do instead.
  """
  if any(isinstance(t, tf.SparseTensor) for t in tf.nest.flatten(x)):
    raise ValueError(f"{where} does not support tf.SparseTensor inputs. {SPARSE_ADVICE}")


def check_dense_inputs(x, engine: str) -> None:
  """Raises for ``tf.RaggedTensor`` / ``tf.SparseTensor`` leaves of ``x`` (bag-of-words ids).

  pfor cannot stack a ragged tensor rebuilt inside the loop (it fails at run
  time, deep in a ``TensorListStack``), so the vectorized engine refuses them
  up front, with a message saying what to do.

  Raises:
    ValueError: naming the engine and the alternatives.
  """
  composite = [t for t in tf.nest.flatten(x) if isinstance(t, (tf.RaggedTensor, tf.SparseTensor))]
  if composite:
    raise ValueError(f"per_example='{engine}' does not support {type(composite[0]).__name__} "
                     f"inputs. {RAGGED_ADVICE}")


def to_units(x, num_microbatches):
  """Reshapes ``[B, ...]`` leaves to ``[m, B/m, ...]`` (microbatches) or leaves them as is."""
  if not num_microbatches:
    return x

  def reshape(t):
    t = tf.convert_to_tensor(t)
    return tf.reshape(t, tf.concat([[num_microbatches, -1], tf.shape(t)[1:]], axis=0))

  return tf.nest.map_structure(reshape, x)


def from_units(x, num_microbatches):
  """Inverse of :func:`to_units` (also drops the singleton axis of per-example units)."""
  def reshape(t):
    return tf.reshape(t, tf.concat([[-1], tf.shape(t)[2:]], axis=0))
  return tf.nest.map_structure(reshape, x)


def check_microbatches(batch_size: tf.Tensor, num_microbatches):
  """Raises unless ``num_microbatches`` divides the batch size.

  Decided in Python (``ValueError`` while tracing) when the batch size is
  static, e.g. when :func:`tf_dpnsgd.forward_checks.verify_step_structure`
  traces the step with the batch's shapes; else an in-graph assertion
  (returned, for control dependencies), which XLA would remove.
  """
  if not num_microbatches:
    return []
  message = (f"num_microbatches={num_microbatches} must divide the batch size "
             "(use drop_remainder batches, or a batch size that is a multiple).")
  static = tf.get_static_value(batch_size)
  if static is not None:
    if int(static) % num_microbatches:
      raise ValueError(message + f" Got a batch of {int(static)}.")
    return []
  return [tf.debugging.assert_equal(batch_size % num_microbatches, 0, message=message)]


def check_mask_and_microbatches(mask, num_microbatches):
  """Raises ``ValueError`` for a padding mask combined with microbatches."""
  if mask is not None and num_microbatches:
    raise ValueError("A padding mask (Poisson sampling) cannot be combined with "
                     "num_microbatches: use per-example units.")


def per_unit_random_state(generators, unit_index):
  """A :class:`~tf_dpnsgd.per_example.stateless.RecordingScope` giving unit ``unit_index``
  its own random stream.

  Inside ``tf.vectorized_map`` a layer's random op would otherwise draw ONE
  mask for the whole batch (the seed is loop invariant), e.g. identical
  dropout for every example. Offsetting each generator's state by the unit
  index gives independent per-example masks; the generators are advanced
  once per step by the caller. Every variable assigned inside is recorded
  (``scope.assigned``); the engine refuses any but the seeds.
  """
  mapping = []
  for gen in generators:
    state = gen.state.value
    offset = tf.cast(unit_index, state.dtype) * tf.constant(0x9E3779B1, state.dtype)
    mapping.append((gen.state, state + tf.stack([tf.zeros([], state.dtype), offset])))
  return stateless.RecordingScope(state_mapping=mapping)


# --- oneDNN ------------------------------------------------------------------

ONEDNN_ADVICE = ("Use per_example='layerwise' (or 'microbatch'), or set TF_ENABLE_ONEDNN_OPTS=0 "
                 "in the environment before TensorFlow is imported.")

_BATCH_MATMUL_OPS = frozenset({"BatchMatMul", "BatchMatMulV2", "BatchMatMulV3"})


def onednn_enabled(strict: bool = False) -> bool:
  """Whether TensorFlow uses its oneDNN (MKL) CPU kernels in this process.

  TensorFlow decides once, at start-up: on x86 Linux oneDNN is on when the CPU
  has AVX512-VNNI/BF16, AVX-VNNI or AMX, unless ``TF_ENABLE_ONEDNN_OPTS=0``
  (``=1`` forces it on). Setting the variable after TensorFlow is imported
  changes nothing. Asks TensorFlow itself; if that is not possible, reads the
  variable and assumes on for x86-64 Linux (the conservative answer: it only
  makes the vectorized engine refuse more).

  Args:
    strict: answer only from TensorFlow itself; False where it cannot be asked
      (for a caller that needs oneDNN's kernels, not one guarding against them).

  Returns:
    True if oneDNN kernels may run (``strict``: if they do).
  """
  if _pywrap_util_port is not None and hasattr(_pywrap_util_port, "IsMklEnabled"):
    return bool(_pywrap_util_port.IsMklEnabled())
  if strict:
    return False
  value = os.environ.get("TF_ENABLE_ONEDNN_OPTS")
  if value is not None:
    return value.strip().lower() not in ("0", "false")
  return platform.system() == "Linux" and platform.machine().lower() in ("x86_64", "amd64")


def _same_batch_dims(a: tf.TensorShape, b: tf.TensorShape) -> bool:
  if a.rank != b.rank:
    return False
  return all(x == y for x, y in zip(a.as_list(), b.as_list()))


def onednn_matmul_hazards(operations) -> list:
  """The batch matmuls oneDNN computes wrongly or crashes on.

  TensorFlow 2.21's oneDNN batch matmul corrupts memory when it broadcasts
  over batch dimensions of rank-4 operands (TF issues #117700, #123109; e.g.
  ``[16, 1, 4, 6] x [6, 6]`` returns wrong values or aborts the process with
  ``free(): invalid pointer``). Rank-3 broadcasts (``[B, T, d] x [d, k]``)
  were exact in every shape tried and are not flagged.

  Args:
    operations: graph operations (e.g. ``graph.get_operations()``).

  Returns:
    ``[op]`` of every ``BatchMatMul*`` whose output has rank >= 4 (or
    unknown) and whose operands' batch dimensions are not identical (a
    broadcast, or unknown). Empty if there is none.
  """
  hazards = []
  for op in operations:
    if op.type not in _BATCH_MATMUL_OPS:
      continue
    a, b = op.inputs[0].shape, op.inputs[1].shape
    if a.rank is None or b.rank is None:
      hazards.append(op)
      continue
    if max(a.rank, b.rank) < 4 or _same_batch_dims(a[:-2], b[:-2]):
      continue
    hazards.append(op)
  return hazards


def _layer_of_op(op_name: str, layers) -> str | None:
  """The model layers whose name scopes ``op_name`` lies in (Keras appends ``_N``), innermost first.

  E.g. ``"EinsumDense 'key' in MultiHeadAttention 'attn'"``; None if none.
  """
  found = []
  for part in op_name.split("/"):
    for layer in layers:
      rest = part[len(layer.name):]
      if part.startswith(layer.name) and (not rest or (rest[0] == "_" and rest[1:].isdigit())):
        found.append(f"{type(layer).__name__} '{layer.name}'")
        break
  return " in ".join(reversed(found)) if found else None


def describe_onednn_hazards(model, hazard_ops) -> str:
  """A message naming the layers whose batch matmuls oneDNN cannot run."""
  layers = [l for l in model._flatten_layers(include_self=False, recursive=True)]
  names, shapes = [], []
  for op in hazard_ops:
    name = _layer_of_op(op.name, layers) or f"op '{op.name}'"
    if name not in names:
      names.append(name)
      shapes.append(f"{op.inputs[0].shape} x {op.inputs[1].shape}")
  detail = "; ".join(f"{n} ({s})" for n, s in zip(names, shapes))
  return (f"per_example='vectorized' cannot run model '{model.name}' while TensorFlow's oneDNN "
          f"CPU kernels are on: tf.vectorized_map turns {detail} into a broadcasting batch "
          "matmul that oneDNN computes wrongly or crashes on (corrupting memory). "
          + ONEDNN_ADVICE)


def _equation_input_rank(equation: str) -> int | None:
  inputs = equation.replace(" ", "").split("->")[0].split(",")[0]
  return None if "..." in inputs else len(inputs)


def onednn_risky_layers(model) -> list:
  """Layers known to give a oneDNN-broken vectorized graph (before any tracing).

  ``MultiHeadAttention`` (and subclasses) and ``EinsumDense`` layers whose
  equation takes inputs of rank >= 3 (or ``...``): Keras computes them with a
  rank-3 ``tf.matmul`` against the 2-D kernel, which pfor makes a rank-4
  broadcast (:func:`onednn_matmul_hazards`). Other layers (a custom layer
  calling ``tf.matmul``) are caught when the engine traces.

  Returns:
    ``["Type 'name'"]`` of such layers.
  """
  risky = []
  for layer in model._flatten_layers(include_self=False, recursive=True):
    if isinstance(layer, keras.layers.MultiHeadAttention):
      risky.append(f"{type(layer).__name__} '{layer.name}'")
    elif isinstance(layer, keras.layers.EinsumDense):
      rank = _equation_input_rank(layer.equation)
      if rank is None or rank >= 3:
        risky.append(f"{type(layer).__name__} '{layer.name}'")
  return risky


# --- loops (recurrent layers) ----------------------------------------------------

MICROBATCH_ADVICE = ("Use per_example='microbatch' (exact, one example at a time; "
                     "per_example='auto' picks it for such models).")
LOOP_ADVICE = ("Use per_example='layerwise' (or 'auto', which picks it) where every recurrent "
               "layer has a layer-wise rule (SimpleRNN, LSTM, GRU, RNN of one of their cells; "
               "dropout 0, not stateful), else per_example='microbatch' (exact, one example at "
               "a time; 'auto' picks it for the others), or build the recurrent layers with "
               "unroll=True (a fixed sequence length), which the vectorized engine handles.")


def while_loop_layers(model) -> list:
  """Recurrent layers whose gradient ``tf.vectorized_map`` cannot convert (before any tracing).

  Keras' TensorFlow backend runs an RNN (``LSTM``, ``GRU``, ``SimpleRNN``,
  ``ConvLSTM*``, also inside ``Bidirectional``) without ``unroll=True`` as a
  ``tf.while_loop`` whose outputs include ``TensorList`` variants (the stacked
  outputs). The tape's gradient of that loop asks for ``zeros_like`` of the
  outputs the loss does not use, and pfor's ``ZerosLike`` converter calls
  ``tf.zeros(shape, dtype=variant)``, which fails while tracing (TensorFlow
  2.21: ``TypeError: dtype <dtype: 'variant'> is not compatible with 0 of dtype
  int64``). An unrolled RNN has no loop and converts.

  Returns:
    ``["Type 'name'"]`` of the ``keras.layers.RNN`` layers with ``unroll=False``.
  """
  return [f"{type(layer).__name__} '{layer.name}'"
          for layer in model._flatten_layers(include_self=False, recursive=True)
          if isinstance(layer, keras.layers.RNN) and not getattr(layer, "unroll", False)]


def check_no_while_loop_layers(model) -> None:
  """Raises if ``model`` has layers the vectorized engine cannot run (:func:`while_loop_layers`).

  Raises:
    UnsupportedLayerError: naming the layers and what to do.
  """
  loops = while_loop_layers(model)
  if loops:
    raise registry_lib.UnsupportedLayerError(
        f"per_example='vectorized' cannot run model '{model.name}': tf.vectorized_map cannot "
        f"convert the gradient of the tf.while_loop of {', '.join(loops)} (pfor has no "
        "ZerosLike of a TensorList). " + LOOP_ADVICE)


def _vectorize(model, fn, elems):
  """``tf.vectorized_map(fn, elems)``; a conversion failure becomes ``UnsupportedLayerError``.

  pfor converts the traced per-unit graph op by op; an op it cannot convert
  (and cannot fall back to a loop for) raises while tracing, before anything
  runs, with an error that names a TensorFlow op and not the layer. Errors the
  engine raises on purpose (``UnsupportedLayerError``,
  ``stateless.StateWriteError``) pass through unchanged.

  Raises:
    UnsupportedLayerError: with the original error chained and quoted, and
      what to do.
  """
  try:
    return tf.vectorized_map(fn, elems)
  except (registry_lib.UnsupportedLayerError, stateless.StateWriteError):
    raise
  except (TypeError, ValueError, NotImplementedError) as e:
    first = (str(e).strip().splitlines() or [""])[0][:300]
    raise registry_lib.UnsupportedLayerError(
        f"per_example='vectorized' could not vectorize the per-example gradient of model "
        f"'{model.name}' (tf.vectorized_map failed while tracing, nothing has run: "
        f"{type(e).__name__}: {first}). " + MICROBATCH_ADVICE) from e


# --- EinsumDense biases ---------------------------------------------------------

_BIAS_ROUTES = CallOverrides()


def _explicit_bias_call(layer):
  """``EinsumDense.call`` with the bias added by ``tf.add`` of an explicit broadcast."""
  def call(inputs, training=None):
    del training
    z = ops.einsum(layer.equation, inputs, layer.kernel)
    if layer.bias is not None:
      axes = registry_lib.bias_layout(z.shape[1:], tuple(layer.bias.shape))  # as Keras adds it
      shape = [1] * len(z.shape)
      for axis in axes:
        shape[axis] = z.shape[axis]
      z = tf.add(z, tf.cast(tf.reshape(ops.convert_to_tensor(layer.bias), shape), z.dtype))
    return layer.activation(z) if layer.activation is not None else z
  return call


class ExplicitBiasAdd:
  """Context manager: ``EinsumDense`` layers of ``model`` add their bias with ``tf.add``.

  Keras' ``ops.add`` turns a bias varying along the output's second axis
  into ``tf.nn.bias_add(..., data_format="NCHW")``, whose pfor gradient
  converter only handles 4-D tensors (a 3-D output fails to convert, "Invalid
  reduction dimension"). Inside this context every plain ``EinsumDense``
  (exact type, no LoRA, not quantized) with a bias gets an instance
  attribute ``call`` that computes the same einsum and adds the bias
  broadcast along the axes Keras adds it along
  (:func:`~tf_dpnsgd.per_example.registry.bias_layout`): the same values, and
  a gradient pfor converts. Removed on exit (reference counted under a lock,
  as ``tf.distribute`` replica threads share layers).
  """

  def __init__(self, model):
    self._layers = [
        l for l in model._flatten_layers(include_self=True, recursive=True)
        if type(l) is keras.layers.EinsumDense and l.bias is not None  # pylint: disable=unidiomatic-typecheck
        and registry_lib.common_unsupported(l) is None]
    self._installed = []

  def __enter__(self):
    self._installed = _BIAS_ROUTES.install(self._layers, _explicit_bias_call)
    return self

  def __exit__(self, *exc):
    _BIAS_ROUTES.uninstall(self._installed)
    return False


# --- the engine -------------------------------------------------------------------

def _per_unit_gradients(model, loss_fn, xu, yu, variables, generators, num_microbatches,
                        unit_loss=None):
  """``(grads, losses, y_pred)`` per unit from ``tf.vectorized_map`` (builds ops only).

  ``unit_loss``: ``fn(losses, index) -> scalar``, unit ``index``'s loss from its rows'
  losses (None: their mean).

  Raises:
    StateWriteError: the forward pass or the loss writes a variable other
      than the seed generators' states (while tracing, nothing has run).
  """
  assigned = []

  def unit_gradient(args):
    x_u, y_u, index = args
    if not num_microbatches:
      x_u = tf.nest.map_structure(lambda t: tf.expand_dims(t, 0), x_u)
      y_u = tf.nest.map_structure(lambda t: tf.expand_dims(t, 0), y_u)
    with per_unit_random_state(generators, index) as scope:
      with tf.GradientTape() as tape:
        with ExplicitBiasAdd(model):
          y_pred = model(x_u, training=True)
        losses = loss_fn(y_u, y_pred)
        loss = tf.reduce_mean(losses) if unit_loss is None else unit_loss(losses, index)
      grads = variable_gradients(tape, loss, variables)  # dense; zeros where unconnected
    assigned.extend(scope.assigned)
    return grads, losses, y_pred

  units = batch_size_of(xu)
  with stateless.NoStateWrites(model, map_seeds=False):  # raw writes (seeds are mapped above)
    out = _vectorize(model, unit_gradient, (xu, yu, tf.range(units)))
  stateless.refuse_state_writes(model, assigned, [], allowed=[g.state for g in generators])
  return out


def onednn_hazards(model, loss_fn, x, y, num_microbatches=None, variables=None) -> list:
  """Traces the vectorized per-unit gradients in a scratch graph; its oneDNN hazards.

  Nothing is run (the graph is only built), so this is safe to call with
  oneDNN on. Used by ``per_example="auto"`` to fall back to the microbatch
  engine, and by :func:`vectorized_engine` in eager mode.

  Returns:
    :func:`onednn_matmul_hazards` of the traced graph's operations.
  """
  if variables is None:
    variables = model.trainable_variables
  generators = stateless.random_state(model)
  specs = tf.nest.map_structure(tf.type_spec_from_value, (x, y))

  def trace(x_, y_):
    return _per_unit_gradients(model, loss_fn, to_units(x_, num_microbatches),
                               to_units(y_, num_microbatches), variables, generators,
                               num_microbatches)

  graph = tf.function(trace, autograph=False).get_concrete_function(*specs).graph
  return onednn_matmul_hazards(graph.get_operations())


def checked_unit_gradients(model, loss_fn, x, y, xu, yu, variables, num_microbatches,
                           unit_loss=None):
  """:func:`vectorized_engine`'s per-unit gradients, refused where oneDNN would break them.

  Also the user-level slots' (:func:`tf_dpnsgd.per_example.units.user_unit_vectorized_engine`,
  ``num_microbatches`` slots of ``k`` rows, ``unit_loss`` their masked mean).

  Args:
    model, loss_fn, x, y, variables, num_microbatches: as :func:`vectorized_engine`.
    xu, yu: ``to_units(x, num_microbatches)``, ``to_units(y, num_microbatches)``.
    unit_loss: ``fn(losses, index) -> scalar``, a unit's loss (None: its rows' mean).

  Returns:
    ``(grads, losses, y_pred)``: ``[U, *var_shape]`` per variable, the units' losses and
    outputs; the seed generators advanced once.

  Raises:
    UnsupportedLayerError, StateWriteError: as :func:`vectorized_engine`, before anything
      runs.
  """
  generators = stateless.random_state(model)
  check = onednn_enabled()
  if check and tf.executing_eagerly():  # vectorized_map would run at once: trace it first
    hazards = onednn_hazards(model, loss_fn, x, y, num_microbatches, variables)
    if hazards:
      raise registry_lib.UnsupportedLayerError(describe_onednn_hazards(model, hazards))
  graph = None if tf.executing_eagerly() else tf.compat.v1.get_default_graph()
  first = len(graph.get_operations()) if graph is not None else 0
  out = _per_unit_gradients(model, loss_fn, xu, yu, variables, generators, num_microbatches,
                            unit_loss)
  if check and graph is not None:  # raised while tracing: nothing has run
    hazards = onednn_matmul_hazards(graph.get_operations()[first:])
    if hazards:
      raise registry_lib.UnsupportedLayerError(describe_onednn_hazards(model, hazards))
  for gen in generators:  # advance each random stream once per step
    gen.next()
  return out


def vectorized_engine(model, loss_fn, x, y, transform, mask=None, num_microbatches=None,
                      variables=None) -> EngineOutput:
  """Transformed sum of per-unit gradients via ``tf.vectorized_map``.

  Args:
    model: a Keras model (called with ``training=True``).
    loss_fn: ``fn(y_true, y_pred) -> [B]`` per-example losses.
    x, y: the batch (nested structures allowed).
    transform: :class:`~tf_dpnsgd.transforms.Normalize` or ``Clip``.
    mask: optional ``[B]`` bool; False rows (padding) contribute 0. Not
      combinable with microbatches.
    num_microbatches: if set, units are ``m`` equal microbatches.
    variables: variables to differentiate (default ``model.trainable_variables``).

  Returns:
    :class:`EngineOutput`.

  Raises:
    ValueError: for ragged or sparse inputs (:func:`check_dense_inputs`).
    UnsupportedLayerError: for recurrent layers that run a ``tf.while_loop``
      (:func:`check_no_while_loop_layers`, before tracing), or any other graph
      ``tf.vectorized_map`` cannot convert (:func:`_vectorize`, while tracing).
    StateWriteError: the forward pass writes a variable other than the seed
      generators' states (:mod:`~tf_dpnsgd.per_example.stateless`).
    UnsupportedLayerError: with oneDNN on (:func:`onednn_enabled`), if the
      traced graph holds a batch matmul oneDNN breaks
      (:func:`onednn_matmul_hazards`); raised while tracing (in eager mode,
      after a scratch trace), so nothing has run.
  """
  if variables is None:
    variables = model.trainable_variables
  check_dense_inputs(x, "vectorized")
  check_no_while_loop_layers(model)
  check_mask_and_microbatches(mask, num_microbatches)
  with tf.control_dependencies(check_microbatches(batch_size_of(x), num_microbatches)):
    xu = to_units(x, num_microbatches)
    yu = to_units(y, num_microbatches)

  grads, losses, y_pred = checked_unit_gradients(model, loss_fn, x, y, xu, yu, variables,
                                                 num_microbatches)
  summed, norms, factors = transforms.transform_and_sum(grads, transform, mask)
  return EngineOutput(summed=summed, norms=norms, factors=factors,
                      losses=tf.reshape(losses, [-1]),
                      y_pred=from_units(y_pred, num_microbatches))
