"""Empirical privacy auditing: a lower bound on epsilon next to every claimed epsilon.

An accountant proves an upper bound on epsilon *if the code does what the
proof assumes*. An audit checks that it does, end to end: train with
canaries, each included with probability 1/2, and measure how well an
adversary tells which ones were in. See ``docs/auditing.md``.

Public API:
  * Bounds (pure functions of counts, :mod:`tf_dpnsgd.audit.bounds`):
    :func:`one_run_epsilon_lower_bound` (Steinke, Nasr, Jagielski 2023),
    :func:`one_run_p_value`, :func:`one_run_max_epsilon`,
    :func:`clopper_pearson_epsilon_lower_bound`, :func:`clopper_pearson_interval`.
  * Guesses (:mod:`tf_dpnsgd.audit.one_run`): :func:`one_run_guesses`,
    :func:`audit_scores` (fixed rule, or the default rules with Bonferroni),
    :class:`OneRunAudit`.
  * Canaries (:mod:`tf_dpnsgd.audit.canaries`): :func:`draw_inclusion`,
    :func:`mislabeled_canaries` (input space, black-box),
    :func:`with_dirac_canaries` / :func:`dirac_canaries` (gradient space,
    white-box), :func:`training_set`.
  * Scores (:mod:`tf_dpnsgd.audit.scoring`): :func:`loss_scores`,
    :func:`margin_scores`, :func:`dirac_scores`.
  * One audited run (:mod:`tf_dpnsgd.audit.experiment`):
    :func:`run_canary_audit` -> :class:`AuditReport`;
    :func:`tf_dpnsgd.audit.plots.plot_scores` draws its score histograms.
  * Command line: ``python -m tf_dpnsgd.launch.audit``.
"""

from tf_dpnsgd.audit import bounds
from tf_dpnsgd.audit import canaries
from tf_dpnsgd.audit import experiment
from tf_dpnsgd.audit import one_run
from tf_dpnsgd.audit import scoring
from tf_dpnsgd.audit.bounds import (clopper_pearson_epsilon_lower_bound, clopper_pearson_interval,
                                    one_run_epsilon_lower_bound, one_run_max_epsilon,
                                    one_run_p_value)
from tf_dpnsgd.audit.canaries import (Canaries, DiracCanaryLogits, dirac_canaries, draw_inclusion,
                                      mislabeled_canaries, training_set, with_dirac_canaries)
from tf_dpnsgd.audit.experiment import AuditReport, run_canary_audit
from tf_dpnsgd.audit.one_run import OneRunAudit, audit_scores, one_run_guesses
from tf_dpnsgd.audit.scoring import dirac_scores, loss_scores, margin_scores

__all__ = [
    "AuditReport", "Canaries", "DiracCanaryLogits", "OneRunAudit", "audit_scores", "bounds",
    "canaries", "clopper_pearson_epsilon_lower_bound", "clopper_pearson_interval",
    "dirac_canaries", "dirac_scores", "draw_inclusion", "experiment", "loss_scores",
    "margin_scores", "mislabeled_canaries", "one_run", "one_run_epsilon_lower_bound",
    "one_run_guesses", "one_run_max_epsilon", "one_run_p_value", "run_canary_audit", "scoring",
    "training_set", "with_dirac_canaries",
]
