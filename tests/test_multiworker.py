"""DP training on MultiWorkerMirroredStrategy: two worker processes on localhost.

The test launches the cluster itself (TF_CONFIG with two free localhost ports,
CPU ring collectives) plus a single-process reference run of the same plans,
seeds and models (``tests/dist_script.py``), all under a hard time limit;
children are killed on failure. Checks, for Poisson, uniform and shuffle
batches of odd size (a masked padding row per step, next to an example of
magnitude 1e6):

(a) at noise 0 both workers end with the single process's weights;
(b) at sigma > 0 with an OS-drawn noise key per process, the update noise of
    a zero-gradient model has std ``sigma * C * sqrt(T) / B`` (one draw per
    step, common to both workers), not ``1/sqrt(2)`` of it (two independent
    per-worker draws averaged) nor ``sqrt(2)`` times it (two draws summed).
"""

import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

import dist_checks
from launch_each import once_per_session
import zygote  # children forked from a pre-imported process (tests/zygote.py)

# two worker processes and a reference process (about 1 min)
pytestmark = pytest.mark.slow

SCRIPT = os.path.join(os.path.dirname(__file__), "dist_script.py")
TIMEOUT_S = 300


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def _run_all(commands, timeout):
  procs = [zygote.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                        text=True) for cmd, env in commands]
  outputs = []
  try:
    for p in procs:
      outputs.append(p.communicate(timeout=timeout)[0])
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait()
  return [p.returncode for p in procs], outputs


def _run_cluster(commands, what: str) -> list:
  """Runs ``commands`` together within TIMEOUT_S; fails the test unless all exit 0."""
  try:
    codes, outputs = _run_all(commands, TIMEOUT_S)
  except subprocess.TimeoutExpired:
    pytest.fail(f"{what} did not finish within {TIMEOUT_S} s")
  for code, out in zip(codes, outputs):
    assert code == 0, out[-4000:]
  return outputs


def _base_env() -> dict:
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
  env.pop("TF_CONFIG", None)
  return env


def _worker_envs(n: int = 2) -> list:
  """One environment per worker of an n-worker localhost cluster (free ports)."""
  cluster = {"worker": [f"localhost:{_free_port()}" for _ in range(n)]}
  return [dict(_base_env(), TF_CONFIG=json.dumps({"cluster": cluster,
                                                  "task": {"type": "worker", "index": i}}))
          for i in range(n)]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
  """The cluster's runs, once per pytest session (``launch_each.once_per_session``: the
  module fixture alone ran twice in CI, 60 s + 58 s, when xdist interleaved modules)."""
  def run(tmp):
    commands = [([sys.executable, SCRIPT, "single", str(tmp / "single.npz")], _base_env())]
    for i, env in enumerate(_worker_envs()):
      commands.append(([sys.executable, SCRIPT, "worker", str(tmp / f"worker{i}.npz")], env))
    _run_cluster(commands, "the 2-worker cluster")
    return None

  tmp, _ = once_per_session(tmp_path_factory, "multiworker_cluster", run)
  load = lambda name: dict(np.load(tmp / name))  # noqa: E731
  return load("single.npz"), [load("worker0.npz"), load("worker1.npz")]


@pytest.mark.xdist_group("multiworker_cluster")  # one run of its module fixture: one worker
def test_two_workers_match_single_process_at_noise_zero(results):
  single, workers = results
  for worker in workers:
    assert int(worker["replicas"]) == 2
    dist_checks.assert_same_training(single, worker)


@pytest.mark.xdist_group("multiworker_cluster")  # one run of its module fixture: one worker
def test_two_workers_add_one_noise_draw_per_step(results):
  _, workers = results
  for worker in workers:
    dist_checks.assert_one_draw_per_step(worker)
  for key in workers[0]:
    if key.endswith("_noise_diff"):  # both workers applied the same (common) noise
      np.testing.assert_array_equal(workers[0][key], workers[1][key])


@pytest.mark.xdist_group("multiworker_cluster")  # one run of its module fixture: one worker
def test_workers_with_different_sampler_seeds_all_refuse(results):
  """Plans whose secret sampler seeds differ across workers would draw different global
  batches: plan.dataset refuses on every worker (none is left waiting in a collective)."""
  _, workers = results
  for worker in workers:
    assert "differs between the workers" in str(worker["mismatched_seed_refused"])


@pytest.mark.xdist_group("multiworker_cluster")  # one run of its module fixture: one worker
def test_every_fit_compares_seed_and_ledger_step_across_workers(results):
  """Issue 19, scenario 12: per-worker seeds fed through plan.dataset(x, y) without
  model=, and workers whose ledgers stand at different steps, are refused at the start of
  fit on every worker, before any step (each ledger keeps its own count)."""
  _, workers = results
  for i, worker in enumerate(workers):
    assert "sampler seed" in str(worker["fit_seed_refused"])
    assert int(worker["fit_seed_steps"]) == 0
    assert "privacy ledger step" in str(worker["fit_ledger_refused"])
    assert int(worker["fit_ledger_steps"]) == (2 if i == 1 else 0)


def test_launcher_runs_on_two_workers_and_only_the_chief_writes(tmp_path):
  """`--distribution_strategy=multi_worker` end to end through a launcher (quickstart)."""
  commands = []
  for i, env in enumerate(_worker_envs()):
    commands.append(([sys.executable, "-m", "tf_dpnsgd.launch.quickstart",
                      "--distribution_strategy=multi_worker", "--epochs=1",
                      f"--model_dir={tmp_path / f'model{i}'}",
                      f"--export_dir={tmp_path / f'export{i}'}"], env))
  outputs = _run_cluster(commands, "the 2-worker launcher")
  finals = [[l for l in out.splitlines() if l.startswith("final test accuracy")]
            for out in outputs]
  assert finals[0] and finals[0] == finals[1]  # one model: same accuracy, epsilon, steps
  with open(tmp_path / "model0" / "privacy_report.json") as f:
    report = json.load(f)
  assert report["steps"] > 0 and report["epsilon"] > 0
  assert os.path.isfile(tmp_path / "export0" / "saved_model.pb")
  assert not os.path.exists(tmp_path / "model1" / "privacy_report.json")
  assert not os.path.exists(tmp_path / "export1")
  assert "only the chief worker writes" in outputs[1]
