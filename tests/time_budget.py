"""The quick tier's time budget: a test not marked ``slow`` must stay cheap, loudly.

Every phase (setup, call, teardown) of a test without the ``slow`` mark must
take at most :data:`MULTIPLE` calibration units (``tests/calibration.py``: the
median time of a fixed small TensorFlow workload on this machine, measured
once per session: by each xdist worker after its tests, the smallest taken, else by the
process that ran the tests, at the end). A phase over the budget fails
the session with a section naming the test, its time, the calibration and the
multiple; the fix is to make the test cheaper or to mark it ``slow`` (the full
suite still runs it). Since the unit scales with the machine's TensorFlow
kernels, one multiple holds on the fast and the slow machine kinds.

Under pytest-xdist the durations reach the controller through
``pytest_runtest_logreport``, so the plugin runs there (``tests/conftest.py``
registers it); the calibration comes from the workers' output (:class:`WorkerCalibration`:
each measures it after its tests; the last to finish measures on an otherwise idle machine,
and the smallest value is taken), so that the controller never imports TensorFlow: it used
to import it and calibrate before starting the workers, about 8 s of a quick tier's wall
time on the fast kind, spent before any test could start (2026-11-28). Before failing, the
calibration is measured again and the larger of the two is used, so that load that arrived
during the session does not fail it on its own.

Environment:

* ``TF_DPNSGD_TEST_BUDGET=off`` disables the check (debugging, profilers,
  a machine shared with heavy work); a number sets another multiple.
* ``TF_DPNSGD_TEST_CALIBRATION=<seconds>`` fixes the calibration instead of
  measuring it (this plugin's own tests).
"""

from __future__ import annotations

import os
import tempfile
import time
from typing import Callable, Iterable, NamedTuple, Optional

import pytest

import calibration
import file_lock

#: Calibration units one phase of a quick-tier test may take. Chosen from the quick tier on
#: the fast kind (2026-11-28, docs/testing.md): the slowest phase took 7-12 s at calibrations
#: of 0.08-0.12 s (about 100 units) with a light load on the cores, and 31 s in a run with a
#: load average of 5.7 on the 2 cores, which still passed at 250. 300 leaves about 3x over a
#: light-load run and fails a quick test that takes about 20 s on a near-idle fast machine
#: (calibration 0.064 s). Halved to 150 when the calibration moved from a fresh controlling
#: process into the workers after their tests (2026-11-28 night): the same workload runs about
#: 2x slower there (0.113-0.116 s after 262 quick tests against 0.045-0.070 s in a fresh
#: process minutes apart, the cores idle both times; a small private fit is only ~5% slower,
#: so the tests' times are not what moved; cause not found), so 150 of those units are about
#: the old 300 in seconds (about 17 s on the fast kind).
MULTIPLE = 150.0
ENV_BUDGET = "TF_DPNSGD_TEST_BUDGET"
ENV_CALIBRATION = "TF_DPNSGD_TEST_CALIBRATION"
PHASES = ("setup", "call", "teardown")
#: The file lock that keeps the workers' calibrations from overlapping.
CALIBRATION_LOCK = os.path.join(tempfile.gettempdir(), "tf_dpnsgd_test_calibration.lock")
#: ``workeroutput`` key under which each xdist worker hands its calibration to the controller.
WORKER_OUTPUT = "tf_dpnsgd_calibration_s"
#: A teardown report's ``user_properties`` key: seconds of that teardown spent on the whole
#: module's clean-up (``tests/conftest.py``), not charged to the test.
MODULE_TEARDOWN = "module_teardown_s"


class Phase(NamedTuple):
  nodeid: str
  when: str
  seconds: float


def over_budget(phases: Iterable[Phase], calibration_s: float,
                multiple: float = MULTIPLE) -> list[Phase]:
  """The phases longer than ``multiple * calibration_s``, slowest first.

  >>> over_budget([Phase("t::a", "call", 3.0), Phase("t::b", "setup", 0.5)], 0.01, 100)
  [Phase(nodeid='t::a', when='call', seconds=3.0)]
  >>> over_budget([Phase("t::a", "call", 0.9)], 0.01, 100)
  []
  """
  if not calibration_s > 0 or not multiple > 0:
    raise ValueError(f"calibration ({calibration_s}) and multiple ({multiple}) must be > 0")
  limit = multiple * calibration_s
  return sorted((p for p in phases if p.seconds > limit), key=lambda p: -p.seconds)


def charged_seconds(report) -> float:
  """A phase's duration less the module clean-up it ran (:data:`MODULE_TEARDOWN`).

  >>> class R: duration, user_properties = 60.0, [(MODULE_TEARDOWN, 58.0), ("other", 1)]
  >>> charged_seconds(R())
  2.0
  """
  module = sum(float(v) for k, v in getattr(report, "user_properties", ()) or ()
               if k == MODULE_TEARDOWN)
  return max(report.duration - module, 0.0)


def run_module_cleanup(item, nextitem, cleanup: Callable[[], object]) -> None:
  """Runs ``cleanup`` after a module's last test (``pytest_runtest_teardown``), timed into
  the teardown report as :data:`MODULE_TEARDOWN` so the budget does not charge it to the
  test that happened to run last."""
  if nextitem is None or nextitem.module is not item.module:
    start = time.perf_counter()
    cleanup()
    item.user_properties.append((MODULE_TEARDOWN, time.perf_counter() - start))


def budget_multiple(environ=os.environ) -> Optional[float]:
  """The multiple from ``TF_DPNSGD_TEST_BUDGET`` (None: disabled), default :data:`MULTIPLE`.

  >>> budget_multiple({}), budget_multiple({ENV_BUDGET: "off"}), budget_multiple({ENV_BUDGET: "40"})
  (150.0, None, 40.0)
  """
  value = environ.get(ENV_BUDGET, "").strip().lower()
  if not value:
    return MULTIPLE
  if value in ("off", "0", "no", "false"):
    return None
  try:
    multiple = float(value)
  except ValueError:
    raise ValueError(f"{ENV_BUDGET}={value!r}: expected 'off' or a positive number") from None
  if not multiple > 0:
    raise ValueError(f"{ENV_BUDGET}={value!r}: expected 'off' or a positive number")
  return multiple


def measure(environ=os.environ) -> float:
  """The calibration: ``TF_DPNSGD_TEST_CALIBRATION`` if set, else measured now."""
  fixed = environ.get(ENV_CALIBRATION)
  return float(fixed) if fixed else calibration.calibrate()


class TimeBudget:
  """The pytest plugin: collects quick-tier phase durations, fails the session on excess."""

  def __init__(self, multiple: float, measure: Callable[[], float] = measure):
    self.multiple = multiple
    self._measure = measure
    self.calibration_s: Optional[float] = None  # at the end: the workers', else measured here
    self.phases: list[Phase] = []
    self.over: list[Phase] = []

  def pytest_report_header(self):
    return (f"machine: {calibration.machine_kind()}; quick-tier budget {self.multiple:g} "
            f"calibration units per phase, the calibration measured after the tests "
            f"({ENV_BUDGET}=off disables)")

  @pytest.hookimpl(optionalhook=True)
  def pytest_testnodedown(self, node, error):
    """xdist: a worker is done; its output carries the calibration it measured after its
    tests. The smallest is kept: the last worker measured with the cores otherwise idle,
    the others under the load of the tests still running (up to 3x slower)."""
    value = (getattr(node, "workeroutput", None) or {}).get(WORKER_OUTPUT)
    if value is not None:
      value = float(value)
      self.calibration_s = value if self.calibration_s is None else min(self.calibration_s,
                                                                         value)

  def pytest_runtest_logreport(self, report):
    if report.when in PHASES and "slow" not in report.keywords:
      self.phases.append(Phase(report.nodeid, report.when, charged_seconds(report)))

  @pytest.hookimpl(tryfirst=True)
  def pytest_sessionfinish(self, session):
    if self.calibration_s is None:  # no xdist, or no worker sent one (crashed): measure here
      self.calibration_s = self._measure()
    if not over_budget(self.phases, self.calibration_s, self.multiple):
      return
    # Measured again before failing: load that arrived mid-session slows the tests and the
    # calibration alike.
    self.calibration_s = max(self.calibration_s, self._measure())
    self.over = over_budget(self.phases, self.calibration_s, self.multiple)
    if self.over and session.exitstatus == pytest.ExitCode.OK:
      session.exitstatus = pytest.ExitCode.TESTS_FAILED

  def pytest_terminal_summary(self, terminalreporter):
    limit = self.multiple * self.calibration_s
    if self.phases and not self.over:  # one line for tracking the suite's cost, even with -q
      p = max(self.phases, key=lambda p: p.seconds)
      terminalreporter.line(
          f"quick-tier time budget: slowest phase {p.nodeid} ({p.when}) {p.seconds:.1f} s = "
          f"{p.seconds / self.calibration_s:.0f} of {self.multiple:g} units; "
          f"{calibration.line(self.calibration_s)}")
    if not self.over:
      return
    terminalreporter.section("quick-tier time budget exceeded", sep="=", red=True, bold=True)
    for p in self.over:
      terminalreporter.line(
          f"{p.nodeid} ({p.when}) took {p.seconds:.1f} s = {p.seconds / self.calibration_s:.0f} "
          f"calibration units; the budget is {self.multiple:g} units = {limit:.1f} s "
          f"(calibration {self.calibration_s:.3f} s)", red=True)
    terminalreporter.line(
        f"Make it cheaper or mark it slow (tests/time_budget.py; {ENV_BUDGET}=off disables "
        f"the check).")


class WorkerCalibration:
  """In each xdist worker: measures the calibration after the worker's tests, never while
  another worker (of this session or any other running) measures: two overlapping
  calibrations on 2 cores measured 0.196 s where one alone takes 0.045 s (a file lock,
  :data:`CALIBRATION_LOCK`). The value goes into the output
  that xdist sends to the controller when the worker finishes (about 1.5 s a worker on the
  fast kind, against the controller's 7.5 s before any worker started)."""

  def __init__(self, config, measure: Callable[[], float] = measure):
    self._config = config
    self._measure = measure

  def pytest_sessionfinish(self, session):
    with file_lock.exclusive(CALIBRATION_LOCK):
      self._config.workeroutput[WORKER_OUTPUT] = self._measure()


def register(config) -> None:
  """Registers :class:`TimeBudget` in the controlling process (or the only one), and
  :class:`WorkerCalibration` in each xdist worker, unless the budget is disabled."""
  multiple = budget_multiple()
  if multiple is None:
    return
  if hasattr(config, "workerinput"):  # an xdist worker: the controller sees every report
    config.pluginmanager.register(WorkerCalibration(config), "tf_dpnsgd_worker_calibration")
    return
  config.pluginmanager.register(TimeBudget(multiple), "tf_dpnsgd_time_budget")
