"""Executes the README's runnable code blocks and checks its commands.

Convention: a fenced block is runnable when the line right before its opening
fence is the HTML comment ``<!-- runnable -->`` (invisible on GitHub) and its
info string is ``python``::

    <!-- runnable -->
    ```python
    ...
    ```

Other blocks are illustrations (e.g. ``loss=...`` placeholders) and are not
run. Each runnable block is executed in-process in a fresh namespace after
``PREAMBLE``, which supplies the names the README leaves to the reader:
``x`` (512 random examples with 8 features, float32), ``y`` (integer labels
in [0, 4)) and ``keras_model`` (an uncompiled ``Dense(16, relu) -> Dense(4)``
Keras model). The README's first code block must be runnable.

The shell commands are checked too: the README's full test command is the one
``.ci/run`` runs, its only other pytest command is the quick tier (the same
command with ``-m "not slow"``), and every ``bash <file>`` it shows exists.
"""

from __future__ import annotations

import pathlib
import re
import shlex

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
MARKER = "<!-- runnable -->"

PREAMBLE = """
import keras
import numpy as np
_rng = np.random.default_rng(0)
x = _rng.normal(size=(512, 8)).astype("float32")
y = _rng.integers(0, 4, size=512).astype("int32")
keras_model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                                keras.layers.Dense(4)])
"""

_FENCE = re.compile(r"^```(\S*)\s*$")


def code_blocks(text: str):
  """[(line number of the opening fence, info string, runnable?, code)] of ``text``."""
  lines = text.splitlines()
  blocks, i = [], 0
  while i < len(lines):
    m = _FENCE.match(lines[i])
    if not m:
      i += 1
      continue
    start = i
    runnable = start > 0 and lines[start - 1].strip() == MARKER
    i += 1
    while i < len(lines) and lines[i].rstrip() != "```":
      i += 1
    blocks.append((start + 1, m.group(1), runnable, "\n".join(lines[start + 1:i]) + "\n"))
    i += 1
  return blocks


BLOCKS = code_blocks(README.read_text(encoding="utf-8"))
RUNNABLE = [(line, code) for line, info, runnable, code in BLOCKS if runnable]


def test_markers_and_first_block():
  assert RUNNABLE, f"no block of README.md is marked {MARKER!r}"
  for line, info, runnable, _ in BLOCKS:
    assert not runnable or info == "python", f"README.md:{line}: runnable block is {info!r}"
  assert README.read_text(encoding="utf-8").count(MARKER) == len(RUNNABLE), (
      f"a {MARKER!r} marker is not right before an opening fence")
  assert BLOCKS[0][2], "the README's first code block must be marked runnable"


@pytest.mark.slow
@pytest.mark.parametrize("line,code", RUNNABLE, ids=[f"README.md:{line}" for line, _ in RUNNABLE])
def test_runnable_block(line, code):
  namespace = {"__name__": "__readme__"}
  exec(compile(PREAMBLE, "<test_readme preamble>", "exec"), namespace)
  # Padding keeps the README's line numbers in tracebacks.
  exec(compile("\n" * line + code, str(README), "exec"), namespace)


def _commands(text: str):
  """Shell commands of ``text``: comments and blank lines dropped, continuations joined."""
  text = re.sub(r"\\\n\s*", " ", text)
  out = []
  for raw in text.splitlines():
    cmd = raw.split(" #", 1)[0].strip()
    if cmd and not cmd.startswith("#"):
      out.append(cmd)
  return out


QUICK = ["-m", "not slow"]


def test_readme_test_commands_are_ci_command_and_its_quick_tier():
  ci = [c for c in _commands((ROOT / ".ci" / "run").read_text()) if " pytest " in f" {c} "]
  readme = [c for _, info, _, code in BLOCKS if info in ("bash", "sh", "shell")
            for c in _commands(code) if " pytest " in f" {c} "]
  assert len(ci) == 1, f".ci/run should run one pytest command; got {ci}"
  full = shlex.split(ci[0])
  assert ci[0] in readme, f"README.md does not show .ci/run's test command {ci[0]!r}"
  assert "-m" not in full[full.index("pytest"):], (
      "the CI command must run every test, the slow ones included")
  quick = [c for c in readme if c != ci[0]]
  assert len(quick) == 1, f"README.md should show one quick command besides CI's; got {quick}"
  words = shlex.split(quick[0])
  after = words[words.index("pytest"):] if "pytest" in words else []
  i = len(words) - len(after) + after.index("-m") if "-m" in after else -1
  assert i > 0 and words[i:i + 2] == QUICK and words[:i] + words[i + 2:] == full, (
      f"the quick command {quick[0]!r} must be {ci[0]!r} with -m \"not slow\"")


def test_readme_scripts_exist():
  scripts = [shlex.split(c)[1] for _, info, _, code in BLOCKS if info in ("bash", "sh", "shell")
             for c in _commands(code) if c.startswith("bash ")]
  assert ".ci/run" in scripts
  missing = [s for s in scripts if not (ROOT / s).is_file()]
  assert not missing, missing
