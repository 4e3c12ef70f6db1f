"""Engines that turn a batch into the sum of transformed per-unit gradients.

Every engine has the signature::

    engine(model, loss_fn, x, y, transform, mask=None, num_microbatches=None)
        -> EngineOutput

and guarantees that ``EngineOutput.summed`` equals ``sum_u h_u g_u`` where
``g_u`` is unit ``u``'s gradient (an example, or a microbatch's mean loss),
``h_u = transform.factors(||g_u||, mask)``, and units with ``h_u = 0``
(masked, or non-finite gradient) contribute exactly zero.

Engines (``per_example=`` on ``DPModel`` / ``make_private``):
  * ``"vectorized"``: :func:`vectorized.vectorized_engine`, per-example
    gradients with ``tf.vectorized_map`` (any model whose ops pfor supports).
  * ``"auto"``: picks an engine for the model and logs which and why.
"""

from __future__ import annotations

import logging

from tf_dpnsgd.per_example import vectorized
from tf_dpnsgd.per_example.base import EngineOutput
from tf_dpnsgd.per_example.vectorized import vectorized_engine

ENGINES = {"vectorized": vectorized_engine}
ENGINE_NAMES = ("auto",) + tuple(ENGINES)

_log = logging.getLogger(__name__)


def validate_engine_name(name: str) -> str:
  if name not in ENGINE_NAMES:
    raise ValueError(f"`per_example` must be one of {ENGINE_NAMES}; got {name!r}.")
  return name


def resolve_engine(model, name: str):
  """Returns the engine function for ``model``; ``"auto"`` logs its choice once."""
  validate_engine_name(name)
  if name != "auto":
    return ENGINES[name]
  _log.info("per_example='auto' chose the vectorized engine for model '%s'.", model.name)
  return vectorized_engine


__all__ = ["EngineOutput", "ENGINES", "ENGINE_NAMES", "resolve_engine", "validate_engine_name",
           "vectorized_engine"]
