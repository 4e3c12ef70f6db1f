"""Empirical privacy auditing: a lower bound on epsilon next to every claimed epsilon.

An accountant proves an upper bound on epsilon *if the code does what the
proof assumes*. An audit checks that it does, end to end: train with
canaries, each included with probability 1/2, and measure how well an
adversary tells which ones were in. See ``docs/auditing.md``.

Public API:
  * Bounds (pure functions of counts, :mod:`tf_dpnsgd.audit.bounds`):
    :func:`one_run_epsilon_lower_bound` (Steinke, Nasr, Jagielski 2023),
    :func:`one_run_p_value`, :func:`one_run_max_epsilon`,
    :func:`clopper_pearson_epsilon_lower_bound`, :func:`clopper_pearson_interval`;
    f-DP (:mod:`tf_dpnsgd.audit.fdp`): :func:`fdp_one_run_epsilon_lower_bound`
    (Mahloujifar, Melis, Chaudhuri 2025), :func:`fdp_one_run_max_epsilon`, the Gaussian
    curve (:func:`gaussian_dp_mu`, :func:`gaussian_dp_epsilon`).
  * The auditor (:mod:`tf_dpnsgd.audit.auditor`): :class:`CanaryScoreAuditor` (in/out
    canary scores -> both one-run bounds and the measures of :mod:`tf_dpnsgd.audit.measures`:
    :func:`gdp_epsilon_estimate` (an estimate, not a bound), :func:`tpr_at_fpr`,
    :func:`auroc`), threshold strategies :class:`TopK` (Bonferroni) and :class:`Split`.
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
    :func:`run_canary_audit` -> :class:`AuditReport`; :func:`audit_block` (the ``"audit"``
    entry of ``privacy_report.json``, :mod:`tf_dpnsgd.audit.report`);
    :func:`tf_dpnsgd.audit.plots.plot_scores` draws its score histograms.
  * Command line: ``python -m tf_dpnsgd.launch.audit``.
"""

from tf_dpnsgd.audit import auditor
from tf_dpnsgd.audit import bounds
from tf_dpnsgd.audit import canaries
from tf_dpnsgd.audit import experiment
from tf_dpnsgd.audit import fdp
from tf_dpnsgd.audit import measures
from tf_dpnsgd.audit import one_run
from tf_dpnsgd.audit import report
from tf_dpnsgd.audit import scoring
from tf_dpnsgd.audit.auditor import CanaryAudit, CanaryScoreAuditor, Split, TopK
from tf_dpnsgd.audit.bounds import (clopper_pearson_epsilon_lower_bound, clopper_pearson_interval,
                                    one_run_epsilon_lower_bound, one_run_max_epsilon,
                                    one_run_p_value)
from tf_dpnsgd.audit.canaries import (Canaries, DiracCanaryLogits, dirac_canaries, draw_inclusion,
                                      mislabeled_canaries, training_set, with_dirac_canaries)
from tf_dpnsgd.audit.experiment import AuditReport, run_canary_audit
from tf_dpnsgd.audit.fdp import (fdp_one_run_epsilon_lower_bound, fdp_one_run_max_epsilon,
                                 gaussian_dp_epsilon, gaussian_dp_mu)
from tf_dpnsgd.audit.measures import auroc, gdp_epsilon_estimate, tpr_at_fpr
from tf_dpnsgd.audit.one_run import OneRunAudit, audit_scores, one_run_guesses
from tf_dpnsgd.audit.report import audit_block
from tf_dpnsgd.audit.scoring import dirac_scores, loss_scores, margin_scores

__all__ = [
    "AuditReport", "CanaryAudit", "CanaryScoreAuditor", "Canaries", "DiracCanaryLogits",
    "OneRunAudit", "Split", "TopK", "audit_block", "audit_scores", "auditor", "auroc", "bounds",
    "canaries", "clopper_pearson_epsilon_lower_bound", "clopper_pearson_interval",
    "dirac_canaries", "dirac_scores", "draw_inclusion", "experiment", "fdp",
    "fdp_one_run_epsilon_lower_bound", "fdp_one_run_max_epsilon", "gaussian_dp_epsilon",
    "gaussian_dp_mu", "gdp_epsilon_estimate", "loss_scores", "margin_scores", "measures",
    "mislabeled_canaries", "one_run", "one_run_epsilon_lower_bound", "one_run_guesses",
    "one_run_max_epsilon", "one_run_p_value", "report", "run_canary_audit", "scoring",
    "tpr_at_fpr",
    "training_set", "with_dirac_canaries",
]
