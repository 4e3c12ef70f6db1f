"""Launchers run under tcmalloc where the machine has it.

Measured on this project's 2-core CPU machine (kernel with 4 KiB pages for
anonymous memory, transparent huge pages on ``madvise`` only): with glibc's
``malloc``, every tensor above its mmap threshold (32 MiB at most) is a fresh
``mmap`` that page-faults on first touch and is unmapped when freed, so a DP
step that allocates a few hundred MiB of per-example gradients and patches
spends about half its CPU time in the kernel (``vmstat``: 40-50% system).
The ScatterNet CNN recipe (``configs/cifar10/scatter_cnn_dpnsgd_eps3.flags``)
took 193 s per epoch with glibc and 52-59 s under tcmalloc, which keeps freed
memory for reuse (``docs/cifar10_cpu.md``).

So a launcher started as a program (its ``__main__``) re-executes itself once
with ``LD_PRELOAD`` naming tcmalloc when all of these hold:

* ``TF_DPNSGD_ALLOCATOR`` is not ``system`` (the opt-out);
* ``LD_PRELOAD`` does not already name tcmalloc or jemalloc;
* a tcmalloc library exists at one of :data:`CANDIDATES` (Debian/Ubuntu:
  ``apt-get install libtcmalloc-minimal4``).

Where none is installed it runs as is and logs how to install one. The
allocator changes no result, only where memory comes from.
"""

from __future__ import annotations

import os
import sys
from typing import Callable, Mapping, Optional, Sequence

#: Environment variable: ``system`` keeps the C library's malloc.
OPT_OUT = "TF_DPNSGD_ALLOCATOR"

#: tcmalloc libraries looked for, in order (Debian/Ubuntu multiarch and RPM layouts).
CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
    "/usr/lib/x86_64-linux-gnu/libtcmalloc.so.4",
    "/usr/lib/aarch64-linux-gnu/libtcmalloc_minimal.so.4",
    "/usr/lib/aarch64-linux-gnu/libtcmalloc.so.4",
    "/usr/lib64/libtcmalloc_minimal.so.4",
    "/usr/lib64/libtcmalloc.so.4",
)

_FAST = ("tcmalloc", "jemalloc")

INSTALL_HINT = ("glibc malloc page-faults on every large tensor here (a DP step measured 3.5x "
                "slower than under tcmalloc); install tcmalloc (Debian/Ubuntu: apt-get install "
                "libtcmalloc-minimal4) and the launcher uses it, or set "
                f"{OPT_OUT}=system to silence this.")


def preloaded_allocator(ld_preload: str) -> Optional[str]:
  """The tcmalloc or jemalloc library named in an ``LD_PRELOAD`` value, or None.

  >>> preloaded_allocator("/lib/libfoo.so:/usr/lib/libjemalloc.so.2")
  '/usr/lib/libjemalloc.so.2'
  >>> preloaded_allocator("") is None
  True
  """
  for entry in ld_preload.replace(" ", ":").split(":"):
    name = os.path.basename(entry)
    if any(fast in name for fast in _FAST):
      return entry
  return None


def reexec_environment(env: Mapping[str, str],
                       exists: Optional[Callable[[str], bool]] = None,
                       candidates: Optional[Sequence[str]] = None) -> Optional[dict]:
  """The environment to re-execute a launcher with, or None to run it as it is.

  Args:
    env: the current environment.
    exists: file test (default ``os.path.exists``).
    candidates: tcmalloc libraries to look for, in order (default :data:`CANDIDATES`).

  Returns:
    A copy of ``env`` whose ``LD_PRELOAD`` starts with the first existing
    candidate (any earlier value kept after it), or None when the user opted
    out, a fast allocator is already preloaded, or no candidate exists.
  """
  if env.get(OPT_OUT, "").strip().lower() == "system":
    return None
  current = env.get("LD_PRELOAD", "")
  if preloaded_allocator(current):
    return None
  exists = exists or os.path.exists
  library = next((c for c in (CANDIDATES if candidates is None else candidates) if exists(c)),
                 None)
  if library is None:
    return None
  new = dict(env)
  new["LD_PRELOAD"] = f"{library}:{current}" if current else library
  return new


def maybe_reexec(argv: Optional[Sequence[str]] = None, env: Optional[Mapping[str, str]] = None,
                 execve: Callable = os.execve, log: Callable[[str], None] = None) -> bool:
  """Re-executes this process under tcmalloc when :func:`reexec_environment` says so.

  Call it only from a launcher's ``if __name__ == "__main__":`` block: it
  replaces the process with ``argv`` (default ``sys.orig_argv``, the command
  line as typed, e.g. ``python -m tf_dpnsgd.launch.cifar10 --flagfile=...``).

  Returns:
    False when it did not re-execute (``execve`` does not return otherwise).
  """
  env = os.environ if env is None else env
  log = log or (lambda message: print(message, file=sys.stderr, flush=True))
  new = reexec_environment(env)
  if new is None:
    if (env.get(OPT_OUT, "").strip().lower() != "system"
        and not preloaded_allocator(env.get("LD_PRELOAD", ""))):
      log(f"tf_dpnsgd: {INSTALL_HINT}")
    return False
  argv = list(sys.orig_argv if argv is None else argv)
  log(f"tf_dpnsgd: re-executing under {new['LD_PRELOAD'].split(':')[0]} (LD_PRELOAD; "
      f"{OPT_OUT}=system keeps glibc malloc)")
  sys.stdout.flush()
  sys.stderr.flush()
  execve(sys.executable, argv, new)
  return True
