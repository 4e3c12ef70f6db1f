"""Runs the docstring examples (``>>>``) of every module of the package.

Modules are discovered when the tests are collected (``pkgutil.walk_packages``
over ``tf_dpnsgd``), so modules added, split or moved are picked up without
editing this file. A module is a case when its source contains ``>>>``; the
source is read without importing the module. One pytest case per module; a
case fails on any failing example, and on a module whose ``>>>`` doctest
cannot find (e.g. an example outside a docstring).

``tf_dpnsgd.launch.*`` modules run in a subprocess of their own: the launchers
define their absl flags when imported and share flag names (``optimizer``,
``batch_size``, ...), so importing two of them in one process raises
``DuplicateFlagError``; a pytest worker may already hold one.

Options: ``ELLIPSIS`` and ``NORMALIZE_WHITESPACE``.
"""

from __future__ import annotations

import doctest
import importlib
import importlib.util
import io
import os
import pkgutil
import sys

import pytest

import tf_dpnsgd
import zygote  # children forked from a pre-imported process (tests/zygote.py)

# Fewer modules with examples than this means discovery broke (18 when written).
MIN_MODULES_WITH_EXAMPLES = 12
OPTIONFLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
SUBPROCESS_PREFIXES = ("tf_dpnsgd.launch.",)


def _defines_flags(name: str) -> bool:
  """Whether module ``name``'s source defines absl flags when imported (then it runs in a
  subprocess; a launch module without flags, e.g. the allocator's, runs in-process)."""
  spec = importlib.util.find_spec(name)
  with open(spec.origin, encoding="utf-8") as f:
    source = f.read()
  return "define_flags(" in source or "flags.DEFINE_" in source


def _discover():
  """(module names with ``>>>`` in their source, import errors of packages)."""
  errors = []
  found = []
  for info in pkgutil.walk_packages(tf_dpnsgd.__path__, "tf_dpnsgd.", onerror=errors.append):
    spec = info.module_finder.find_spec(info.name)
    origin = getattr(spec, "origin", None)
    if not origin or not origin.endswith(".py"):
      continue
    with open(origin, encoding="utf-8") as f:
      if ">>>" in f.read():
        found.append(info.name)
  return sorted(found), errors


MODULES, WALK_ERRORS = _discover()


def _run_doctests(name: str) -> tuple[int, int, str]:
  """(attempted, failed, report) of the doctests of module ``name``."""
  module = importlib.import_module(name)
  runner = doctest.DocTestRunner(optionflags=OPTIONFLAGS)
  out = io.StringIO()
  for test in doctest.DocTestFinder().find(module, name):
    runner.run(test, out=out.write)
  return runner.tries, runner.failures, out.getvalue()


_SUBPROCESS_CODE = """
import sys
sys.path.insert(0, sys.argv[1])
import test_doctests
attempted, failed, report = test_doctests._run_doctests(sys.argv[2])
print(report)
print(f"ATTEMPTED {attempted} FAILED {failed}")
"""


def test_examples_were_found():
  assert not WALK_ERRORS, f"modules that could not be imported while walking: {WALK_ERRORS}"
  assert len(MODULES) >= MIN_MODULES_WITH_EXAMPLES, MODULES


@pytest.mark.parametrize("name", MODULES)
def test_doctests(name):
  if name.startswith(SUBPROCESS_PREFIXES) and _defines_flags(name):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", KERAS_BACKEND="tensorflow",
               CUDA_VISIBLE_DEVICES="")
    proc = zygote.run(
        [sys.executable, "-c", _SUBPROCESS_CODE, os.path.dirname(os.path.abspath(__file__)), name],
        capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    last = proc.stdout.strip().splitlines()[-1].split()
    attempted, failed, report = int(last[1]), int(last[3]), proc.stdout
  else:
    attempted, failed, report = _run_doctests(name)
  assert attempted > 0, f"{name} contains '>>>' but doctest found no example in its docstrings"
  assert failed == 0, f"{failed} of {attempted} examples failed in {name}:\n{report}"
