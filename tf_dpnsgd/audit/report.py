"""The ``"audit"`` block a run's ``privacy_report.json`` carries next to its claimed epsilon.

:func:`audit_block` turns one audit (:class:`~tf_dpnsgd.audit.auditor.CanaryAudit`)
into the JSON entry written by ``python -m tf_dpnsgd.launch.audit`` and by every
training launcher run with ``--audit_canaries``: the claim, each lower bound
with its method and confidence, the canaries, the utility cost when measured,
and what the comparison means (:data:`INTERPRETATION`).
"""

from __future__ import annotations

import math
from typing import Optional

from tf_dpnsgd.audit import auditor as auditor_lib

INTERPRETATION = (
    "A lower bound below the claimed epsilon is the expected outcome: it is consistent with "
    "the claim but does not prove it (one-run audits of a correct mechanism stay well below "
    "its claim, docs/auditing.md). A lower bound above the claimed epsilon refutes the claim "
    "at the stated confidence: training did not do what the accountant was told (a bug: "
    "too little noise, no clipping, repeated noise, ...), or, for the f-DP bound only, the "
    "mechanism is not as private as the Gaussian trade-off curve through the claimed "
    "(epsilon, delta).")


def audit_block(epsilon_claimed: Optional[float], canary_audit: auditor_lib.CanaryAudit, *,
                canary_kind: str, score: str, num_canaries: int, num_included: int,
                sampling: str = "poisson", accuracy_with_canaries: Optional[float] = None,
                accuracy_without_canaries: Optional[float] = None) -> dict:
  """The ``"audit"`` entry of ``privacy_report.json``: the claim, each lower bound with
  its method and confidence, the canaries, the utility cost (when measured) and what the
  comparison means (:data:`INTERPRETATION`). JSON-ready (an infinite claim is ``None``).

  Args:
    epsilon_claimed: the run's claimed epsilon (``None`` or inf: no claim).
    canary_audit: :meth:`~tf_dpnsgd.audit.auditor.CanaryScoreAuditor.audit` of the scores.
    canary_kind, score, num_canaries, num_included: what was inserted and how it was scored.
    sampling: the plan's sampling (not ``poisson``: the comparison is indicative only).
    accuracy_with_canaries, accuracy_without_canaries: test accuracy of this run and of a
      run without canaries (``None``: not measured).
  """
  claimed = (None if epsilon_claimed is None or math.isinf(float(epsilon_claimed))
             else float(epsilon_claimed))
  lower = []
  for method, b in canary_audit.bounds.items():
    lower.append({"method": method, "reference": auditor_lib.METHOD_NAMES[method],
                  "epsilon_lower_bound": float(b.epsilon_lower_bound),
                  "confidence": float(b.confidence), "strategy": b.strategy,
                  "num_rules": int(b.num_rules), "num_guesses": int(b.num_guesses),
                  "num_correct": int(b.num_correct),
                  "exceeds_claim": bool(claimed is not None
                                        and b.epsilon_lower_bound > claimed)})
  cost = None
  if accuracy_with_canaries is not None and accuracy_without_canaries is not None:
    cost = float(accuracy_without_canaries) - float(accuracy_with_canaries)
  block = {
      "epsilon_claimed": claimed,
      "delta": float(canary_audit.delta),
      "lower_bounds": lower,
      "contradicts_claim": any(b["exceeds_claim"] for b in lower),
      "gdp_epsilon_estimate": float(canary_audit.gdp_epsilon_estimate),
      "gdp_estimate_note": ("an estimate, not a bound (Gaussian curve fitted to the ROC, "
                            "canaries treated as independent trials)"),
      "auroc": float(canary_audit.auroc),
      "tpr_at_fpr": {f"{k:g}": float(v) for k, v in canary_audit.tpr_at_fpr.items()},
      "num_canaries": int(num_canaries),
      "num_included": int(num_included),
      "canary_kind": canary_kind,
      "score": score,
      "utility": {"test_accuracy_with_canaries": accuracy_with_canaries,
                  "test_accuracy_without_canaries": accuracy_without_canaries,
                  "accuracy_cost": cost,
                  "note": ("the released model was trained with the included canaries; "
                           "without_canaries is a second run of the same configuration "
                           "(None: not measured)")},
      "interpretation": INTERPRETATION,
  }
  if claimed is None:
    block["epsilon_claimed_note"] = "no privacy claim (no noise): any bound is consistent"
  if sampling != "poisson":
    block["sampling_note"] = (
        f"{sampling} sampling is accounted under replace-one neighbours; the one-run "
        "theorems are about including or excluding each canary: indicative only.")
  return block


__all__ = ["INTERPRETATION", "audit_block"]
