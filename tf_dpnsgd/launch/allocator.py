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

**oneDNN.** TensorFlow decides at start-up whether its oneDNN CPU kernels run:
on x86 Linux only where the CPU has AVX512-VNNI/BF16, AVX-VNNI or AMX, unless
``TF_ENABLE_ONEDNN_OPTS`` says otherwise. Where it turned them off and the
variable is unset, the launcher also re-executes with
``TF_ENABLE_ONEDNN_OPTS=1`` (:func:`onednn_environment`). Measured on a 2-core
AMD EPYC without AVX-512 (2026-11-27, ``benchmarks/engine_ratio.py``): a
ResNet20-GN DP step (book-keeping, batch 256) 3348 ms with TensorFlow's default
against 2148 ms with oneDNN on (plain steps 2273 and 1590 ms), a MiniLM-size
BERT's (batch 32) 8612 against 6104 ms (plain 6589 and 5058 ms); the grouped
backprop-filter that computes per-example convolution gradients at once needs
oneDNN's kernels (:func:`tf_dpnsgd.per_example.layers.conv.grouped_filter_available`).
The engines' choices already account for oneDNN (the vectorized engine is not
chosen for attention under it). ``TF_ENABLE_ONEDNN_OPTS=0`` keeps it off.
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


#: TensorFlow's switch for its oneDNN CPU kernels, read once at start-up.
ONEDNN = "TF_ENABLE_ONEDNN_OPTS"


def onednn_environment(env: Mapping[str, str], enabled: bool) -> Optional[dict]:
  """A copy of ``env`` with ``TF_ENABLE_ONEDNN_OPTS=1``, or None to leave it as it is.

  Only where TensorFlow turned oneDNN off on its own (``enabled`` False) and the
  user did not set the variable (any value, ``0`` included, is theirs to keep).

  >>> onednn_environment({"PATH": "/bin"}, enabled=False)
  {'PATH': '/bin', 'TF_ENABLE_ONEDNN_OPTS': '1'}
  >>> onednn_environment({"TF_ENABLE_ONEDNN_OPTS": "0"}, enabled=False) is None
  True
  >>> onednn_environment({}, enabled=True) is None
  True
  """
  if enabled or ONEDNN in env:
    return None
  new = dict(env)
  new[ONEDNN] = "1"
  return new


def reexec_environment(env: Mapping[str, str],
                       exists: Optional[Callable[[str], bool]] = None,
                       candidates: Optional[Sequence[str]] = None,
                       onednn_enabled: bool = True) -> Optional[dict]:
  """The environment to re-execute a launcher with, or None to run it as it is.

  Args:
    env: the current environment.
    exists: file test (default ``os.path.exists``).
    candidates: tcmalloc libraries to look for, in order (default :data:`CANDIDATES`).
    onednn_enabled: whether this process runs oneDNN's kernels (False: also
      :func:`onednn_environment`).

  Returns:
    A copy of ``env`` whose ``LD_PRELOAD`` starts with the first existing
    candidate (any earlier value kept after it) and, where oneDNN is off by
    TensorFlow's default, with ``TF_ENABLE_ONEDNN_OPTS=1``; or None when neither
    applies (the user opted out of tcmalloc, a fast allocator is already
    preloaded or no candidate exists, and oneDNN is on or its variable set).
  """
  new = _allocator_environment(env, exists, candidates)
  return onednn_environment(new or env, onednn_enabled) or new


def _allocator_environment(env, exists, candidates) -> Optional[dict]:
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
                 execve: Callable = os.execve, log: Callable[[str], None] = None,
                 onednn_enabled: Optional[bool] = None) -> bool:
  """Re-executes this process under tcmalloc, with oneDNN, when :func:`reexec_environment` says so.

  ``onednn_enabled``: whether oneDNN's kernels run here (default: asks
  TensorFlow; a set ``TF_ENABLE_ONEDNN_OPTS`` counts as the user's choice).

  Call it only from a launcher's ``if __name__ == "__main__":`` block: it
  replaces the process with ``argv`` (default ``sys.orig_argv``, the command
  line as typed, e.g. ``python -m tf_dpnsgd.launch.cifar10 --flagfile=...``).

  Returns:
    False when it did not re-execute (``execve`` does not return otherwise).
  """
  env = os.environ if env is None else env
  log = log or (lambda message: print(message, file=sys.stderr, flush=True))
  if onednn_enabled is None:
    from tf_dpnsgd.per_example import vectorized  # noqa: PLC0415 (TensorFlow, imported by now)

    onednn_enabled = vectorized.onednn_enabled(strict=True) or ONEDNN in env
  new = reexec_environment(env, onednn_enabled=onednn_enabled)
  if new is None:  # (the hint once, in the process that goes on)
    if (env.get(OPT_OUT, "").strip().lower() != "system"
        and not preloaded_allocator(env.get("LD_PRELOAD", ""))):
      log(f"tf_dpnsgd: {INSTALL_HINT}")
    return False
  argv = list(sys.orig_argv if argv is None else argv)
  if new.get("LD_PRELOAD") != env.get("LD_PRELOAD"):
    log(f"tf_dpnsgd: re-executing under {new['LD_PRELOAD'].split(':')[0]} (LD_PRELOAD; "
        f"{OPT_OUT}=system keeps glibc malloc)")
  if new.get(ONEDNN) != env.get(ONEDNN):
    log(f"tf_dpnsgd: re-executing with {ONEDNN}=1: TensorFlow turned its oneDNN kernels off "
        f"on this CPU, and DP steps measured 1.4-1.6x faster with them (see "
        f"tf_dpnsgd.launch.allocator); {ONEDNN}=0 keeps them off")
  sys.stdout.flush()
  sys.stderr.flush()
  execve(sys.executable, argv, new)
  return True
