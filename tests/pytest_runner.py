"""``main`` of the Bazel ``py_test`` targets: runs pytest on the given test files.

    python tests/pytest_runner.py tests/test_noise.py [pytest args...]

Exits with pytest's status, and with status 1 when pytest exits 0 but no test
ran (all skipped or none collected), so a target cannot pass by testing
nothing. Under ``bazel test`` it writes the JUnit XML Bazel asks for
(``$XML_OUTPUT_FILE``) and keeps pytest's cache out of the runfiles.
"""

from __future__ import annotations

import os
import sys

import pytest


class _Count:
  """Counts the tests whose call phase ran (passed or failed)."""

  def __init__(self):
    self.ran = 0

  def pytest_runtest_logreport(self, report):
    if report.when == "call" and not report.skipped:
      self.ran += 1


def main(argv: list[str]) -> int:
  if not argv:
    print(__doc__, file=sys.stderr)
    return 2
  args = ["-q", "-p", "no:cacheprovider", *argv]
  if os.environ.get("XML_OUTPUT_FILE"):
    args.append(f"--junitxml={os.environ['XML_OUTPUT_FILE']}")
  count = _Count()
  status = int(pytest.main(args, plugins=[count]))
  if status == 0 and count.ran == 0:
    print(f"pytest_runner: no test ran in {argv}", file=sys.stderr)
    return 1
  return status


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
