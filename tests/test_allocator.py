"""tf_dpnsgd.launch.allocator: launchers re-execute under tcmalloc where it is installed."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tf_dpnsgd.launch import allocator

TC = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"


def only(*paths):
  return lambda path: path in paths


def test_preloads_the_first_installed_candidate_before_any_earlier_preload():
  env = {"PATH": "/bin", "LD_PRELOAD": "/opt/libhook.so"}
  new = allocator.reexec_environment(env, exists=only("/b/libtcmalloc.so.4", TC),
                                     candidates=("/a/libtcmalloc.so.4", "/b/libtcmalloc.so.4", TC))
  assert new == {"PATH": "/bin", "LD_PRELOAD": "/b/libtcmalloc.so.4:/opt/libhook.so"}
  assert env["LD_PRELOAD"] == "/opt/libhook.so"  # the caller's mapping is not changed
  assert allocator.reexec_environment({}, exists=only(TC), candidates=(TC,)) == {"LD_PRELOAD": TC}


@pytest.mark.parametrize("env", [
    {"TF_DPNSGD_ALLOCATOR": "system"},                      # the opt-out
    {"TF_DPNSGD_ALLOCATOR": " System "},
    {"LD_PRELOAD": TC},                                     # already under tcmalloc: no loop
    {"LD_PRELOAD": "/x/libhook.so /usr/lib/libjemalloc.so.2"},  # jemalloc, space-separated
])
def test_no_reexec_when_opted_out_or_already_fast(env):
  assert allocator.reexec_environment(env, exists=only(TC), candidates=(TC,)) is None


def test_no_reexec_when_nothing_is_installed():
  assert allocator.reexec_environment({}, exists=lambda _: False) is None


def test_maybe_reexec_execs_the_command_line_as_typed_or_logs_the_hint(monkeypatch):
  calls, logs = [], []
  monkeypatch.setattr(allocator, "CANDIDATES", (TC,))
  monkeypatch.setattr(allocator.os.path, "exists", only(TC))
  argv = ["python", "-m", "tf_dpnsgd.launch.cifar10", "--flagfile=x.flags"]
  assert allocator.maybe_reexec(argv, env={}, execve=lambda *a: calls.append(a),
                                log=logs.append, onednn_enabled=True)
  ((path, got_argv, env),) = calls
  assert path == sys.executable and got_argv == argv and env == {"LD_PRELOAD": TC}
  assert "re-executing under " + TC in logs[0]
  # Not installed: no exec, one hint naming the package and the opt-out.
  monkeypatch.setattr(allocator.os.path, "exists", lambda _: False)
  logs.clear()
  assert not allocator.maybe_reexec(argv, env={}, execve=lambda *a: calls.append(a),
                                    log=logs.append, onednn_enabled=True)
  assert len(calls) == 1 and len(logs) == 1
  assert "libtcmalloc-minimal4" in logs[0] and "TF_DPNSGD_ALLOCATOR=system" in logs[0]
  # Opted out: silent.
  logs.clear()
  assert not allocator.maybe_reexec(argv, env={"TF_DPNSGD_ALLOCATOR": "system"},
                                    execve=lambda *a: calls.append(a), log=logs.append,
                                    onednn_enabled=True)
  assert logs == [] and len(calls) == 1


@pytest.mark.parametrize("env,enabled,expected", [
    ({}, False, {"TF_ENABLE_ONEDNN_OPTS": "1"}),            # TensorFlow turned it off: on
    ({"TF_ENABLE_ONEDNN_OPTS": "0"}, False, None),           # the user's 0 is kept
    ({"TF_ENABLE_ONEDNN_OPTS": "1"}, False, None),           # already asked for: no loop
    ({}, True, None),                                        # on by TensorFlow's default
])
def test_onednn_is_turned_on_only_where_tensorflow_turned_it_off_and_the_user_said_nothing(
    env, enabled, expected):
  assert allocator.onednn_environment(env, enabled) == expected
  # With no tcmalloc installed, the oneDNN part alone decides whether to re-execute.
  assert allocator.reexec_environment(env, exists=lambda _: False,
                                      onednn_enabled=enabled) == expected


def test_tcmalloc_and_onednn_come_in_one_reexecution(monkeypatch):
  calls, logs = [], []
  monkeypatch.setattr(allocator, "CANDIDATES", (TC,))
  monkeypatch.setattr(allocator.os.path, "exists", only(TC))
  argv = ["python", "-m", "tf_dpnsgd.launch.sst2", "--flagfile=x.flags"]
  assert allocator.maybe_reexec(argv, env={"HOME": "/h"}, execve=lambda *a: calls.append(a),
                                log=logs.append, onednn_enabled=False)
  ((_, got_argv, env),) = calls
  assert got_argv == argv
  assert env == {"HOME": "/h", "LD_PRELOAD": TC, "TF_ENABLE_ONEDNN_OPTS": "1"}
  assert any("re-executing under " + TC in line for line in logs)
  assert any("TF_ENABLE_ONEDNN_OPTS=1" in line and "TF_ENABLE_ONEDNN_OPTS=0" in line
             for line in logs)
  # No tcmalloc: the re-execution for oneDNN alone.
  monkeypatch.setattr(allocator.os.path, "exists", lambda _: False)
  calls.clear()
  logs.clear()
  assert allocator.maybe_reexec(argv, env={}, execve=lambda *a: calls.append(a),
                                log=logs.append, onednn_enabled=False)
  assert calls[0][2] == {"TF_ENABLE_ONEDNN_OPTS": "1"}
  assert len(logs) == 1 and "TF_ENABLE_ONEDNN_OPTS=1" in logs[0]
  # The re-executed process (the variable now set; TensorFlow asked, off in this test
  # process) runs on, no second re-execution, and gives the tcmalloc hint once.
  again = calls[0][2]
  calls.clear()
  logs.clear()
  assert not allocator.maybe_reexec(argv, env=again, execve=lambda *a: calls.append(a),
                                    log=logs.append)
  assert calls == [] and len(logs) == 1 and "libtcmalloc-minimal4" in logs[0]


@pytest.mark.slow
def test_a_real_process_reexecutes_once_under_an_installed_tcmalloc():
  """End to end where tcmalloc is installed: the re-executed process runs the same command
  line with tcmalloc preloaded and does not re-execute again."""
  library = next((c for c in allocator.CANDIDATES if os.path.exists(c)), None)
  if library is None:
    pytest.skip("no tcmalloc installed (apt-get install libtcmalloc-minimal4)")
  script = ("import os, sys\n"
            "from tf_dpnsgd.launch import allocator\n"
            "allocator.maybe_reexec()\n"
            "print('PRELOAD', os.environ.get('LD_PRELOAD'), sys.argv[1:])\n")
  env = {k: v for k, v in os.environ.items() if k not in ("TF_DPNSGD_ALLOCATOR", "LD_PRELOAD")}
  out = subprocess.run([sys.executable, "-c", script, "--flag=1"], env=env, text=True,
                       capture_output=True, timeout=300)
  assert out.returncode == 0, out.stderr[-3000:]
  lines = [l for l in out.stdout.splitlines() if l.startswith("PRELOAD")]
  assert lines == [f"PRELOAD {library} ['--flag=1']"]
  assert out.stderr.count("re-executing under") == 1


@pytest.mark.slow
def test_a_real_launcher_process_ends_up_with_onednn_and_reexecutes_at_most_once():
  """End to end with ``TF_ENABLE_ONEDNN_OPTS`` unset (this suite sets 0): the process that
  goes on runs oneDNN's kernels, whether TensorFlow's default on this CPU already did
  (no re-execution for it) or not (one re-execution with the variable set)."""
  script = ("import os, sys\n"
            "from tf_dpnsgd.launch import allocator\n"
            "from tf_dpnsgd.per_example import vectorized\n"
            "allocator.maybe_reexec()\n"
            "print('ONEDNN', vectorized.onednn_enabled(strict=True),"
            " os.environ.get('TF_ENABLE_ONEDNN_OPTS'))\n")
  env = {k: v for k, v in os.environ.items() if k != "TF_ENABLE_ONEDNN_OPTS"}
  env["TF_DPNSGD_ALLOCATOR"] = "system"  # this test is about oneDNN alone
  out = subprocess.run([sys.executable, "-c", script], env=env, text=True,
                       capture_output=True, timeout=300)
  assert out.returncode == 0, out.stderr[-3000:]
  lines = [l for l in out.stdout.splitlines() if l.startswith("ONEDNN")]
  assert len(lines) == 1 and lines[0].startswith("ONEDNN True"), (lines, out.stderr[-2000:])
  reexecuted = out.stderr.count("re-executing with TF_ENABLE_ONEDNN_OPTS=1")
  assert reexecuted == (1 if lines[0].endswith(" 1") else 0)
