"""Tests for tf_dpnsgd.sampling: inclusion rates, exact sizes, determinism, padding masks,
events, and the masked train step."""

import dp_accounting
import keras
import numpy as np
import pytest
import tensorflow as tf
from scipy import stats

import tf_dpnsgd
from tf_dpnsgd import accounting
from tf_dpnsgd import sampling
from tf_dpnsgd.ledger import DP_DENOMINATOR_KEY, DP_MASK_KEY


def toy_data(n, d=3, seed=0):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(n, d)).astype("float32")
  y = (x[:, 0] > 0).astype("int32")
  return x, y


# ---------------------------------------------------------------------------
# Index streams.
# ---------------------------------------------------------------------------
def test_poisson_inclusion_rate_and_variable_batch_size():
  n, b, steps = 2000, 100, 400  # q = 0.05
  s = sampling.PoissonSampler(n, b, seed=3)
  counts = np.zeros(n)
  sizes = []
  for t in range(steps):
    idx = s.indices(t)
    assert len(np.unique(idx)) == len(idx) and idx.min() >= 0 and idx.max() < n
    counts[idx] += 1
    sizes.append(len(idx))
  q = b / n
  rate = counts.sum() / (n * steps)
  assert abs(rate - q) < 4 * np.sqrt(q * (1 - q) / (n * steps))
  # Batch sizes are Binomial(N, q), not fixed: variance N q (1 - q) = 95.
  assert 70 < np.var(sizes) < 125
  # Per-example counts are Binomial(steps, q): a chi-square goodness-of-fit test.
  expected = steps * q
  chi2 = np.sum((counts - expected) ** 2 / (expected * (1 - q)))
  assert stats.chi2.sf(chi2, n - 1) > 1e-4


def test_uniform_draws_exactly_b_distinct_examples_fresh_each_step():
  n, b, steps = 500, 40, 300
  s = sampling.UniformSampler(n, b, seed=7)
  counts = np.zeros(n)
  previous = None
  for t in range(steps):
    idx = s.indices(t)
    assert idx.shape == (b,) and len(np.unique(idx)) == b
    assert idx.min() >= 0 and idx.max() < n
    counts[idx] += 1
    assert previous is None or not np.array_equal(idx, previous)
    previous = idx
  q = b / n
  assert abs(counts.mean() / steps - q) < 1e-12  # exactly B per step
  assert abs(counts / steps - q).max() < 6 * np.sqrt(q * (1 - q) / steps)


def test_shuffle_epochs_are_disjoint_batches_of_fresh_permutations():
  n, b = 103, 10  # 10 batches per epoch, 3 examples unused per epoch
  s = sampling.ShuffleSampler(n, b, seed=1)
  assert s.steps_per_epoch == 10 and s.unused_per_epoch == 3
  epochs = []
  for e in range(3):
    batches = [s.indices(e * 10 + k) for k in range(10)]
    joined = np.concatenate(batches)
    assert all(len(bt) == b for bt in batches)
    assert len(np.unique(joined)) == 100  # no example twice within an epoch
    epochs.append(set(joined.tolist()))
  assert s.indices(10).tolist() != s.indices(0).tolist()
  assert len(set(range(n)) - epochs[0]) == 3
  assert epochs[0] != epochs[1] or epochs[1] != epochs[2]  # a different unused set


@pytest.mark.parametrize("cls", [sampling.PoissonSampler, sampling.UniformSampler,
                                 sampling.ShuffleSampler])
def test_deterministic_given_seed_and_step(cls):
  a, b, c = cls(300, 20, seed=11), cls(300, 20, seed=11), cls(300, 20, seed=12)
  for t in (0, 1, 17, 1000):
    np.testing.assert_array_equal(a.indices(t), b.indices(t))
  assert any(not np.array_equal(a.indices(t), c.indices(t)) for t in range(5))
  assert cls(300, 20).seed != cls(300, 20).seed  # seed=None draws one from the OS


def test_samplers_name_their_events():
  sigma = 2.0
  p = sampling.PoissonSampler(1000, 10, seed=0)
  assert p.dp_event(sigma, 5) == dp_accounting.SelfComposedDpEvent(
      dp_accounting.PoissonSampledDpEvent(0.01, dp_accounting.GaussianDpEvent(sigma)), 5)
  u = sampling.UniformSampler(1000, 10, seed=0)
  assert u.dp_event(sigma, 5) == dp_accounting.SelfComposedDpEvent(
      dp_accounting.SampledWithoutReplacementDpEvent(1000, 10, dp_accounting.GaussianDpEvent(1.0)),
      5)
  assert u.neighboring_relation == dp_accounting.NeighboringRelation.REPLACE_ONE
  with pytest.raises(accounting.UnsupportedAccountingError):
    u.dp_event(sigma, 5, accountant="pld")
  sh = sampling.ShuffleSampler(1000, 10, seed=0)  # 100 steps per epoch
  assert sh.dp_event(sigma, 250, accountant="pld") == dp_accounting.SelfComposedDpEvent(
      dp_accounting.GaussianDpEvent(sigma), 3)
  # The event composes in the accountant its spec makes, and gives the report's epsilon.
  spec = u.accounting_spec(orders=(2.0, 4.0, 8.0))
  ledger = spec.make_accountant()
  ledger.compose(u.dp_event(sigma, 5))
  assert ledger.get_epsilon(1e-5) == pytest.approx(accounting.epsilon_for(spec, sigma, 5, 1e-5))


def test_sampler_uses_the_spec_it_is_given():
  spec = accounting.make_spec(1000, 10, "shuffle", accountant="pld")
  s = sampling.ShuffleSampler(1000, 10, seed=0, spec=spec)
  assert s.accounting_spec() is spec                       # not rebuilt
  assert s.dp_event(2.0, 250) == spec.composed_event(2.0, 250)  # the spec's accountant: pld
  assert s.accounting_spec(accountant="rdp") == accounting.make_spec(1000, 10, "shuffle")
  standalone = sampling.ShuffleSampler(1000, 10, seed=0)  # builds one: rdp, default, modern
  assert standalone.accounting_spec() == accounting.make_spec(1000, 10, "shuffle")
  assert standalone.dp_event(2.0, 250) != s.dp_event(2.0, 250)  # sigma/2 for rdp, replace-one
  for wrong in (sampling.PoissonSampler(1000, 10, seed=0), sampling.ShuffleSampler(1000, 20)):
    with pytest.raises(ValueError, match="would not describe"):
      type(wrong)(1000, wrong.batch_size, seed=0, spec=spec)
  with pytest.raises(TypeError, match="AccountingSpec"):
    sampling.ShuffleSampler(1000, 10, seed=0, spec="pld")


def test_poisson_max_batch_size_is_the_binomial_tail_quantile():
  n, q, p = 50000, 0.02, 1e-12
  m = sampling.poisson_max_batch_size(n, q, p)
  assert stats.binom.sf(m, n, q) <= p < stats.binom.sf(m - 1, n, q)
  assert sampling.PoissonSampler(n, 1000, seed=0).max_batch_size == m
  assert sampling.poisson_max_batch_size(10, 1.0) == 10


def test_poisson_overflow_raises_instead_of_dropping():
  s = sampling.PoissonSampler(100, 50, seed=0, max_batch_size=2)
  with pytest.raises(sampling.PoissonOverflowError, match="never dropped"):
    s.padded_indices(0)
  x, y = toy_data(100)
  with pytest.raises(Exception, match="never dropped"):
    next(iter(s.dataset(x, y)))


def test_bad_sampler_arguments():
  with pytest.raises(ValueError, match="q = B/N"):
    sampling.UniformSampler(10, 11)
  with pytest.raises(ValueError, match="seed"):
    sampling.UniformSampler(10, 2, seed=-1)
  with pytest.raises(ValueError, match="max_batch_size"):
    sampling.PoissonSampler(10, 2, max_batch_size=11)
  with pytest.raises(ValueError, match="sampling"):
    sampling.make_sampler("bootstrap", 10, 2)
  x, y = toy_data(50)
  with pytest.raises(ValueError, match="N = 60"):
    sampling.UniformSampler(60, 5, seed=0).dataset(x, y)
  with pytest.raises(ValueError, match="step"):
    sampling.UniformSampler(50, 5, seed=0).indices(-1)


# ---------------------------------------------------------------------------
# Datasets.
# ---------------------------------------------------------------------------
def test_poisson_dataset_is_padded_static_and_masked():
  n, b = 200, 20
  x, y = toy_data(n)
  s = sampling.PoissonSampler(n, b, seed=5)
  ds = s.dataset(x, y, num_steps=6)
  spec = ds.element_spec
  assert spec[0].shape == (s.max_batch_size, 3)  # static: no retracing
  assert spec[2][DP_MASK_KEY].shape == (s.max_batch_size,)
  for t, (xb, yb, w) in enumerate(ds):
    idx = s.indices(t)
    mask = w[DP_MASK_KEY].numpy()
    assert mask.sum() == len(idx) and mask[:len(idx)].all() and not mask[len(idx):].any()
    np.testing.assert_array_equal(xb.numpy()[:len(idx)], x[idx])
    np.testing.assert_array_equal(yb.numpy()[:len(idx)], y[idx])
    np.testing.assert_allclose(w[DP_DENOMINATOR_KEY].numpy(), b)  # q N, one per row


@pytest.mark.parametrize("cls", [sampling.PoissonSampler, sampling.UniformSampler,
                                 sampling.ShuffleSampler])
def test_dataset_resumes_the_same_stream_and_matches_numpy_batches(cls):
  n = 90
  x, y = toy_data(n)
  s = cls(n, 10, seed=21)
  full = list(s.dataset(x, y, num_steps=12).as_numpy_iterator())
  tail = list(s.dataset(x, y, start_step=7, num_steps=5).as_numpy_iterator())
  as_numpy = list(s.numpy_batches(x, y, start_step=7, num_steps=5))
  assert (len(full), len(tail), len(as_numpy)) == (12, 5, 5)  # zip below must not be empty
  for a, b, c in zip(full[7:], tail, as_numpy):
    tf.nest.map_structure(np.testing.assert_array_equal, a, b)
    tf.nest.map_structure(np.testing.assert_array_equal, a, tf.nest.map_structure(np.asarray, c))
  # Iterating again restarts at start_step (a peek does not consume the stream).
  again = list(s.dataset(x, y, start_step=7, num_steps=5).as_numpy_iterator())
  tf.nest.map_structure(np.testing.assert_array_equal, tail, again)


@pytest.mark.parametrize("sampling_name", ["poisson", "uniform", "shuffle"])
def test_replica_pipelines_deliver_exactly_the_split_global_batch(sampling_name):
  """One pipeline per replica (``replica_id``) must hand replica r exactly the rows that
  splitting the padded global batch into R equal shards gives it: the same examples, the
  same masks and tags, the global denominator, step after step (oracle: the global stream
  cut by hand)."""
  n, replicas = 45, 3
  x, y = toy_data(n)
  s = sampling.make_sampler(sampling_name, n, 7, seed=8)
  whole = list(s.dataset(x, y, num_steps=6, num_replicas=replicas).as_numpy_iterator())
  shards = [list(s.dataset(x, y, start_step=0, num_steps=6, num_replicas=replicas,
                           replica_id=r).as_numpy_iterator()) for r in range(replicas)]
  assert len(whole) == 6 and all(len(sh) == 6 for sh in shards)
  for step, global_batch in enumerate(whole):
    rows = len(global_batch[0])
    assert rows % replicas == 0
    per = rows // replicas
    for r in range(replicas):
      cut = tf.nest.map_structure(lambda a, r=r: a[r * per:(r + 1) * per], global_batch)
      tf.nest.map_structure(np.testing.assert_array_equal, shards[r][step], cut)
    if sampling_name == "poisson":  # padding rows are masked in whichever shard they land
      mask = np.concatenate([sh[step][2][DP_MASK_KEY] for sh in shards])
      assert mask.sum() == len(s.indices(step))
  with pytest.raises(ValueError, match="replica_id"):
    s.dataset(x, y, num_replicas=replicas, replica_id=replicas)
  with pytest.raises(ValueError, match="replica_id"):
    s.dataset(x, y, num_replicas=replicas, replica_id=True)


def test_dataset_stops_at_the_overflowing_step_like_the_step_by_step_stream():
  """The dataset draws its steps' indices in blocks (sampling.STEPS_PER_BLOCK); a Poisson
  batch that overflows in the middle of a block must still deliver every step before it,
  then raise, exactly as the step-by-step numpy stream (the oracle) does."""
  n = 60
  x, y = toy_data(n)
  s = sampling.PoissonSampler(n, 10, seed=5, max_batch_size=11)
  sizes = [len(s.indices(t)) for t in range(40)]
  first = next(t for t, k in enumerate(sizes) if k > 11)
  assert first % sampling.STEPS_PER_BLOCK != 0  # mid-block: the case under test
  expected = []
  with pytest.raises(sampling.PoissonOverflowError, match=f"step {first}"):
    for batch in s.numpy_batches(x, y, num_steps=40):
      expected.append(batch)
  got = []
  with pytest.raises(tf.errors.OpError, match=f"step {first}"):
    for batch in s.dataset(x, y, num_steps=40).as_numpy_iterator():
      got.append(batch)
  assert len(got) == len(expected) == first
  for a, b in zip(got, expected):
    tf.nest.map_structure(np.testing.assert_array_equal, a,
                          tf.nest.map_structure(np.asarray, b))


def test_nested_inputs():
  n = 40
  x, y = toy_data(n)
  inputs = {"a": x, "b": x[:, :1] * 2}
  s = sampling.UniformSampler(n, 8, seed=0)
  xb, yb, tags = next(iter(s.dataset(inputs, y)))
  idx = s.indices(0)
  assert set(tags) == {"dp_kind", "dp_step", "dp_sampler", "dp_seed", "dp_period", "dp_example",
                       "dp_identity",
                       "dp_digest"}
  np.testing.assert_array_equal(tags["dp_example"].numpy(), idx)
  np.testing.assert_array_equal(tags["dp_step"].numpy(), np.zeros(8))
  np.testing.assert_array_equal(xb["b"].numpy(), inputs["b"][idx])
  np.testing.assert_array_equal(yb.numpy(), y[idx])


# ---------------------------------------------------------------------------
# The masked train step (contract with tf_dpnsgd.training).
# ---------------------------------------------------------------------------
def _one_step(batch, seed=0):
  keras.utils.set_random_seed(seed)
  inp = keras.Input((3,))
  model = tf_dpnsgd.DPModel(inp, keras.layers.Dense(2)(inp),
                            trust_untagged_batches=True)  # some batches are made by hand
  model.compile(optimizer=tf_dpnsgd.DPSGD(learning_rate=0.5, l2_norm_clip=1.0,
                                          noise_multiplier=0.0, seed=0),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  model.fit(tf.data.Dataset.from_tensors(batch), epochs=1, verbose=0)
  return [w.numpy() for w in model.trainable_weights]


@pytest.mark.slow
def test_padded_rows_contribute_exactly_zero():
  n, b = 60, 12
  x, y = toy_data(n)
  s = sampling.PoissonSampler(n, b, seed=2)
  xb, yb, w = next(iter(s.dataset(x, y)))
  idx = s.indices(0)
  real = (x[idx], y[idx], {DP_MASK_KEY: np.ones(len(idx), bool),
                           DP_DENOMINATOR_KEY: np.float32(b)})
  after_real = _one_step(real)
  after_padded = _one_step((xb, yb, w))
  garbage_x = xb.numpy().copy()
  garbage_x[len(idx):] = 1e6  # padded rows that would dominate the update if counted
  after_garbage = _one_step((garbage_x, yb, w))
  for a, p, g in zip(after_real, after_padded, after_garbage):
    np.testing.assert_allclose(p, a, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(g, a, rtol=1e-6, atol=1e-7)
  initial = _one_step((xb, yb, {DP_MASK_KEY: np.zeros(s.max_batch_size, bool),
                                DP_DENOMINATOR_KEY: np.float32(b)}))
  assert any(not np.allclose(a, i) for a, i in zip(after_real, initial))  # the step did move


def test_numpy_batches_feed_fit():
  n, b = 60, 12
  x, y = toy_data(n)
  s = sampling.PoissonSampler(n, b, seed=9)
  keras.utils.set_random_seed(0)
  inp = keras.Input((3,))
  model = tf_dpnsgd.DPModel(inp, keras.layers.Dense(2)(inp))
  model.compile(optimizer=tf_dpnsgd.DPSGD(learning_rate=0.1, l2_norm_clip=1.0,
                                          noise_multiplier=1.0, seed=0),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  model.fit(s.numpy_batches(x, y), steps_per_epoch=3, epochs=2, verbose=0)
  assert int(model.optimizer.iterations.numpy()) == 6
  assert model.privacy_ledger.to_dict()["steps"] == 6
  assert model.privacy_ledger.kind == "poisson"
