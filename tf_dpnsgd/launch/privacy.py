r"""Epsilon (or the noise multiplier for a target epsilon) of a DP training run.

Usage::

  python -m tf_dpnsgd.privacy --dataset_size=50000 --batch_size=1000 --epochs=100 \
      --noise_multiplier=3.6 --delta=1e-5 --sampling=poisson [--accountant=rdp] \
      [--bound=default] [--conversion=modern] [--json]

  python -m tf_dpnsgd.privacy --dataset_size=50000 --batch_size=1000 --steps=5000 \
      --target_epsilon=2 --delta=1e-5 --sampling=uniform --json

Exactly one of ``--epochs``/``--steps`` (steps = floor(epochs * steps per epoch), with
:func:`tf_dpnsgd.accounting.steps_per_epoch`, the rule of every plan) and
one of ``--noise_multiplier``/``--target_epsilon``. ``--json`` prints one
JSON object (``epsilon``, ``noise_multiplier``, ``steps``, ``optimal_order``,
``assumptions``, ...); otherwise a readable statement. Invalid input or an
unsupported sampling/accountant/bound combination exits with status 2 and a
message on stderr; no number is printed.

Flags are read here and nowhere else; the library takes plain arguments
(:mod:`tf_dpnsgd.accounting`).
"""

from __future__ import annotations

import json
import math
import sys

from absl import app
from absl import flags

from tf_dpnsgd import accounting

FLAGS = flags.FLAGS

flags.DEFINE_integer("dataset_size", None, "Number of training examples N.")
flags.DEFINE_integer("batch_size", None, "Batch size B (expected batch size for Poisson).")
flags.DEFINE_float("epochs", None, "Epochs; steps = floor(epochs * steps per epoch), steps "
                   "per epoch = round(N / B) (N // B for shuffle), as every plan counts.")
flags.DEFINE_integer("steps", None, "Number of training steps.")
flags.DEFINE_float("noise_multiplier", None, "Noise std / per-example L2 bound (sigma).")
flags.DEFINE_float("target_epsilon", None, "Calibrate the noise multiplier to this epsilon.")
flags.DEFINE_float("delta", None, "Target delta, in (0, 1).")
flags.DEFINE_enum("sampling", None, list(accounting.SAMPLINGS),
                  "How batches are drawn: poisson (independent inclusion, q = B/N), uniform "
                  "(fresh fixed-size subset without replacement each step), shuffle (epoch "
                  "permutations; no amplification claimed).")
flags.DEFINE_enum("accountant", "rdp", list(accounting.ACCOUNTANTS), "dp-accounting accountant.")
flags.DEFINE_enum("bound", "default", list(accounting.BOUNDS),
                  "uniform + rdp only: default (dp-accounting), paper (the paper's bound; "
                  "refused unless Bun et al. 2018 Thm. 11 applies: B < 0.1 N and rho = "
                  "2/sigma^2 <= 0.1, i.e. sigma >= 4.472), min (pointwise minimum of both RDP "
                  "curves; dp-accounting's alone where the paper's bound does not apply).")
flags.DEFINE_enum("conversion", "modern", list(accounting.CONVERSIONS),
                  "RDP -> (epsilon, delta): modern (dp-accounting) or classic (Mironov 2017).")
flags.DEFINE_float("tolerance", 1e-3, "Absolute tolerance of the calibrated noise multiplier.")
flags.DEFINE_bool("json", False, "Print one JSON object instead of a statement.")

flags.mark_flags_as_required(["dataset_size", "batch_size", "delta", "sampling"])
flags.mark_flags_as_mutual_exclusive(["epochs", "steps"], required=True)
flags.mark_flags_as_mutual_exclusive(["noise_multiplier", "target_epsilon"], required=True)


def compute_report(flag_values=FLAGS) -> accounting.PrivacyReport:
  """The report the flags ask for (raises ``accounting.AccountingError`` on bad input)."""
  fv = flag_values
  common = dict(dataset_size=fv.dataset_size, batch_size=fv.batch_size, delta=fv.delta,
                sampling=fv.sampling, steps=fv.steps, epochs=fv.epochs,
                accountant=fv.accountant, bound=fv.bound, conversion=fv.conversion)
  if fv.noise_multiplier is not None:
    report = accounting.compute_epsilon(noise_multiplier=fv.noise_multiplier, **common)
  else:
    report = accounting.calibrate(target_epsilon=fv.target_epsilon, tolerance=fv.tolerance,
                                  **common)
  if report.steps == 0:
    raise accounting.AccountingError(
        "floor(epochs * steps per epoch) = 0 steps: nothing is trained, nothing to account.")
  if not math.isfinite(report.epsilon):
    raise accounting.AccountingError(
        f"Epsilon is infinite under these assumptions ({report.to_dict()['assumptions']}).")
  return report


def comparison_lines(report: accounting.PrivacyReport) -> list:
  """Epsilon of the same run under each sampling (RDP, modern conversion), for context."""
  spec = report.spec
  lines = ["", "The same run under each sampling assumption (RDP accountant, modern conversion):"]
  for sampling in accounting.SAMPLINGS:
    other = accounting.make_spec(spec.dataset_size, spec.batch_size, sampling)
    eps = accounting.epsilon_for(other, report.noise_multiplier, report.steps, report.delta)
    marker = "  <- this report's sampling" if sampling == spec.sampling else ""
    lines.append(f"    {sampling:8s} epsilon = {eps:.4g}{marker}")
  return lines


def format_output(report: accounting.PrivacyReport, as_json: bool) -> str:
  if as_json:
    return json.dumps(report.to_dict(), sort_keys=True)
  return "\n".join([report.statement()] + comparison_lines(report))


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  try:
    report = compute_report(FLAGS)
  except accounting.AccountingError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
  print(format_output(report, FLAGS.json))


if __name__ == "__main__":
  app.run(main)
