"""tests/launch_each.py's once-per-session helper: one computation however many callers
(xdist workers are simulated by threads: the lock is an flock on separately opened files,
which excludes threads and processes alike), and a failed one is tried again."""

import threading
import time
import uuid

import pytest

from launch_each import once_per_session


def test_concurrent_callers_share_one_computation(tmp_path_factory):
  name = f"once_{uuid.uuid4().hex}"
  calls = []

  def compute(folder):
    calls.append(folder)
    time.sleep(0.2)  # the other callers arrive while it runs
    (folder / "result.txt").write_text("42")
    return {"answer": 42}

  got = []
  threads = [threading.Thread(target=lambda: got.append(
      once_per_session(tmp_path_factory, name, compute))) for _ in range(3)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert len(calls) == 1 and len(got) == 3
  assert all(value == {"answer": 42} and (folder / "result.txt").read_text() == "42"
             for folder, value in got)


def test_a_failed_computation_is_tried_again_by_the_next_caller(tmp_path_factory):
  name = f"once_{uuid.uuid4().hex}"
  attempts = []

  def flaky(folder):
    attempts.append(1)
    (folder / "partial.txt").write_text("half")
    if len(attempts) == 1:
      raise RuntimeError("cluster died")
    return "ok"

  with pytest.raises(RuntimeError, match="cluster died"):
    once_per_session(tmp_path_factory, name, flaky)
  folder, value = once_per_session(tmp_path_factory, name, flaky)
  assert value == "ok" and len(attempts) == 2
  assert once_per_session(tmp_path_factory, name, flaky)[1] == "ok" and len(attempts) == 2
