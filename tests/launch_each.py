"""Runs one absl launcher's ``main`` on several argument lists in ONE process.

For the suite's flag-error tests: each of them used to start its own Python
(about 6-10 s of TensorFlow import and start-up) only to see the launcher refuse
its flags before training. Here one process imports the launcher once and runs
``app.run(common.main_with_usage_errors(main))`` (what the launcher's
``__main__`` block runs; checked) per argument list, resetting the flags between runs and
capturing file descriptors 1 and 2 (so that absl's and TensorFlow's writes are
caught as a separate process would see them). A run that raises anything but
``SystemExit`` gets its traceback in its stderr and exit status 1, as a process
would. Meant for runs that stop before training: a run that trains would leave
its state behind for the next.

Usage (tests call :func:`launch_each`)::

    python tests/launch_each.py MODULE '[["--flag=1"], ["--other"]]'
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import types

MARKER = "LAUNCH_EACH_RESULTS "


def launch_each(module: str, argvs, env=None, timeout: int = 600) -> list:
  """``[SimpleNamespace(returncode, stdout, stderr)]``, one per argument list of ``argvs``."""
  out = subprocess.run([sys.executable, os.path.abspath(__file__), module,
                        json.dumps([list(a) for a in argvs])],
                       capture_output=True, text=True, timeout=timeout, env=env)
  lines = [l for l in out.stdout.splitlines() if l.startswith(MARKER)]
  if out.returncode != 0 or len(lines) != 1:
    raise AssertionError(f"launch_each {module} failed (exit {out.returncode}):\n"
                         f"{out.stdout[-3000:]}\n{out.stderr[-5000:]}")
  return [types.SimpleNamespace(**r) for r in json.loads(lines[0][len(MARKER):])]


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


def _main(module_name: str, argvs_json: str) -> None:
  import functools
  import importlib

  from absl import app, flags

  from tf_dpnsgd.launch import common

  module = importlib.import_module(module_name)
  # What the launcher's `if __name__ == "__main__":` block runs (checked, so the two agree).
  entry = "app.run(common.main_with_usage_errors(main))"
  with open(module.__file__) as f:
    if entry not in f.read():
      raise SystemExit(f"{module_name} does not end with {entry}: launch_each cannot stand in")
  main = common.main_with_usage_errors(module.main)
  results = []
  for argv in json.loads(argvs_json):
    flags.FLAGS.unparse_flags()
    code, out, err = _captured(functools.partial(app.run, main, argv=[module_name, *argv]))
    results.append({"returncode": code, "stdout": out, "stderr": err})
  sys.stdout.write("\n" + MARKER + json.dumps(results) + "\n")


if __name__ == "__main__":
  _main(sys.argv[1], sys.argv[2])
