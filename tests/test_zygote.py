"""tests/zygote.py: a child forked from a zygote behaves as a fresh ``python`` with the same
command, environment and working directory would (the oracle: the same command through
``subprocess``), or the command runs through ``subprocess`` itself.

The zygotes here preload only ``json`` (a zygote of the suite's own preload imports
TensorFlow: about 5 s), so these tests are quick; one slow test forks from the real preload.
"""

import doctest
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

import zygote

LIGHT = ("json",)
WORKERS_ZYGOTES = zygote._ZYGOTES  # pylint: disable=protected-access  # the suite's children's


@pytest.fixture(autouse=True)
def own_zygotes(monkeypatch):
  """This module's zygotes apart from the worker's (whose TensorFlow zygote the suite's other
  children fork from: the light ones here must not push it out), stopped after each test."""
  mine = {}
  monkeypatch.setattr(zygote, "_ZYGOTES", mine)
  yield
  for z in list(mine.values()):
    z.close()


def test_doctests():
  assert doctest.testmod(zygote).failed == 0


def both(args, **kwargs):
  """The command through a zygote and through ``subprocess``: (zygote's, subprocess's)."""
  forked = zygote.run(args, preload=LIGHT, capture_output=True, text=True, timeout=60, **kwargs)
  fresh = subprocess.run(args, capture_output=True, text=True, timeout=60, **kwargs)
  return forked, fresh


@pytest.mark.parametrize("code, status", [
    ("pass", 0), ("import sys; sys.exit(3)", 3), ("import sys; sys.exit(256 + 7)", 7),
    ("import sys; sys.exit('a message')", 1), ("raise ValueError('boom')", 1),
    ("import sys; sys.stdout.write('no newline'); sys.stderr.write('err')", 0),
    ("print('x' * 200000)", 0), ("import atexit; atexit.register(print, 'at exit')", 0),
    ("raise KeyboardInterrupt", -signal.SIGINT),
])
def test_exit_status_and_output_are_a_fresh_interpreters(code, status):
  forked, fresh = both([sys.executable, "-c", code, "arg"])
  assert fresh.returncode == status
  assert (forked.returncode, forked.stdout, forked.stderr) == (
      fresh.returncode, fresh.stdout, fresh.stderr)


def test_a_traceback_starts_at_the_commands_own_frames():
  forked, fresh = both([sys.executable, "-c", "def f():\n  raise KeyError(1)\nf()"])
  assert forked.stderr == fresh.stderr and "zygote" not in forked.stderr
  assert forked.stderr.startswith("Traceback") and forked.returncode == 1


def test_killed_by_a_signal_reports_minus_its_number():
  code = "import os, signal; os.kill(os.getpid(), signal.SIGTERM)"
  forked, fresh = both([sys.executable, "-c", code])
  assert forked.returncode == fresh.returncode == -signal.SIGTERM


def test_argv_path_environment_and_directory_of_each_command_kind(tmp_path):
  script = tmp_path / "script.py"
  report = ("import json, os, sys; print(json.dumps({'argv': sys.argv, 'path0': sys.path[0], "
            "'orig': sys.orig_argv, 'cwd': os.getcwd(), 'mine': os.environ.get('MINE'), "
            "'gone': 'GONE' in os.environ, 'c_env': __import__('ctypes').CDLL(None).getenv("
            "b'MINE') is not None, 'main': __name__, 'file': globals().get('__file__')}))")
  script.write_text(report + "\n")
  (tmp_path / "pkg").mkdir()
  (tmp_path / "pkg" / "__init__.py").write_text("")
  (tmp_path / "pkg" / "mod.py").write_text(report + "\n")
  env = {k: v for k, v in os.environ.items() if k != "GONE"}
  env["MINE"] = "set here"
  os.environ["GONE"] = "in the caller only"
  try:
    for args in ([sys.executable, "-c", report, "a", "--b=1"],
                 [sys.executable, str(script), "a", "--b=1"],
                 [sys.executable, "-m", "pkg.mod", "a", "--b=1"]):
      forked, fresh = both(args, env=env, cwd=str(tmp_path))
      assert fresh.returncode == 0, fresh.stderr
      assert json.loads(forked.stdout) == json.loads(fresh.stdout), args
      assert json.loads(forked.stdout)["c_env"]  # C's getenv sees the request's environment
  finally:
    del os.environ["GONE"]


def test_stdin_is_empty_or_the_given_input():
  code = "import sys; print(repr(sys.stdin.read()))"
  assert zygote.run([sys.executable, "-c", code], preload=LIGHT, capture_output=True,
                    text=True).stdout == "''\n"
  assert zygote.run([sys.executable, "-c", code], preload=LIGHT, capture_output=True,
                    text=True, input="some input").stdout == "'some input'\n"


def test_a_file_left_open_is_flushed_as_at_a_normal_exit(tmp_path):
  code = textwrap.dedent(f"""
      import sys
      f = open({str(tmp_path / 'left_open')!r}, 'w')
      f.write('buffered, never closed')
      class Owner:
        def __del__(self):
          open({str(tmp_path / 'finalized')!r}, 'w').write('yes')
      owner = Owner()
  """)
  assert zygote.run([sys.executable, "-c", code], preload=LIGHT).returncode == 0
  assert (tmp_path / "left_open").read_text() == "buffered, never closed"
  assert (tmp_path / "finalized").read_text() == "yes"


def test_each_child_draws_its_own_random_numbers():
  code = "import random; print(random.random())"
  values = {zygote.run([sys.executable, "-c", code], preload=LIGHT, capture_output=True,
                       text=True).stdout for _ in range(3)}
  assert len(values) == 3


def test_a_timeout_kills_the_child_and_what_it_started(tmp_path):
  pid_file = tmp_path / "grandchild"
  code = textwrap.dedent(f"""
      import subprocess, time
      p = subprocess.Popen(["sleep", "600"])
      open({str(pid_file)!r}, "w").write(str(p.pid))
      time.sleep(600)
  """)
  for timeout in (1.0, 5.0, 30.0):  # longer only where a loaded machine had not started it
    with pytest.raises(subprocess.TimeoutExpired):
      zygote.run([sys.executable, "-c", code], preload=LIGHT, timeout=timeout)
    if pid_file.exists() and pid_file.read_text():
      break
  grandchild = int(pid_file.read_text())
  deadline = time.time() + 10
  while time.time() < deadline:
    try:
      os.kill(grandchild, 0)
    except ProcessLookupError:
      break
    with open(f"/proc/{grandchild}/stat") as f:  # a zombie waiting for its reaper is gone too
      if f.read().split(")")[-1].split()[0] == "Z":
        break
    time.sleep(0.1)
  else:
    pytest.fail("the timed-out child's own child is still running")


def test_children_run_concurrently_and_popen_reports_as_subprocess(tmp_path):
  # Each child marks its start, then waits (up to 60 s) until all three have started: they
  # finish only if they ran at the same time.
  code = textwrap.dedent(f"""
      import os, sys, time
      open(os.path.join({str(tmp_path)!r}, sys.argv[1]), "w").close()
      deadline = time.time() + 60
      while len(os.listdir({str(tmp_path)!r})) < 3 and time.time() < deadline:
        time.sleep(0.01)
      print(len(os.listdir({str(tmp_path)!r})), sys.argv[1])
      sys.exit(int(sys.argv[1]))
  """)
  procs = [zygote.Popen([sys.executable, "-c", code, str(i)], preload=LIGHT,
                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
           for i in range(3)]
  outputs = [p.communicate(timeout=90)[0] for p in procs]
  assert outputs == ["3 0\n", "3 1\n", "3 2\n"] and [p.returncode for p in procs] == [0, 1, 2]
  slow = zygote.Popen([sys.executable, "-c", "import time; time.sleep(60)"], preload=LIGHT)
  assert slow.poll() is None
  with pytest.raises(subprocess.TimeoutExpired):
    slow.wait(timeout=0.01)
  slow.kill()
  assert slow.wait(timeout=30) == -signal.SIGKILL


def test_an_import_time_variable_gets_its_own_zygote_and_others_share_one():
  code = "import os; print(os.getppid())"

  def parent(**extra):
    env = dict(os.environ, **extra)
    return zygote.run([sys.executable, "-c", code], preload=LIGHT, env=env,
                      capture_output=True, text=True).stdout

  assert parent(UNRELATED="1") == parent(UNRELATED="2", TF_CONFIG="{}")
  assert parent(TF_CPP_MIN_LOG_LEVEL="1") != parent(TF_CPP_MIN_LOG_LEVEL="0")
  # The library's variables are read where used, not at import: one zygote serves both.
  assert parent(TF_DPNSGD_LINEAGE_DIR="/a") == parent(TF_DPNSGD_LINEAGE_DIR="/b")
  assert parent() != str(os.getpid()) + "\n"  # forked from a zygote, not from this process


def test_pythonpath_reaches_the_child_and_gets_its_own_zygote_only_where_it_shadows(tmp_path):
  """A PYTHONPATH entry is on the child's sys.path as in a fresh interpreter; one holding a
  package of the preload (here ``csv``) needs its own zygote, which imports that one."""
  (tmp_path / "plain").mkdir()
  (tmp_path / "plain" / "extra_module.py").write_text("WHERE = 'plain'\n")
  (tmp_path / "shadow" / "csv").mkdir(parents=True)
  (tmp_path / "shadow" / "csv" / "__init__.py").write_text("SHADOW = True\n")
  code = ("import csv, os, sys; print(os.getppid(), getattr(csv, 'SHADOW', False), "
          "sys.path.index(sys.argv[1]) == 1)")

  def child(entry):
    env = dict(os.environ, PYTHONPATH=str(tmp_path / entry))
    args = [sys.executable, "-c", code, str(tmp_path / entry)]
    forked = zygote.run(args, preload=("csv",), env=env, capture_output=True, text=True)
    fresh = subprocess.run(args, env=env, capture_output=True, text=True)
    assert forked.stdout.split()[1:] == fresh.stdout.split()[1:], (forked.stderr, fresh.stderr)
    return forked.stdout.split()

  base = zygote.run([sys.executable, "-c", "import os; print(os.getppid())"],
                    preload=("csv",), capture_output=True, text=True).stdout.split()[0]
  plain, shadow = child("plain"), child("shadow")
  assert plain == [base, "False", "True"]
  assert shadow[0] != base and shadow[1:] == ["True", "True"]


def test_what_zygote_cannot_stand_in_for_runs_through_subprocess():
  out = zygote.run([sys.executable, "-X", "utf8", "-c", "import sys; print(sys.flags.utf8_mode)"],
                   preload=LIGHT, capture_output=True, text=True)
  assert out.stdout == "1\n"
  out = zygote.run(["/bin/sh", "-c", "echo $$"], capture_output=True, text=True)
  assert out.returncode == 0 and out.stdout.strip().isdigit()
  proc = zygote.Popen(["/bin/sh", "-c", "exit 4"])
  assert isinstance(proc, subprocess.Popen) and proc.wait(timeout=30) == 4
  with pytest.raises(ValueError, match="not a python command"):
    zygote.Child(["/bin/true"])


def test_switched_off_everything_runs_through_subprocess(monkeypatch):
  monkeypatch.setenv("TF_DPNSGD_TEST_ZYGOTE", "off")
  code = "import os; print(os.getppid())"
  proc = zygote.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
  assert isinstance(proc, subprocess.Popen)
  assert proc.communicate(timeout=60)[0] == f"{os.getpid()}\n"
  assert zygote.run([sys.executable, "-c", code], capture_output=True,
                    text=True).stdout == f"{os.getpid()}\n"


def test_a_zygote_refuses_to_fork_once_tensorflow_runs_in_it():
  # This process has run TensorFlow (the suite's conftest and other tests): a fork of it
  # would not be a fresh process, so the zygote's check says why.
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  tf.constant(1.0) + 1.0
  assert "runtime is initialised" in zygote._pristine(())  # pylint: disable=protected-access


@pytest.mark.slow
def test_the_suites_preload_forks_a_tensorflow_child_that_trains(monkeypatch):
  """The real preload (TensorFlow, Keras, keras-hub, the library): a child builds and fits a
  model, the same as a fresh process (no runtime or flags inherited). It forks from the
  worker's own zygote, the one the suite's other children fork from (started here if none
  has been yet)."""
  monkeypatch.setattr(zygote, "_ZYGOTES", WORKERS_ZYGOTES)
  code = textwrap.dedent("""
      import json, sys
      import keras, numpy as np, tensorflow as tf
      from absl import flags
      from tensorflow.python.eager import context
      fresh = not context.context()._initialized and not flags.FLAGS.is_parsed()
      keras.utils.set_random_seed(0)
      model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
      model.compile(optimizer="sgd", loss="mse")
      x = np.arange(12, dtype="float32").reshape(4, 3)
      loss = model.fit(x, x[:, :1], epochs=1, verbose=0).history["loss"][0]
      print(json.dumps({"fresh": fresh, "loss": loss, "modules": "keras_hub" in sys.modules}))
  """)
  forked = zygote.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
  fresh = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=600)
  a, b = json.loads(forked.stdout), json.loads(fresh.stdout)
  assert a["fresh"] and b["fresh"] and a["loss"] == pytest.approx(b["loss"], rel=1e-6)
  assert a["modules"] and not b["modules"]  # what the zygote preloaded, and only that


def test_the_least_recently_used_zygote_goes_once_its_children_are_done(monkeypatch):
  monkeypatch.setattr(zygote, "MAX_ZYGOTES", 1)
  slow = zygote.Popen([sys.executable, "-c", "import time; time.sleep(0.5); print('done')"],
                      preload=("csv",), stdout=subprocess.PIPE, text=True)
  # Another preload: the first zygote is dropped, its running child goes on.
  assert zygote.run([sys.executable, "-c", "print(1)"], preload=("csv", "json"),
                    capture_output=True, text=True).stdout == "1\n"
  assert len(zygote._ZYGOTES) == 1  # pylint: disable=protected-access
  assert slow.communicate(timeout=30) == ("done\n", None) and slow.returncode == 0


def test_a_zygote_that_died_is_replaced_and_its_waiting_caller_told():
  code = "import time; time.sleep(30)"
  waiting = zygote.Popen([sys.executable, "-c", code], preload=LIGHT)
  (first,) = zygote._ZYGOTES.values()  # pylint: disable=protected-access
  first._proc.kill()  # pylint: disable=protected-access
  with pytest.raises(zygote.ZygoteError, match="before its child did"):
    waiting.wait(timeout=30)
  waiting.kill()  # its child, orphaned by the zygote's death, is still running
  out = zygote.run([sys.executable, "-c", "print('again')"], preload=LIGHT, capture_output=True,
                   text=True)
  assert out.stdout == "again\n" and first.dead


# --- a child's own python children (a launcher's, a sweep's, a benchmark's) -----------------
# The child below runs `subprocess.run` as a library would; forked from a zygote, its python
# children are forked from the worker's zygote too (through the relay), with the real run's
# outputs, status, `check` and timeout. "json" in sys.modules tells a fork of a LIGHT zygote
# (which imported it) from a fresh interpreter (which does not at start-up).
INNER = "import sys; print('json' in sys.modules); sys.stderr.write('to stderr'); sys.exit(4)"


def test_a_childs_python_children_fork_from_the_zygote_with_the_real_runs_results(tmp_path):
  code = textwrap.dedent(f"""
      import json, subprocess, sys
      inner = {INNER!r}
      captured = subprocess.run([sys.executable, "-c", inner], capture_output=True, text=True)
      raw = subprocess.run([sys.executable, "-c", inner], capture_output=True)
      with open({str(tmp_path / 'log')!r}, "w") as log:
        log.write("before\\n")
        log.flush()
        subprocess.run([sys.executable, "-c", inner], stdout=log, stderr=subprocess.STDOUT)
      try:
        subprocess.run([sys.executable, "-c", inner], check=True, capture_output=True)
        checked = None
      except subprocess.CalledProcessError as exc:
        checked = [exc.returncode, exc.stderr.decode()]
      fed = subprocess.run([sys.executable, "-c", "import sys; print(sys.stdin.read()[::-1])"],
                           input="olleh", capture_output=True, text=True).stdout
      sys.stdout.flush()
      inherited = subprocess.run([sys.executable, "-c", "print('inherited')"]).returncode
      print(json.dumps([captured.returncode, captured.stdout, captured.stderr, raw.stdout.decode(),
                        checked, fed, inherited, open({str(tmp_path / 'log')!r}).read()]))
  """)
  forked = zygote.run([sys.executable, "-c", code], preload=LIGHT, capture_output=True,
                      text=True, timeout=120)
  fresh = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
  assert fresh.returncode == 0, fresh.stderr
  assert forked.returncode == 0, forked.stderr
  lines_forked, lines_fresh = forked.stdout.splitlines(), fresh.stdout.splitlines()
  assert lines_forked[0] == lines_fresh[0] == "inherited"
  got, want = json.loads(lines_forked[1]), json.loads(lines_fresh[1])
  # Forked: every python grandchild saw the zygote's preload; fresh: none did.
  assert want == [4, "False\n", "to stderr", "False\n", [4, "to stderr"], "hello\n", 0,
                  "before\nFalse\nto stderr"]
  assert got[:7] == [4, "True\n", "to stderr", "True\n", [4, "to stderr"], "hello\n", 0]
  assert got[7].replace("True", "False") == want[7]


def test_a_childs_children_of_children_fork_and_other_commands_run_fresh():
  code = textwrap.dedent("""
      import os, subprocess, sys
      run = lambda args: subprocess.run(args, capture_output=True, text=True).stdout.strip()
      probe = "import sys; print('json' in sys.modules)"
      nested = "import subprocess, sys; print(subprocess.run([sys.executable, '-c', %r], " \\
               "capture_output=True, text=True).stdout.strip())" % probe
      print(run([sys.executable, "-c", nested]),        # a grandchild's own child: forked
            run([sys.executable, "-I", "-c", probe]),   # interpreter options: fresh
            subprocess.run(f"{sys.executable} -c \\"{probe}\\"", shell=True,
                           capture_output=True, text=True).stdout.strip(),  # a shell: fresh
            run(["/bin/echo", "echo"]),
            # switched off in the child's environment: fresh
            subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                           env=dict(os.environ, TF_DPNSGD_TEST_ZYGOTE="off")).stdout.strip())
  """)
  out = zygote.run([sys.executable, "-c", code], preload=LIGHT, capture_output=True, text=True,
                   timeout=120)
  assert out.returncode == 0, out.stderr
  assert out.stdout == "True False False echo False\n"


def _gone(pid, within_s=15.0):
  deadline = time.time() + within_s
  while time.time() < deadline:
    try:
      os.kill(pid, 0)
    except ProcessLookupError:
      return True
    try:
      with open(f"/proc/{pid}/stat") as f:
        if f.read().split(")")[-1].split()[0] == "Z":
          return True
    except FileNotFoundError:
      return True
    time.sleep(0.05)
  return False


def test_a_childs_child_is_killed_by_its_timeout_or_when_the_child_dies(tmp_path):
  sleeper = ("import os, sys, time; open(sys.argv[1], 'w').write(str(os.getpid())); "
             "time.sleep(600)")
  code = textwrap.dedent(f"""
      import subprocess, sys, time
      start = time.monotonic()
      try:
        subprocess.run([sys.executable, "-c", {sleeper!r}, sys.argv[1]], timeout=float(sys.argv[2]))
      except subprocess.TimeoutExpired as exc:
        print("timed out", round(exc.timeout), time.monotonic() - start < 60)
  """)
  pid_file = tmp_path / "timed_out"
  for timeout in (1.0, 5.0, 30.0):  # longer only where a loaded machine had not started it
    out = zygote.run([sys.executable, "-c", code, str(pid_file), str(timeout)], preload=LIGHT,
                     capture_output=True, text=True, timeout=120)
    assert out.stdout == f"timed out {round(timeout)} True\n", out.stderr
    if pid_file.exists() and pid_file.read_text():
      break
  assert _gone(int(pid_file.read_text()))
  # The child killed while its own child runs: that child goes with it.
  pid_file = tmp_path / "orphaned"
  parent = zygote.Popen([sys.executable, "-c", code, str(pid_file), "600"], preload=LIGHT)
  deadline = time.time() + 60
  while not (pid_file.exists() and pid_file.read_text()) and time.time() < deadline:
    time.sleep(0.05)
  parent.kill()
  assert parent.wait(timeout=30) == -signal.SIGKILL
  assert _gone(int(pid_file.read_text()))


def test_without_a_relay_a_childs_children_start_through_subprocess(tmp_path, monkeypatch):
  """Where no Unix socket can be made (here: a temporary folder whose path is longer than a
  socket address may be), forked children still run; their own children start fresh."""
  long_dir = tmp_path / ("d" * 120)
  long_dir.mkdir()
  monkeypatch.setattr(zygote, "_RELAY", None)
  monkeypatch.setattr(zygote.tempfile, "tempdir", str(long_dir))
  code = ("import subprocess, sys; print(subprocess.run([sys.executable, '-c', "
          "\"import sys; print('json' in sys.modules)\"], capture_output=True, "
          "text=True).stdout.strip())")
  out = zygote.run([sys.executable, "-c", code], preload=LIGHT, capture_output=True, text=True,
                   timeout=120)
  assert zygote._RELAY is False  # pylint: disable=protected-access
  assert (out.returncode, out.stdout) == (0, "False\n"), out.stderr


def test_a_child_killed_at_once_after_its_fork_is_killed():
  """Its process group exists before its pid is handed out (the zygote sets it as well as the
  child): killed right after the fork, before the child ran a line, it still dies (without
  that, 26 of 40 such kills missed the child)."""
  for _ in range(10):
    child = zygote.Popen([sys.executable, "-c", "import time; time.sleep(60)"], preload=LIGHT)
    child.kill()
    assert child.wait(timeout=20) == -signal.SIGKILL
