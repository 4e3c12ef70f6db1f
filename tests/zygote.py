"""Python child processes forked from a pre-imported process (a *zygote*) instead of started
anew: about 4.5 s of TensorFlow, Keras and keras-hub import saved per child on the fast
machine kind (3.5x that on the slow ones), for the suite's ~40 launcher, multi-worker and
script children (issue 47).

A test calls :func:`run` (as ``subprocess.run``) or :class:`Popen` (as ``subprocess.Popen``,
the subset the suite uses) with ``[sys.executable, "-c", code, ...]``,
``[sys.executable, "-m", module, ...]`` or ``[sys.executable, script.py, ...]``. The child is
forked from a process of the same pytest worker that imported :data:`PRELOAD` and nothing
else (no TensorFlow runtime, no flags of a launcher, no model built: checked before every
fork), then becomes what a fresh ``python`` with those arguments would be:

* the request's environment (``os.environ``, so ``getenv`` in C sees it too), working
  directory, ``sys.argv``, ``sys.orig_argv`` (a re-execution, e.g. under tcmalloc, starts the
  real command), ``sys.path`` (its first entry by the command's kind, the request's
  ``PYTHONPATH`` after it) and a fresh ``__main__``; stdin from ``/dev/null`` (or ``input``),
  stdout and stderr to files the caller reads back;
* a new process group (a timeout kills the child and whatever it started);
* Python's and NumPy's global random state reseeded from the OS (a fork would otherwise share
  the zygote's); TensorFlow's runtime and seeds start fresh (never initialised before the
  fork);
* it exits as an interpreter does (:func:`_exit_as_an_interpreter`): ``SystemExit``'s code, a
  traceback from the command's own frames and status 1 for an exception (killed by SIGINT for an
  uncaught ``KeyboardInterrupt``, as the interpreter ends), non-daemon threads
  joined, atexit handlers run, what the command's modules held finalized, buffers flushed;
  killed by a signal, ``returncode`` is minus its number, as ``subprocess`` reports.

What is read once at import time cannot be changed after it, so zygotes are kept per value of
the import-time environment (:func:`import_key`: ``TF_*`` but ``TF_CONFIG`` and the library's
``TF_DPNSGD_*``, ``XLA_*``, ``KERAS*``, ``CUDA*``, ``PYTHON*``, ``LD_*``, allocator, threading
and home variables; ``PYTHONPATH`` where it would shadow a preloaded package): a request with
another ``TF_CPP_MIN_LOG_LEVEL`` or ``TF_ENABLE_ONEDNN_OPTS`` gets its own zygote (at most
:data:`MAX_ZYGOTES` kept per process). Anything this module cannot stand in for (another
executable, interpreter options, ``TF_DPNSGD_TEST_ZYGOTE=off``, no ``os.fork``) runs through
``subprocess`` unchanged; ``TF_DPNSGD_TEST_ZYGOTE_LOG=<file>`` logs each zygote and fork.

A forked child's own ``subprocess.run([sys.executable, ...])`` (a sweep's cells, a benchmark
script's children, what those start in turn) is forked the same way: the child's
``subprocess.run`` sends the command to a Unix socket of the pytest worker (:class:`_Relay`),
which forks it from its zygote for that environment and answers with its pid and exit
status; outputs go to the files or pipes the run asked for (``/proc/<pid>/fd/<n>`` of the
asking process for an inherited or given file), a timeout kills the child's process group,
and a child whose asker dies is killed with it (:func:`_routed_run`). ``Popen`` and the rest
of ``subprocess`` stay the real ones.

Tests whose subject is a fresh process itself (what is logged or imported at start-up, the
allocator's re-execution, child pytest sessions) keep ``subprocess``.
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import re
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading

# What each zygote imports before it forks (the library, not its launchers: a launcher defines
# its flags when imported, so it is imported in the child, as in a fresh process).
PRELOAD = ("numpy", "tensorflow", "keras", "keras_hub", "dp_accounting", "absl.app",
           "absl.flags", "tf_dpnsgd", "tf_dpnsgd.launch.common")

# Variables read when the preloaded modules are imported (or cached by them): a zygote serves
# only requests with the same values of these. Not TF_CONFIG (read when a strategy is made) nor
# the library's own TF_DPNSGD_* (each read where it is used, never at import); PYTHONPATH only
# where it would shadow a preloaded package (:func:`import_key`).
_IMPORT_TIME = re.compile(r"^(TF_(?!CONFIG$|DPNSGD_)|XLA_|KERAS|CUDA|PYTHON(?!PATH$)|LD_|MALLOC|"
                          r"GLIBC|TCMALLOC|OMP_|MKL|ONEDNN|DNNL|OPENBLAS|HOME$|TMPDIR$|TEMP$|TMP$)")
_READY = "ZYGOTE_READY"
_START_TIMEOUT_S = 600
_FORK_TIMEOUT_S = 120


def _pythonpath(env) -> list:
  return [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]


def _shadows(entries, preload) -> bool:
  """Whether a fresh interpreter with ``entries`` first on its path would import one of the
  preloaded packages from elsewhere than the zygote did (found without importing it)."""
  import importlib.util  # pylint: disable=g-import-not-at-top
  for name in sorted({p.split(".")[0] for p in preload}):
    spec = importlib.util.find_spec(name)
    origin = (list(spec.submodule_search_locations or [])[:1] or [spec.origin]) if spec else []
    for entry in entries:
      for candidate in (os.path.join(entry, name), os.path.join(entry, name + ".py")):
        if os.path.exists(candidate) and [os.path.realpath(candidate)] != [
            os.path.realpath(o) for o in origin]:
          return True
  return False


def import_key(env, preload=PRELOAD) -> tuple:
  """The import-time part of ``env`` (a zygote serves requests with an equal key).

  >>> import_key({"TF_CPP_MIN_LOG_LEVEL": "3", "TF_CONFIG": "{}", "PATH": "/bin",
  ...             "TF_DPNSGD_LINEAGE_DIR": "/tmp/x", "PYTHONPATH": "/nonexistent"})
  (('TF_CPP_MIN_LOG_LEVEL', '3'),)
  """
  key = sorted((k, v) for k, v in env.items() if _IMPORT_TIME.match(k))
  if _shadows(_pythonpath(env), preload):
    key.append(("PYTHONPATH", env["PYTHONPATH"]))
  return tuple(key)


def parse_command(args):
  """``(kind, target, rest)`` of a ``python`` command this module can stand in for, else None.

  >>> parse_command([sys.executable, "-m", "tf_dpnsgd.privacy", "--json"])
  ('module', 'tf_dpnsgd.privacy', ['--json'])
  >>> parse_command([sys.executable, "-c", "print(1)"])
  ('code', 'print(1)', [])
  >>> parse_command([sys.executable, "-u", "x.py"]) is None
  True
  >>> parse_command(["/bin/echo", "x"]) is None
  True
  """
  args = [os.fspath(a) for a in args]
  if len(args) < 2 or args[0] != sys.executable:
    return None
  if args[1] in ("-c", "-m"):
    if len(args) < 3:
      return None
    return ("code" if args[1] == "-c" else "module"), args[2], args[3:]
  if args[1].startswith("-"):
    return None
  return "script", args[1], args[2:]


def enabled() -> bool:
  return hasattr(os, "fork") and os.environ.get("TF_DPNSGD_TEST_ZYGOTE", "on") != "off"


# ------------------------------------------------------------------------------------------
# The caller's side (a pytest worker).
# ------------------------------------------------------------------------------------------
class ZygoteError(RuntimeError):
  pass


class _Zygote:
  """One zygote process and the thread reading its replies."""

  def __init__(self, env, preload):
    self._err = tempfile.TemporaryFile("w+")
    self._proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), json.dumps(preload)],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=self._err, env=env, text=True, bufsize=1)
    self._lock = threading.Lock()
    self._cond = threading.Condition(self._lock)
    self._replies = {}
    self._next = 0
    self._dead = None
    self._ready = False
    self._reader = threading.Thread(target=self._read, daemon=True)
    self._reader.start()
    with self._cond:
      if not self._cond.wait_for(lambda: self._ready or self._dead, _START_TIMEOUT_S):
        self._dead = "did not start in time"
      if self._dead:
        raise ZygoteError(f"the zygote failed: {self._dead}: {self._stderr()}")

  @property
  def dead(self) -> bool:
    with self._cond:
      return self._dead is not None

  def _stderr(self) -> str:
    try:
      self._err.seek(0)
      return self._err.read()[-4000:]
    except (OSError, ValueError):
      return ""

  def _read(self):
    for line in self._proc.stdout:
      line = line.strip()
      if not line:
        continue
      with self._cond:
        if line == _READY:
          self._ready = True
        elif line.startswith("{"):
          msg = json.loads(line)
          self._replies.setdefault(msg["id"], {}).update(msg)
        self._cond.notify_all()
    with self._cond:
      self._dead = f"exited with status {self._proc.wait()}"
      self._cond.notify_all()

  def start(self, request) -> tuple:
    """Forks a child for ``request``; returns ``(id, pid)``."""
    with self._cond:
      if self._dead:
        raise ZygoteError(f"the zygote {self._dead}: {self._stderr()}")
      self._next += 1
      ident = self._next
      self._proc.stdin.write(json.dumps(dict(request, id=ident)) + "\n")
      self._proc.stdin.flush()
      self._cond.wait_for(lambda: "pid" in self._replies.get(ident, {}) or self._dead,
                          _FORK_TIMEOUT_S)
      reply = self._replies.get(ident, {})
      if "error" in reply or "pid" not in reply:
        raise ZygoteError("the zygote could not fork: "
                          f"{reply.get('error') or self._dead or 'no answer in time'}")
      return ident, reply["pid"]

  def returncode(self, ident, timeout=None):
    """The child's exit status, waiting up to ``timeout`` (None: forever); None if still
    running after ``timeout``."""
    with self._cond:
      self._cond.wait_for(lambda: "returncode" in self._replies[ident] or self._dead,
                          timeout)
      reply = self._replies[ident]
      if "returncode" in reply:
        return reply["returncode"]
      if self._dead:
        raise ZygoteError(f"the zygote {self._dead} before its child did: {self._stderr()}")
      return None

  def close(self, wait=True):
    """Stops the zygote: at once, with what still runs (``wait``), or once its running
    children have exited (not ``wait``: they are waited for)."""
    if not wait:
      with self._cond:
        running = [i for i, r in self._replies.items() if "returncode" not in r]
      if running:
        threading.Thread(target=self._close_after, args=(running,), daemon=True).start()
        return
    try:
      self._proc.stdin.close()  # the zygote kills what still runs and exits
      self._proc.wait(timeout=60)
    except (OSError, ValueError, subprocess.TimeoutExpired):
      self._proc.kill()

  def _close_after(self, running):
    for ident in running:
      try:
        self.returncode(ident)
      except ZygoteError:
        pass
    self.close()


_ZYGOTES = {}
_ZYGOTES_LOCK = threading.Lock()


def _log(**event):
  """One JSON line per zygote started and per child forked, to ``TF_DPNSGD_TEST_ZYGOTE_LOG``
  (a file; unset: nothing), for counting what the suite forks."""
  path = os.environ.get("TF_DPNSGD_TEST_ZYGOTE_LOG")
  if path:
    with open(path, "a") as f:
      f.write(json.dumps(dict(event, worker=os.environ.get("PYTEST_XDIST_WORKER"))) + "\n")


# Zygotes kept per process: each holds TensorFlow, Keras and keras-hub (about 0.6 GB); the
# least recently used one goes when another is needed (its running children go on).
MAX_ZYGOTES = 3


def _zygote_for(env, preload=PRELOAD) -> _Zygote:
  key = (import_key(env, preload), tuple(preload))
  with _ZYGOTES_LOCK:
    if key in _ZYGOTES and _ZYGOTES[key].dead:
      _ZYGOTES.pop(key)  # a zygote that died (its error went to its callers): a new one
    if key in _ZYGOTES:
      _ZYGOTES[key] = _ZYGOTES.pop(key)  # most recently used last
    else:
      while len(_ZYGOTES) >= MAX_ZYGOTES:
        _ZYGOTES.pop(next(iter(_ZYGOTES))).close(wait=False)
      import time  # pylint: disable=g-import-not-at-top
      start = time.perf_counter()
      _ZYGOTES[key] = _Zygote(dict(env), list(preload))
      _log(event="zygote", seconds=round(time.perf_counter() - start, 2), key=key[0],
           zygotes=len(_ZYGOTES))
    return _ZYGOTES[key]


@atexit.register
def _close_all():
  for z in list(_ZYGOTES.values()):
    z.close()
  _ZYGOTES.clear()
  if _RELAY:
    import shutil  # pylint: disable=g-import-not-at-top
    shutil.rmtree(_RELAY.dir, ignore_errors=True)


def Popen(args, **kwargs):  # noqa: N802 (subprocess's name)
  """``subprocess.Popen`` for a ``python`` command: a :class:`Child` forked from a zygote where
  this module can stand in for a fresh interpreter, else ``subprocess.Popen`` itself (the
  keywords of :class:`Child` only; ``input`` goes to the child's stdin)."""
  if enabled() and parse_command(args) is not None:
    return Child(args, **kwargs)
  kwargs.pop("preload", None)
  data = kwargs.pop("input", None)
  proc = subprocess.Popen(args, stdin=subprocess.PIPE if data is not None else None, **kwargs)
  if data is not None:
    proc.stdin.write(data)
    proc.stdin.close()
  return proc


class Child:
  """A child forked from a zygote, with the part of ``subprocess.Popen``'s interface the
  suite uses (``stdout``/``stderr``: ``subprocess.PIPE`` (read by :meth:`communicate` after
  the child exits), ``subprocess.DEVNULL``, ``subprocess.STDOUT`` for stderr, or None: the
  zygote's own stderr, a file the caller reads only when the zygote fails)."""

  def __init__(self, args, *, env=None, cwd=None, stdout=None, stderr=None, text=False,
               input=None, preload=PRELOAD):  # noqa: A002 (subprocess's name)
    command = parse_command(args)
    if command is None:
      raise ValueError(f"not a python command zygote can run: {args!r}")
    env = dict(os.environ if env is None else env)
    self.args, self.text, self.returncode = list(args), text, None
    self._files = []
    self._out = self._file(stdout)
    self._err = self._out if stderr == subprocess.STDOUT else self._file(stderr)
    stdin_path = None
    if input is not None:
      stdin_path = self._temp()
      with open(stdin_path, "w" if text else "wb") as f:
        f.write(input)
    kind, target, rest = command
    request = {"kind": kind, "target": target, "rest": rest, "env": env,
               "cwd": os.path.abspath(cwd if cwd is not None else os.getcwd()),
               "stdin": stdin_path, "stdout": self._out, "stderr": self._err,
               "orig_argv": [os.fspath(a) for a in args], "relay": _relay_path()}
    self._zygote = _zygote_for(env, preload)
    self._id, self.pid = self._zygote.start(request)
    _log(event="fork", kind=kind, target=target[:80])

  def _temp(self) -> str:
    return _temp_file(self._files)

  def _file(self, spec):
    if spec is None:
      return None  # the zygote's stderr (a file of this process's), not this process's own
    if spec == subprocess.PIPE:
      return self._temp()
    if spec == subprocess.DEVNULL:
      return os.devnull
    raise ValueError(f"zygote.Popen: unsupported output {spec!r}")

  def poll(self):
    if self.returncode is None:
      self.returncode = self._zygote.returncode(self._id, timeout=0)
    return self.returncode

  def wait(self, timeout=None):
    if self.returncode is None:
      self.returncode = self._zygote.returncode(self._id, timeout=timeout)
      if self.returncode is None:
        raise subprocess.TimeoutExpired(self.args, timeout)
    return self.returncode

  def send_signal(self, sig):
    if self.returncode is None:
      try:
        os.killpg(self.pid, sig)  # the child leads its own group: it and what it started
      except ProcessLookupError:
        pass

  def kill(self):
    self.send_signal(signal.SIGKILL)

  def terminate(self):
    self.send_signal(signal.SIGTERM)

  def _read(self, path):
    if path is None:
      return None
    with open(path, "r" if self.text else "rb", **({"errors": "replace"} if self.text else {})) as f:
      return f.read()

  def communicate(self, input=None, timeout=None):  # noqa: A002
    if input is not None:
      raise ValueError("zygote.Popen: pass input= to the constructor")
    self.wait(timeout)
    out = self._read(self._out)
    err = None if self._err == self._out else self._read(self._err)
    for path in self._files:
      try:
        os.remove(path)
      except OSError:
        pass
    self._files = []
    return out, err

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    if self.poll() is None:
      self.kill()
      self.wait()
    self.communicate()


def _temp_file(keep: list) -> str:
  """The path of a new empty temporary file, appended to ``keep`` (the caller removes them)."""
  fd, path = tempfile.mkstemp(prefix="zygote_")
  os.close(fd)
  keep.append(path)
  return path


def _send(sock, **msg) -> None:
  """One JSON line to ``sock`` (the relay's protocol)."""
  sock.sendall((json.dumps(msg) + "\n").encode())


class _Lines:
  """The JSON lines read from a socket, one at a time (the relay's protocol)."""

  def __init__(self, sock):
    self._sock, self._buf = sock, b""

  def next(self, deadline=None):
    """The next message; None if ``deadline`` (``time.monotonic()``) passes first.

    Raises:
      EOFError: the other side closed the connection before a whole line.
    """
    import time  # pylint: disable=g-import-not-at-top
    while b"\n" not in self._buf:
      wait = None if deadline is None else max(0.0, deadline - time.monotonic())
      if not select.select([self._sock], [], [], wait)[0]:
        return None
      chunk = self._sock.recv(1 << 16)
      if not chunk:
        raise EOFError
      self._buf += chunk
    line, _, self._buf = self._buf.partition(b"\n")
    return json.loads(line)


class _Relay:
  """A Unix socket on which this process's forked children (and theirs) ask for children of
  their own: a ``subprocess.run([sys.executable, ...])`` in a launcher, a sweep or a benchmark
  script (:func:`_routed_run`) is forked from this process's zygote of the same import-time
  environment, as this process's own children are. One thread per request; a requester that
  goes away before its child has exited takes the child's process group with it (as a
  ``subprocess`` child in its own group would be taken by a ``killpg`` of the requester's)."""

  def __init__(self):
    self.dir = tempfile.mkdtemp(prefix="zygote_relay_")
    self.path = os.path.join(self.dir, "socket")
    self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
      self._sock.bind(self.path)
      self._sock.listen(16)
    except OSError:
      self._sock.close()
      os.rmdir(self.dir)
      raise
    threading.Thread(target=self._accept, daemon=True).start()

  def _accept(self):
    while True:
      try:
        conn, _ = self._sock.accept()
      except OSError:
        return
      threading.Thread(target=self._serve_one, args=(conn,), daemon=True).start()

  def _serve_one(self, conn):
    with conn:
      try:
        try:
          request = _Lines(conn).next()
        except EOFError:
          return
        preload = request.pop("preload")
        try:
          zyg = _zygote_for(request["env"], preload)
          ident, pid = zyg.start(dict(request, relay=self.path))
        except ZygoteError as exc:
          _send(conn, error=str(exc))
          return
        _log(event="fork", kind=request["kind"], target=request["target"][:80], relayed=True)
        _send(conn, pid=pid)
        while True:
          try:
            code = zyg.returncode(ident, timeout=0.2)
          except ZygoteError as exc:
            _send(conn, error=str(exc))
            return
          if code is not None:
            _send(conn, returncode=code)
            return
          readable, _, _ = select.select([conn], [], [], 0)
          if readable and not conn.recv(1, socket.MSG_PEEK):  # the requester is gone
            try:
              os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
              pass
      except OSError:
        return


_RELAY = None


def _relay_path():
  """The relay's socket path (started on first use), or None where none can be made (e.g. a
  ``TMPDIR`` too long for a Unix socket's address): the children's own children then start
  through ``subprocess``, as before the relay."""
  global _RELAY
  with _ZYGOTES_LOCK:
    if _RELAY is None:
      try:
        _RELAY = _Relay()
      except OSError as exc:
        _log(event="no relay", error=str(exc))
        _RELAY = False
    return _RELAY.path if _RELAY else None


def run(args, *, capture_output=False, text=False, timeout=None, env=None, cwd=None,
        check=False, input=None, stdout=None, stderr=None, preload=PRELOAD):  # noqa: A002
  """``subprocess.run`` for a ``python`` command, forked from a zygote where this module can
  stand in for a fresh interpreter (see the module's docstring), else ``subprocess.run``."""
  if capture_output:
    stdout = stderr = subprocess.PIPE
  if not enabled() or parse_command(args) is None:
    return subprocess.run(args, text=text, timeout=timeout, env=env, cwd=cwd, check=check,
                          input=input, stdout=stdout, stderr=stderr)
  proc = Child(args, env=env, cwd=cwd, stdout=stdout, stderr=stderr, text=text, input=input,
               preload=preload)
  try:
    out, err = proc.communicate(timeout=timeout)
  except subprocess.TimeoutExpired:
    proc.kill()
    proc.wait()
    out, err = proc.communicate()
    raise subprocess.TimeoutExpired(args, timeout, output=out, stderr=err) from None
  result = subprocess.CompletedProcess(args, proc.returncode, out, err)
  if check:
    result.check_returncode()
  return result


# ------------------------------------------------------------------------------------------
# The zygote's side.
# ------------------------------------------------------------------------------------------
def _pristine(preload) -> str:
  """Why forking now would not give a fresh process (empty if it would)."""
  problems = []
  if "tensorflow" in sys.modules:
    from tensorflow.python.eager import context  # pylint: disable=g-import-not-at-top
    if context.context()._initialized:  # pylint: disable=protected-access
      problems.append("TensorFlow's runtime is initialised")
  if "absl.flags" in sys.modules:
    from absl import flags  # pylint: disable=g-import-not-at-top
    if flags.FLAGS.is_parsed():
      problems.append("absl flags were parsed")
  if threading.active_count() != 1:
    problems.append(f"{threading.active_count()} Python threads")
  return "; ".join(problems)


# subprocess.run's keywords a routed run stands in for (others: the real run).
_ROUTABLE = frozenset(("input", "capture_output", "timeout", "check", "stdin", "stdout", "stderr",
                       "env", "cwd", "text", "universal_newlines", "encoding", "errors"))


def _fd_path(fd):
  """A path that opens what ``fd`` of this process is (a regular file, a pipe or a device: a
  socket cannot be opened so), else None."""
  import stat  # pylint: disable=g-import-not-at-top
  try:
    mode = os.fstat(fd).st_mode
  except OSError:
    return None
  if stat.S_ISREG(mode) or stat.S_ISFIFO(mode) or stat.S_ISCHR(mode):
    return f"/proc/{os.getpid()}/fd/{fd}"
  return None


def _routed_run(relay, preload, real_run, *popenargs, **kwargs):
  """``subprocess.run`` in a forked child (installed by :func:`_become`): a ``python`` command
  this module can stand in for is forked from the worker's zygote through its relay
  (:class:`_Relay`), with the outputs, status, timeout and ``check`` of the real run; anything
  else, or a relay that cannot fork, goes to the real run."""
  args = popenargs[0] if len(popenargs) == 1 else kwargs.get("args")
  switched_off = not enabled() or (kwargs.get("env") or {}).get("TF_DPNSGD_TEST_ZYGOTE") == "off"
  if (switched_off or len(popenargs) != 1 or set(kwargs) - _ROUTABLE
      or not isinstance(args, (list, tuple)) or parse_command(args) is None):
    return real_run(*popenargs, **kwargs)
  kind, target, rest = parse_command(args)
  stdout, stderr = kwargs.get("stdout"), kwargs.get("stderr")
  if kwargs.get("capture_output"):
    if stdout is not None or stderr is not None:
      raise ValueError("stdout and stderr arguments may not be used with capture_output.")
    stdout = stderr = subprocess.PIPE
  temps = []
  temp = functools.partial(_temp_file, temps)

  def output(spec, fd):
    if spec is None:
      return _fd_path(fd)
    if spec == subprocess.PIPE:
      return temp()
    if spec == subprocess.DEVNULL:
      return os.devnull
    if isinstance(spec, int) and spec >= 0:
      return _fd_path(spec)
    if hasattr(spec, "fileno"):
      return _fd_path(spec.fileno())
    return None

  stdin = kwargs.get("stdin")
  data = kwargs.get("input")
  if data is not None:
    stdin_path = temp()
    with open(stdin_path, "wb") as f:
      f.write(data.encode(kwargs.get("encoding") or "utf-8") if isinstance(data, str) else data)
  else:
    stdin_path = output(stdin, 0) if stdin != subprocess.PIPE else None
  out_path = output(stdout, 1)
  err_path = out_path if stderr == subprocess.STDOUT else output(stderr, 2)
  if None in (stdin_path, out_path, err_path):
    for path in temps:
      os.remove(path)
    return real_run(*popenargs, **kwargs)
  env = dict(os.environ if kwargs.get("env") is None else kwargs["env"])
  cwd = kwargs.get("cwd")
  request = {"kind": kind, "target": os.fspath(target), "rest": [os.fspath(a) for a in rest],
             "env": env, "cwd": os.path.abspath(os.fspath(cwd) if cwd is not None else os.getcwd()),
             "stdin": stdin_path, "stdout": out_path, "stderr": err_path,
             "orig_argv": [os.fspath(a) for a in args], "preload": list(preload)}
  import time  # pylint: disable=g-import-not-at-top
  timeout = kwargs.get("timeout")
  deadline = None if timeout is None else time.monotonic() + timeout
  sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
  lines = _Lines(sock)

  def reply(until):
    try:
      return lines.next(until)
    except EOFError:
      raise ZygoteError("the relay closed the connection") from None

  pid = code = None
  try:
    sock.connect(relay)
    _send(sock, **request)
    started = reply(None)
    if "pid" not in started:  # the zygote could not fork: a fresh process, as without it
      return real_run(*popenargs, **kwargs)
    pid = started["pid"]
    done = reply(deadline)
    expired = done is None
    if expired:  # timed out: kill its group, as subprocess.run kills its child
      os.killpg(pid, signal.SIGKILL)
      done = reply(None)
    if "returncode" not in done:
      raise ZygoteError(done.get("error", "no exit status"))
    code = done["returncode"]
    text = bool(kwargs.get("text") or kwargs.get("universal_newlines") or kwargs.get("encoding")
                or kwargs.get("errors"))

    def read(path, spec):
      if spec != subprocess.PIPE:
        return None
      if text:
        with open(path, encoding=kwargs.get("encoding"), errors=kwargs.get("errors")) as f:
          return f.read()
      with open(path, "rb") as f:
        return f.read()

    out = read(out_path, stdout)
    err = None if stderr == subprocess.STDOUT else read(err_path, stderr)
    if expired:
      raise subprocess.TimeoutExpired(args, timeout, output=out, stderr=err)
    result = subprocess.CompletedProcess(args, code, out, err)
    if kwargs.get("check"):
      result.check_returncode()
    return result
  finally:
    if pid is not None and code is None:  # interrupted while it ran: it does not outlive us
      try:
        os.killpg(pid, signal.SIGKILL)
      except ProcessLookupError:
        pass
    sock.close()
    for path in temps:
      try:
        os.remove(path)
      except OSError:
        pass


def _become(request):
  """In the forked child: turn into ``python <request's command>``, run it and exit
  (:func:`_exit_as_an_interpreter`). Never returns."""
  _PRELOADED.update(sys.modules)
  os.setpgid(0, 0)
  signal.set_wakeup_fd(-1)
  signal.signal(signal.SIGCHLD, signal.SIG_DFL)
  signal.signal(signal.SIGINT, signal.default_int_handler)
  signal.signal(signal.SIGPIPE, signal.SIG_IGN)  # as the interpreter sets it at start-up

  def opened(path, write):
    if path is None:
      return None
    if write:
      return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    return os.open(path, os.O_RDONLY)

  stdin = opened(request["stdin"] or os.devnull, write=False)
  out = opened(request["stdout"], write=True)
  err = out if request["stderr"] == request["stdout"] else opened(request["stderr"], write=True)
  # fd 0 of the zygote is its request pipe; its fds 1 and 2 both go to its stderr file, where
  # an output not redirected stays.
  os.dup2(stdin, 0)
  for fd, target in ((out, 1), (err, 2)):
    if fd is not None:
      os.dup2(fd, target)
  for fd in {stdin, out, err} - {None, 0, 1, 2}:
    os.close(fd)
  sys.stdin = open(0, "r", closefd=False)  # noqa: SIM115
  sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115
  sys.stderr = open(2, "w", closefd=False, errors="backslashreplace")  # noqa: SIM115
  sys.__stdin__, sys.__stdout__, sys.__stderr__ = sys.stdin, sys.stdout, sys.stderr

  # sys.path as the request's PYTHONPATH would have made it (after its first entry, before
  # the site directories; the zygote's own PYTHONPATH entries out).
  own = _pythonpath(os.environ)
  site = [p for p in sys.path[1:] if p not in own]
  sys.path[1:] = [*_pythonpath(request["env"]), *site]
  os.environ.clear()
  os.environ.update(request["env"])
  os.chdir(request["cwd"])
  import random  # pylint: disable=g-import-not-at-top
  random.seed()
  if "numpy" in sys.modules:
    sys.modules["numpy"].random.seed()
  sys.orig_argv = request["orig_argv"]
  if request.get("relay"):  # the command's own python children fork from a zygote too
    subprocess.run = functools.partial(_routed_run, request["relay"], _OWN_PRELOAD,
                                       subprocess.run)

  kind, target, rest = request["kind"], request["target"], request["rest"]
  import types  # pylint: disable=g-import-not-at-top
  # A new, empty __main__, as the interpreter starts with (this file's stays out of reach).
  main = types.ModuleType("__main__")
  main.__dict__["__builtins__"] = __builtins__
  sys.modules["__main__"] = main
  if kind == "module":
    sys.argv = ["-m", *rest]
    sys.path[0] = os.getcwd()
    import runpy  # pylint: disable=g-import-not-at-top
    # What `python -m` runs (in the __main__ it finds).
    _exit_as_an_interpreter(lambda: runpy._run_module_as_main(target, alter_argv=True))  # pylint: disable=protected-access
  if kind == "code":
    sys.argv, sys.path[0], filename, source = ["-c", *rest], "", "<string>", target
  else:
    sys.argv = [target, *rest]
    sys.path[0] = os.path.dirname(os.path.realpath(target))
    filename = target
    with open(target, "rb") as f:
      source = f.read()
  if kind == "script":
    main.__file__ = target
  _exit_as_an_interpreter(
      lambda: exec(compile(source, filename, "exec"), main.__dict__))  # noqa: S102 (the request's own code)


def _exit_as_an_interpreter(run) -> None:
  """Runs ``run()``, then ends the process as the interpreter would after a script: the exit
  status of ``SystemExit`` (its message on stderr), a traceback and 1 for an exception; then
  non-daemon threads joined, atexit handlers run, garbage collected (finalizers of what the
  command made run) and the standard streams flushed. Only the interpreter's tear-down of
  the preloaded modules is skipped (``os._exit``): in a forked child it took 1.35 s after the
  command (measured; ~0.45 s in a fresh process: the shared pages it writes are copied,
  presumably)."""
  import atexit as atexit_  # pylint: disable=g-import-not-at-top
  import gc  # pylint: disable=g-import-not-at-top
  # The command may rebind this module's globals.
  os_, sys_, threading_, signal_, preloaded = os, sys, threading, signal, _PRELOADED
  ours = (__file__, _RUNPY)
  try:
    run()
    code = 0
  except SystemExit as exc:
    if exc.code is None:
      code = 0
    elif isinstance(exc.code, int):
      code = exc.code & 0xFF
    else:
      print(exc.code, file=sys_.stderr)
      code = 1
  except BaseException as exc:  # noqa: BLE001 (the interpreter prints it and exits 1)
    tb = exc.__traceback__  # from the command's own frames on, as the interpreter shows it
    while tb is not None and tb.tb_frame.f_code.co_filename in ours:
      tb = tb.tb_next
    sys_.excepthook(type(exc), exc.with_traceback(tb), tb)
    # An uncaught KeyboardInterrupt ends the interpreter by SIGINT (status -2 to its parent).
    code = -signal_.SIGINT if isinstance(exc, KeyboardInterrupt) else 1
  for thread in threading_.enumerate():
    if thread is not threading_.main_thread() and not thread.daemon:
      thread.join()
  atexit_._run_exitfuncs()  # pylint: disable=protected-access
  # What the interpreter's tear-down would finalize of the command's own: the globals of
  # __main__ and of every module imported since the fork (newest first), e.g. a file left open
  # with buffered writes.
  for names in (["__main__"], reversed([m for m in sys_.modules if m not in preloaded])):
    for name in list(names):
      module = sys_.modules.get(name)
      if module is not None and isinstance(getattr(module, "__dict__", None), dict):
        module.__dict__.clear()
    gc.collect()
  for stream in (sys_.stdout, sys_.stderr):
    try:
      stream.flush()
    except (OSError, ValueError):
      pass
  if code < 0:
    signal_.signal(-code, signal_.SIG_DFL)
    os_.kill(os_.getpid(), -code)
  os_._exit(code)


_OWN_PRELOAD = []  # what this zygote imported (its children's children ask for the same)
_PRELOADED = set()  # the modules imported at the fork (the child's tear-down leaves them)
_RUNPY = os.path.join(os.path.dirname(os.__file__), "runpy.py")


def _serve(preload) -> None:
  import importlib  # pylint: disable=g-import-not-at-top
  _OWN_PRELOAD[:] = preload
  # Replies on a copy of fd 1; fd 1 itself goes to stderr, so that nothing a preloaded module
  # prints can garble them.
  protocol_out = os.fdopen(os.dup(1), "w", buffering=1)
  os.dup2(2, 1)
  for name in preload:
    importlib.import_module(name)
  import gc  # pylint: disable=g-import-not-at-top
  gc.freeze()  # the children's collections skip what was imported (and their pages stay shared)
  wake_r, wake_w = os.pipe()
  os.set_blocking(wake_w, False)
  signal.set_wakeup_fd(wake_w)
  signal.signal(signal.SIGCHLD, lambda *_: None)
  children = {}  # pid -> request id
  pending = b""  # requests read from fd 0 but not yet served (one JSON line each)

  def reply(**msg):
    protocol_out.write(json.dumps(msg) + "\n")

  def reap():
    while children:
      try:
        pid, status = os.waitpid(-1, os.WNOHANG)
      except ChildProcessError:
        return
      if pid == 0:
        return
      if pid in children:
        reply(id=children.pop(pid), returncode=os.waitstatus_to_exitcode(status))

  protocol_out.write(_READY + "\n")
  while True:
    if b"\n" not in pending:
      ready, _, _ = select.select([0, wake_r], [], [])
      if wake_r in ready:
        os.read(wake_r, 4096)
        reap()
      if 0 not in ready:
        continue
      chunk = os.read(0, 1 << 16)
      if not chunk:  # the caller is gone: stop what still runs
        for pid in list(children):
          try:
            os.killpg(pid, signal.SIGKILL)
          except ProcessLookupError:
            pass
        return
      pending += chunk
      continue
    line, _, pending = pending.partition(b"\n")
    request = json.loads(line)
    problem = _pristine(preload)
    if problem:
      reply(id=request["id"], error=f"not a fresh process to fork from: {problem}")
      continue
    sys.stdout.flush(), sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
      os.close(wake_r), os.close(wake_w)
      protocol_out.close()
      _become(request)
    # The child's own group exists before its pid is handed out (the child sets it too): a
    # kill of the group right after the fork would otherwise find no group and miss the child.
    try:
      os.setpgid(pid, pid)
    except OSError:  # it already did, or has exited
      pass
    children[pid] = request["id"]
    reply(id=request["id"], pid=pid)
    reap()


if __name__ == "__main__":
  _serve(json.loads(sys.argv[1]))
