"""The README's test command relies on ``--dist loadgroup`` keeping each ``xdist_group`` on
one worker (the launcher groups, the multi-worker cluster: run once, by one worker). With
pytest 9.2 and pytest-xdist 3.8 the mark is silently ignored (pytest-xdist issue 1386: the
tests spread over both workers, the second waiting on the first's file lock): CI of
2026-11-28 evening lost minutes to it. This runs a throwaway session the way the README
does and fails, naming the versions, if a group was split."""

import os
import subprocess
import sys
import textwrap

import pytest
import xdist


@pytest.mark.slow  # a child pytest session guarding CI's own command: CI only (issue 47)
def test_loadgroup_keeps_a_group_on_one_worker(tmp_path):
  (tmp_path / "pytest.ini").write_text("[pytest]\n")
  (tmp_path / "test_inner.py").write_text(textwrap.dedent(f"""
      import os, time
      import pytest

      @pytest.mark.xdist_group("one")
      @pytest.mark.parametrize("i", range(6))
      def test_grouped(i):
        time.sleep(0.05)
        with open(os.path.join({str(tmp_path)!r}, "worker_%d.txt" % i), "w") as f:
          f.write(os.environ.get("PYTEST_XDIST_WORKER", "none"))

      @pytest.mark.parametrize("i", range(6))
      def test_free(i):
        time.sleep(0.05)
      """))
  out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        "-n", "2", "--dist", "loadgroup", "test_inner.py"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=300,
                       env={k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"})
  assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
  workers = {(tmp_path / f"worker_{i}.txt").read_text() for i in range(6)}
  assert len(workers) == 1 and "none" not in workers, (
      f"--dist loadgroup split one xdist_group over {sorted(workers)} with pytest "
      f"{pytest.__version__} and pytest-xdist {xdist.__version__} (pytest-xdist issue 1386): "
      "pin pytest to a version that keeps groups (setup.py's test extra)")
