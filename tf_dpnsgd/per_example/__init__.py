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
    norms / book-keeping); one forward and one backward pass. Needs a rule
    (:mod:`registry`) for every layer holding trainable variables.
  * ``"vectorized"``: :func:`vectorized.vectorized_engine`, per-example
    gradients with ``tf.vectorized_map`` (any model whose ops pfor supports).
  * ``"microbatch"``: :func:`microbatch.microbatch_engine`, a loop over units
    (examples, or microbatches with ``num_microbatches``); any model, slowest.
  * ``"auto"``: ``"layerwise"`` when every trainable variable is covered by a
    rule, else ``"vectorized"``; logs which and why (:func:`choose_engine`).
"""

from __future__ import annotations

import logging

from tf_dpnsgd.per_example import layerwise
from tf_dpnsgd.per_example import microbatch
from tf_dpnsgd.per_example import registry
from tf_dpnsgd.per_example import vectorized
from tf_dpnsgd.per_example.base import EngineOutput
from tf_dpnsgd.per_example.layerwise import layerwise_engine
from tf_dpnsgd.per_example.microbatch import microbatch_engine
from tf_dpnsgd.per_example.registry import DEFAULT_REGISTRY, LayerRule, UnsupportedLayerError
from tf_dpnsgd.per_example.vectorized import vectorized_engine

ENGINES = {"layerwise": layerwise_engine, "vectorized": vectorized_engine,
           "microbatch": microbatch_engine}
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
    with a layer-wise rule, else ``("vectorized", reason)`` naming the layers
    without one.
  """
  cov = registry.coverage(model, registry_)
  if cov.complete:
    return "layerwise", cov.explain()
  return "vectorized", cov.explain()


def resolve_engine(model, name: str):
  """Returns the engine function for ``model``; ``"auto"`` logs its choice once.

  Raises:
    UnsupportedLayerError: for ``"layerwise"`` when some trainable variable
      has no layer-wise rule (the message names the layers).
  """
  validate_engine_name(name)
  if name == "layerwise":
    layerwise.check_coverage(model)
  if name != "auto":
    return ENGINES[name]
  chosen, why = choose_engine(model)
  if chosen == "layerwise":
    _log.info("per_example='auto' chose the layer-wise engine for model '%s': %s.",
              model.name, why)
  else:
    _log.warning("per_example='auto' chose the vectorized engine for model '%s' (slower, "
                 "more memory) because there is %s. Register a layer-wise rule to use the "
                 "fast path, or pass per_example='vectorized' to silence this.", model.name, why)
  return ENGINES[chosen]


__all__ = ["DEFAULT_REGISTRY", "EngineOutput", "ENGINES", "ENGINE_NAMES", "LayerRule",
           "UnsupportedLayerError", "choose_engine", "layerwise_engine", "microbatch_engine",
           "registry", "resolve_engine", "validate_engine_name", "vectorized_engine"]
