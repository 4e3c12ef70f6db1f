"""Tests for the `python -m tf_dpnsgd.privacy` command line."""

import json
import os
import sys

import dp_accounting
import pytest
from absl import flags

import tf_dpnsgd
from tf_dpnsgd import accounting
from tf_dpnsgd import owned_plan
from tf_dpnsgd.launch import privacy
import zygote  # children forked from a pre-imported process (tests/zygote.py)

CIFAR = ["--dataset_size=50000", "--batch_size=1000", "--epochs=100", "--delta=1e-5"]


@pytest.fixture
def parse():
  def _parse(args):
    privacy.FLAGS.unparse_flags()
    privacy.FLAGS(["privacy"] + args)
    return privacy.FLAGS
  yield _parse
  privacy.FLAGS.unparse_flags()


def run_main(parse, args, capsys):
  parse(args)
  privacy.main(["privacy"])
  return capsys.readouterr()


def dp_accounting_epsilon(accountant, event, orders=None):
  """The oracle: dp-accounting's own accountant composing the event (no tf_dpnsgd code)."""
  relation = dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE
  if accountant == "pld":
    acc = dp_accounting.pld.PLDAccountant(relation)
  else:
    acc = dp_accounting.rdp.RdpAccountant(list(orders), relation)
  acc.compose(event)
  return acc.get_epsilon_and_optimal_order(1e-5) if accountant == "rdp" else (
      acc.get_epsilon(1e-5), None)


# The paper's CIFAR-10 setting: q = 1000 / 50000, 5000 Poisson-subsampled Gaussian steps.
CIFAR_EVENT = dp_accounting.SelfComposedDpEvent(
    dp_accounting.PoissonSampledDpEvent(0.02, dp_accounting.GaussianDpEvent(3.6)), 5000)


def test_json_output_matches_dp_accounting_pld(parse, capsys):
  out = run_main(parse, CIFAR + ["--noise_multiplier=3.6", "--sampling=poisson",
                                 "--accountant=pld", "--json"], capsys)
  d = json.loads(out.out)
  expected, _ = dp_accounting_epsilon("pld", CIFAR_EVENT)
  assert d["epsilon"] == pytest.approx(expected, rel=1e-9)
  assert d["noise_multiplier"] == 3.6 and d["steps"] == 5000
  assert d["neighboring_relation"] == "ADD_OR_REMOVE_ONE"
  assert set(d["assumptions"]) >= {"sampling", "sensitivity", "accountant", "conversion"}


def test_json_output_matches_dp_accounting_rdp(parse, capsys):
  out = run_main(parse, CIFAR + ["--noise_multiplier=3.6", "--sampling=poisson", "--json"],
                 capsys)
  d = json.loads(out.out)
  # The CLI minimises over a denser order grid (it holds the integers 2..64 and more), so
  # its epsilon can only be lower, and not by much (1.7098 vs 1.7116).
  integer_orders = range(2, 65)
  expected, order = dp_accounting_epsilon("rdp", CIFAR_EVENT, integer_orders)
  assert expected * 0.99 <= d["epsilon"] <= expected
  assert abs(d["optimal_order"] - order) <= 2  # 11.5 and 11


@pytest.mark.parametrize("n,b,epochs,sampling,steps", [
    (1437, 128, 40, "poisson", 440),
    *[pytest.param(*case, marks=pytest.mark.slow) for case in (
        (67349, 1000, 10, "poisson", 670), (1000, 400, 3, "shuffle", 6),
        (1000, 400, 3, "uniform", 9))]])
def test_one_count_of_steps_everywhere(parse, capsys, n, b, epochs, sampling, steps):
  """The CLI, compute_epsilon, calibrate, PrivacyPlan and make_private's plan count the same
  steps for the same epochs (floor(epochs * round(N / B)), N // B for shuffle) and calibrate
  the same sigma; the old floor(epochs * N / B) differed (673, 449, 7, 7)."""
  out = run_main(parse, [f"--dataset_size={n}", f"--batch_size={b}", f"--epochs={epochs}",
                         "--delta=1e-6", "--target_epsilon=4", f"--sampling={sampling}",
                         "--json"], capsys)
  cli = json.loads(out.out)
  plan = tf_dpnsgd.PrivacyPlan(dataset_size=n, batch_size=b, sampling=sampling, delta=1e-6,
                               epochs=epochs, target_epsilon=4.0, seed=0)
  owned = owned_plan.PlanRequest(delta=1e-6, batch_size=b, target_epsilon=4.0, epochs=epochs,
                                 sampling=sampling).resolve(n, seed=0)
  report = accounting.calibrate(n, b, 4.0, 1e-6, sampling, epochs=epochs)
  assert cli["steps"] == plan.num_steps == owned.num_steps == report.steps == steps
  assert accounting.compute_epsilon(n, b, 1.0, 1e-6, sampling, epochs=epochs).steps == steps
  assert cli["noise_multiplier"] == pytest.approx(plan.training_noise_multiplier, abs=1e-3)
  assert owned.training_noise_multiplier == plan.training_noise_multiplier


def test_delta_at_or_above_one_over_n_is_refused_everywhere(parse, capsys):
  """(epsilon, delta) with delta >= 1/N allows publishing about one example: refused by the
  CLI, compute_epsilon, calibrate, PrivacyPlan and make_private's plan (before training)."""
  with pytest.raises(SystemExit) as info:
    run_main(parse, ["--dataset_size=8000", "--batch_size=256", "--epochs=1", "--delta=1e-3",
                     "--noise_multiplier=1", "--sampling=poisson"], capsys)
  assert info.value.code == 2 and "1/N" in capsys.readouterr().err
  for call in (lambda: accounting.compute_epsilon(8000, 256, 1.0, 1e-3, "poisson", steps=3),
               lambda: accounting.calibrate(8000, 256, 4.0, 1.25e-4, "poisson", steps=3),
               lambda: tf_dpnsgd.PrivacyPlan(dataset_size=8000, batch_size=256, delta=1e-3,
                                             sampling="poisson", epochs=1, noise_multiplier=1.0),
               lambda: owned_plan.PlanRequest(delta=1e-3, batch_size=256, noise_multiplier=1.0,
                                              epochs=1).resolve(8000)):
    with pytest.raises(ValueError, match="not below 1/N"):
      call()


@pytest.mark.slow
def test_target_epsilon_calibrates(parse, capsys):
  out = run_main(parse, CIFAR + ["--target_epsilon=2", "--sampling=poisson",
                                 "--conversion=classic", "--json"], capsys)
  d = json.loads(out.out)
  assert d["epsilon"] <= 2.0 and d["target_epsilon"] == 2.0
  assert round(d["noise_multiplier"], 1) == 3.6  # the paper's CIFAR-10 statement
  assert d["conversion"] == "classic" and d["optimal_order"] > 1


def test_readable_statement(parse, capsys):
  out = run_main(parse, ["--dataset_size=60000", "--batch_size=256", "--steps=1000",
                         "--delta=1e-5", "--noise_multiplier=1.1", "--sampling=shuffle"], capsys)
  assert "epsilon = " in out.out and "NO amplification" in out.out
  assert "replace one example" in out.out
  for sampling in accounting.SAMPLINGS:
    assert f"    {sampling}" in out.out  # the same run under each sampling, for contrast


@pytest.mark.parametrize("args,match", [
    (CIFAR + ["--noise_multiplier=1", "--sampling=uniform", "--accountant=pld"], "no PLD analysis"),
    (CIFAR + ["--noise_multiplier=1", "--sampling=poisson", "--bound=paper"], "WITHOUT"),
    (CIFAR + ["--noise_multiplier=0", "--sampling=poisson"], "noise_multiplier"),
    (CIFAR + ["--noise_multiplier=-2", "--sampling=poisson"], "noise_multiplier"),
    (["--dataset_size=100", "--batch_size=200", "--steps=10", "--delta=1e-5",
      "--noise_multiplier=1", "--sampling=poisson"], "q = B/N"),
    (["--dataset_size=100", "--batch_size=10", "--steps=10", "--delta=1",
      "--noise_multiplier=1", "--sampling=poisson"], "delta"),
    (["--dataset_size=100", "--batch_size=10", "--epochs=0.05", "--delta=1e-5",
      "--noise_multiplier=1", "--sampling=poisson"], "0 steps"),
    (["--dataset_size=60000", "--batch_size=6000", "--steps=10", "--delta=1e-5",
      "--noise_multiplier=30", "--sampling=uniform", "--bound=paper"], "B < 0.1 N"),
    # The paper's epsilon-2 CIFAR-10 sigma: s = 1.8, rho = 0.1543 > 0.1 (Bun et al. Thm. 11).
    (CIFAR + ["--noise_multiplier=3.6", "--sampling=uniform", "--bound=paper"],
     "rho = 0.1543 > 0.1"),
])
def test_bad_input_exits_with_a_message_and_no_number(parse, capsys, args, match):
  with pytest.raises(SystemExit) as info:
    run_main(parse, args + ["--json"], capsys)
  assert info.value.code == 2
  captured = capsys.readouterr()
  assert captured.out == ""
  assert match in captured.err


def test_flags_require_exactly_one_of_each_pair(parse):
  with pytest.raises(flags.IllegalFlagValueError):
    parse(CIFAR + ["--steps=10", "--noise_multiplier=1", "--sampling=poisson"])
  with pytest.raises(flags.IllegalFlagValueError):
    parse(CIFAR + ["--noise_multiplier=1", "--target_epsilon=1", "--sampling=poisson"])
  with pytest.raises(flags.IllegalFlagValueError):
    parse(CIFAR + ["--noise_multiplier=1", "--sampling=bootstrap"])


@pytest.mark.slow
def test_module_runs_as_a_program():
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
  ok = zygote.run(
      [sys.executable, "-m", "tf_dpnsgd.privacy"] + CIFAR
      + ["--noise_multiplier=1.2", "--sampling=uniform", "--bound=min", "--json"],
      capture_output=True, text=True, env=env, timeout=120)
  assert ok.returncode == 0, ok.stderr
  d = json.loads(ok.stdout.strip().splitlines()[-1])
  assert d["bound"] == "min" and d["sampling"] == "uniform" and d["epsilon"] > 0
