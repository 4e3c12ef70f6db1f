"""The quick tier's share of a parametrized test: every value of every axis once.

A test parametrized over a product of axes (engines x transforms x models x magnitudes)
runs the whole product in the full suite (CI); in the quick tier (``-m "not slow"``) it
runs an *each-choice* cover of it: case ``k`` takes value ``k mod n_i`` of axis ``i``,
for ``k < max_i n_i``, so every engine, every transform, every model and every magnitude
is still exercised in the quick tier, each at least once, and the other combinations are
marked ``slow``. ``docs/testing.md`` lists the tests that use it.
"""

from __future__ import annotations

import itertools
from typing import Sequence

import pytest


def each_choice(*axes: Sequence) -> set:
  """The each-choice cover of the product of ``axes`` (as tuples).

  >>> sorted(each_choice(["a", "b"], [1, 2, 3]))
  [('a', 1), ('a', 3), ('b', 2)]
  """
  size = max(len(axis) for axis in axes)
  return {tuple(axis[k % len(axis)] for axis in axes) for k in range(size)}


def quick_cover(*axes: Sequence, ids: Sequence | None = None) -> list:
  """``pytest.param`` for every combination of ``axes``; those outside
  :func:`each_choice` (taken over the values' positions: values need not be hashable)
  carry the ``slow`` mark. A single axis: one argument per case. ``ids``: per axis, a list
  of names or None (then a plain value's ``str``, else its position).

  >>> [c.marks != () for c in quick_cover([1, 2], ["x", "y"])]
  [False, True, True, False]
  >>> [c.id for c in quick_cover([1.0, 1e6], [len, max], ids=[None, ["len", "max"]])]
  ['1.0-len', '1.0-max', '1000000.0-len', '1000000.0-max']
  """
  ids = ids or [None] * len(axes)
  if len(ids) != len(axes):
    raise ValueError(f"ids: one entry per axis ({len(axes)}), got {len(ids)}")

  def name(axis, names, i):
    if names is not None:
      return str(names[i])
    value = axis[i]
    return str(value) if isinstance(value, (str, int, float, bool, type(None))) else f"v{i}"

  quick = each_choice(*[range(len(axis)) for axis in axes])
  cases = []
  for index in itertools.product(*[range(len(axis)) for axis in axes]):
    values = tuple(axis[i] for axis, i in zip(axes, index))
    marks = () if index in quick else (pytest.mark.slow,)
    case_id = "-".join(name(axis, names, i) for axis, names, i in zip(axes, ids, index))
    cases.append(pytest.param(*values, marks=marks, id=case_id))
  return cases


def quick_only(values: Sequence, quick: Sequence) -> list:
  """``values`` as cases of a one-axis parametrization where only those in ``quick`` stay in
  the quick tier; the others carry the ``slow`` mark (the full suite still runs them all).
  A value named in ``quick`` but absent from ``values`` is an error (a renamed case would
  otherwise leave the quick tier silently).

  >>> [c.marks != () for c in quick_only(["a", "b", "c"], ["b"])]
  [True, False, True]
  >>> quick_only(["a"], ["z"])
  Traceback (most recent call last):
  ...
  ValueError: quick_only: ['z'] not among the values
  """
  missing = [q for q in quick if q not in values]
  if missing:
    raise ValueError(f"quick_only: {missing} not among the values")
  return [pytest.param(v, marks=() if v in quick else (pytest.mark.slow,)) for v in values]
