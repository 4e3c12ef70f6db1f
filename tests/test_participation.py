"""Who ran when is checked on example identity, for every sampler, across every continuation.

The oracle is independent of the sampler and the guard: a recorder wrapped around the
model's train function reads, from the batches the compiled step actually consumed, each
real row's example (column 0 of ``x`` holds a unique example number, fixed to the example,
not to its position), and the test measures the participation that ran:

* cyclic Poisson (BandMF, BLT, separation ``b``): every example's steps are congruent mod
  ``b`` (so at least ``b`` apart), and the report's epsilon is dp-accounting's
  ``SelfComposed(PoissonSampled(bB/N, Gaussian(sigma)), ceil(T / b))`` (BandMF) built here;
* shuffling: no example twice in one epoch;
* Poisson: the report's epsilon is dp-accounting's ``PoissonSampled(B/N)`` composed ``T``
  times; every sampling: no example twice in one step.

Each continuation (a second fit on reordered arrays, an interrupted fit resumed on
reordered arrays, a reshuffled ``tf.data`` pipeline with ``extend_privacy_plan``, a
``.keras`` reload) either satisfies the measured pattern and the oracle epsilon, or is
refused before any step runs. The adversarial cases feed batches that break the rule
(positions instead of identities) and must be refused by the host check.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import fixtures
import matrix_fixtures
import tf_dpnsgd
from tf_dpnsgd import ledger as ledger_lib
from tf_dpnsgd import participation
from tf_dpnsgd import sampling as sampling_lib
from tf_dpnsgd.correlated import noise as cn
from tf_dpnsgd.correlated import sampling as cs

N, B, BANDS, EPOCHS, DELTA, SIGMA = 48, 6, 4, 2, 1e-5, 1.5
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


# --- the pure rules -------------------------------------------------------------------
def test_parts_and_permutations_are_functions_of_identity_not_position():
  rng = np.random.default_rng(0)
  ids = participation.mix(np.arange(500), 3)
  perm = rng.permutation(500)
  parts = participation.part_of(ids, key=77, bands=5)
  np.testing.assert_array_equal(participation.part_of(ids[perm], 77, 5), parts[perm])
  order = ids[participation.epoch_order(ids, 9, 2)]
  np.testing.assert_array_equal(ids[perm][participation.epoch_order(ids[perm], 9, 2)], order)
  assert not np.array_equal(order, ids[participation.epoch_order(ids, 9, 3)])  # new epoch
  assert participation.multiset_digest(ids[perm]) == participation.multiset_digest(ids)
  assert participation.multiset_digest(ids[1:]) != participation.multiset_digest(ids)


def test_identities_tell_equal_rows_apart_and_user_ids_must_be_distinct():
  x = np.array([[1.0], [2.0], [1.0], [1.0]], np.float32)
  y = np.array([0, 1, 0, 0])
  pop = participation.Population.of_data(x, y)
  assert np.unique(pop.identities).size == 4  # three equal rows, three identities
  # The same rows in another order: the same set of identities (equal rows interchangeable).
  again = participation.Population.of_data(x[[3, 1, 0, 2]], y[[3, 1, 0, 2]])
  assert again.digest == pop.digest
  assert participation.Population.of_data(x, y, example_ids=["a", "b", "c", "d"]).size == 4
  with pytest.raises(ValueError, match="distinct"):
    participation.ids_to_identities([1, 2, 2])
  with pytest.raises(TypeError, match="integers or strings"):
    participation.ids_to_identities([0.5, 1.5])


def test_cyclic_poisson_parts_follow_examples_when_the_data_is_reordered():
  """Scenario 1's cause: the part of an example must not depend on its row position."""
  x, y = _data()
  s = cs.CyclicPoissonSampler(dataset_size=N, batch_size=B, bands=BANDS, seed=5)
  perm = np.random.default_rng(1).permutation(N)
  a, b = s.population(x, y), s.population(x[perm], y[perm])
  assert s.seed_tag(a) == s.seed_tag(b)
  for p in range(BANDS):
    assert set(x[s.part(p, a), 0]) == set(x[perm][s.part(p, b), 0])


def test_the_check_refuses_rows_of_another_part_and_repeats_within_an_epoch():
  check = participation.ParticipationCheck()
  ids = participation.mix(np.arange(40), 1)
  parts = participation.part_of(ids, 123, 4)
  check.check("cyclic_poisson", 6, 4, 123, ids[parts == 2])  # step 6: part 2
  with pytest.raises(participation.ParticipationError, match="another part"):
    check.check("cyclic_poisson", 7, 4, 123, ids[parts == 2])
  record = check.check("shuffle", 3, 5, 9, ids[:4])  # epoch 0
  check.commit(record)
  with pytest.raises(participation.ParticipationError, match="already ran in epoch 0"):
    check.check("shuffle", 4, 5, 9, ids[3:6])
  check.check("shuffle", 5, 5, 9, ids[3:6])  # epoch 1: allowed again
  with pytest.raises(participation.ParticipationError, match="repeating an example"):
    check.check("poisson", 0, 0, 9, np.r_[ids[:3], ids[:1]])


# --- the oracle -----------------------------------------------------------------------
def _data(n=N):
  rng = np.random.default_rng(0)
  x = rng.normal(size=(n, 5)).astype(np.float32)
  x[:, 0] = np.arange(n)  # the example's number: travels with the example, never its position
  return x, rng.integers(0, 3, n)


class _Tap:
  """The iterator a train function call consumes, keeping each batch it handed out (one
  module-level class: a class made per call was cyclic garbage holding the batches)."""

  def __init__(self, iterator):
    self.taken, self.stream = [], iter(iterator)

  def __iter__(self):
    return self

  def __next__(self):
    self.taken.append(next(self.stream))
    return self.taken[-1]


class Recorder:
  """The examples each executed step consumed, read from the batches themselves."""

  def __init__(self, model):
    self.model, self.steps = model, {}
    make = model.make_train_function

    def make_recorded(force=False):  # whenever Keras (re)makes the train function
      inner = make(force=force)
      if getattr(inner, "_recorded", False):
        return inner
      recorded = lambda iterator: self.run(inner, iterator)  # noqa: E731
      recorded._recorded = True
      model.train_function = recorded
      return recorded

    model.make_train_function = make_recorded

  def run(self, inner, iterator):
    tap = _Tap(iterator)
    taken = tap.taken
    first = ledger_lib.ledger_of(self.model).steps
    out = inner(tap)
    for offset, batch in enumerate(taken):
      x, _, weights = keras.utils.unpack_x_y_sample_weight(batch)
      rows = np.asarray(x)[:, 0].astype(int)
      if isinstance(weights, dict) and "dp_mask" in weights:
        rows = rows[np.asarray(weights["dp_mask"]).astype(bool)]
      assert np.unique(rows).size == rows.size, "an example twice in one step"
      self.steps[first + offset] = rows
    return out

  def participation(self) -> dict:
    """example -> sorted steps it ran in."""
    seen = {}
    for step, rows in sorted(self.steps.items()):
      for r in rows.tolist():
        seen.setdefault(r, []).append(step)
    return seen


def _poisson_epsilon(q, steps, sigma):
  """dp-accounting's PoissonSampled(q, Gaussian(sigma)) composed ``steps`` times (built in
  tests/matrix_fixtures.py from dp-accounting's events; memoized per distinct pattern: the
  matrix's cases share a handful)."""
  return matrix_fixtures.poisson_epsilon(float(q), int(steps), float(sigma), DELTA)


def _assert_pattern_and_epsilon(model, recorder, sampling, bands=BANDS):
  """The measured participation satisfies the sampling's assumption; the report's epsilon
  is dp-accounting's for it (BandMF, Poisson)."""
  steps = model.privacy_ledger.steps
  assert sorted(recorder.steps) == list(range(steps))  # every executed step was seen
  seen = recorder.participation()
  if sampling == "cyclic_poisson":
    for example, ran in seen.items():
      assert len({t % bands for t in ran}) == 1, (example, ran)  # at least b steps apart
  if sampling == "shuffle":
    per_epoch = N // B
    for example, ran in seen.items():
      epochs = [t // per_epoch for t in ran]
      assert len(epochs) == len(set(epochs)), (example, ran)
  report = model.privacy_report()
  sigma = model.optimizer.noise_multiplier
  if sampling == "cyclic_poisson" and getattr(model.optimizer, "bands", 1) > 1:
    expected = _poisson_epsilon(bands * B / N, -(-steps // bands), sigma)
    assert report.epsilon == pytest.approx(expected, rel=1e-6)
  elif sampling == "poisson":
    assert report.epsilon == pytest.approx(_poisson_epsilon(B / N, steps, sigma), rel=1e-6)


Interrupt, InterruptAt = fixtures.Interrupt, fixtures.InterruptAt


def _private(sampling, noise=None, epochs=EPOCHS):
  keras.utils.set_random_seed(3)
  base = keras.Sequential([keras.Input((5,)), keras.layers.Dense(3)])
  kwargs = dict(noise_multiplier=SIGMA, delta=DELTA, batch_size=B, epochs=epochs)
  if noise is not None:
    kwargs.update(noise=noise, bands=BANDS)
  else:
    kwargs.update(sampling=sampling)
  model = tf_dpnsgd.make_private(base, **kwargs)
  model.compile(optimizer=tf_dpnsgd.DPSGD(learning_rate=0.1, l2_norm_clip=1.0), loss=LOSS)
  return model


MECHANISMS = {"bandmf": ("cyclic_poisson", "bandmf"), "blt": ("cyclic_poisson", "blt"),
              "shuffle": ("shuffle", None), "poisson": ("poisson", None),
              "uniform": ("uniform", None)}
QUICK = ("bandmf", "shuffle")


def _mechanisms():
  return [m if m in QUICK else pytest.param(m, marks=pytest.mark.slow) for m in MECHANISMS]


# --- scenario 1 and its matrix: an interrupted fit, then fit on reordered data -----------------
@pytest.mark.parametrize("mechanism", _mechanisms())
def test_an_interrupted_fit_resumed_on_reordered_data_keeps_every_examples_participation(
    mechanism):
  """Scenario 1 (BandMF, b = 4): stopped at step 5, the data reloaded in another order, fit
  again. Before the fix one example ran in two adjacent steps (reported 3.19, true 4.05)."""
  sampling, noise = MECHANISMS[mechanism]
  model = _private(sampling, noise)
  recorder = Recorder(model)
  x, y = _data()
  with pytest.raises(Interrupt):
    model.fit(x, y, verbose=0, callbacks=[InterruptAt(5)])
  assert model.privacy_ledger.steps == 5
  perm = np.random.default_rng(7).permutation(N)
  model.fit(x[perm], y[perm], verbose=0)
  assert model.privacy_ledger.steps == model.privacy_plan.num_steps
  _assert_pattern_and_epsilon(model, recorder, sampling)


@pytest.mark.parametrize("mechanism", [
    m if m in ("blt", "shuffle") else pytest.param(m, marks=pytest.mark.slow)
    for m in MECHANISMS])
def test_a_reshuffled_dataset_and_an_extended_plan_keep_every_examples_participation(
    mechanism):
  """Scenario 2 (BLT): fit on tf.data with .shuffle(N), extend_privacy_plan, fit again (a new
  order on every pass). Before the fix one example ran in steps 3, 7, 8 and 12."""
  sampling, noise = MECHANISMS[mechanism]
  model = _private(sampling, noise, epochs=1)
  recorder = Recorder(model)
  x, y = _data()
  ds = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(N, seed=None)
  model.fit(ds, verbose=0)
  model.extend_privacy_plan(epochs=2)
  if mechanism == "bandmf":  # BandMF's strategy is optimized for the plan's steps
    with pytest.raises(ValueError, match="extended to more steps"):
      model.fit(ds, verbose=0)
    return
  model.fit(ds, verbose=0)
  assert model.privacy_ledger.steps == model.privacy_plan.num_steps
  _assert_pattern_and_epsilon(model, recorder, sampling)


@pytest.mark.parametrize("mechanism", ["bandmf", pytest.param("shuffle", marks=pytest.mark.slow)])
def test_a_second_fit_on_other_data_of_the_same_size_is_refused(mechanism):
  """Edited data mid-run (same N): the partition (or this epoch's permutation) would be of
  another data set; refused before any step, weights untouched."""
  sampling, noise = MECHANISMS[mechanism]
  model = _private(sampling, noise)
  x, y = _data()
  with pytest.raises(Interrupt):
    model.fit(x, y, verbose=0, callbacks=[InterruptAt(3)])
  weights = [w.copy() for w in model.get_weights()]
  x2 = x.copy()
  x2[4, 1] += 1.0  # one example edited
  with pytest.raises(ledger_lib.LedgerMismatchError, match="other data"):
    model.fit(x2, y, verbose=0)
  assert model.privacy_ledger.steps == 3
  for a, b in zip(weights, model.get_weights()):
    np.testing.assert_array_equal(a, b)


# --- the participation matrix: every sampler x every continuation ----------------------------
def _interrupted(model, x, y, step=11, callbacks=()):
  with pytest.raises(Interrupt):
    model.fit(x, y, verbose=0, callbacks=[*callbacks, InterruptAt(step)])


def _second_fit(model, x, y, perm, tmp_path):
  model.fit(x, y, verbose=0)
  model.extend_privacy_plan(epochs=EPOCHS + 1)
  return model, lambda: model.fit(x[perm], y[perm], verbose=0)


def _backup_and_restore(model, x, y, perm, tmp_path):
  backup = keras.callbacks.BackupAndRestore(str(tmp_path / "backup"))
  _interrupted(model, x, y, callbacks=[backup])
  return model, lambda: model.fit(x[perm], y[perm], verbose=0, callbacks=[backup])


# The file continuations start from the same interrupted run (step 11) of each mechanism,
# saved on every file path ONCE (the fixture below); each case reloads and continues.
def _keras_file(folder, checkpoint, x, y, perm, mechanism):
  loaded = keras.models.load_model(folder / "m.keras")
  return loaded, lambda: loaded.fit(x[perm], y[perm], verbose=0)


def _weights_file(folder, checkpoint, x, y, perm, mechanism):
  fresh = _private(*MECHANISMS[mechanism])
  fresh.load_weights(folder / "m.weights.h5")
  return fresh, lambda: fresh.fit(x[perm], y[perm], verbose=0)


def _tf_checkpoint(folder, checkpoint, x, y, perm, mechanism):
  fresh = _private(*MECHANISMS[mechanism])
  fresh.build((None, 5))
  tf.train.Checkpoint(model=fresh).restore(checkpoint).expect_partial()
  return fresh, lambda: fresh.fit(x[perm], y[perm], verbose=0)


IN_PLACE = {"second_fit": _second_fit, "backup_and_restore": _backup_and_restore}
FROM_FILES = {"keras_file": _keras_file, "weights_file": _weights_file,
              "tf_checkpoint": _tf_checkpoint}
CONTINUATIONS = {**IN_PLACE, **FROM_FILES}


@pytest.fixture(scope="module")
def interrupted_and_saved(tmp_path_factory):
  """``interrupted_and_saved(mechanism)``: ``(once, checkpoint, recorded)``: the mechanism's
  model interrupted at step 11 and saved as ``m.keras``, ``m.weights.h5`` and a
  ``tf.train.Checkpoint`` (once per mechanism, not once per file path), and the examples its
  steps consumed (read by its :class:`Recorder`). Each case calls
  ``once.resume_after_the_save()`` (tests/matrix_fixtures.py), then reloads and continues."""
  cache = {}

  def get(mechanism):
    if mechanism not in cache:
      once = matrix_fixtures.TrainedOnce(tmp_path_factory.mktemp(f"interrupted_{mechanism}"))
      with once.training():
        model = _private(*MECHANISMS[mechanism])
        recorder = Recorder(model)
        x, y = _data()
        _interrupted(model, x, y)
        model.save(once.folder / "m.keras")
        model.save_weights(once.folder / "m.weights.h5")
        checkpoint = tf.train.Checkpoint(model=model).save(str(once.folder / "ckpt"))
      once.saved(model)
      cache[mechanism] = (once, checkpoint, dict(recorder.steps))
    return cache[mechanism]

  return get


# Continuations refused before any step, and why (every other pair must run):
REFUSED = {
    # a reloaded make_private model draws a new sampler seed: a new partition / permutation
    ("bandmf", "keras_file"): "another seed", ("blt", "keras_file"): "another seed",
    ("shuffle", "keras_file"): "another seed", ("shuffle", "weights_file"): "another seed",
    ("bandmf", "tf_checkpoint"): "another seed", ("blt", "tf_checkpoint"): "another seed",
    ("shuffle", "tf_checkpoint"): "another seed",
    # the correlated-noise buffers cannot continue a new optimizer or a rollback
    ("bandmf", "weights_file"): "buffers", ("blt", "weights_file"): "buffers",
    ("bandmf", "backup_and_restore"): "buffers", ("blt", "backup_and_restore"): "buffers",
    # BandMF's strategy is optimized for the plan's steps: an extended plan cannot continue it
    ("bandmf", "second_fit"): "extended to more steps",
}


@pytest.mark.slow
@pytest.mark.parametrize("continuation", sorted(CONTINUATIONS))
@pytest.mark.parametrize("mechanism", sorted(MECHANISMS))
def test_participation_matrix(tmp_path, interrupted_and_saved, mechanism, continuation):
  """Every sampler x every continuation on reordered data: the participation that ran (read
  from the batches) satisfies the accounting's assumption and the report's epsilon is the
  oracle's, or the continuation is refused before any step (nothing counted)."""
  sampling, noise = MECHANISMS[mechanism]
  x, y = _data()
  perm = np.random.default_rng(2).permutation(N)
  if continuation in FROM_FILES:
    once, checkpoint, recorded = interrupted_and_saved(mechanism)
    once.resume_after_the_save()
    model, resume = FROM_FILES[continuation](once.folder, checkpoint, x, y, perm, mechanism)
    # A reloaded model: record it too, from the step it is at; the steps that ran before the
    # save were recorded on the first model object.
    recorder = Recorder(model)
    recorder.steps.update(recorded)
  else:
    model = _private(sampling, noise)
    recorder = Recorder(model)
    model, resume = IN_PLACE[continuation](model, x, y, perm, tmp_path)
    assert model is recorder.model
  steps = model.privacy_ledger.steps
  reason = REFUSED.get((mechanism, continuation))
  if reason is not None:
    with pytest.raises((ledger_lib.LedgerMismatchError, ValueError), match=reason):
      resume()
    assert model.privacy_ledger.steps == steps  # refused before any step ran
    return
  resume()
  assert model.privacy_ledger.steps > steps
  if continuation in ("keras_file", "weights_file", "tf_checkpoint"):
    # Steps that ran before the save are recorded on the first model object.
    assert set(range(steps)) <= set(recorder.steps)
  _assert_pattern_and_epsilon(model, recorder, sampling)


# --- adversarial: batches that break the rule, whatever made them ------------------------
def _explicit(sampling, bands=1):
  keras.utils.set_random_seed(3)
  base = keras.Sequential([keras.Input((5,)), keras.layers.Dense(3)])
  model = tf_dpnsgd.make_private(base)
  kwargs = {"band_coefficients": list(cn.bandmf(12, bands))} if bands > 1 else {}
  model.compile(optimizer=tf_dpnsgd.DPSGD(learning_rate=0.1, l2_norm_clip=1.0,
                                          noise_multiplier=SIGMA, **kwargs), loss=LOSS)
  return model


class PositionalCyclicSampler(cs.CyclicPoissonSampler):
  """The old rule: parts over row positions (a seeded permutation of 0..N-1)."""

  def part(self, index, population=None):
    perm = np.random.default_rng([self.seed, 0xC1C2]).permutation(self.dataset_size)
    return np.sort(perm[int(index)::self.bands])


def test_batches_whose_parts_follow_positions_are_refused_after_a_reorder():
  """Scenario 1's mechanism fed through the explicit path: the first steps on the data, then
  the same sampler on reordered data; the first step whose rows belong to another part is
  refused by the host check (nothing runs, nothing is counted)."""
  x, y = _data()
  sampler = PositionalCyclicSampler(dataset_size=N, batch_size=B, bands=BANDS, seed=5)
  model = _explicit("cyclic_poisson", bands=BANDS)
  perm = np.random.default_rng(7).permutation(N)
  # Positions are not identities: after the reorder the positional parts hold other examples.
  with pytest.raises(participation.ParticipationError, match="another part"):
    model.fit(sampler.dataset(x, y), steps_per_epoch=2, epochs=1, verbose=0)
    model.fit(sampler.dataset(x[perm], y[perm], start_step=lambda: model.privacy_ledger.steps),
              steps_per_epoch=4, epochs=1, verbose=0)
  assert model.privacy_ledger.steps < 6


class PositionalShuffleSampler(sampling_lib.ShuffleSampler):
  """The old rule: each epoch a seeded permutation of row positions."""

  def permutation(self, epoch, population=None):
    return self._rng(int(epoch)).permutation(self.dataset_size)


def test_a_positional_shuffle_resumed_on_reordered_data_is_refused_mid_epoch():
  x, y = _data()
  sampler = PositionalShuffleSampler(dataset_size=N, batch_size=B, seed=5)
  model = _explicit("shuffle")
  model.fit(sampler.dataset(x, y), steps_per_epoch=4, epochs=1, verbose=0)
  perm = np.random.default_rng(7).permutation(N)
  with pytest.raises(participation.ParticipationError, match="already ran in epoch 0"):
    model.fit(sampler.dataset(x[perm], y[perm], start_step=lambda: model.privacy_ledger.steps),
              steps_per_epoch=4, epochs=1, verbose=0)
  assert model.privacy_ledger.steps < 8


def test_the_identity_tag_cannot_be_dropped():
  x, y = _data()
  sampler = sampling_lib.PoissonSampler(N, B, seed=1)
  batches = sampler.dataset(x, y).map(
      lambda xb, yb, t: (xb, yb, {k: v for k, v in t.items() if k != "dp_identity"}))
  model = _explicit("poisson")
  with pytest.raises(ValueError, match="dp_identity"):
    model.fit(batches, steps_per_epoch=1, epochs=1, verbose=0)
