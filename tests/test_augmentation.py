"""Augmentation cannot break the sensitivity (issue 30, scenarios 2 and 3).

The attacks: a batch-level hook that follows each batch with an augmented copy of
its rows (tags copied along: naive augmentation multiplicity), and MixUp across rows
(rows and tags kept, contents mixed). Each is first shown to break the replace-one
bound when it does run (an untagged batch the user vouches for: the mechanism the
hook used to run), then refused through the public API, by the old hook name and
by a ``.map`` after the sampler. The per-example augmentation that replaces the
hook (``augment=``, ``multiplicity=K``) is checked against an independent loop of
single-example tapes: each example's contribution is the normalized gradient of
the mean of its K views' losses, and a replaced example moves the noiseless sum
by at most 2 (twice DP-NSGD's sensitivity 1).

Setup of the replace-one experiments: a bias-free Dense layer with zero kernel, so
every prediction is uniform and the gradient of ``x`` with label 0 is ``x (p - e_0)``:
replacing example ``J`` by ``-x_J`` flips its gradient, and the normalized
contributions differ by almost 2 (the bound, reached); an example counted twice
moves the sum by almost 4.
"""

import numpy as np
import pytest
import tensorflow as tf

import keras
import tf_dpnsgd
from tf_dpnsgd import augmentation
from tf_dpnsgd import rows as rows_lib
from tf_dpnsgd.ledger import LedgerMismatchError
from tf_dpnsgd.models import views

N, D, C = 6, 3, 2
J = 2  # the replaced example
R = 1e-3  # DP-NSGD's regularizer: contributions of norm ||g|| / (R + ||g||) < 1
LR = 1.0


def data(replaced: bool = False):
  x = np.random.default_rng(0).normal(size=(N, D)).astype(np.float32)
  x[J] = [300.0, -200.0, 100.0]
  if replaced:
    x[J] = -x[J]
  return x, np.zeros(N, np.int32)  # one label: every contribution points the same way


def plan():
  # B = N: every step holds every example, so the replaced one is always in the batch.
  return tf_dpnsgd.PrivacyPlan(dataset_size=N, batch_size=N, sampling="uniform", steps=4,
                               noise_multiplier=1.0, delta=1e-5, seed=11)


def model(multiplicity: int = 1, trust: bool = False, steps_per_execution: int = 1):
  """A zero-initialized, bias-free Dense head, on K stacked views when K > 1."""
  head = keras.Sequential([keras.Input((D,)), keras.layers.Dense(
      C, use_bias=False, kernel_initializer="zeros")])
  base, loss = head, keras.losses.SparseCategoricalCrossentropy(from_logits=True)
  if multiplicity > 1:
    base, loss = views.multi_view(head, multiplicity), views.view_mean_loss()
  private = tf_dpnsgd.make_private(base, trust_untagged_batches=trust)
  private.compile(optimizer=tf_dpnsgd.DPNSGD(learning_rate=LR, regularizer=R,
                                             noise_multiplier=0.0, seed=0), loss=loss,
                  steps_per_execution=steps_per_execution)
  return private, head


def summed_contributions(private, head, dataset, denominator=N, **fit_kwargs):
  """The noiseless sum of one step's contributions: ``(w0 - w1) * denominator / lr`` (noise
  0; the step divides the sum by ``B``, or by the rows of an untagged batch)."""
  before = head.get_weights()[0].copy()
  private.fit(dataset, epochs=1, verbose=0, **fit_kwargs)
  return (before - head.get_weights()[0]) * denominator / LR


def scale_up(x_i, y_i, seed):
  """A per-example augmentation: the example times a random factor in [1, 3)."""
  return x_i * (1.0 + 2.0 * tf.random.stateless_uniform([], seed))


# ---------------------------------------------------------------------------
# Scenarios 2 and 3: what the hook made possible, and that it is now refused.
# ---------------------------------------------------------------------------
def followed_by_augmented_copy(xb, yb, tags):
  """Scenario 2: the batch, then an augmented copy of its rows, tags copied along."""
  doubled = lambda t: tf.concat([t, t], axis=0)  # noqa: E731
  return (tf.concat([xb, 2.0 * xb], axis=0), doubled(yb),
          {k: doubled(v) for k, v in tags.items()})


def followed_by_exact_copy(xb, yb, tags):
  """Scenario 2 without changing any row: only the example identities repeat."""
  doubled = lambda t: tf.concat([t, t], axis=0)  # noqa: E731
  return doubled(xb), doubled(yb), {k: doubled(v) for k, v in tags.items()}


def mixup(xb, yb, tags):
  """Scenario 3: MixUp with the next row (rows and tags kept, contents mixed)."""
  return 0.5 * xb + 0.5 * tf.roll(xb, shift=1, axis=0), yb, tags


def untagged(transform):
  """The batch ``transform`` makes of the full data, without tags (the user vouches)."""
  def batch(x, y):
    tags = {"dp_kind": tf.zeros([N], tf.int32)}
    xb, yb, _ = transform(tf.constant(x), tf.constant(y), tags)
    return tf.data.Dataset.from_tensors((xb, yb))
  return batch


@pytest.mark.slow
@pytest.mark.parametrize("attack", [followed_by_augmented_copy, mixup])
def test_the_attacks_break_the_replace_one_bound_when_they_run(attack):
  """The oracle that makes the refusals below matter: run as the hook ran them, one replaced
  example moves the noiseless sum by about 4, twice the replace-one bound of 2."""
  moved = []
  rows = 2 * N if attack is followed_by_augmented_copy else N
  for replaced in (False, True):
    private, head = model(trust=True)
    moved.append(summed_contributions(private, head, untagged(attack)(*data(replaced)), rows))
  assert np.linalg.norm(moved[0] - moved[1]) > 3.9


@pytest.mark.parametrize("attack", [followed_by_augmented_copy, mixup])
def test_the_batch_level_hook_is_gone(attack):
  private, head = model()
  before = head.get_weights()[0].copy()
  with pytest.raises(TypeError, match="augment="):
    stream = plan().dataset(*data(), model=private,
                            transform=lambda ds, replica: ds.map(attack))
    private.fit(stream, steps_per_epoch=1, epochs=1, verbose=0)
  assert private.privacy_ledger.steps == 0
  np.testing.assert_array_equal(head.get_weights()[0], before)
  with pytest.raises(TypeError, match="unexpected"):
    plan().dataset(*data(), model=private, trnasform=None)


@pytest.mark.parametrize("attack", [followed_by_augmented_copy, followed_by_exact_copy, mixup])
def test_rows_changed_or_repeated_after_the_sampler_are_refused_before_any_step(attack):
  private, head = model()
  before = head.get_weights()[0].copy()
  stream = plan().dataset(*data(), model=private).map(attack)
  with pytest.raises(LedgerMismatchError, match="augment="):
    private.fit(stream, steps_per_epoch=1, epochs=1, verbose=0)
  assert private.privacy_ledger.steps == 0
  np.testing.assert_array_equal(head.get_weights()[0], before)


def test_a_padding_row_made_real_after_the_sampler_is_refused():
  """Poisson padding rows hold example 0 (masked); unmasking them after the sampler would add
  an example the sampler did not draw (its digest still matches: only its tag says padding)."""
  private, head = model()
  p = tf_dpnsgd.PrivacyPlan(dataset_size=N, batch_size=2, sampling="poisson", steps=4,
                            noise_multiplier=1.0, delta=1e-5, seed=2)
  assert len(p.sampler.indices(0)) < p.sampler.max_batch_size  # step 0 has padding rows
  stream = p.dataset(*data(), model=private).map(
      lambda xb, yb, tags: (xb, yb, dict(tags, dp_mask=tf.ones_like(tags["dp_mask"]))))
  with pytest.raises(LedgerMismatchError, match="padding"):
    private.fit(stream, steps_per_epoch=1, epochs=1, verbose=0)
  assert private.privacy_ledger.steps == 0


@pytest.mark.parametrize("steps_per_execution", [1, 2])
def test_a_batch_repeated_with_its_tags_is_refused(steps_per_execution):
  """A batch followed by an augmented copy of itself as the next element (flat_map), tags
  copied: the copy replays the step, within one train-function call or in the next."""
  private, _ = model(steps_per_execution=steps_per_execution)
  stream = plan().dataset(*data(), model=private).flat_map(
      lambda xb, yb, tags: tf.data.Dataset.from_tensors((xb, yb, tags)).concatenate(
          tf.data.Dataset.from_tensors((2.0 * xb, yb, tags))))
  with pytest.raises(LedgerMismatchError, match="replayed"):
    private.fit(stream, steps_per_epoch=2, epochs=1, verbose=0)
  assert private.privacy_ledger.steps == (1 if steps_per_execution == 1 else 0)


# ---------------------------------------------------------------------------
# The per-example augmentation, against single-example tapes.
# ---------------------------------------------------------------------------
def oracle_sum(head, xb, yb):
  """Independent oracle: per example, the tape gradient of the mean over its views (axis 1,
  or one view) of the cross-entropy, normalized by R + its norm; summed."""
  w = head.trainable_variables[0]
  xb = np.asarray(xb)
  if xb.ndim == 2:
    xb = xb[:, None]
  total = np.zeros(w.shape)
  for i in range(len(xb)):
    with tf.GradientTape() as tape:
      losses = [keras.losses.sparse_categorical_crossentropy(
          yb[i:i + 1], head(xb[i, k][None]), from_logits=True)[0] for k in range(xb.shape[1])]
      loss = tf.add_n(losses) / len(losses)
    g = tape.gradient(loss, w).numpy().astype(np.float64)
    total += g / (R + np.linalg.norm(g))
  return total


@pytest.mark.slow
@pytest.mark.parametrize("multiplicity", [1, 4])
def test_per_example_augmentation_keeps_the_replace_one_bound_and_matches_the_tape_loop(
    multiplicity):
  sums, batches = [], []
  for replaced in (False, True):
    private, head = model(multiplicity)
    p = plan()
    x, y = data(replaced)
    batch = next(iter(p.dataset(x, y, augment=scale_up, multiplicity=multiplicity)))
    got = summed_contributions(private, head, p.dataset(x, y, model=private, augment=scale_up,
                                                        multiplicity=multiplicity),
                               steps_per_epoch=1)
    head.set_weights([np.zeros_like(w) for w in head.get_weights()])  # the step's start
    np.testing.assert_allclose(got, oracle_sum(head, batch[0], y), rtol=1e-4, atol=1e-5)
    sums.append(got)
    batches.append(batch)
  moved = np.linalg.norm(sums[0] - sums[1])
  assert 1.9 < moved <= 2.0 + 1e-5  # the bound, reached (the test has teeth) but not crossed
  xb = batches[0][0].numpy()
  if multiplicity > 1:
    assert xb.shape == (N, multiplicity, D)
    # Each example's views are fn of that example alone, with the sampler's seeds (oracle:
    # fn called directly), distinct from each other.
    key = augmentation.augmentation_key(plan().seed)
    x, y = data()
    for i in range(N):
      for k in range(multiplicity):
        want = scale_up(x[i], y[i], augmentation.view_seed(key, 0, i, k)).numpy()
        np.testing.assert_allclose(xb[i, k], want, rtol=1e-6)
      assert len({tuple(v) for v in xb[i]}) == multiplicity


def test_augmented_rows_are_tagged_with_their_own_digest_and_example():
  """The digest tag is of the row as it left the sampler (after the augmentation), so the
  guard accepts augmented rows; padding rows of Poisson batches are masked."""
  x, y = data()
  sampler = tf_dpnsgd.sampling.PoissonSampler(N, 3, seed=4)
  for step, (xb, yb, tags) in enumerate(sampler.dataset(x, y, augment=scale_up,
                                                        multiplicity=2).take(3)):
    idx = sampler.indices(step)
    assert xb.shape[1:] == (2, D)
    np.testing.assert_array_equal(tags["dp_example"].numpy()[:len(idx)], idx)
    assert (tags["dp_example"].numpy()[len(idx):] == -1).all()  # padding
    np.testing.assert_array_equal(tags["dp_digest"].numpy(),
                                  rows_lib.row_digests((xb, yb)).numpy())
    assert not tags["dp_mask"].numpy()[len(idx):].any()


def test_augment_arguments_are_validated():
  x, y = data()
  sampler = tf_dpnsgd.sampling.UniformSampler(N, 2, seed=0)
  with pytest.raises(ValueError, match="needs `augment`"):
    sampler.dataset(x, y, multiplicity=2)
  with pytest.raises(TypeError, match="ONE"):
    sampler.dataset(x, y, augment="crop")
  with pytest.raises(ValueError, match="multiplicity"):
    sampler.dataset(x, y, augment=scale_up, multiplicity=0)


# ---------------------------------------------------------------------------
# The row digest itself.
# ---------------------------------------------------------------------------
def test_row_digest_is_per_row_and_sees_every_change():
  rng = np.random.default_rng(1)
  x = {"img": rng.normal(size=(5, 4, 4, 3)).astype(np.float32),
       "ids": rng.integers(0, 100, size=(5, 7)).astype(np.int32),
       "mask": rng.random((5, 7)) < 0.5, "half": rng.normal(size=(5, 2)).astype(np.float16)}
  y = np.arange(5, dtype=np.int64)
  d = rows_lib.row_digests((x, y)).numpy()
  assert d.dtype == np.int64 and (d >= 0).all() and len(set(d)) == 5
  # Per row: a row's digest does not depend on the other rows nor on its position.
  perm = [3, 0, 4, 1, 2]
  permuted = rows_lib.row_digests(tf.nest.map_structure(lambda a: a[perm], (x, y))).numpy()
  np.testing.assert_array_equal(permuted, d[perm])
  # One bit of one leaf changes that row's digest only.
  for leaf in ("img", "ids", "mask", "half"):
    changed = {k: v.copy() for k, v in x.items()}
    flat = changed[leaf].reshape(5, -1)
    if flat.dtype == bool:
      flat[2, 1] = ~flat[2, 1]
    else:  # the lowest bit of one element
      flat.view({2: np.uint16, 4: np.uint32}[flat.dtype.itemsize])[2, 1] ^= 1
    changed[leaf] = flat.reshape(x[leaf].shape)
    after = rows_lib.row_digests((changed, y)).numpy()
    assert after[2] != d[2], leaf
    np.testing.assert_array_equal(np.delete(after, 2), np.delete(d, 2))
  # Two values swapped within a row, and -0.0 against 0.0, are seen.
  swapped = x["ids"].copy()
  swapped[1, [0, 1]] = swapped[1, [1, 0]]
  if swapped[1, 0] != swapped[1, 1]:
    assert rows_lib.row_digests(swapped)[1] != rows_lib.row_digests(x["ids"])[1]
  zeros = np.zeros((2, 3), np.float32)
  zeros[1, 0] = -0.0
  dz = rows_lib.row_digests(zeros).numpy()
  assert dz[0] != dz[1]
  # The guard's XLA-compiled digest (large leaves) gives the same values as the pipeline's.
  big = (rng.normal(size=(4, 128, 128, 1)).astype(np.float32), y[:4])
  np.testing.assert_array_equal(rows_lib.row_digests(big, xla=True).numpy(),
                                rows_lib.row_digests(big).numpy())


def test_row_digest_of_ragged_and_string_rows_and_what_it_refuses():
  rt = tf.ragged.constant([[1, 2], [3], [1, 2]], dtype=tf.int64)
  d = rows_lib.row_digests(rt).numpy()
  assert d[0] == d[2] != d[1]
  # The boundary between rows counts: [[1, 2], [3]] is not [[1], [2, 3]].
  other = rows_lib.row_digests(tf.ragged.constant([[1], [2, 3], [1, 2]], dtype=tf.int64))
  assert other.numpy()[0] != d[0]
  nested = tf.ragged.constant([[[1, 2], [3]], [[1], [2, 3]]])
  dn = rows_lib.row_digests(nested).numpy()
  assert dn[0] != dn[1]
  s = rows_lib.row_digests(tf.constant([["a", "b"], ["b", "a"], ["a", "b"]])).numpy()
  assert s[0] == s[2] != s[1]
  with pytest.raises(TypeError, match="SparseTensor"):
    rows_lib.row_digests(tf.sparse.from_dense(tf.eye(2)))
  with pytest.raises(TypeError, match="complex"):
    rows_lib.row_digests(tf.constant([[1j]], tf.complex64))


def test_row_problems_count_only_real_rows():
  check = rows_lib.count_problems(np.array([4, 1, 4, -1, -1]),
                                  np.array([True, True, True, False, False]),
                                  np.array([True, False, True, False, False]))
  assert check == rows_lib.RowCheck(altered=1, duplicated=1)  # padding rows are not counted
  unmasked = rows_lib.count_problems(np.array([4, -1, -1]), np.ones(3, bool), np.ones(3, bool))
  assert unmasked == rows_lib.RowCheck(unmasked_padding=2)
  with pytest.raises(LedgerMismatchError, match="padding"):
    rows_lib.check_rows(unmasked)
  with pytest.raises(LedgerMismatchError, match="changed after the sampler"):
    rows_lib.check_rows(check)
  with pytest.raises(LedgerMismatchError, match="repeating an example"):
    rows_lib.check_rows(rows_lib.RowCheck(duplicated=1), offset=1)
  rows_lib.check_rows(rows_lib.RowCheck())


@pytest.mark.slow  # imports the launcher (its models)
def test_cifar10_launcher_augmentations_are_per_example():
  """The launcher's augment functions through the sampler: float32 rows, each a crop and flip
  of its own example only (oracle: example i's pixels are the values 10 i + 1 ... 10 i + 9, so
  a row's nonzero values name the examples it came from)."""
  # The launcher's augment functions live in the library (importing a launcher defines its
  # absl flags, which a pytest worker may already hold from another launcher).
  from tf_dpnsgd.data import cifar10 as launcher  # pylint: disable=import-outside-toplevel
  rng = np.random.default_rng(3)
  images = np.stack([rng.integers(10 * i + 1, 10 * i + 10, size=(8, 8, 3))
                     for i in range(N)]).astype(np.uint8)
  y = np.zeros(N, np.int32)
  sampler = tf_dpnsgd.sampling.UniformSampler(N, 4, seed=1)
  for fn in (launcher.pixels_to_float, launcher.crop_flip_to_float):
    xb, _, tags = next(iter(sampler.dataset(images, y, augment=fn)))
    assert xb.dtype == tf.float32 and xb.shape == (4, 8, 8, 3)
    for row, i in zip(xb.numpy(), tags["dp_example"].numpy()):
      values = set(np.unique(row)) - {0.0}
      assert values and values <= set(images[i].astype(np.float32).ravel()), fn.__name__
      if fn is launcher.pixels_to_float:
        np.testing.assert_array_equal(row, images[i])
