"""tests/tiers.py: the quick tier keeps every value of every axis of a tiered test."""

import doctest
import itertools

import pytest

import tiers


def test_doctests():
  assert doctest.testmod(tiers).failed == 0


@pytest.mark.parametrize("sizes", [(1,), (5,), (2, 2, 2, 2), (15, 2), (3, 7, 2), (4, 1, 6)])
def test_every_value_of_every_axis_is_quick_and_the_rest_is_slow(sizes):
  axes = [list(range(n)) for n in sizes]
  cases = tiers.quick_cover(*axes)
  assert len(cases) == len(list(itertools.product(*axes)))  # the full product, each once
  quick = [c.values for c in cases if not c.marks]
  assert all([m.name for m in c.marks] == ["slow"] for c in cases if c.marks)
  assert len(quick) == max(sizes)
  for i, axis in enumerate(axes):
    assert {q[i] for q in quick} == set(axis)


def test_quick_only_keeps_the_named_values_quick_and_all_values_in_order():
  cases = tiers.quick_only([3, 1, 2], [1, 2])
  assert [c.values for c in cases] == [(3,), (1,), (2,)]
  assert [[m.name for m in c.marks] for c in cases] == [["slow"], [], []]
