"""Shakespeare with natural users: next-character prediction, one user per speaking role.

The data is ``input.txt`` of karpathy/char-rnn's ``data/tinyshakespeare`` (about 1.1 MB,
a subset of Shakespeare's plays; the repository is MIT-licensed, the text is in the public
domain), laid out as speeches separated by blank lines, each speech a line ``Speaker:``
and then its text::

    First Citizen:
    Before we proceed any further, hear me speak.

    All:
    Speak, speak.

``scripts/shakespeare_setup.sh`` writes it to ``ROOT/input.txt`` from a local clone; nothing
is downloaded here. As in LEAF (Caldas et al. 2018), a speaking role is a user and the task
is the next character after a window of the role's own text. The users are the speaker
names as given: the file does not mark where one play ends, so a name used in several
plays ("Servant", "First Citizen", "GLOUCESTER") is one user.

=====================  ================================================================
part                   rule
=====================  ================================================================
user                   the speaker name of the speech (the line before the colon)
a user's text          the user's speeches in file order, joined by ``"\\n"``
a row                  the ``context`` characters before a target character of the
                       user's text (left-padded with id 0), and that character's id;
                       targets at positions ``1, 1 + stride, 1 + 2 stride, ...``
vocabulary             fixed and public: id 0 is padding, ``"\\n"`` and printable
                       ASCII follow (:data:`ALPHABET`); other characters map to 0
split                  BY USER: a role is a test user iff ``md5(name)`` falls in the
                       first ``test_fraction`` of the hash range (deterministic, public)
=====================  ================================================================

Why by user: user-level DP protects a person, and ``fit`` refuses validation data that
shares users with training; held-out roles measure how the model does on people it never
saw, which is what a user-level guarantee is about. (LEAF's Shakespeare splits each role's
lines instead; that would put every test role in training too.)
"""

from __future__ import annotations

import hashlib
import os
import string
from typing import NamedTuple

import numpy as np

FILENAME = "input.txt"
#: Public vocabulary: id 0 is padding (and any character outside this list).
ALPHABET = "\n" + "".join(c for c in string.printable if c not in "\t\n\r\x0b\x0c")
VOCAB_SIZE = len(ALPHABET) + 1
_IDS = {c: i + 1 for i, c in enumerate(ALPHABET)}


class Split(NamedTuple):
  """Rows of one split: ``x`` int32 ``[n, context]``, ``y`` int32 ``[n]``, ``users`` ``[n]``
  (the speaker name of each row)."""

  x: np.ndarray
  y: np.ndarray
  users: np.ndarray


def parse_speeches(text: str) -> list:
  """``[(speaker, speech)]`` of a tinyshakespeare-format text, in file order.

  A block (text between blank lines) whose first line ends with ``:`` is a speech;
  any other block is skipped.

  >>> parse_speeches("A:\\nHi.\\nYou.\\n\\nB:\\nNo.\\n\\nstray text\\n")
  [('A', 'Hi.\\nYou.'), ('B', 'No.')]
  """
  speeches = []
  for block in text.replace("\r\n", "\n").split("\n\n"):
    lines = block.strip("\n").split("\n")
    head = lines[0].strip()
    if len(lines) < 2 or not head.endswith(":") or len(head) < 2:
      continue
    body = "\n".join(lines[1:]).strip()
    if body:
      speeches.append((head[:-1].strip(), body))
  return speeches


def user_texts(speeches) -> dict:
  """``{speaker: the speaker's speeches joined by newlines}``, speakers in first-seen order."""
  texts = {}
  for speaker, speech in speeches:
    texts.setdefault(speaker, []).append(speech)
  return {k: "\n".join(v) for k, v in texts.items()}


def encode(text: str) -> np.ndarray:
  """int32 ids of ``text`` in the public vocabulary (0 for a character outside it).

  >>> encode("ab\\n~\\u00e9").tolist()
  [12, 13, 1, 95, 0]
  """
  return np.array([_IDS.get(c, 0) for c in text], np.int32)


def windows(ids: np.ndarray, context: int, stride: int) -> tuple:
  """``(x [n, context], y [n])``: the ``context`` ids before each target position
  ``1, 1 + stride, ...`` of ``ids`` (left-padded with 0).

  >>> x, y = windows(np.array([5, 6, 7, 8]), context=2, stride=2)
  >>> x.tolist(), y.tolist()
  ([[0, 5], [6, 7]], [6, 8])
  """
  if context < 1 or stride < 1:
    raise ValueError(f"`context` and `stride` must be >= 1; got {context}, {stride}.")
  targets = np.arange(1, len(ids), stride)
  padded = np.concatenate([np.zeros(context, np.int32), np.asarray(ids, np.int32)])
  x = np.stack([padded[t:t + context] for t in targets]) if targets.size else np.zeros(
      [0, context], np.int32)
  return x.astype(np.int32), np.asarray(ids, np.int32)[targets]


def is_test_user(name: str, test_fraction: float) -> bool:
  """Whether role ``name`` is held out: a public hash of the name, never of the data."""
  h = int.from_bytes(hashlib.md5(name.encode("utf-8")).digest()[:8], "big")
  return h < test_fraction * 2.0 ** 64


def load_shakespeare(data_dir: str, context: int = 16, stride: int = 16,
                     test_fraction: float = 0.2) -> tuple:
  """``(train, test)`` :class:`Split` of ``data_dir/input.txt`` (see the module docstring).

  Raises:
    FileNotFoundError: no ``input.txt`` (run ``scripts/shakespeare_setup.sh``).
    ValueError: no speech in the file, or an empty split.
  """
  path = os.path.join(data_dir, FILENAME)
  if not os.path.exists(path):
    raise FileNotFoundError(
        f"{path} not found: run `bash scripts/shakespeare_setup.sh ROOT` (it writes "
        "ROOT/input.txt, tinyshakespeare from karpathy/char-rnn) and pass --data_dir=ROOT.")
  if not 0 < test_fraction < 1:
    raise ValueError(f"`test_fraction` must be in (0, 1); got {test_fraction}.")
  with open(path, encoding="utf-8") as f:
    texts = user_texts(parse_speeches(f.read()))
  if not texts:
    raise ValueError(f"{path} holds no speech ('Speaker:' line, then text, blocks separated "
                     "by blank lines).")
  parts = {True: ([], [], []), False: ([], [], [])}
  for name, text in texts.items():
    x, y = windows(encode(text), context, stride)
    xs, ys, us = parts[is_test_user(name, test_fraction)]
    xs.append(x), ys.append(y), us.append(np.full(len(y), name, dtype=object))
  out = []
  for held_out in (False, True):
    xs, ys, us = parts[held_out]
    if not xs or not sum(len(y) for y in ys):
      raise ValueError(f"The {'test' if held_out else 'training'} split is empty: "
                       f"{len(texts)} roles, test_fraction={test_fraction}.")
    out.append(Split(np.concatenate(xs), np.concatenate(ys),
                     np.concatenate(us).astype(str)))
  return tuple(out)


__all__ = ["ALPHABET", "FILENAME", "Split", "VOCAB_SIZE", "encode", "is_test_user",
           "load_shakespeare", "parse_speeches", "user_texts", "windows"]
