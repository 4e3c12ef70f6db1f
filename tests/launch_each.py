"""Runs one absl launcher's ``main`` on several argument lists in ONE process.

The suite's launcher tests each used to start their own Python (about 6-10 s of
TensorFlow import and start-up, then the noise calibration) for every launch.
Here one process imports the launcher once and runs
``app.run(common.main_with_usage_errors(main))`` (what the launcher's
``__main__`` block runs; checked) per argument list, capturing file descriptors
1 and 2 (so that absl's and TensorFlow's writes are caught as a separate
process would see them). A run that raises anything but ``SystemExit`` gets its
traceback in its stderr and exit status 1, as a process would.

Between runs the process is put back to what a fresh one would be for the
launcher: the flags are reset to their defaults, Keras' global state is cleared
(layer names, the global seed, the functional API's state) and Python's,
NumPy's and TensorFlow's global seeds are reseeded from the OS (a launcher with
``--seed`` seeds them itself, as in a fresh process). The noise and sampler
seeds come from the OS in every run anyway. So runs that train may follow each
other, and a run may continue the model directory of an earlier one (a resume),
as two processes one after the other would.

A run is an argument list, or a dict with ``argv`` and optionally:

* ``remove``: paths deleted just before the run (a test's step between two launches);
* ``read``: paths read just after the run, returned in the result's ``files``
  (``{path: text or None}``) and ``modes`` (``{path: permission bits or None}``), for a
  check of a file's state between two runs;
* ``parse_only``: only ``FLAGS([module, *argv])``, as a test importing the
  launcher and parsing a flag file would (exit status 0, or 1 with the traceback);
* ``prelude`` and ``context``: Python source executed before the run, and an
  expression evaluated in its namespace giving a context manager entered
  around ``app.run`` (e.g. ``tfds.testing.mock_data(...)``).

Usage (tests call :func:`launch_each`, or :func:`launch_once` for a group of runs
that several tests share)::

    python tests/launch_each.py MODULE '[["--flag=1"], {"argv": ["--other"]}]'
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import tempfile
import types

import file_lock
import zygote  # children forked from a pre-imported process (tests/zygote.py)

MARKER = "LAUNCH_EACH_RESULTS "


def launch_each(module: str, argvs, env=None, timeout: int = 600) -> list:
  """``[SimpleNamespace(returncode, stdout, stderr, files, modes, seconds)]``, one per run of
  ``argvs`` (argument lists, or dicts as in the module's docstring). ``timeout`` is per
  run (the whole process gets ``timeout`` times the number of runs)."""
  runs = [r if isinstance(r, dict) else {"argv": list(r)} for r in argvs]
  out = zygote.run([sys.executable, os.path.abspath(__file__), module, json.dumps(runs)],
                   capture_output=True, text=True, timeout=timeout * max(len(runs), 1),
                   env=env)
  lines = [l for l in out.stdout.splitlines() if l.startswith(MARKER)]
  if out.returncode != 0 or len(lines) != 1:
    raise AssertionError(f"launch_each {module} failed (exit {out.returncode}):\n"
                         f"{out.stdout[-3000:]}\n{out.stderr[-5000:]}")
  return [types.SimpleNamespace(**r) for r in json.loads(lines[0][len(MARKER):])]


def shared_dir(tmp_path_factory, name: str):
  """A folder of this pytest session shared by its xdist workers (this process's base
  temporary folder without xdist), and the lock file guarding it."""
  import pathlib
  base = pathlib.Path(tmp_path_factory.getbasetemp())
  if os.environ.get("PYTEST_XDIST_WORKER"):
    base = base.parent  # pytest-N/, the session's, above every worker's popen-gwK/
  return base / f"launch_shared_{name}", base / f"launch_shared_{name}.lock"


def launch_once(tmp_path_factory, name: str, module: str, make_runs, env=None,
                timeout: int = 600):
  """Runs a group of launches that several tests share ONCE per pytest session, even
  under xdist (a worker that needs it while another runs it waits for the results).

  ``make_runs(folder)`` writes the data the runs need under ``folder`` and returns the
  runs (as for :func:`launch_each`); ``env`` may be a function of ``folder``. Returns
  ``(folder, results)``; the tests read the runs' files under ``folder`` and must not
  change them. A group whose process failed is run again by the next test needing it
  (which then fails as well, with the process's output)."""
  def compute(folder):
    runs = make_runs(folder)
    results = launch_each(module, runs, env=env(folder) if callable(env) else env,
                          timeout=timeout)
    return [vars(r) for r in results]

  folder, results = once_per_session(tmp_path_factory, name, compute)
  return folder, [types.SimpleNamespace(**r) for r in results]


def once_per_session(tmp_path_factory, name: str, compute):
  """``compute(folder)`` run ONCE per pytest session even under xdist, as
  :func:`launch_once` runs a launcher group (a worker that needs it while another computes
  it waits; a failed ``compute`` is tried again by the next caller, which then fails with
  its error). ``compute`` writes its results under ``folder`` and returns a JSON-able
  value; every caller gets ``(folder, value)`` and must only read ``folder``.

  For a module-scoped fixture of subprocesses (a multi-worker cluster): pytest tears a
  module fixture down whenever its worker runs another module in between, and xdist
  interleaves modules, so the fixture itself may run twice."""
  folder, lock = shared_dir(tmp_path_factory, name)
  done = folder / "once_per_session.json"
  with file_lock.exclusive(lock):
    if not done.exists():
      if folder.exists():
        shutil.rmtree(folder)
      folder.mkdir(parents=True)
      done.write_text(json.dumps({"value": compute(folder)}))
    return folder, json.loads(done.read_text())["value"]


def named_runs(tmp_path_factory, name: str, module: str, runs_of, prepare=None, env=None):
  """A group of launches of ``module`` run in one process, once per pytest session even under
  xdist (:func:`launch_once`): ``runs_of(folder)`` gives ``[(run name, run)]`` (no side
  effects), ``prepare(folder)`` writes the data they need, ``env`` as for
  :func:`launch_once`. Returns ``(folder, {run name: result})``; the tests only read the
  runs' files under ``folder``."""
  named = runs_of(shared_dir(tmp_path_factory, name)[0])
  names = [n for n, _ in named]
  assert len(set(names)) == len(names), names

  def make_runs(folder):
    if prepare:
      prepare(folder)
    return [r for _, r in named]

  folder, results = launch_once(tmp_path_factory, name, module, make_runs, env=env)
  return folder, dict(zip(names, results))


def checked(result, what: str = "launch"):
  """``result`` if its run exited 0, else an AssertionError with its output (as the
  tests' ``launch(..., check=True)``)."""
  if result.returncode != 0:
    raise AssertionError(f"{what} failed (exit {result.returncode}):\n"
                         f"{result.stdout[-3000:]}\n{result.stderr[-5000:]}")
  return result


def _captured(fn) -> tuple:
  """Runs ``fn()`` with fds 1 and 2 sent to files; returns (exit status, stdout, stderr)."""
  import traceback

  saved = [os.dup(1), os.dup(2)]
  with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
    sys.stdout.flush(), sys.stderr.flush()
    os.dup2(out.fileno(), 1), os.dup2(err.fileno(), 2)
    try:
      code = 0
      try:
        fn()
      except SystemExit as exc:  # as the interpreter: a message goes to stderr, status 1
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if exc.code is not None and not isinstance(exc.code, int):
          print(exc.code, file=sys.stderr)
      except BaseException:  # noqa: BLE001 (a process would print it and exit 1)
        traceback.print_exc()
        code = 1
      sys.stdout.flush(), sys.stderr.flush()
    finally:
      os.dup2(saved[0], 1), os.dup2(saved[1], 2)
      for fd in saved:
        os.close(fd)
    out.seek(0), err.seek(0)
    return code, out.read(), err.read()


def _fresh_process_state() -> None:
  """What a new process would start from, for the state a launcher run leaves behind."""
  import random

  import numpy as np

  if "keras" in sys.modules:
    import keras
    keras.backend.clear_session(free_memory=False)  # names, functional API state, global seed
  if "tensorflow" in sys.modules:
    import tensorflow as tf
    tf.random.set_seed(None)
  random.seed()  # from the OS, as at start-up
  np.random.seed()


def _read(path):
  try:
    with open(path) as f:
      return f.read()
  except OSError:
    return None


def _mode(path):
  try:
    return os.stat(path).st_mode & 0o7777
  except OSError:
    return None


def _main(module_name: str, runs_json: str) -> None:
  import functools
  import importlib
  import time

  from absl import app, flags

  from tf_dpnsgd.launch import common

  module = importlib.import_module(module_name)
  # What the launcher's `if __name__ == "__main__":` block runs (checked, so the two agree).
  entries = {"app.run(common.main_with_usage_errors(main))":
                 lambda: common.main_with_usage_errors(module.main),
             "app.run(main)": lambda: module.main}
  with open(module.__file__) as f:
    # its last line (mnist, cifar10, sst2 re-execute under tcmalloc first: not here)
    block = f.read().rpartition('if __name__ == "__main__":')[2].strip().splitlines()[-1].strip()
  if block not in entries:
    raise SystemExit(f"{module_name}'s __main__ block runs {block!r}, not one of "
                     f"{sorted(entries)}: launch_each cannot stand in")
  main = entries[block]()
  results = []
  for run in json.loads(runs_json):
    run = run if isinstance(run, dict) else {"argv": run}
    start = time.perf_counter()
    flags.FLAGS.unparse_flags()
    _fresh_process_state()
    for path in run.get("remove", ()):
      os.remove(path)
    argv = [module_name, *run["argv"]]
    if run.get("parse_only"):
      call = functools.partial(flags.FLAGS, argv)
    else:
      call = functools.partial(app.run, main, argv=argv)
    if run.get("prelude") or run.get("context"):
      namespace = {}
      exec(run.get("prelude", ""), namespace)  # noqa: S102 (the test's own source)
      context = eval(run["context"], namespace) if run.get("context") else contextlib.nullcontext()  # noqa: S307

      def call(inner=call, context=context):
        with context:
          inner()
    code, out, err = _captured(call)
    results.append({"returncode": code, "stdout": out, "stderr": err,
                    "files": {p: _read(p) for p in run.get("read", ())},
                    "modes": {p: _mode(p) for p in run.get("read", ())},
                    "seconds": round(time.perf_counter() - start, 2)})
  flags.FLAGS.unparse_flags()
  sys.stdout.write("\n" + MARKER + json.dumps(results) + "\n")


if __name__ == "__main__":
  _main(sys.argv[1], sys.argv[2])
