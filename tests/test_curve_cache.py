"""The on-disk RDP curve cache (tf_dpnsgd/accounting/curve_cache.py): exact values under an
exact key, nothing kept without the environment variable, and anything else in a cache file
(another key, a truncated or malformed file) ignored, with dp-accounting as the oracle."""

import json
import math
import os

import dp_accounting
import pytest

from tf_dpnsgd.accounting import curve_cache
from tf_dpnsgd.accounting import rdp as rdp_module

ORDERS = (1.5, 2.0, 3.5, 8.0, 64.0)
EVENT = dp_accounting.PoissonSampledDpEvent(0.25, dp_accounting.GaussianDpEvent(0.9))
RELATION = dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE


def oracle():
  accountant = dp_accounting.rdp.RdpAccountant(list(ORDERS), RELATION)
  accountant.compose(EVENT)
  return tuple(float(v) for v in accountant.rdp)


@pytest.fixture
def cache(tmp_path, monkeypatch):
  monkeypatch.setenv(curve_cache.ENV, str(tmp_path))
  rdp_module._rdp_of_event.cache_clear()  # the in-process memo would answer first
  yield tmp_path
  rdp_module._rdp_of_event.cache_clear()


def fresh(*args):
  rdp_module._rdp_of_event.cache_clear()
  return rdp_module._rdp_of_event(*args)


class Forbidden(dp_accounting.rdp.RdpAccountant):
  def compose(self, *args, **kwargs):
    raise AssertionError("dp-accounting was asked although the curve is kept")


def test_a_kept_curve_is_read_back_exactly_without_asking_dp_accounting(cache, monkeypatch):
  first, notes = fresh(EVENT, RELATION, ORDERS)
  # q = 0.25, sigma = 0.9: dp-accounting gives up on order 1.5 (RDP inf), which gets a note.
  assert first == oracle() and first[0] == math.inf and "1.5" in notes[0]
  assert len(os.listdir(cache)) == 1
  monkeypatch.setattr(dp_accounting.rdp, "RdpAccountant", Forbidden)
  assert fresh(EVENT, RELATION, ORDERS) == (first, notes)
  # Another event, relation or order grid is another key: dp-accounting is asked.
  for args in ((dp_accounting.PoissonSampledDpEvent(0.25, dp_accounting.GaussianDpEvent(0.9000001)),
                RELATION, ORDERS),
               (EVENT, dp_accounting.NeighboringRelation.REPLACE_ONE, ORDERS),
               (EVENT, RELATION, ORDERS[:-1])):
    with pytest.raises(AssertionError, match="was asked"):
      fresh(*args)


def test_without_the_variable_nothing_is_read_or_written(tmp_path, monkeypatch):
  monkeypatch.delenv(curve_cache.ENV, raising=False)
  assert curve_cache.directory() is None
  assert fresh(EVENT, RELATION, ORDERS)[0] == oracle()
  assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("damage", ["other_key", "truncated", "not_json", "wrong_types",
                                    "short"])
def test_a_damaged_or_foreign_file_is_ignored_and_the_curve_recomputed(cache, damage):
  k = curve_cache.key(EVENT, RELATION, ORDERS)
  _, notes = fresh(EVENT, RELATION, ORDERS)
  (path,) = [cache / name for name in os.listdir(cache)]
  stored = json.loads(path.read_text())
  lie = [float(0.0).hex()] * len(ORDERS)  # RDP 0: epsilon 0, if it were believed
  text = {"other_key": json.dumps(dict(stored, key=k + " ", rdp=lie)),  # a hash collision
          "truncated": path.read_text()[:40],
          "not_json": "\x00" * 10,
          "wrong_types": json.dumps(dict(stored, rdp=[0.0] * len(ORDERS))),
          "short": json.dumps(dict(stored, rdp=lie[:2]))}[damage]
  path.write_text(text)
  assert fresh(EVENT, RELATION, ORDERS) == (oracle(), notes)


def test_infinite_values_and_notes_round_trip_exactly(tmp_path):
  values = (math.inf, 0.1 + 0.2, 5e-324, 1.7976931348623157e308)
  curve_cache.store(str(tmp_path), "k", values, ("a note",))
  assert curve_cache.load(str(tmp_path), "k") == (values, ("a note",))
  assert curve_cache.load(str(tmp_path), "another") is None
