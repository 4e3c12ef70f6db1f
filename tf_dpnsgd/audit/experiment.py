"""One audited training run: canaries in, the normal DP training, scores, the bound.

:func:`run_canary_audit` is the whole audit as a library call (plain
arguments; the launcher ``python -m tf_dpnsgd.launch.audit`` reads flags
and calls it, and the test suite calls it directly):

1. draw the canaries' coins (:func:`~tf_dpnsgd.audit.canaries.draw_inclusion`)
   and build ``m`` canaries of the chosen kind;
2. append the included canaries to the real rows; build the
   :class:`~tf_dpnsgd.plan.PrivacyPlan` for the resulting ``N`` (its
   sampler draws the batches, so canaries are Poisson-sampled like any row);
3. train with the DP model, optimizer, dataset and callbacks of the plan,
   exactly as a user would (no step is bypassed), through the launchers' own
   runner (:func:`tf_dpnsgd.runner.build`, :func:`tf_dpnsgd.runner.fit`);
4. the claimed epsilon is ``plan.report(model).epsilon``: what the package
   would print for this model, from its privacy ledger;
5. score all ``m`` canaries on the final model and audit the scores
   (:class:`~tf_dpnsgd.audit.auditor.CanaryScoreAuditor`): Steinke et al.'s and
   the f-DP one-run lower bounds from the same guesses, a Gaussian-DP estimate,
   AUROC and TPR at low FPR.

``noise_multiplier=0`` trains without noise (no plan can claim anything:
the claimed epsilon is infinite); the batches still come from the same
sampler.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Callable, Optional, Sequence

import keras
import numpy as np

import tf_dpnsgd
from tf_dpnsgd import accounting
from tf_dpnsgd import runner
from tf_dpnsgd import sampling as sampling_lib
from tf_dpnsgd.audit import auditor as auditor_lib
from tf_dpnsgd.audit import canaries as canaries_lib
from tf_dpnsgd.audit import one_run
from tf_dpnsgd.audit import report as report_lib
from tf_dpnsgd.audit import scoring
from tf_dpnsgd.plan import PrivacyPlan

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


@dataclasses.dataclass(frozen=True)
class AuditReport:
  """What one audited run found (``to_dict()`` is ``audit_report.json``).

  Attributes:
    canary_kind: ``"input"`` (black-box) or ``"gradient"`` (white-box Dirac).
    score: ``"loss"``, ``"margin"`` (input canaries) or ``"dirac"``.
    epsilon_claimed: the package's epsilon for the model (``inf`` without noise).
    delta: the claimed delta (also the delta of the audit's null hypothesis).
    epsilon_lower_bound: Steinke et al.'s one-run bound at ``confidence``.
    confidence: each bound's overall confidence (Bonferroni over the rules included).
    audit: the winning rule's counts for that bound
      (:class:`~tf_dpnsgd.audit.one_run.OneRunAudit`).
    clopper_pearson: the classic bound on the same scores, for comparison only
      (not valid from one run).
    scores, included: the ``m`` scores and coins.
    noise_multiplier: the noise multiplier given to the optimizer.
    optimizer: the optimizer's class name.
    steps, dataset_size, batch_size, sampling: what ran (from the ledger and plan).
    privacy: ``plan.report(model).to_dict()`` (None without noise).
    test_accuracy: the audited model's accuracy on the test rows, if given.
    timings: seconds for ``train``, ``score`` (all ``m`` canaries) and ``bound``.
    canary_audit: everything the auditor measured on the same scores
      (:class:`~tf_dpnsgd.audit.auditor.CanaryAudit`): both lower bounds (Steinke et al.,
      f-DP), the Gaussian-DP estimate, AUROC, TPR at low FPR.
  """

  canary_kind: str
  score: str
  epsilon_claimed: float
  delta: float
  epsilon_lower_bound: float
  confidence: float
  audit: one_run.OneRunAudit
  clopper_pearson: dict
  scores: np.ndarray
  included: np.ndarray
  noise_multiplier: float
  optimizer: str
  steps: int
  dataset_size: int
  batch_size: int
  sampling: str
  privacy: Optional[dict]
  test_accuracy: Optional[float]
  timings: dict
  canary_audit: Optional[auditor_lib.CanaryAudit] = None

  @property
  def num_canaries(self) -> int:
    return int(len(self.scores))

  @property
  def epsilon_lower_bound_fdp(self) -> Optional[float]:
    """The f-DP one-run bound (Mahloujifar, Melis, Chaudhuri 2025) on the same scores."""
    if self.canary_audit is None:
      return None
    return self.canary_audit.fdp.epsilon_lower_bound

  @property
  def lower_bounds(self) -> dict:
    """``{method: bound}`` of every one-run lower bound computed."""
    out = {auditor_lib.STEINKE: float(self.epsilon_lower_bound)}
    if self.canary_audit is not None:
      out[auditor_lib.FDP] = float(self.canary_audit.fdp.epsilon_lower_bound)
    return out

  @property
  def contradicts_claim(self) -> bool:
    """True if a lower bound exceeds the claimed epsilon (the claim is refuted, at the
    bound's confidence; for the f-DP bound: the mechanism is not even as private as the
    Gaussian curve through the claimed (epsilon, delta))"""
    return max(self.lower_bounds.values()) > self.epsilon_claimed

  def summary(self) -> dict:
    """The audit in a few JSON-ready fields (no scores), to sit next to a claimed epsilon,
    e.g. as ``privacy_report.json``'s ``"audit"`` entry."""
    d = self.to_dict()
    keys = ("epsilon_claimed", "epsilon_lower_bound", "epsilon_lower_bound_fdp", "delta",
            "confidence", "contradicts_claim", "canary_kind", "score", "num_canaries",
            "num_included", "k_plus", "k_minus", "num_guesses", "num_correct", "bound")
    return {k: d[k] for k in keys if k in d}

  def audit_block(self) -> dict:
    """The ``"audit"`` entry for ``privacy_report.json``
    (:func:`tf_dpnsgd.audit.report.audit_block`)."""
    return report_lib.audit_block(
        self.epsilon_claimed, self.canary_audit, canary_kind=self.canary_kind, score=self.score,
        num_canaries=self.num_canaries, num_included=int(np.sum(self.included)),
        sampling=self.sampling, accuracy_with_canaries=self.test_accuracy)

  def to_dict(self) -> dict:
    """JSON-ready; an infinite claimed epsilon is written as ``null`` with a note."""
    claimed = None if math.isinf(self.epsilon_claimed) else float(self.epsilon_claimed)
    out = {
        "epsilon_claimed": claimed,
        "epsilon_lower_bound": float(self.epsilon_lower_bound),
        "delta": float(self.delta),
        "confidence": float(self.confidence),
        "contradicts_claim": bool(self.contradicts_claim),
        "canary_kind": self.canary_kind,
        "score": self.score,
        "num_canaries": self.num_canaries,
        "num_included": int(np.sum(self.included)),
        "k_plus": self.audit.k_plus,
        "k_minus": self.audit.k_minus,
        "num_guesses": self.audit.num_guesses,
        "num_correct": self.audit.num_correct,
        "correct_in": self.audit.correct_in,
        "correct_out": self.audit.correct_out,
        "num_rules": self.audit.num_rules,
        "rule_confidence": self.audit.confidence,
        "bound": ("Steinke, Nasr, Jagielski (2023), one run: P[correct >= v] <= "
                  "f(v) + 2 m delta max_i (f(v-i) - f(v))/i, f = tail of "
                  "Binomial(r, e^eps/(1+e^eps)); best of num_rules fixed top-k+/bottom-k- "
                  "threshold rules at confidence 1 - beta/num_rules (Bonferroni); the f-DP "
                  "bound of the same guesses is in canary_audit"),
        "clopper_pearson_comparison": self.clopper_pearson,
        "epsilon_lower_bound_fdp": (None if self.epsilon_lower_bound_fdp is None
                                    else float(self.epsilon_lower_bound_fdp)),
        "canary_audit": (None if self.canary_audit is None else self.canary_audit.to_dict()),
        "noise_multiplier": float(self.noise_multiplier),
        "optimizer": self.optimizer,
        "steps": int(self.steps),
        "dataset_size": int(self.dataset_size),
        "batch_size": int(self.batch_size),
        "sampling": self.sampling,
        "test_accuracy": self.test_accuracy,
        "timings_seconds": {k: float(v) for k, v in self.timings.items()},
        "scores_in": [float(s) for s in self.scores[self.included]],
        "scores_out": [float(s) for s in self.scores[~self.included]],
        "privacy_report": self.privacy,
    }
    if claimed is None:
      out["epsilon_claimed_note"] = ("trained without noise: no privacy claim (epsilon is "
                                     "infinite)")
    if self.sampling != "poisson":
      out["sampling_note"] = (
          f"{self.sampling} sampling is accounted under replace-one neighbours; the one-run "
          "theorem is about including or excluding each canary (add/remove), so the two "
          "epsilons are not about the same neighbouring relation: indicative only.")
    return out


def run_canary_audit(build_model: Callable[[], keras.Model], train: tuple, *, num_classes: int,
                     canary_kind: str, num_canaries: int,
                     make_optimizer: Callable[[float], keras.optimizers.Optimizer],
                     batch_size: int, epochs: Optional[float] = None,
                     steps: Optional[int] = None, noise_multiplier: Optional[float] = None,
                     target_epsilon: Optional[float] = None, delta: float = 1e-5,
                     sampling: str = "poisson", accountant: str = "rdp",
                     conversion: str = "modern", canary_pool: Optional[tuple] = None,
                     score: str = "loss", confidence: float = 0.95,
                     k_plus: Optional[int] = None, k_minus: Optional[int] = None,
                     rules: Optional[Sequence[tuple]] = None, strategy=None,
                     gradient_norm: Optional[float] = None, audit_seed: Optional[int] = None,
                     sampler_seed: Optional[int] = None, test: Optional[tuple] = None,
                     per_example: str = "auto", physical_batch_size: Optional[int] = None,
                     verbose: int = 0, callbacks: Sequence = (),
                     log: Optional[Callable[[str], None]] = None) -> AuditReport:
  """Trains ``build_model()`` with ``num_canaries`` canaries and audits the result.

  Args:
    build_model: returns a fresh Keras model ``x -> num_classes logits`` (not private).
    train: ``(x, y)`` real training rows.
    num_classes: ``K``.
    canary_kind: ``"gradient"`` (white-box Dirac canaries, any ``build_model``) or
      ``"input"`` (black-box mislabeled examples from ``canary_pool``).
    num_canaries: ``m``.
    make_optimizer: ``sigma -> DP optimizer`` (e.g. ``lambda s: DPSGD(..., noise_multiplier=s)``);
      called with the plan's training noise multiplier (or 0).
    batch_size, epochs | steps, noise_multiplier | target_epsilon, delta, sampling,
      accountant, conversion: the :class:`~tf_dpnsgd.plan.PrivacyPlan`;
      ``noise_multiplier=0`` trains without noise (claimed epsilon infinite).
    canary_pool: ``(x, y)`` real examples outside ``train`` for input canaries.
    score: black-box score, ``"loss"`` or ``"margin"`` (gradient canaries use ``"dirac"``).
    confidence, k_plus, k_minus, rules: the guessing rules (a fixed ``(k_plus, k_minus)``,
      the ``rules`` to try, or the default grid; Bonferroni over the rules tried), as
      :func:`~tf_dpnsgd.audit.one_run.audit_scores`.
    strategy: instead, an :class:`~tf_dpnsgd.audit.auditor.TopK` or
      :class:`~tf_dpnsgd.audit.auditor.Split` threshold strategy.
    gradient_norm: Dirac canaries' gradient norm (default 100 x the sensitivity).
    audit_seed: seed of the coins and canary choice (``None``: OS; fix it only in tests).
    sampler_seed: the plan's sampler seed (``None``: OS).
    test: optional ``(x, y)`` for the audited model's test accuracy.
    per_example, physical_batch_size: as :func:`tf_dpnsgd.make_private`.
    verbose, callbacks: passed to ``fit`` (after the plan's callbacks).
    log: optional ``print``-like function for progress lines.

  Returns:
    The :class:`AuditReport`.
  """
  log = log or (lambda _: None)
  if canary_kind not in canaries_lib.KINDS:
    raise ValueError(f"`canary_kind` must be one of {canaries_lib.KINDS}; got {canary_kind!r}.")
  no_noise = noise_multiplier is not None and float(noise_multiplier) == 0.0
  x_real, y_real = np.asarray(train[0], np.float32), np.asarray(train[1], np.int32)
  audit_seed = tf_dpnsgd.noise.random_seed() if audit_seed is None else int(audit_seed)
  included = canaries_lib.draw_inclusion(num_canaries, audit_seed)

  # Canaries and the model under audit.
  base = build_model()
  if canary_kind == "gradient":
    if gradient_norm is None:
      sensitivity = make_optimizer(1.0).transform.sensitivity
      gradient_norm = canaries_lib.DEFAULT_GRADIENT_NORM_OVER_SENSITIVITY * sensitivity
    canaries = canaries_lib.dirac_canaries(x_real.shape[1:], num_canaries, num_classes,
                                           included, gradient_norm)
    audited = canaries_lib.with_dirac_canaries(base, num_canaries)
    score = "dirac"
  else:
    if canary_pool is None:
      raise ValueError("Input canaries need `canary_pool`: real examples not in `train`.")
    canaries = canaries_lib.mislabeled_canaries(canary_pool[0], canary_pool[1], num_canaries,
                                                num_classes, included, seed=audit_seed)
    audited = base
    if score not in scoring.SCORES:
      raise ValueError(f"`score` must be one of {scoring.SCORES}; got {score!r}.")
  x, y = canaries_lib.training_set(x_real, y_real, canaries)
  n = len(y)

  # The plan of this training set (or, without noise, the same sampler alone).
  if no_noise:
    num_steps = steps if steps is not None else accounting.planned_steps(epochs, n, batch_size, sampling)
    sampler = sampling_lib.make_sampler(sampling, n, batch_size, seed=sampler_seed)
    plan, sigma = None, 0.0
  else:
    plan = PrivacyPlan(dataset_size=n, batch_size=batch_size, sampling=sampling, delta=delta,
                       steps=steps, epochs=None if steps is not None else epochs,
                       noise_multiplier=noise_multiplier, target_epsilon=target_epsilon,
                       accountant=accountant, conversion=conversion, seed=sampler_seed)
    num_steps, sigma = plan.num_steps, plan.training_noise_multiplier
    sampler = None

  optimizer = make_optimizer(sigma)
  _, model = runner.build(lambda: audited, optimizer, loss=LOSS, metrics=["accuracy"],
                          plan=plan, per_example=per_example,
                          physical_batch_size=physical_batch_size)
  initial_table = (canaries_lib.dirac_table(model).copy() if canary_kind == "gradient" else None)
  log(f"audit: {canary_kind} canaries, m={num_canaries} ({int(included.sum())} in), N={n}, "
      f"B={batch_size}, {num_steps} steps, sigma={sigma:.4g}, {type(optimizer).__name__}")

  trained = runner.fit(model, x, y, total_steps=num_steps, plan=plan, sampler=sampler,
                       stop_after=None if plan is not None else num_steps,
                       callbacks=callbacks, verbose=verbose)
  train_seconds, steps_taken = trained.seconds, trained.steps
  privacy = None
  claimed = math.inf
  if trained.report is not None:
    privacy, claimed = trained.report.to_dict(), float(trained.report.epsilon)

  # Scores of all m canaries (in and out) on the final model, then the bound.
  start = time.perf_counter()
  if canary_kind == "gradient":
    scores = scoring.dirac_scores(model, initial_table)
  else:
    scores = scoring.input_scores(model, canaries.x, canaries.y, score)
  score_seconds = time.perf_counter() - start
  start = time.perf_counter()
  strategy = _strategy(k_plus, k_minus, rules, strategy)
  canary_audit = auditor_lib.CanaryScoreAuditor.from_scores(scores, included).audit(
      delta, confidence, strategy=strategy)
  audit = _one_run_audit(canary_audit.steinke, delta)
  cp = one_run.clopper_pearson_comparison(scores, included, delta=delta, confidence=confidence)
  bound_seconds = time.perf_counter() - start

  test_accuracy = None
  if test is not None:
    x_test = np.asarray(test[0], np.float32)
    if canary_kind == "gradient":
      x_test = canaries_lib.as_dirac_inputs(x_test)
    logits = model.predict(x_test, batch_size=1024, verbose=0)
    test_accuracy = float(np.mean(np.argmax(logits, -1) == np.asarray(test[1])))
  log(f"audit: claimed epsilon {claimed:.4g}, lower bounds {audit.epsilon_lower_bound:.4g} "
      f"(Steinke et al., {audit.num_correct}/{audit.num_guesses} correct, k+={audit.k_plus}, "
      f"k-={audit.k_minus}) and {canary_audit.fdp.epsilon_lower_bound:.4g} (f-DP); "
      f"train {train_seconds:.1f} s, score {score_seconds:.3f} s")
  return AuditReport(
      canary_kind=canary_kind, score=score, epsilon_claimed=claimed, delta=float(delta),
      epsilon_lower_bound=audit.epsilon_lower_bound, confidence=float(confidence), audit=audit,
      clopper_pearson=cp, scores=np.asarray(scores, np.float64), included=included,
      noise_multiplier=float(sigma), optimizer=type(optimizer).__name__, steps=steps_taken,
      dataset_size=n, batch_size=int(batch_size), sampling=sampling, privacy=privacy,
      test_accuracy=test_accuracy,
      timings={"train": train_seconds, "score": score_seconds, "bound": bound_seconds},
      canary_audit=canary_audit)


def _strategy(k_plus, k_minus, rules, strategy):
  """The auditor's threshold strategy from the rule arguments of :func:`run_canary_audit`."""
  if (k_plus is None) != (k_minus is None):
    raise ValueError("Give both `k_plus` and `k_minus`, or neither (then the default rules "
                     "are tried with a Bonferroni correction).")
  given = [k_plus is not None, rules is not None, strategy is not None]
  if sum(given) > 1:
    raise ValueError("Give at most one of (`k_plus`, `k_minus`), `rules` and `strategy`.")
  if strategy is not None:
    return strategy
  if k_plus is not None:
    return auditor_lib.TopK(rules=((int(k_plus), int(k_minus)),))
  return auditor_lib.TopK(rules=None if rules is None else tuple(tuple(r) for r in rules))


def _one_run_audit(bound: auditor_lib.BoundResult, delta: float) -> one_run.OneRunAudit:
  return one_run.OneRunAudit(
      num_canaries=bound.num_canaries, k_plus=bound.k_plus, k_minus=bound.k_minus,
      num_guesses=bound.num_guesses, num_correct=bound.num_correct,
      correct_in=bound.correct_in, correct_out=bound.correct_out, delta=float(delta),
      confidence=bound.rule_confidence, num_rules=bound.num_rules,
      epsilon_lower_bound=bound.epsilon_lower_bound)


__all__ = ["AuditReport", "LOSS", "run_canary_audit"]
