"""tests/time_budget.py: a quick-tier test over its budget fails the session, by name.

The decision is a pure function of the phases' durations, the calibration and
the multiple (checked against hand-picked numbers); the plugin is checked end
to end in a pytest subprocess on a throwaway test directory, under
pytest-xdist (``-n 2``: durations known only in the controller) and with the
check switched off. The calibration is fixed through the environment there,
so no timing of this machine enters the verdict.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import pytest

import calibration
import time_budget
from time_budget import Phase

TESTS = os.path.dirname(os.path.abspath(__file__))


def test_only_phases_over_multiple_times_calibration_are_named_slowest_first():
  phases = [Phase("t.py::fast", "call", 0.99),       # 99 units: within 100
            Phase("t.py::edge", "call", 1.0),         # exactly 100 units: within
            Phase("t.py::fixture", "setup", 1.5),     # a setup counts as well
            Phase("t.py::heavy", "call", 4.0)]
  assert time_budget.over_budget(phases, calibration_s=0.01, multiple=100) == [
      Phase("t.py::heavy", "call", 4.0), Phase("t.py::fixture", "setup", 1.5)]
  # The same times on a machine five times slower (calibration 0.05) are all within budget.
  assert time_budget.over_budget(phases, calibration_s=0.05, multiple=100) == []


@pytest.mark.parametrize("calibration_s, multiple", [(0.0, 100), (0.01, 0), (float("nan"), 1)])
def test_a_degenerate_calibration_or_multiple_is_refused(calibration_s, multiple):
  with pytest.raises(ValueError, match="must be > 0"):
    time_budget.over_budget([], calibration_s, multiple)


@pytest.mark.parametrize("value, expected", [
    ("", time_budget.MULTIPLE), ("off", None), ("0", None), (" OFF ", None), ("40", 40.0)])
def test_the_environment_sets_or_disables_the_multiple(value, expected):
  assert time_budget.budget_multiple({time_budget.ENV_BUDGET: value}) == expected


@pytest.mark.parametrize("value", ["-3", "fast"])
def test_a_malformed_multiple_is_refused(value):
  with pytest.raises(ValueError, match=time_budget.ENV_BUDGET):
    time_budget.budget_multiple({time_budget.ENV_BUDGET: value})


def test_machine_kind_names_cores_and_avx512():
  kind = calibration.machine_kind()
  assert f"{calibration.cores()} cores" in kind and kind.endswith(("avx512 yes", "avx512 no"))


def _inner_session(tmp_path, *args, budget=None, module_cleanup_s=0.0):
  (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    slow: slow\n")
  (tmp_path / "conftest.py").write_text(textwrap.dedent(f"""
      import functools, time
      import pytest
      import time_budget

      def pytest_configure(config):
        time_budget.register(config)

      @pytest.hookimpl(wrapper=True)
      def pytest_runtest_teardown(item, nextitem):
        result = yield
        time_budget.run_module_cleanup(item, nextitem,
                                       functools.partial(time.sleep, {module_cleanup_s}))
        return result
      """))
  (tmp_path / "test_inner.py").write_text(textwrap.dedent("""
      import time
      import pytest

      @pytest.mark.slow
      def test_marked_slow():
        time.sleep(0.5)

      def test_cheap():
        pass

      def test_sleepy():  # the module's last test: its teardown runs the module's clean-up
        time.sleep(0.5)
      """))
  env = dict(os.environ, PYTHONPATH=TESTS + os.pathsep + os.environ.get("PYTHONPATH", ""))
  env[time_budget.ENV_CALIBRATION] = "0.001"   # 100 units = 0.1 s
  env[time_budget.ENV_BUDGET] = budget or "100"
  env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"  # about 1 s less per session (pytest-benchmark)
  return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider",
                         "-q", *args, "test_inner.py"],
                        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


def test_a_quick_test_over_budget_fails_the_xdist_session_by_name(tmp_path):
  out = _inner_session(tmp_path, "-p", "xdist.plugin", "-n", "2")
  text = out.stdout + out.stderr
  assert out.returncode == pytest.ExitCode.TESTS_FAILED, text
  assert "3 passed" in text, text  # every test passed; the budget failed the session
  assert "quick-tier time budget exceeded" in text, text
  assert re.search(r"test_inner.py::test_sleepy \(call\) took 0\.[5-9] s", text), text
  assert "the budget is 100 units = 0.1 s (calibration 0.001 s)" in text, text
  assert "test_marked_slow" not in text.split("quick-tier time budget exceeded")[1], text


@pytest.mark.slow  # a child pytest session: CI only (issue 47)
def test_the_budget_can_be_switched_off(tmp_path):
  out = _inner_session(tmp_path, budget="off")
  assert out.returncode == pytest.ExitCode.OK, out.stdout + out.stderr
  assert "time budget" not in out.stdout, out.stdout


def test_a_session_within_budget_passes_and_prints_its_slowest_phase(tmp_path):
  out = _inner_session(tmp_path, budget="1000")  # 1000 units = 1 s: the 0.5 s sleep fits
  assert out.returncode == pytest.ExitCode.OK, out.stdout + out.stderr
  assert re.search(r"quick-tier time budget: slowest phase test_inner.py::test_sleepy "
                   r"\(call\) 0\.[5-9] s", out.stdout), out.stdout


@pytest.mark.slow  # a child pytest session: CI only (issue 47)
def test_a_modules_clean_up_is_not_charged_to_its_last_test(tmp_path):
  # The clean-up after the module's last test (test_sleepy, one process) sleeps 2 s against
  # a 1 s budget: not charged, while the 0.5 s test itself still counts (the slowest phase).
  out = _inner_session(tmp_path, budget="1000", module_cleanup_s=2.0)
  assert out.returncode == pytest.ExitCode.OK, out.stdout + out.stderr
  assert re.search(r"slowest phase test_inner.py::test_sleepy \(call\) 0\.[5-9] s",
                   out.stdout), out.stdout


def test_the_calibration_travels_from_the_workers_to_the_controller_smallest_first(
    monkeypatch):
  """Under xdist each worker measures the calibration after its tests and the controller
  keeps the smallest (the last worker measured on idle cores); the controller measures
  nothing unless no worker sent one."""
  monkeypatch.delenv(time_budget.ENV_BUDGET, raising=False)  # registered even if run with it off
  class Plugins:
    def __init__(self):
      self.plugins = {}

    def register(self, plugin, name):
      self.plugins[name] = plugin

  class Config:
    def __init__(self, workerid):
      self.pluginmanager = Plugins()
      self.workerinput, self.workeroutput = {"workerid": workerid}, {}

  workers = {w: Config(w) for w in ("gw0", "gw1")}
  for (w, config), seconds in zip(workers.items(), (0.25, 0.08)):  # gw0 ran under load
    time_budget.register(config)
    (measuring,) = config.pluginmanager.plugins.values()
    measuring._measure = lambda seconds=seconds: seconds
    measuring.pytest_sessionfinish(session=None)
  assert workers["gw1"].workeroutput == {time_budget.WORKER_OUTPUT: 0.08}

  measured_here = []
  budget = time_budget.TimeBudget(100, measure=lambda: measured_here.append(1) or 9.0)
  assert budget.calibration_s is None  # nothing measured at the start
  for config in workers.values():
    budget.pytest_testnodedown(node=type("Node", (), {"workeroutput": config.workeroutput}),
                               error=None)
  budget.phases = [Phase("t::a", "call", 7.0)]   # 87.5 units of 0.08 s: within budget

  class Session:
    exitstatus = pytest.ExitCode.OK

  budget.pytest_sessionfinish(Session())
  assert (budget.calibration_s, budget.over, measured_here) == (0.08, [], [])
  budget.phases = [Phase("t::a", "call", 9.0)]   # 112.5 units: over, measured again (9.0 s
  budget.pytest_sessionfinish(Session())          # here: the machine got slower), within
  assert (budget.calibration_s, budget.over, measured_here) == (9.0, [], [1])
  alone = time_budget.TimeBudget(100, measure=lambda: 0.5)  # no worker: measured at the end
  alone.pytest_sessionfinish(Session())
  assert alone.calibration_s == 0.5


def test_the_controllers_conftest_does_not_import_tensorflow():
  """The controlling process of ``-n 2`` loads tests/conftest.py: importing TensorFlow
  there delays every worker's start (about 8 s with the calibration, fast kind)."""
  code = ("import sys; sys.path.insert(0, %r); import conftest; "
          "assert 'tensorflow' not in sys.modules and 'keras' not in sys.modules, "
          "sorted(m for m in sys.modules if m.startswith(('tensorflow', 'keras')))[:5]" % TESTS)
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
  assert out.returncode == 0, out.stderr[-2000:]
