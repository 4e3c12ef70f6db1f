"""Every statistics release is its own event in the ledger, wherever it was recorded.

Issue 30, scenarios 6 and 7. Before: the ledger kept the NUMBER of releases and the
SMALLEST noise multiplier, so a plan saying (8, 8, 8, 2) was accepted for releases
(8, 8, 2, 2) (reported 3.635, true 4.198); a release recorded on a head and then trained
inside ``views.multi_view(head, 2)``, or recorded and then saved + reloaded before any
``fit``, was lost (reported 2.902 where the releases that ran give 4.124). The oracle is
dp-accounting composing the events itself.
"""

import dp_accounting
import keras
import numpy as np
import pytest

import tf_dpnsgd
from tf_dpnsgd import accounting
from tf_dpnsgd import ledger as ledger_lib
from tf_dpnsgd import private_stats
from tf_dpnsgd.models import views
from tf_dpnsgd.plan import PrivacyPlan

N, B = 40, 8
COMMON = dict(dataset_size=N, batch_size=B, sampling="poisson", steps=5, noise_multiplier=1.5,
              delta=1e-5)


def _oracle(releases, steps=0, sigma=1.5):
  acc = dp_accounting.rdp.RdpAccountant(list(accounting.DEFAULT_ORDERS))
  for m in releases:
    acc.compose(dp_accounting.GaussianDpEvent(m))
  if steps:
    acc.compose(dp_accounting.PoissonSampledDpEvent(B / N, dp_accounting.GaussianDpEvent(sigma)),
                steps)
  return acc.get_epsilon(1e-5)


def _head(name="head"):
  inputs = keras.Input((4,))
  return keras.Model(inputs, keras.layers.Dense(2)(inputs), name=name)


def _release(model, sigma):
  """One private normalization: two releases at ``sigma``."""
  private_stats.release_channel_moments(np.ones((N, 3, 4)), model, noise_multiplier=sigma,
                                        mean_clip=1.0, square_clip=1.0, dataset_size=N)


def test_releases_are_kept_one_by_one_in_order():
  model = tf_dpnsgd.make_private(_head())
  _release(model, 8.0)
  _release(model, 2.0)
  assert ledger_lib.ledger_of(model).release_noise_multipliers == (8.0, 8.0, 2.0, 2.0)
  assert len(ledger_lib.ledger_of(model).release_events()) == 4


def test_a_plan_with_the_right_count_and_minimum_but_other_releases_is_refused():
  """Scenario 7: (8, 8, 2, 2) ran; (8, 8, 8, 2) has the same count and minimum."""
  model = tf_dpnsgd.make_private(_head())
  _release(model, 8.0)
  _release(model, 2.0)
  with pytest.raises(ledger_lib.LedgerMismatchError, match="not covered by the plan"):
    PrivacyPlan(**COMMON, releases=(8.0, 8.0, 8.0, 2.0)).report(model)
  report = PrivacyPlan(**COMMON, releases=(2.0, 8.0, 2.0, 8.0)).report(model)  # any order
  assert report.epsilon == pytest.approx(_oracle((8.0, 8.0, 2.0, 2.0)), rel=1e-9)


def test_the_report_composes_the_releases_that_ran_not_the_planned_ones():
  model = tf_dpnsgd.make_private(_head())
  _release(model, 8.0)  # two releases at 8 ran; the plan reserved three at 2
  report = PrivacyPlan(**COMMON, releases=(2.0, 2.0, 2.0)).report(model)
  assert report.epsilon == pytest.approx(_oracle((8.0, 8.0)), rel=1e-9)


def test_a_release_on_a_head_counts_in_the_multi_view_model_built_around_it():
  """Scenario 6a: the release was recorded on the head; the model trained is another."""
  head = _head()
  _release(head, 4.0)
  model = tf_dpnsgd.make_private(views.multi_view(head, 2))
  ledger = ledger_lib.ledger_of(model)
  assert ledger.release_noise_multipliers == (4.0, 4.0)
  with pytest.raises(ledger_lib.LedgerMismatchError, match="release"):
    PrivacyPlan(**COMMON).report(model)


def test_combining_two_models_with_their_own_ledgers_is_refused():
  first, second = _head("first"), _head("second")
  _release(first, 4.0)
  _release(second, 4.0)
  inputs = keras.Input((4,))
  both = keras.Model(inputs, keras.layers.Add()([first(inputs), second(inputs)]))
  with pytest.raises(ValueError, match="different privacy ledgers"):
    tf_dpnsgd.make_private(both)


@pytest.mark.parametrize("kind", ["functional", "sequential"])
def test_a_release_saved_and_reloaded_before_any_fit_is_refused_by_a_plan_without_it(
    tmp_path, kind):
  """Scenario 6b: release, save, load_model, then fit with a plan that forgot it."""
  if kind == "sequential":
    base = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
  else:
    base = _head()
  plan = PrivacyPlan(**COMMON)
  model = tf_dpnsgd.make_private(base, plan=plan)
  _release(model, 6.0)
  model.compile(optimizer=tf_dpnsgd.DPNSGD(learning_rate=0.1, regularizer=0.1),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  path = str(tmp_path / "m.keras")
  model.save(path)
  loaded = keras.models.load_model(path)
  assert ledger_lib.ledger_of(loaded).release_noise_multipliers == (6.0, 6.0)
  x = np.random.default_rng(0).normal(size=(N, 4)).astype(np.float32)
  y = np.zeros(N, np.int64)
  with pytest.raises(ledger_lib.LedgerMismatchError, match="release"):
    loaded.fit(x, y, verbose=0)
  assert ledger_lib.ledger_of(loaded).steps == 0  # refused before any step


def test_the_base_models_file_gets_its_releases_back_on_this_machine(tmp_path):
  """A release on a built base model records the weights' fingerprint: base.save +
  load_model + make_private (a new process on this machine) keeps the releases."""
  base = _head()
  _release(base, 5.0)
  path = str(tmp_path / "base.keras")
  base.save(path)
  private = tf_dpnsgd.make_private(keras.models.load_model(path))
  assert ledger_lib.ledger_of(private).release_noise_multipliers == (5.0, 5.0)


def test_a_rolled_back_release_stays_and_a_later_one_is_added():
  model = tf_dpnsgd.make_private(_head())
  ledger = ledger_lib.ledger_of(model)
  before = {k: np.asarray(v) for k, v in ledger.state().items()}
  _release(model, 8.0)
  ledger.load_own_variables(before)  # e.g. load_weights of a file saved before the release
  assert ledger.release_noise_multipliers == (8.0, 8.0)
  _release(model, 3.0)
  assert ledger.release_noise_multipliers == (8.0, 8.0, 3.0, 3.0)


def test_merge_of_two_branches_keeps_both_branches_releases():
  assert ledger_lib.merge_releases([8.0, 4.0], [8.0, 2.0, 2.0]) == [8.0, 4.0, 2.0, 2.0]
  assert ledger_lib.merge_releases([], [3.0]) == [3.0]


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf")])
def test_a_release_needs_a_finite_positive_noise_multiplier(bad):
  ledger = ledger_lib.PrivacyLedger()
  with pytest.raises(ValueError, match="noise multiplier"):
    ledger.record_release(bad)
  assert ledger.releases == 0
