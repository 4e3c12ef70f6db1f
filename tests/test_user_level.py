"""User-level DP (issue 50): the privacy unit is a user with many rows (tf_dpnsgd.users).

Oracles: a loop of one tf.GradientTape per user (the mean loss of the user's real rows,
clipped or normalized, summed) against the step's engine; dp-accounting's own
PoissonSampledDpEvent over users against the plan's epsilon; the closed form of group
privacy. Adversarial: a 1-row and a 10,000-row user, string/int/missing ids, a user
replaced by an outlier, a unit holding two users, a model continued at another unit.
"""

from __future__ import annotations

import dp_accounting
import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dpnsgd
from tf_dpnsgd import accounting
from tf_dpnsgd import ledger as ledger_lib
from tf_dpnsgd import participation
from tf_dpnsgd import plan as plan_lib
from tf_dpnsgd import step as step_lib
from tf_dpnsgd import transforms
from tf_dpnsgd import users
from tf_dpnsgd.per_example import units

K = 3


def _data(rows_per_user=(1, 2, 5, 3, 1, 4), seed=0, features=3):
  rng = np.random.default_rng(seed)
  ids = np.repeat(np.arange(len(rows_per_user)) * 10 + 7, rows_per_user)
  n = ids.size
  x = rng.normal(size=(n, features)).astype(np.float32)
  y = rng.integers(0, 2, size=n).astype(np.int32)
  return x, y, ids


def _model(features=3, seed=1):
  keras.utils.set_random_seed(seed)
  inputs = keras.Input((features,))
  return keras.Model(inputs, keras.layers.Dense(2)(inputs))


def _private(num_users, k=K, batch_size=2, **kw):
  model = tf_dpnsgd.make_private(
      _model(), privacy_unit="user", user_key="uid", max_examples_per_user=k,
      noise_multiplier=1.0, delta=1e-5, batch_size=batch_size, steps=2,
      dataset_size=num_users, **kw)
  model.compile(optimizer=tf_dpnsgd.DPNSGD(learning_rate=0.1, regularizer=0.01),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  return model


def _sampler(num_users, batch_size=2, k=K, seed=3):
  return users.UserPoissonSampler(num_users, batch_size, k, seed=seed, max_users=num_users)


def _oracle(model, x, y, mask, user_tags, transform):
  """Per user: the gradient of the mean loss of its real rows (its own tape), transformed,
  summed; padding rows and padding slots left out by hand."""
  total = [np.zeros(v.shape, np.float64) for v in model.trainable_variables]
  for user in sorted(set(user_tags[mask].tolist())):
    rows = np.flatnonzero(mask & (user_tags == user))
    with tf.GradientTape() as tape:
      losses = model._dp_loss_fn(tf.gather(y, rows), model(tf.gather(x, rows), training=True))
      loss = tf.reduce_mean(losses)
    grads = tape.gradient(loss, model.trainable_variables)
    norm = np.sqrt(sum(float(tf.reduce_sum(g * g)) for g in grads))
    factor = float(transform.factors(tf.constant([norm], tf.float32))[0])
    total = [t + factor * g.numpy() for t, g in zip(total, grads)]
  return total


# --- identities and the k-row rule ----------------------------------------------------
def test_user_ids_may_be_strings_or_ints_and_missing_ids_are_refused():
  a = users.user_identities(["ann", "bob", "ann"])
  assert a[0] == a[2] != a[1]
  assert users.user_identities(np.array([5, 5], np.int16)).tolist() == \
      users.user_identities([5, 5]).tolist()
  for missing in (["a", None], ["a", ""], np.array(["a", ""]), [1.0, float("nan")]):
    with pytest.raises((users.MissingUserIdError, TypeError)):
      users.user_identities(missing)
  with pytest.raises(TypeError, match="all integers or all strings"):
    users.user_identities(np.array([3, "3"], object))
  with pytest.raises(TypeError, match="floats"):
    users.user_identities(np.array([1.0, 2.0]))
  with pytest.raises(users.MissingUserIdError):
    users.split_user_column({"features": np.zeros([2, 1])}, "uid")


def test_the_k_rows_kept_are_a_function_of_the_users_own_rows_not_of_the_order():
  x, y, ids = _data((7, 1, 4))
  pop = participation.Population.of_data(x, y)
  table = users.UserTable.of(users.user_identities(ids), pop.identities, K)
  perm = np.random.default_rng(5).permutation(ids.size)
  pop2 = participation.Population.of_data(x[perm], y[perm])
  table2 = users.UserTable.of(users.user_identities(ids[perm]), pop2.identities, K)
  kept = lambda t, p: {u: sorted(p.identities[r[r >= 0]].tolist())  # noqa: E731
                       for u, r in zip(t.users.tolist(), t.rows)}
  assert kept(table, pop) == kept(table2, pop2)
  assert [int((r >= 0).sum()) for r in table.rows] == [min(c, K) for c in table.counts]
  # Removing another user's rows changes nothing for this user.
  keep = ids != ids[0]
  pop3 = participation.Population.of_data(x[keep], y[keep])
  table3 = users.UserTable.of(users.user_identities(ids[keep]), pop3.identities, K)
  mine = kept(table3, pop3)
  assert all(kept(table, pop)[u] == v for u, v in mine.items())


def test_bound_diagnostics_are_exact_counts_and_never_in_the_report():
  assert users.bound_diagnostics([1, 1, 1, 1, 2], 3) == {
      "users": 2, "rows": 5, "users_truncated": 1, "rows_unused": 1}


# --- the sampler ----------------------------------------------------------------------
def test_a_1_row_user_and_a_10000_row_user_each_fill_exactly_one_slot():
  rows = (1, 10_000, 2)
  x, y, ids = _data(rows, features=1)
  sampler = users.UserPoissonSampler(3, 3, 4, seed=0)  # q = 1: every user every step
  xb, yb, tags = next(sampler.numpy_batches(x, y, ids))
  u = tags[ledger_lib.DP_USER_KEY].reshape(-1, 4)
  m = tags[ledger_lib.DP_MASK_KEY].reshape(-1, 4)
  assert sorted(m.sum(axis=1).tolist()) == [1, 2, 4]  # the heavy user is cut to k = 4
  users.check_user_batch(4, tags[ledger_lib.DP_USER_KEY], tags[ledger_lib.DP_MASK_KEY])
  assert np.all(np.where(m, u >= 0, u == -1))
  assert tags[ledger_lib.DP_DENOMINATOR_KEY][0] == 3.0


def test_reordered_data_gives_the_same_batches():
  x, y, ids = _data()
  sampler = _sampler(6)
  perm = np.random.default_rng(2).permutation(ids.size)
  a = list(sampler.numpy_batches(x, y, ids, num_steps=4))
  b = list(sampler.numpy_batches(x[perm], y[perm], ids[perm], num_steps=4))
  for (_, _, ta), (_, _, tb) in zip(a, b):
    for key in (ledger_lib.DP_IDENTITY_KEY, ledger_lib.DP_USER_KEY, ledger_lib.DP_MASK_KEY):
      assert ta[key].tolist() == tb[key].tolist()


def test_the_host_check_refuses_two_users_in_a_unit_and_one_user_in_two():
  real = np.ones(4, bool)
  users.check_user_batch(2, np.array([1, 1, 2, 2]), real)
  with pytest.raises(participation.ParticipationError, match="two users"):
    users.check_user_batch(2, np.array([1, 2, 2, 2]), real)
  with pytest.raises(participation.ParticipationError, match="two units"):
    users.check_user_batch(2, np.array([1, 1, 1, 1]), real)
  users.check_user_batch(2, np.array([1, -1, 2, 2]), np.array([True, False, True, True]))
  with pytest.raises(users.UnitMismatchError):
    users.check_user_batch(None, np.array([1, 1]), real[:2])
  with pytest.raises(users.UnitMismatchError):
    users.check_user_batch(2, None, None)


# --- the step: exact against a loop over users ---------------------------------------
@pytest.mark.parametrize("transform", [  # quick: DP-NSGD's (issue 47); clipping in CI
    transforms.Normalize(0.01), pytest.param(transforms.Clip(0.5), marks=pytest.mark.slow)],
                         ids=["normalize", "clip"])
def test_the_step_sums_each_users_bounded_mean_gradient_exactly(transform):
  x, y, ids = _data()
  model = _private(6)
  xb, yb, tags = next(_sampler(6, batch_size=5).numpy_batches(x, y, ids))
  mask = tags[ledger_lib.DP_MASK_KEY]
  assert len(set(tags[ledger_lib.DP_USER_KEY][mask].tolist())) >= 2

  @tf.function
  def contributions(xb, yb, mask):
    out = step_lib.contributions(model, xb, yb, mask, None, transform)
    return out.summed, out.norms, out.unit_mask

  summed, norms, unit_mask = contributions(tf.constant(xb), tf.constant(yb), tf.constant(mask))
  expected = _oracle(model, xb, yb, mask, tags[ledger_lib.DP_USER_KEY], transform)
  for got, want in zip(summed, expected):
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-6)
  assert norms.shape[0] == xb.shape[0] // K
  assert unit_mask.numpy().tolist() == mask.reshape(-1, K).any(axis=1).tolist()


def test_padding_rows_holding_nan_add_nothing_and_padding_slots_add_exactly_zero():
  model = _private(2)
  x = np.ones([2 * K, 3], np.float32)
  x[1] = np.nan  # a padding row of user 0's slot
  y = np.zeros([2 * K], np.int32)
  mask = np.array([True, False, False] + [False] * K)
  out = units.user_unit_engine(model, model._dp_loss_fn, tf.constant(x), tf.constant(y),
                               transforms.Normalize(1e-6), mask=tf.constant(mask),
                               rows_per_unit=K)
  assert np.isfinite(out.norms.numpy()[0])
  assert out.factors.numpy()[1] == 0.0
  norm = np.sqrt(sum(float(tf.reduce_sum(s * s)) for s in out.summed))
  np.testing.assert_allclose(norm, 1.0, rtol=1e-4)  # one user, normalized


def test_replacing_one_whole_user_moves_the_noiseless_sum_by_at_most_the_bound():
  x, y, ids = _data((2, 3, 3, 1))
  model = _private(4)
  sampler = users.UserPoissonSampler(4, 4, K, seed=0)  # q = 1: the replaced user runs
  transform = transforms.Normalize(1e-6)  # S = 1: replace-one bound 2
  x2 = x.copy()
  x2[ids == ids[2]] = 1e4  # the user's every row replaced by outliers
  sums = []
  for xs in (x, x2):
    xb, yb, tags = next(sampler.numpy_batches(xs, y, ids))
    out = units.user_unit_engine(model, model._dp_loss_fn, tf.constant(xb), tf.constant(yb),
                                 transform, mask=tf.constant(tags[ledger_lib.DP_MASK_KEY]),
                                 rows_per_unit=K)
    sums.append(np.concatenate([s.numpy().ravel() for s in out.summed]))
  moved = float(np.linalg.norm(sums[0] - sums[1]))
  assert 0.1 < moved <= 2.0 + 1e-5


# --- accounting -------------------------------------------------------------------------
def test_the_epsilon_is_dp_accountings_poisson_over_users():
  plan = plan_lib.PrivacyPlan(dataset_size=1000, batch_size=50, sampling="user_poisson",
                              max_examples_per_user=4, user_key="uid", steps=300,
                              noise_multiplier=1.1, delta=1e-6, seed=0)
  acc = dp_accounting.rdp.RdpAccountant(list(accounting.DEFAULT_ORDERS))
  acc.compose(dp_accounting.PoissonSampledDpEvent(
      0.05, dp_accounting.GaussianDpEvent(1.1)), 300)
  np.testing.assert_allclose(plan.epsilon(), acc.get_epsilon(1e-6), rtol=1e-9)
  report = plan.planned_report()
  assert "user" in report.spec.assumptions()["neighboring_relation"]
  assert any("User-level DP" in n and "k = 4" in n for n in report.notes)
  with pytest.raises(ValueError, match="user-level settings"):
    plan_lib.PrivacyPlan(dataset_size=10, batch_size=2, sampling="poisson", steps=1,
                         noise_multiplier=1.0, delta=1e-5, max_examples_per_user=2)
  with pytest.raises(ValueError, match="max_examples_per_user"):
    plan_lib.PrivacyPlan(dataset_size=10, batch_size=2, sampling="user_poisson", steps=1,
                         noise_multiplier=1.0, delta=1e-5)


def test_group_privacy_says_what_an_example_level_run_means_for_a_user_with_k_rows():
  eps, d = accounting.group_privacy_epsilon(0.5, 1e-7, 4)
  assert eps == 2.0
  np.testing.assert_allclose(d, 1e-7 * sum(np.exp(0.5 * i) for i in range(4)), rtol=1e-12)
  assert d <= 4 * np.exp(3 * 0.5) * 1e-7
  # Side by side: the same noise and steps, accounted per row (a user with k rows: group
  # privacy) and per user (k rows in one bounded contribution).
  spec = accounting.make_spec(10_000, 100, "poisson")
  acc = spec.make_accountant()
  acc.compose(spec.composed_event(1.0, 500))  # composed once; converted at every delta
  eps_at = acc.get_epsilon

  group_eps, group_delta = accounting.example_level_for_group(eps_at, 8, 1e-5)
  assert group_delta <= 1e-5 and group_eps >= 8 * eps_at(1e-5) * 0.5
  user_plan = plan_lib.PrivacyPlan(dataset_size=10_000, batch_size=100, steps=500,
                                   sampling="user_poisson", max_examples_per_user=8,
                                   user_key="uid", noise_multiplier=1.0, delta=1e-5, seed=0)
  assert user_plan.epsilon() < group_eps


# --- the one call, the ledger and the report -------------------------------------------
def test_one_call_user_level_fit_records_the_unit_and_reports_user_level():
  x, y, ids = _data((1, 2, 5, 3, 1, 4))
  names = np.array([f"user-{i}" for i in ids])
  model = tf_dpnsgd.make_private(
      _model(), privacy_unit="user", user_key="uid", max_examples_per_user=K,
      noise_multiplier=1.0, delta=1e-4, batch_size=2, steps=3)
  model.compile(optimizer=tf_dpnsgd.DPNSGD(learning_rate=0.1, regularizer=0.01),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  model.fit({"features": x, "uid": names}, y, verbose=0)
  ledger = model.privacy_ledger
  assert (ledger.steps, ledger.privacy_unit, ledger.unit_rows) == (3, "user", K)
  assert model.privacy_plan.dataset_size == 6  # N = users
  report = model.privacy_report()
  assert any("User-level DP" in n for n in report.notes)
  statement = report.statement()
  assert "N = 6 users" in statement and "User-level DP, add/remove one user" in statement
  assert "No user-level guarantee" not in statement
  assert any("User ids as given" in n for n in report.not_covered)
  # An example-level plan cannot describe this ledger, nor can an example-level model go on.
  example_plan = plan_lib.PrivacyPlan(dataset_size=16, batch_size=2, sampling="poisson",
                                      steps=3, noise_multiplier=1.0, delta=1e-4)
  with pytest.raises(ledger_lib.LedgerMismatchError):
    example_plan.report(model)
  with pytest.raises(users.UnitMismatchError):
    users.check_ledger_unit(None, ledger)
  with pytest.raises(users.UnitMismatchError):
    users.check_ledger_unit(K + 1, ledger)


def test_an_example_level_batch_is_refused_by_a_user_level_model_before_any_update():
  x, y, ids = _data()
  model = _private(6)
  before = [v.numpy().copy() for v in model.trainable_variables]
  plan = plan_lib.PrivacyPlan(dataset_size=ids.size, batch_size=4, sampling="poisson",
                              steps=1, noise_multiplier=1.0, delta=1e-4, seed=0)
  with pytest.raises(users.UnitMismatchError, match="no user tags"):
    model.fit(plan.dataset(x, y, model=model), steps_per_epoch=1, epochs=1, verbose=0)
  assert model.privacy_ledger.steps == 0
  for b, v in zip(before, model.trainable_variables):
    np.testing.assert_array_equal(b, v.numpy())


def test_a_user_level_batch_is_refused_by_an_example_level_model():
  x, y, ids = _data()
  model = tf_dpnsgd.make_private(_model())
  model.compile(optimizer=tf_dpnsgd.DPNSGD(learning_rate=0.1, regularizer=0.01,
                                            noise_multiplier=1.0),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  plan = plan_lib.PrivacyPlan(dataset_size=6, batch_size=2, sampling="user_poisson",
                              max_examples_per_user=K, user_key="uid", steps=1,
                              noise_multiplier=1.0, delta=1e-4, seed=0)
  with pytest.raises(users.UnitMismatchError, match="bounds each ROW"):
    model.fit(plan.dataset({"f": x, "uid": ids}, y, model=model), steps_per_epoch=1,
              epochs=1, verbose=0)
  assert model.privacy_ledger.steps == 0


def test_make_private_refuses_incomplete_or_conflicting_user_settings():
  with pytest.raises(ValueError, match="user_key"):
    tf_dpnsgd.make_private(_model(), privacy_unit="user", max_examples_per_user=2,
                           noise_multiplier=1.0, delta=1e-5, batch_size=2, steps=1)
  with pytest.raises(ValueError, match="privacy_unit='user'"):
    tf_dpnsgd.make_private(_model(), user_key="uid", noise_multiplier=1.0, delta=1e-5,
                           batch_size=2, steps=1)
  with pytest.raises(ValueError, match="Poisson sampling"):
    tf_dpnsgd.make_private(_model(), privacy_unit="user", user_key="u",
                           max_examples_per_user=2, sampling="shuffle", noise_multiplier=1.0,
                           delta=1e-5, batch_size=2, steps=1)
  with pytest.raises(ValueError, match="privacy_unit"):
    tf_dpnsgd.make_private(_model(), privacy_unit="person")


def test_kept_rows_are_at_most_k_per_user_and_follow_the_examples_not_their_order():
  """users.kept_rows (the rows an example-level comparison trains on, so that a group-privacy
  statement for k rows covers every user): at most k rows per user, all rows of users with
  fewer, the same examples whatever the order of the data."""
  rng = np.random.default_rng(0)
  user_ids = np.repeat(np.arange(6), [1, 2, 5, 9, 3, 12])
  x = rng.normal(size=(user_ids.size, 3)).astype("float32")
  y = rng.integers(0, 2, user_ids.size)
  kept = users.kept_rows(x, y, user_ids, 3)
  assert np.all(np.diff(kept) > 0)
  per_user = np.bincount(user_ids[kept], minlength=6)
  assert per_user.tolist() == [1, 2, 3, 3, 3, 3]
  perm = rng.permutation(user_ids.size)
  again = users.kept_rows(x[perm], y[perm], user_ids[perm], 3)
  assert sorted(map(tuple, x[perm][again])) == sorted(map(tuple, x[kept]))
