"""Engines that turn a batch into the sum of transformed per-unit gradients.

Every engine has the signature::

    engine(model, loss_fn, x, y, transform, mask=None, num_microbatches=None)
        -> EngineOutput

and guarantees that ``EngineOutput.summed`` equals ``sum_u h_u g_u`` where
``g_u`` is unit ``u``'s gradient (an example, or a microbatch's mean loss),
``h_u = transform.factors(||g_u||, mask)``, and units with ``h_u = 0``
(masked, or non-finite gradient) contribute exactly zero.

Engines (``per_example=`` on ``DPModel`` / ``make_private``):
  * ``"layerwise"``: :func:`layerwise.layerwise_engine`, per-example norms
    and the weighted sum from each layer's inputs and output gradients (ghost
    norms / book-keeping); one forward and one backward pass, holding every
    layer's output gradient until all norms exist. Needs a rule
    (:mod:`registry`) for every layer holding trainable variables.
  * ``"two_pass"``: :func:`layerwise.two_pass_engine`, the same rules in two
    forward and backward passes (norms, then the weighted sum): aimed at a plain
    step's memory for one more pass of time (measured: not yet there).
  * ``"vectorized"``: :func:`vectorized.vectorized_engine`, per-example
    gradients with ``tf.vectorized_map`` (any model whose ops pfor supports).
  * ``"microbatch"``: :func:`microbatch.microbatch_engine`, a loop over units
    (examples, or microbatches with ``num_microbatches``); any model, slowest.
  * ``"auto"``: the layer-wise rules when every trainable variable is covered
    by one, else ``"vectorized"``; logs which and why (:func:`choose_engine`).
    With the rules, book-keeping or two passes per traced batch: two passes
    where the output gradients book-keeping holds exceed the memory budget
    ``keep_per_example_mib`` (:func:`layerwise.choose_mode`, logged).
    Keras ``SimpleRNN``, ``LSTM`` and ``GRU`` layers have rules
    (:mod:`layers.recurrent`); models with recurrent layers that have none
    (dropout, stacked cells, ``ConvLSTM*``) and run a ``tf.while_loop`` (no
    ``unroll=True``) get ``"microbatch"``: pfor cannot convert the loop's
    gradient (:func:`vectorized.while_loop_layers`; an explicit
    ``"vectorized"`` refuses every such model at ``compile``).
    With TensorFlow's oneDNN CPU kernels on, ``"auto"`` never runs the
    vectorized engine on a graph oneDNN breaks: it picks ``"microbatch"`` for
    models with layers known to (:func:`vectorized.onednn_risky_layers`) and
    checks every other model's traced graph, falling back to the microbatch
    engine (:func:`vectorized.onednn_hazards`). An explicit
    ``"vectorized"`` refuses such models (at ``compile`` for the known
    layers, else while tracing).
"""

from __future__ import annotations

import functools
import logging

import tensorflow as tf

from tf_dpnsgd.per_example import layerwise
from tf_dpnsgd.per_example import microbatch
from tf_dpnsgd.per_example import registry
from tf_dpnsgd.per_example import vectorized
from tf_dpnsgd.per_example.base import EngineOutput
from tf_dpnsgd.per_example.layerwise import layerwise_engine, two_pass_engine
from tf_dpnsgd.per_example.microbatch import microbatch_engine
from tf_dpnsgd.per_example.registry import DEFAULT_REGISTRY, LayerRule, UnsupportedLayerError
from tf_dpnsgd.per_example.vectorized import vectorized_engine

ENGINES = {"layerwise": layerwise_engine, "two_pass": two_pass_engine,
           "vectorized": vectorized_engine, "microbatch": microbatch_engine}
_LAYERWISE = (layerwise_engine, two_pass_engine)
ENGINE_NAMES = ("auto",) + tuple(ENGINES)

_log = logging.getLogger(__name__)


def validate_engine_name(name: str) -> str:
  if name not in ENGINE_NAMES:
    raise ValueError(f"`per_example` must be one of {ENGINE_NAMES}; got {name!r}.")
  return name


def choose_engine(model, registry_=None) -> tuple[str, str]:
  """The engine ``"auto"`` picks for ``model``, and why.

  Returns:
    ``("layerwise", reason)`` if every trainable variable belongs to a layer
    with a layer-wise rule; else ``("microbatch", reason)`` if the model has
    recurrent layers that run a ``tf.while_loop``
    (:func:`vectorized.while_loop_layers`), or if oneDNN is on
    and the model has layers whose vectorized graph oneDNN breaks
    (:func:`vectorized.onednn_risky_layers`); else ``("vectorized", reason)``
    naming the layers without a rule.
  """
  cov = registry.coverage(model, registry_)
  if cov.complete:
    return "layerwise", cov.explain()
  loops = vectorized.while_loop_layers(model)
  if loops:
    return "microbatch", (f"{cov.explain()}, and tf.vectorized_map cannot convert the "
                          f"gradient of the tf.while_loop of {', '.join(loops[:4])}")
  if vectorized.onednn_enabled():
    risky = vectorized.onednn_risky_layers(model)
    if risky:
      return "microbatch", (f"{cov.explain()}, and TensorFlow's oneDNN kernels (on) break the "
                            f"vectorized engine on {', '.join(risky[:4])}")
  return "vectorized", cov.explain()


def _vectorized_unless_onednn_breaks_it(model, loss_fn, x, y, transform, mask=None,
                                         num_microbatches=None):
  """``"auto"``'s vectorized engine: the microbatch engine where oneDNN would break it.

  With oneDNN on, the vectorized graph is first traced in a scratch graph
  (nothing runs); if it holds a batch matmul oneDNN breaks
  (:func:`vectorized.onednn_hazards`), or if ``tf.vectorized_map`` cannot
  convert it (``UnsupportedLayerError`` while tracing), the microbatch engine
  is used instead.
  """
  if vectorized.onednn_enabled():
    try:
      hazards = vectorized.onednn_hazards(model, loss_fn, x, y, num_microbatches)
    except UnsupportedLayerError as e:
      _log.warning("per_example='auto' uses the microbatch engine (slowest, exact) for model "
                   "'%s': %s", model.name, e)
      return microbatch_engine(model, loss_fn, x, y, transform, mask=mask,
                               num_microbatches=num_microbatches)
    if hazards:
      _log.warning("per_example='auto' uses the microbatch engine for model '%s': %s",
                   model.name, vectorized.describe_onednn_hazards(model, hazards))
      return microbatch_engine(model, loss_fn, x, y, transform, mask=mask,
                               num_microbatches=num_microbatches)
  return vectorized_engine(model, loss_fn, x, y, transform, mask=mask,
                           num_microbatches=num_microbatches)


def has_ragged_inputs(x) -> bool:
  """Whether a leaf of ``x`` is a ``tf.RaggedTensor`` (e.g. bag-of-words ids); static."""
  return any(isinstance(t, tf.RaggedTensor) for t in tf.nest.flatten(x))


def _microbatch_for_ragged_inputs(engine):
  """``"auto"``'s engine: ``engine``, or the microbatch engine for ragged inputs.

  Only the microbatch engine is exact on ragged inputs (it runs one example
  at a time); the layer-wise and vectorized engines refuse them. Decided per
  traced batch (a Python check of the input types, nothing runs). The
  returned function's ``dense_engine`` attribute is ``engine`` (the choice
  for dense inputs).
  """
  def auto_engine(model, loss_fn, x, y, transform, mask=None, num_microbatches=None):
    if has_ragged_inputs(x):
      _log.warning("per_example='auto' uses the microbatch engine (slowest, exact) for model "
                   "'%s': its inputs are ragged, which only that engine handles. Pad the ids "
                   "to a dense tensor (Embedding(..., mask_zero=True)) for a faster engine.",
                   model.name)
      return microbatch_engine(model, loss_fn, x, y, transform, mask=mask,
                               num_microbatches=num_microbatches)
    return engine(model, loss_fn, x, y, transform, mask=mask,
                  num_microbatches=num_microbatches)
  auto_engine.dense_engine = engine
  return auto_engine


def check_vectorized(model) -> None:
  """Raises if ``per_example="vectorized"`` is known to break on ``model``.

  Raises:
    UnsupportedLayerError: the model has recurrent layers that run a
      ``tf.while_loop`` (:func:`vectorized.check_no_while_loop_layers`); or
      oneDNN is on and the model has layers whose
      vectorized graph oneDNN computes wrongly or crashes on (the message
      names them and says what to do).
  """
  vectorized.check_no_while_loop_layers(model)
  if not vectorized.onednn_enabled():
    return
  risky = vectorized.onednn_risky_layers(model)
  if risky:
    raise UnsupportedLayerError(
        f"per_example='vectorized' cannot run model '{model.name}' while TensorFlow's oneDNN "
        f"CPU kernels are on: pfor turns the matmuls of {', '.join(risky)} into broadcasting "
        "batch matmuls that oneDNN computes wrongly or crashes on (corrupting memory). "
        + vectorized.ONEDNN_ADVICE)


def validate_keep_mib(mib):
  """``keep_per_example_mib``: None (the default budget) or a finite number >= 0.

  The layer-wise engines' memory budget (MiB) for per-example tensors kept
  between the norms and the weighted sum: book-keeping's held output gradients
  first, then per-example weight gradients; ``"auto"`` runs two passes where
  the output gradients alone exceed it (:func:`layerwise.choose_mode`).
  """
  if mib is None:
    return None
  if isinstance(mib, bool) or not isinstance(mib, (int, float)) or not 0 <= mib < float("inf"):
    raise ValueError(f"`keep_per_example_mib` must be a number >= 0 (MiB) or None; got "
                     f"{mib!r}.")
  return mib


def engine_name(engine) -> str:
  """The name (a key of :data:`ENGINES`) of a resolved engine: ``resolve_engine``'s result
  unwrapped from its keep budget (a ``functools.partial``) and ``auto``'s ragged routing;
  ``"layerwise (auto)"`` when the layer-wise engine picks its mode per batch; ``"?"`` for a
  function that is not one of the package's engines."""
  engine = getattr(engine, "dense_engine", engine)
  mode = None
  while isinstance(engine, functools.partial):
    mode = engine.keywords.get("mode", mode)
    engine = engine.func
  names = {fn: name for name, fn in ENGINES.items()}
  name = names.get(engine, "?")
  return f"{name} ({mode})" if name == "layerwise" and mode not in (None, "bookkeeping") \
      else name


def _with_keep_budget(engine, keep_mib, **kwargs):
  """``engine`` with the layer-wise engines' keep budget bound (other engines ignore it)."""
  if engine not in _LAYERWISE or (keep_mib is None and not kwargs):
    return engine
  if keep_mib is not None:
    kwargs["keep_bytes"] = int(keep_mib * 2 ** 20)
  return functools.partial(engine, **kwargs)


def resolve_engine(model, name: str, keep_mib=None):
  """Returns the engine function for ``model``; ``"auto"`` logs its choice once.

  ``"auto"`` runs the microbatch engine on ragged inputs (the only exact one
  for them; :func:`_microbatch_for_ragged_inputs`); its choice for dense
  inputs is the returned function's ``dense_engine``; where that is the
  layer-wise engine, it is called with ``mode="auto"`` (book-keeping or two
  passes by memory, decided per traced batch and logged). ``keep_mib``: the
  layer-wise engines' memory budget for per-example tensors kept between
  norms and sum (MiB; None: the default
  :data:`~tf_dpnsgd.per_example.factored.KEEP_BYTES`).

  Raises:
    UnsupportedLayerError: for ``"layerwise"`` or ``"two_pass"`` when some trainable variable
      has no layer-wise rule (the message names the layers); for
      ``"vectorized"`` when oneDNN is on and the model has layers it breaks
      (:func:`check_vectorized`).
  """
  validate_engine_name(name)
  if name in ("layerwise", "two_pass"):
    layerwise.check_coverage(model)
  if name == "vectorized":
    check_vectorized(model)
  if name != "auto":
    return _with_keep_budget(ENGINES[name], keep_mib)
  chosen, why = choose_engine(model)
  if chosen == "layerwise":
    _log.info("per_example='auto' chose the layer-wise engine for model '%s': %s.",
              model.name, why)
    return _microbatch_for_ragged_inputs(_with_keep_budget(layerwise_engine, keep_mib,
                                                           mode="auto"))
  if chosen == "microbatch":
    advice = ("build the recurrent layers with unroll=True" if vectorized.while_loop_layers(model)
              else "set TF_ENABLE_ONEDNN_OPTS=0 before importing TensorFlow")
    _log.warning("per_example='auto' chose the microbatch engine (slowest) for model '%s' "
                 "because there is %s. Register layer-wise rules for the other layers, or %s "
                 "to use the vectorized engine.", model.name, why, advice)
    return ENGINES[chosen]
  _log.warning("per_example='auto' chose the vectorized engine for model '%s' (slower, "
               "more memory) because there is %s. Register a layer-wise rule to use the "
               "fast path, or pass per_example='vectorized' to silence this.", model.name, why)
  if vectorized.onednn_enabled():  # decided per traced graph
    return _microbatch_for_ragged_inputs(_vectorized_unless_onednn_breaks_it)
  return _microbatch_for_ragged_inputs(ENGINES[chosen])


__all__ = ["DEFAULT_REGISTRY", "EngineOutput", "ENGINES", "ENGINE_NAMES", "LayerRule",
           "UnsupportedLayerError", "check_vectorized", "choose_engine", "engine_name",
           "layerwise_engine",
           "microbatch_engine", "registry", "resolve_engine", "two_pass_engine",
           "validate_engine_name", "validate_keep_mib", "vectorized_engine"]
