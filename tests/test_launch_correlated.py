"""Correlated noise from the launchers (issue 33): --noise=bandmf --bands=b, and
--noise=blt --bands=b --blt_buffers=d (accounted without amplification).

Quick tier: the flags (refusals, the cyclic-Poisson default, --noise=independent unchanged),
the plan and optimizer the launcher builds (epsilon against dp-accounting computed here,
the optimizer's band coefficients), and the secret sampler-seed file of a resumable run.
Slow: the quickstart launcher end to end in a subprocess (report, resume, refusals), and
an in-process resume against an uninterrupted run with the same seeds.
"""

import functools
import json
import math
import os
import stat

import dp_accounting
import h5py
import keras
import numpy as np
import pytest

import tf_dpnsgd
from tf_dpnsgd import accounting
from tf_dpnsgd.launch import common
from tf_dpnsgd.launch import resume

import fixtures


def parse(*args, **defaults):
  """The shared launcher flags parsed from ``args`` (launcher default: target epsilon 4)."""
  from absl import flags
  fv = flags.FlagValues()
  common.define_flags(fv, **{"target_epsilon": 4.0, **defaults})
  fv(["launcher", *args])
  return common.config_from_flags(fv)


def oracle_epsilon(n, batch, sigma, delta, bands, steps):
  """dp-accounting's RDP epsilon of Thm. 4's event: Poisson at rate bB/N, ceil(T/b) times."""
  acc = dp_accounting.rdp.RdpAccountant(list(accounting.DEFAULT_ORDERS))
  acc.compose(dp_accounting.PoissonSampledDpEvent(
      bands * batch / n, dp_accounting.GaussianDpEvent(sigma)), math.ceil(steps / bands))
  return acc.get_epsilon(delta)


# --- flags ----------------------------------------------------------------------------------
def test_independent_noise_is_the_unchanged_default():
  cfg = parse()
  assert (cfg.noise, cfg.bands, cfg.sampling) == ("independent", None, "poisson")
  assert common.band_coefficients(cfg, 100) is None
  opt = common.make_optimizer(cfg, 1.0, 10)
  assert opt.band_noise is None and opt.bands == 1


def test_bandmf_samples_cyclic_poisson_with_its_bands():
  cfg = parse("--noise=bandmf", "--bands=4")
  assert (cfg.noise, cfg.bands, cfg.sampling) == ("bandmf", 4, "cyclic_poisson")
  cfg = parse("--noise=bandmf", "--bands=2", "--sampling=cyclic_poisson")
  assert cfg.sampling == "cyclic_poisson"
  assert cfg.hyperparameters()["noise"] == "bandmf" and cfg.hyperparameters()["bands"] == 2


@pytest.mark.parametrize("args,message", [
    (["--noise=bandmf", "--bands=2", "--sampling=uniform"], "Drop --sampling"),
    (["--noise=bandmf", "--bands=2", "--sampling=shuffle"], "Drop --sampling"),
    (["--noise=bandmf", "--bands=2", "--sampling=poisson"], "Drop --sampling"),
    (["--bands=4"], "needs --noise=bandmf"),
    (["--noise=independent", "--bands=1"], "needs --noise=bandmf"),
    (["--sampling=cyclic_poisson"], "give --noise=bandmf --bands=b"),
    (["--noise=bandmf"], "needs --bands=b with b >= 2"),
    (["--noise=bandmf", "--bands=1"], "use --noise=independent"),
    (["--noise=bandmf", "--bands=0"], "needs --bands=b with b >= 2"),
    (["--noise=bandmf", "--bands=2", "--optimizer=sgd"], "trains without privacy"),
    (["--noise=bandmf", "--bands=2", "--optimizer=adam"], "trains without privacy"),
    (["--noise=bandmf", "--bands=2", "--optimizer=dpsgd", "--target_unclipped_quantile=0.5"],
     "adaptive clipping"),
    (["--noise=bandmf", "--bands=2", "--distribution_strategy=mirrored"], "one replica"),
    (["--noise=blt"], "needs --bands=b with b >= 1"),
    (["--noise=blt", "--bands=0"], "needs --bands=b with b >= 1"),
    (["--blt_buffers=2"], "needs --noise=blt"),
    (["--noise=bandmf", "--bands=2", "--blt_buffers=2"], "needs --noise=blt"),
    (["--noise=blt", "--bands=2", "--blt_buffers=0"], "--blt_buffers must be >= 1"),
    (["--noise=blt", "--bands=2", "--sampling=poisson"], "Drop --sampling"),
    (["--noise=blt", "--bands=2", "--optimizer=sgd"], "trains without privacy"),
    (["--noise=blt", "--bands=2", "--distribution_strategy=mirrored"], "one replica"),
])
def test_inconsistent_noise_flags_are_flag_errors_that_say_what_to_do(args, message):
  from absl import flags
  with pytest.raises(flags.IllegalFlagValueError, match=message):
    parse(*args)


def test_bands_against_the_data_are_refused_before_training():
  cfg = common.ExperimentConfig(noise_multiplier=1.0, batch_size=16, epochs=1.0, noise="bandmf",
                                bands=5, sampling="cyclic_poisson")
  with pytest.raises(common.LaunchError, match=r"b \* B <= N \(80 > 64"):
    common.make_plan(cfg, 64)
  short = common.ExperimentConfig(noise_multiplier=1.0, batch_size=16, epochs=0.5,
                                  noise="bandmf", bands=3, sampling="cyclic_poisson")
  with pytest.raises(common.LaunchError, match="more than the run's 2 planned steps"):
    common.make_plan(short, 64)
  with pytest.raises(ValueError, match="Drop --sampling"):  # the dataclass checks too
    common.ExperimentConfig(noise_multiplier=1.0, noise="bandmf", bands=2)


# --- the plan and the optimizer the launcher builds ------------------------------------------
def test_plan_epsilon_is_the_cyclic_poisson_event_of_dp_accounting():
  cfg = parse("--noise=bandmf", "--bands=4", "--noise_multiplier=1.1", "--batch_size=256",
              "--delta=1e-5")
  plan = common.make_plan(cfg, 60000)
  assert (plan.sampling, plan.bands) == ("cyclic_poisson", 4)
  for steps in (1, 99, 100, 101, plan.num_steps):
    assert plan.epsilon(steps) == pytest.approx(
        oracle_epsilon(60000, 256, 1.1, 1e-5, 4, steps), rel=1e-12)
  # docs/correlated_noise.md's reference value (b = 4, T = 100).
  assert round(plan.epsilon(100), 6) == 1.064481
  assert "seed" not in plan.public_dict() and plan.public_dict()["bands"] == 4


@pytest.mark.parametrize("optimizer,momentum,expected_momentum", [
    # CI only (issue 47): the plan's own strategy stays quick in the two tests below
    pytest.param("dpsgd", 0.9, 0.9, marks=pytest.mark.slow),
    pytest.param("dpnsgd", 0.5, 0.5, marks=pytest.mark.slow),
    pytest.param("dpadam", 0.0, 0.0, marks=pytest.mark.slow),
    pytest.param("dpnadam", 0.0, 0.0, marks=pytest.mark.slow)])
def test_optimizer_takes_the_strategy_of_the_plans_steps_bands_and_momentum(
    optimizer, momentum, expected_momentum):
  cfg = parse("--noise=bandmf", "--bands=3", f"--optimizer={optimizer}",
              f"--momentum={momentum}", "--batch_size=16", "--epochs=2")
  plan = common.make_plan(cfg, 96)
  opt = common.make_optimizer(cfg, plan.training_noise_multiplier, plan.num_steps)
  expected = tf_dpnsgd.correlated.noise.bandmf(plan.num_steps, 3, momentum=expected_momentum)
  np.testing.assert_allclose(opt.band_noise.coefficients, expected, rtol=1e-12)
  assert opt.bands == 3
  plan.check_optimizer(opt)
  # What make_private's own plan would hand the optimizer at compile: the same strategy.
  opt.take_plan_bands(plan.num_steps, plan.bands)


def blt_oracle_epsilon(blt, steps, separation, sigma, delta):
  """dp-accounting's RDP epsilon of ONE Gaussian mechanism whose sensitivity is found by
  enumerating every participation pattern (steps ``separation`` apart) of the BLT's matrix."""
  from tf_dpnsgd.correlated import strategy as st
  sensitivity = st.sensitivity(blt.matrix(steps), None, separation=separation)
  acc = dp_accounting.rdp.RdpAccountant(list(accounting.DEFAULT_ORDERS))
  acc.compose(dp_accounting.GaussianDpEvent(sigma / sensitivity))
  return acc.get_epsilon(delta)


@pytest.mark.parametrize("optimizer,expected_momentum", [
    ("dpsgd", 0.9), pytest.param("dpnadam", 0.0, marks=pytest.mark.slow)])
def test_blt_plan_and_optimizer_share_the_blt_of_the_plans_steps(optimizer, expected_momentum):
  momentum = ["--momentum=0.9"] if optimizer == "dpsgd" else []
  cfg = parse("--noise=blt", "--bands=3", "--blt_buffers=2", f"--optimizer={optimizer}",
              "--noise_multiplier=2.0", "--batch_size=16", "--epochs=2", *momentum)
  assert (cfg.sampling, cfg.hyperparameters()["blt_buffers"]) == ("cyclic_poisson", 2)
  plan = common.make_plan(cfg, 96)
  expected = tf_dpnsgd.correlated.blt.optimize_blt(plan.num_steps, 2, 3, expected_momentum)
  assert (plan.sampling, plan.bands, plan.num_steps) == ("cyclic_poisson", 3, 12)
  np.testing.assert_allclose(np.ravel(plan.blt), np.ravel(expected.parameters()), rtol=1e-9)
  opt = common.make_optimizer(cfg, plan.training_noise_multiplier, plan.num_steps)
  plan.check_optimizer(opt)  # the same BLT, bit for bit
  assert opt.bands == expected.ledger_code
  for steps in (1, 5, 12):
    assert plan.epsilon(steps) == pytest.approx(
        blt_oracle_epsilon(expected, steps, 3, 2.0, 1e-5), rel=1e-6)
  target = common.make_plan(parse("--noise=blt", "--bands=3", "--batch_size=16", "--epochs=2",
                                  "--target_epsilon=6"), 96)
  got = blt_oracle_epsilon(tf_dpnsgd.correlated.blt.BLTStrategy(*target.blt), 12, 3,
                           target.training_noise_multiplier, 1e-5)
  assert 5.95 < got <= 6.0 * (1 + 2e-3)


# --- the secret sampler seed of a resumable correlated run -----------------------------------
def test_sampler_seed_file_is_owner_only_and_read_back(tmp_path):
  assert resume.keeps_sampler_seed("cyclic_poisson")
  assert not any(resume.keeps_sampler_seed(s) for s in ("poisson", "uniform", "shuffle"))
  old_umask = os.umask(0)  # even a permissive umask leaves the file owner-only
  try:
    path = resume.write_sampler_seed(str(tmp_path), 123456789)
  finally:
    os.umask(old_umask)
  assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
  assert resume.read_sampler_seed(str(tmp_path)) == 123456789
  assert resume.sampler_seed_to_resume(str(tmp_path), "cyclic_poisson", True) == 123456789
  # A fresh run (no checkpoint), another sampling or no model_dir: a fresh OS seed.
  assert resume.sampler_seed_to_resume(str(tmp_path), "cyclic_poisson", False) is None
  assert resume.sampler_seed_to_resume(str(tmp_path), "poisson", True) is None
  assert resume.sampler_seed_to_resume(None, "cyclic_poisson", True) is None
  os.chmod(path, 0o644)
  with pytest.raises(resume.ResumeError, match="chmod 600"):
    resume.read_sampler_seed(str(tmp_path))
  os.chmod(path, 0o600)
  resume.write_sampler_seed(str(tmp_path), 7)  # replaced, still owner-only
  assert resume.read_sampler_seed(str(tmp_path)) == 7
  assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
  os.remove(path)
  with pytest.raises(resume.ResumeError, match="not its sampler seed"):
    resume.sampler_seed_to_resume(str(tmp_path), "cyclic_poisson", True)


# --- the quickstart launcher end to end ------------------------------------------------------
def report(run):
  with open(run / "privacy_report.json") as f:
    return json.load(f)


def _bandmf_runs_of(f):
  """This module's launches, in one process (tests/launch_each.py): the BandMF run, its
  resume, the resume without its seed file (removed just before), the independent-noise
  one; then the refused flags. Files are read back between runs where a test checks them."""
  run = f / "run"
  flags_ = ["--noise=bandmf", "--bands=2", "--noise_multiplier=1.2", "--batch_size=64",
            "--epochs=1", "--momentum=0.9", f"--model_dir={run}"]
  seed_path = str(run / resume.SEED_FILE)
  snapshot = [seed_path, str(run / "privacy_report.json"), str(run / resume.MARKER_FILE)]
  return [
      ("bandmf", {"argv": [*flags_, "--max_steps=4"], "read": snapshot}),
      ("bandmf_resume", {"argv": [*flags_, "--max_steps=7"], "read": snapshot}),
      ("bandmf_without_seed", {"argv": [*flags_, "--max_steps=9"], "remove": [seed_path],
                               "read": [str(run / "privacy_report.json")]}),
      ("independent_over_bandmf", ["--noise_multiplier=1.2", "--batch_size=64", "--epochs=1",
                                   f"--model_dir={run}", "--max_steps=9"]),
      ("bad_noise_flags", ["--noise=bandmf", "--bands=2", "--sampling=uniform",
                           f"--model_dir={f}/refused/run"]),
  ]


@pytest.fixture(scope="module")
def quickstart_runs(tmp_path_factory):
  from launch_each import named_runs
  env = lambda f: dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", TF_ENABLE_ONEDNN_OPTS="0",  # noqa: E731
                       TF_DPNSGD_LINEAGE_DIR=str(f / "lineages"))
  return named_runs(tmp_path_factory, "test_launch_correlated", "tf_dpnsgd.launch.quickstart",
                    _bandmf_runs_of, env=env)


def seed_in(snapshot, mode, tmp_path):
  """``resume.read_sampler_seed`` of a seed file as a run left it (its text and mode)."""
  copy = tmp_path / "seed_snapshot"
  copy.mkdir(exist_ok=True)
  path = copy / resume.SEED_FILE
  path.write_text(snapshot)
  os.chmod(path, mode)
  return resume.read_sampler_seed(str(copy))


@pytest.mark.slow
@pytest.mark.xdist_group("launch_correlated_quickstart")  # its runs' one process: one worker
def test_quickstart_bandmf_reports_its_noise_and_resumes_on_the_same_partition(
    quickstart_runs, tmp_path):
  from launch_each import checked
  f, runs = quickstart_runs
  run = f / "run"
  seed_path, report_path = str(run / resume.SEED_FILE), str(run / "privacy_report.json")
  out = checked(runs["bandmf"], "the BandMF run (--max_steps=4)")
  first = json.loads(out.files[report_path])
  n = first["dataset_size"]
  assert first["private"] and first["steps"] == 4
  assert (first["noise"], first["bands"], first["sampling"]) == ("bandmf", 2, "cyclic_poisson")
  assert first["hyperparameters"]["noise"] == "bandmf"
  assert first["epsilon"] == pytest.approx(oracle_epsilon(n, 64, 1.2, 1e-5, 2, 4), rel=1e-9)
  # The secret sampler seed: in model_dir only, owner-only, nowhere in the report or logs.
  assert stat.S_IMODE(out.modes[seed_path]) == 0o600
  seed = seed_in(out.files[seed_path], out.modes[seed_path], tmp_path)
  for path in (report_path, str(run / resume.MARKER_FILE)):
    assert str(seed) not in out.files[path]
  assert str(seed) not in out.stdout + out.stderr
  # A rerun continues the same partition (the ledger would refuse another seed) and the
  # noise buffers from the checkpoint: all 7 steps accounted as one cyclic-Poisson run.
  out = checked(runs["bandmf_resume"], "the resume (--max_steps=7)")
  second = json.loads(out.files[report_path])
  assert second["steps"] == 7 and seed_in(out.files[seed_path], out.modes[seed_path],
                                          tmp_path) == seed
  assert second["epsilon"] == pytest.approx(oracle_epsilon(n, 64, 1.2, 1e-5, 2, 7), rel=1e-9)
  # Without its seed file the run cannot continue: refused before training.
  out = runs["bandmf_without_seed"]  # the seed file removed just before
  assert out.returncode != 0 and "not its sampler seed" in out.stderr
  assert json.loads(out.files[report_path])["steps"] == 7
  # Independent noise cannot continue it either (another plan: refused by run.json).
  out = runs["independent_over_bandmf"]
  assert out.returncode != 0 and "plan.sampling" in out.stderr


@pytest.mark.slow
@pytest.mark.xdist_group("launch_correlated_quickstart")  # its runs' one process: one worker
def test_quickstart_refuses_bad_noise_flags_before_training(quickstart_runs):
  f, runs = quickstart_runs
  out = runs["bad_noise_flags"]
  assert out.returncode != 0 and "Drop --sampling" in out.stderr
  assert not (f / "refused" / "run").exists()


# --- in process: a resumed run equals an uninterrupted one with the same seeds ---------------
SAMPLER_SEED, NOISE_SEED = 20261126, 7


_data = fixtures.tiny_image_data
_build = fixtures.tiny_image_mlp


def _run(model_dir, **kw):
  x, y = _data()
  cfg = common.ExperimentConfig(**{
      "noise_multiplier": 1.0, "optimizer": "dpsgd", "momentum": 0.9, "batch_size": 16,
      "epochs": 2.0, "seed": 0, "verbose": 0, "model_dir": str(model_dir), "noise": "bandmf",
      "bands": 2, "sampling": "cyclic_poisson", **kw})
  return common.run_experiment(
      cfg, _build, (x, y), (x[:16], y[:16]),
      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
      extra_report={"dataset": "toy"})


def _fixed_seeds(monkeypatch, seen):
  """The sampler seed of a FRESH run and the noise seed fixed (a reproducibility experiment;
  the launcher never does this): a resumed run takes its sampler seed from its file."""
  make_plan = common.make_plan

  def plan(cfg, n, sampler_seed=None):
    seen.append(sampler_seed)
    return make_plan(cfg, n, sampler_seed=SAMPLER_SEED if sampler_seed is None else sampler_seed)

  monkeypatch.setattr(common, "make_plan", plan)
  monkeypatch.setattr(tf_dpnsgd, "DPSGD", functools.partial(tf_dpnsgd.DPSGD, seed=NOISE_SEED))


def _weights_and_buffers(model_dir):
  """Every array of the checkpoint except the ledger's (which names each run's own lineage)."""
  out = {}
  with h5py.File(model_dir / "checkpoint.weights.h5", "r") as f:
    def visit(name, obj):
      if isinstance(obj, h5py.Dataset) and "privacy_ledger" not in name:
        out[name] = np.asarray(obj)
    f.visititems(visit)
  assert any("bandmf_w" in k or "blt_s" in k or "optimizer" in k for k in out)
  return out


@pytest.mark.slow
@pytest.mark.parametrize("noise", ["bandmf", "blt"])
def test_a_resumed_run_continues_the_uninterrupted_stream(tmp_path, monkeypatch, noise):
  seen = []
  _fixed_seeds(monkeypatch, seen)
  straight = _run(tmp_path / "straight", max_steps=6, noise=noise)
  first = _run(tmp_path / "resumed", max_steps=3, noise=noise)
  resumed = _run(tmp_path / "resumed", max_steps=6, noise=noise)
  assert seen == [None, None, SAMPLER_SEED]  # the resume read the kept seed back
  assert first.steps == 3 and resumed.steps == straight.steps == 6
  if noise == "blt":  # the plan's BLT: 2 buffers for the planned 8 steps, separation 2
    blt = tf_dpnsgd.correlated.blt.optimize_blt(8, 2, 2, momentum=0.9)
    expected = blt_oracle_epsilon(blt, 6, 2, 1.0, 1e-5)
  else:
    expected = oracle_epsilon(64, 16, 1.0, 1e-5, 2, 6)
  assert resumed.epsilon == straight.epsilon == pytest.approx(expected, rel=1e-6)
  a, b = _weights_and_buffers(tmp_path / "straight"), _weights_and_buffers(tmp_path / "resumed")
  assert sorted(a) == sorted(b)
  floats = 0
  for name in a:
    if a[name].dtype.kind == "f":  # weights, momentum, the noise buffers w_{t-k}
      floats += 1
      np.testing.assert_allclose(b[name], a[name], rtol=1e-5, atol=1e-6, err_msg=name)
    elif a[name].shape == (3,):  # the buffers' position [lineage, generation, step]
      np.testing.assert_array_equal(b[name][1:], a[name][1:], err_msg=name)
    else:
      np.testing.assert_array_equal(b[name], a[name], err_msg=name)
  assert floats >= 4 + 1 + 4  # 4 weight arrays, >= 1 buffer per weight (b - 1 = 1), momenta
  assert resumed.final_metrics["loss"] == pytest.approx(straight.final_metrics["loss"], rel=1e-5)


@pytest.mark.slow
def test_a_replaced_sampler_seed_is_refused_by_the_ledger(tmp_path):
  run = tmp_path / "run"
  _run(run, max_steps=3)
  resume.write_sampler_seed(str(run), resume.read_sampler_seed(str(run)) + 1)
  from tf_dpnsgd import ledger as ledger_lib
  with pytest.raises(ledger_lib.LedgerMismatchError, match="another seed, or over other data"):
    _run(run, max_steps=6)
  assert json.loads((run / "privacy_report.json").read_text())["steps"] == 3


def test_canary_audit_refuses_correlated_noise():
  from tf_dpnsgd.launch import canary_audit
  spec = canary_audit.AuditSpec(num_canaries=10)
  cfg = parse("--noise=bandmf", "--bands=2", "--batch_size=16")
  with pytest.raises(common.LaunchError, match="does not support --noise=bandmf"):
    canary_audit._check_can_audit(cfg, spec, 1000, 16)
  canary_audit._check_can_audit(parse("--batch_size=16"), spec, 1000, 16)  # independent: runs
