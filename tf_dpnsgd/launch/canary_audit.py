"""``--audit_canaries=N``: an empirical privacy audit inside a training launcher's own run.

The quickstart, MNIST and SST-2 launchers call :func:`run_experiment`
instead of :func:`tf_dpnsgd.launch.common.run_experiment`. With
``--audit_canaries=0`` (the default) it is exactly that call. With ``N > 0``
the run trains with ``N`` canaries, each included with probability 1/2 (coins
from the OS), as ordinary rows of the training set: the plan is built for the
real rows plus the included canaries, its sampler draws them like any row,
and the normal DP train step (per-example engine, transform, noise, ledger)
processes them. After training the canaries are scored on the final model and
audited (:class:`tf_dpnsgd.audit.CanaryScoreAuditor`: Steinke et al.'s and the
f-DP one-run lower bounds from the same guesses); ``privacy_report.json`` (in
``--model_dir`` and ``--export_dir``) gains an ``"audit"`` entry
(:func:`tf_dpnsgd.audit.audit_block`).

* ``--audit_canary_kind=gradient`` (white-box, the default): Dirac canaries
  (:func:`tf_dpnsgd.audit.with_dirac_canaries`): the trained model carries a
  canary head (an ``Embedding(N, 1)`` table) whose entries are the scores.
  The export is the user's model without the head (same trained weights).
  Needs a model with one input tensor (not the SST-2 text models).
* ``--audit_canary_kind=input`` (black-box): the last ``N`` training rows
  become canaries with a wrong label (so the real training set is ``N`` rows
  smaller); scored by ``--audit_score`` (the final model's loss or margin).

``--audit_baseline`` also trains once without canaries (same flags, nothing
written) to measure the utility cost. Input canaries (rows of the private training
set) and the baseline's accuracy are releases outside the run's epsilon: the
report's ``not_covered`` lists them (:func:`not_covered`). An audited run does not resume from a
checkpoint (its coins are not saved) and does not run on several workers
(each would draw its own coins): both are refused.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Callable, Optional

from absl import flags
import numpy as np

from tf_dpnsgd import audit
from tf_dpnsgd.audit import canaries as canaries_lib
from tf_dpnsgd.audit import scoring
from tf_dpnsgd.launch import common


@dataclasses.dataclass(frozen=True)
class AuditSpec:
  """What to audit (from the flags): ``num_canaries`` (0: no audit), ``kind``, ``score``,
  ``confidence``, ``baseline`` (also train without canaries)."""

  num_canaries: int = 0
  kind: str = "gradient"
  score: str = "loss"
  confidence: float = 0.95
  baseline: bool = False

  def __post_init__(self):
    if self.num_canaries < 0:
      raise common.LaunchError(f"--audit_canaries must be >= 0; got {self.num_canaries}.")
    if self.kind not in canaries_lib.KINDS:
      raise common.LaunchError(f"--audit_canary_kind must be one of {canaries_lib.KINDS}.")
    if self.score not in scoring.SCORES:
      raise common.LaunchError(f"--audit_score must be one of {scoring.SCORES}.")
    if not 0 < self.confidence < 1:
      raise common.LaunchError(f"--audit_confidence must lie in (0, 1); got {self.confidence}.")


def define_flags(flag_values: Optional[flags.FlagValues] = None) -> None:
  """Defines ``--audit_canaries``, ``--audit_canary_kind``, ``--audit_score``,
  ``--audit_confidence`` and ``--audit_baseline``."""
  kw = {"flag_values": flags.FLAGS if flag_values is None else flag_values}
  flags.DEFINE_integer("audit_canaries", 0,
                       "Audit this run with N canaries, each included with probability 1/2 "
                       "(0: no audit). privacy_report.json gains an 'audit' entry.", **kw)
  flags.DEFINE_enum("audit_canary_kind", "gradient", canaries_lib.KINDS,
                    "gradient: white-box Dirac canaries (a canary head, not exported); input: "
                    "the last N training rows with wrong labels (black-box).", **kw)
  flags.DEFINE_enum("audit_score", "loss", scoring.SCORES,
                    "Score of input canaries: -loss or logit margin of the canary label.", **kw)
  flags.DEFINE_float("audit_confidence", 0.95, "Confidence of each lower bound.", **kw)
  flags.DEFINE_boolean("audit_baseline", False,
                       "Also train once without canaries (nothing written) to report the "
                       "audit's utility cost.", **kw)


def spec_from_flags(flag_values: Optional[flags.FlagValues] = None) -> AuditSpec:
  fv = flags.FLAGS if flag_values is None else flag_values
  return AuditSpec(num_canaries=fv.audit_canaries, kind=fv.audit_canary_kind,
                   score=fv.audit_score, confidence=fv.audit_confidence,
                   baseline=fv.audit_baseline)


def _check_can_audit(cfg: common.ExperimentConfig, spec: AuditSpec, n: int, batch: int) -> None:
  if cfg.noise != "independent":
    raise common.LaunchError(
        f"--audit_canaries audits independent noise under the run's sampling; it does not "
        f"support --noise={cfg.noise} (cyclic Poisson parts and correlated noise). Audit "
        "without --noise, or drop --audit_canaries.")
  if cfg.distribution_strategy == "multi_worker":
    raise common.LaunchError("--audit_canaries does not run under multi_worker (each worker "
                             "would draw its own coins); audit on one worker.")
  if cfg.model_dir and os.path.exists(os.path.join(cfg.model_dir, "checkpoint.weights.h5")):
    raise common.LaunchError(
        f"--audit_canaries cannot resume {cfg.model_dir}: the canaries' coins are drawn per run "
        "and never saved. Use a new --model_dir.")
  if spec.kind == "input" and n - spec.num_canaries < batch:
    raise common.LaunchError(
        f"--audit_canary_kind=input takes the last {spec.num_canaries} of {n} training rows as "
        f"canaries, leaving fewer real rows than --batch_size={batch}.")


def not_covered(spec: AuditSpec) -> tuple:
  """What the audit entry of the report releases outside the run's epsilon (sentences for
  ``not_covered``; empty for a gradient audit without baseline).

  The audit reads the trained model, the canaries, the coins (OS, independent of the data)
  and the test set. Gradient canaries are synthetic and the scores are the trained
  model's canary table: post-processing of the DP release, covered. Input canaries are
  the last ``m`` rows of the private training set: those not included never pass
  through the Gaussian mechanism, yet their scores decide the audit's correct guesses,
  AUROC, TPR and bounds. ``--audit_baseline`` trains a second model on the same rows:
  its accuracy is a second release, composed with nothing in the report's epsilon.
  """
  if not spec.num_canaries:
    return ()
  items = []
  if spec.kind == "input":
    items.append(
        f"Canary audit (the report's 'audit' entry): its {spec.num_canaries} input canaries "
        f"are the last {spec.num_canaries} rows of the private training set; those not "
        "included never passed through the Gaussian mechanism, and the audit's numbers "
        "(correct guesses, AUROC, TPR, lower bounds) are computed from their scores, outside "
        "the epsilon. Do not publish the audit entry, or audit with "
        "--audit_canary_kind=gradient (synthetic canaries).")
  if spec.baseline:
    items.append(
        "Canary audit baseline (audit.utility.test_accuracy_without_canaries): the accuracy "
        "of a second model trained on the same private rows; the epsilon covers this run "
        "only, not that second release.")
  return tuple(items)


def _gradient_norm(cfg: common.ExperimentConfig) -> float:
  """Dirac canaries' gradient norm: 100 x the transform's sensitivity (any norm for SGD)."""
  if not cfg.private:
    return canaries_lib.DEFAULT_GRADIENT_NORM_OVER_SENSITIVITY
  optimizer = common.make_optimizer(cfg, 1.0, 1)
  return canaries_lib.DEFAULT_GRADIENT_NORM_OVER_SENSITIVITY * float(
      optimizer.transform.sensitivity)


def _check_single_input(model) -> None:
  inputs = getattr(model, "inputs", None)
  if not inputs or len(inputs) != 1:
    raise common.LaunchError(
        "--audit_canary_kind=gradient needs a functional model with one input tensor (the "
        "Dirac canary head adds its own inputs); use --audit_canary_kind=input for this model.")


def run_experiment(cfg: common.ExperimentConfig, spec: AuditSpec,
                   build_model: Callable, train: tuple, test: tuple, *, num_classes: int,
                   loss, export_fn=None, print_fn=None, **kwargs):
  """:func:`tf_dpnsgd.launch.common.run_experiment`, audited when ``spec.num_canaries > 0``.

  Args:
    cfg, build_model, train, test, loss, export_fn, print_fn, kwargs: as
      :func:`~tf_dpnsgd.launch.common.run_experiment` (``train``/``test`` arrays).
    spec: the audit (:func:`spec_from_flags`).
    num_classes: ``K`` (canary labels).

  Returns:
    ``(record, audit_block)``: the run's :class:`~tf_dpnsgd.records.RunRecord` (its
    ``extra["audit"]`` is the block, also written to ``privacy_report.json``) and the
    block (``None`` without an audit).
  """
  if spec.num_canaries == 0:
    return common.run_experiment(cfg, build_model, train, test, loss=loss, export_fn=export_fn,
                                 print_fn=print_fn, **kwargs), None
  m = spec.num_canaries
  x_train, y_train = train[0], np.asarray(train[1], np.int32)
  _check_can_audit(cfg, spec, len(y_train), cfg.batch_size)
  baseline_accuracy = None
  if spec.baseline:
    plain = dataclasses.replace(cfg, model_dir=None, export_dir=None)
    baseline = common.run_experiment(plain, build_model, train, test, loss=loss, **kwargs)
    baseline_accuracy = baseline.metric("accuracy")
  included = canaries_lib.draw_inclusion(m)
  holder = {}
  if spec.kind == "gradient":
    def build():
      holder["model"] = build_model()
      _check_single_input(holder["model"])
      return canaries_lib.with_dirac_canaries(holder["model"], m)
    if isinstance(x_train, dict):
      raise common.LaunchError(
          "--audit_canary_kind=gradient needs a model with one input tensor (the Dirac canary "
          "head adds its own inputs); use --audit_canary_kind=input for this model.")
    canaries = canaries_lib.dirac_canaries(np.shape(x_train)[1:], m, num_classes, included,
                                           _gradient_norm(cfg))
    real = (x_train, y_train)
    test = (canaries_lib.as_dirac_inputs(test[0]), test[1])
    audited_export = None if export_fn is None else (
        lambda _wrapper, export_dir: export_fn(holder["model"], export_dir))
    score_name = "dirac"
  else:
    build, audited_export, score_name = build_model, export_fn, spec.score
    n = len(y_train)
    real = (canaries_lib.take_rows(x_train, np.arange(n - m)), y_train[:n - m])
    canaries = canaries_lib.mislabeled_canaries(
        canaries_lib.take_rows(x_train, np.arange(n - m, n)), y_train[n - m:], m, num_classes,
        included)
  x, y = canaries_lib.training_set(real[0], real[1], canaries)

  def after_training(model, plan, final_metrics):
    if spec.kind == "gradient":
      scores = scoring.dirac_scores(model)
    else:
      scores = scoring.input_scores(model, canaries.x, canaries.y, spec.score)
    claimed = plan.report(model).epsilon if plan is not None else None
    delta = cfg.delta
    result = audit.CanaryScoreAuditor.from_scores(scores, included).audit(
        delta, spec.confidence)
    block = audit.audit_block(
        claimed, result, canary_kind=spec.kind, score=score_name, num_canaries=m,
        num_included=int(included.sum()), sampling=cfg.sampling,
        accuracy_with_canaries=final_metrics.get("accuracy"),
        accuracy_without_canaries=baseline_accuracy)
    holder["block"] = block
    return {"audit": block}

  record = common.run_experiment(cfg, build, (x, y), test, loss=loss, export_fn=audited_export,
                                 print_fn=print_fn, after_training=after_training,
                                 not_covered=tuple(kwargs.pop("not_covered", ())) +
                                 not_covered(spec), **kwargs)
  return record, holder["block"]


def print_audit(block: Optional[dict], print_fn=print) -> None:
  """Prints the claim and both lower bounds, one line each, and what they mean."""
  if block is None:
    return
  claimed = block["epsilon_claimed"]
  claim = "inf (no noise)" if claimed is None else f"{claimed:.3f}"
  print_fn(f"audit ({block['num_canaries']} {block['canary_kind']} canaries, "
           f"{block['num_included']} in): claimed epsilon {claim} (delta {block['delta']:g})")
  for b in block["lower_bounds"]:
    name = {"steinke": "Steinke et al. 2023", "fdp": "f-DP, Mahloujifar et al. 2025"}.get(
        b["method"], b["method"])
    print_fn(f"  lower bound {b['epsilon_lower_bound']:.3f} at {b['confidence']:.0%} ({name}; "
             f"{b['num_correct']}/{b['num_guesses']} correct guesses)")
  utility = block["utility"]
  if utility["accuracy_cost"] is not None:
    print_fn(f"  test accuracy {utility['test_accuracy_with_canaries']:.4f} with canaries, "
             f"{utility['test_accuracy_without_canaries']:.4f} without")
  if block["contradicts_claim"]:
    print_fn("  WARNING: a lower bound exceeds the claimed epsilon: the mechanism does not do "
             "what the accountant assumes (see the report's interpretation).")
  else:
    print_fn("  a lower bound below the claim is the expected outcome (consistent with it, "
             "not a proof of it).")


__all__ = ["AuditSpec", "define_flags", "not_covered", "print_audit", "run_experiment",
           "spec_from_flags"]
