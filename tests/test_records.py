"""tf_dpnsgd.records.RunRecord: the run record a launcher writes and a sweep reads back."""

import functools
import json
import math

import pytest

from tf_dpnsgd import accounting
from tf_dpnsgd import export
from tf_dpnsgd.records import ACCOUNTING_KEYS, NON_PRIVATE_NOTE, RunRecord

RUN = {"hyperparameters": {"optimizer": "dpnsgd", "learning_rate": 0.5},
       "final_metrics": {"accuracy": 0.875, "loss": 0.4},
       "best_val_accuracy": 0.9, "extra": {"dataset": "tiny", "width": 8}}


def strict(text):
  """json.loads refusing NaN/Infinity (not JSON)."""
  def refuse(constant):
    raise ValueError(f"non-standard JSON constant {constant}")
  return json.loads(text, parse_constant=refuse)


# The calibration below takes about 2 s: its tests share one worker (``--dist loadgroup``) so
# that it runs once per session, not once per worker (issue 47).
pytestmark = pytest.mark.xdist_group("records_calibration")


@functools.lru_cache(maxsize=None)
def calibrated_report():
  # Calibrated with bound="min": the report has every optional key (optimal_bound, ...).
  return accounting.calibrate(2000, 50, 4.0, 1e-5, "uniform", steps=8, bound="min")


def private_record(**changes):
  return RunRecord.from_privacy_report(calibrated_report(), **{**RUN, **changes})


@pytest.mark.slow
def test_private_record_round_trip_keeps_the_flat_keys():
  record = private_record()
  d = strict(record.to_json())
  # The keys launchers always wrote (and tests, sweeps and users read) stay top level.
  assert d["private"] is True and d["steps"] == 8 and d["dataset_size"] == 2000
  assert 0 < d["epsilon"] <= 4.0 and d["delta"] == 1e-5 and d["noise_multiplier"] > 0
  assert (d["sampling"], d["accountant"], d["bound"], d["target_epsilon"]) == (
      "uniform", "rdp", "min", 4.0)
  assert d["dataset"] == "tiny" and d["final_metrics"]["accuracy"] == 0.875
  assert RunRecord.from_json(record.to_json()) == record
  assert RunRecord.from_dict(record.to_dict()) == record


def test_every_report_key_is_a_field_or_an_accounting_key():
  keys = set(calibrated_report().to_dict())
  fields = set(RunRecord(private=True, steps=1, dataset_size=1).to_dict())
  assert keys <= fields | set(ACCOUNTING_KEYS)
  assert not set(ACCOUNTING_KEYS) & fields


def test_non_private_record_round_trips_with_epsilon_none():
  record = RunRecord.non_private(steps=3, dataset_size=100, **RUN)
  d = strict(record.to_json())
  assert d["private"] is False and d["epsilon"] is None and d["delta"] is None
  assert d["noise_multiplier"] is None and d["notes"] == [NON_PRIVATE_NOTE]
  back = RunRecord.from_json(record.to_json())
  assert back == record and back.epsilon is None
  assert back.epsilon_text() == "non-private (no privacy guarantee)"
  with pytest.raises(ValueError, match="non-private"):
    RunRecord(private=False, steps=1, dataset_size=1, epsilon=1.0)


def test_written_and_read_through_the_report_writer(tmp_path):
  record = private_record(final_metrics={"accuracy": 0.5, "loss": float("nan")},
                          best_val_accuracy=float("nan"))
  path = export.write_privacy_report(tmp_path, **record.to_dict())
  with open(path) as f:
    d = json.load(f)
  assert d["final_metrics"]["loss"] == "nan" and d["best_val_accuracy"] is None
  back = RunRecord.read(tmp_path)
  assert math.isnan(back.metric("loss")) and back.best_val_accuracy is None
  assert set(back.extra) == {"dataset", "width", "versions"}
  assert back.epsilon == record.epsilon and back.accounting == record.accounting


def test_older_files_and_infinite_epsilon():
  old_sgd = {"private": False, "steps": 3, "dataset_size": 10, "epsilon": "inf",
             "note": NON_PRIVATE_NOTE, "best_val_accuracy": "nan"}
  record = RunRecord.from_dict(old_sgd)
  assert record.epsilon is None and record.notes == (NON_PRIVATE_NOTE,)
  assert record.best_val_accuracy is None
  unbounded = RunRecord(private=True, steps=1, dataset_size=10, epsilon=math.inf, delta=1e-5)
  assert unbounded.epsilon is None and "no finite guarantee" in unbounded.notes[-1]
  assert strict(unbounded.to_json())["epsilon"] is None


def test_extra_fields_cannot_shadow_fields():
  for extra in ({"epsilon": 1.0}, {"sampling": "poisson"}, {"notes": []}):
    with pytest.raises(ValueError, match="cannot be"):
      RunRecord(private=True, steps=1, dataset_size=10, extra=extra)
