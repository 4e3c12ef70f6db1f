"""Batch samplers that name the dp-accounting event they realise.

This module is long (about 700 lines): the three samplers share one base class (index
streams, tags, the ``tf.data`` pipeline), kept in one file with the event each realises.

A privacy claim is only as good as the match between how batches were drawn
and how epsilon was computed. Each sampler here draws batches one way and
returns, from :meth:`Sampler.dp_event`, the event that
:mod:`tf_dpnsgd.accounting` accounts for exactly that way, so a sampler
cannot be paired with the wrong accountant.

==============  =========================================  ==================================
sampler         batch of step ``t``                         element fed to ``model.fit``
==============  =========================================  ==================================
PoissonSampler  each example independently w.p. ``q=B/N``   ``(x, y, tags + {dp_mask,
                                                            dp_denominator})``, padded to a
                                                            static ``max_batch_size``
UniformSampler  a uniformly random ``B``-subset, without    ``(x, y, tags)``, exactly ``B``
                replacement, fresh every step               rows
ShuffleSampler  batch ``t mod (N//B)`` of epoch             ``(x, y, tags)``, exactly ``B``
                ``t // (N//B)``'s random permutation        rows
==============  =========================================  ==================================

Every batch is tagged with its sampler's kind, its step index ``t`` and the
sampler's public fingerprint (:mod:`tf_dpnsgd.ledger`); the DP train step
refuses a batch that would not continue the model's privacy ledger (a
replayed or skipped step, another sampling), so the accounted steps are the
executed ones. Every row is tagged with its example index and a digest of
its contents (:mod:`tf_dpnsgd.rows`): rows changed or repeated after the
sampler are refused too. Augmentation runs inside the sampler, one example
at a time (``dataset(..., augment=fn, multiplicity=K)``,
:mod:`tf_dpnsgd.augmentation`).

Determinism and resumption: the batch of step ``t`` is a pure function of
``(seed, t)`` (a NumPy ``Generator`` seeded with ``[seed, tag, t]``, or
``[seed, tag, epoch]`` for the permutation), so ``dataset(x, y,
start_step=k)`` continues the stream of an interrupted run exactly; take
``k = model.privacy_ledger.steps`` from the restored model (or pass
``model=model`` to :meth:`tf_dpnsgd.plan.PrivacyPlan.dataset`).
Streams are reproducible for a fixed NumPy version (NumPy does not promise
``Generator`` streams across versions).

Within a step no example is dropped or duplicated: indices are distinct, and
a Poisson batch larger than ``max_batch_size`` raises
:class:`PoissonOverflowError` instead of being truncated (truncation would
change the mechanism; its probability per step is below
``overflow_probability``, 1e-12 by default). Shuffling uses
``N // B`` full batches per epoch; the ``N mod B`` examples left over are
a different random set each epoch (reported by :attr:`ShuffleSampler.unused_per_epoch`).

Privacy note: amplification by subsampling assumes the batch composition is
secret. Keep the sampler seed as private as the noise seed (``seed=None``
draws one from the OS).

References:
  Abadi et al. (2016), Mironov, Talwar, Zhang (2019): Poisson subsampling.
  Wang, Balle, Kasiviswanathan (2019): sampling without replacement.
  Chua et al. (2024), "How Private are DP-SGD Implementations?": shuffled
  batches vs. Poisson accounting.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import ClassVar, Iterator, Optional

import numpy as np
import tensorflow as tf
from scipy import stats

from tf_dpnsgd import accounting
from tf_dpnsgd import augmentation as augmentation_lib
from tf_dpnsgd import distribution
from tf_dpnsgd import noise as noise_lib
from tf_dpnsgd import ledger as ledger_lib
from tf_dpnsgd import participation
from tf_dpnsgd import rows as rows_lib
from tf_dpnsgd.ledger import DP_DENOMINATOR_KEY, DP_MASK_KEY

# Domain tags keep the samplers' streams apart from each other for one seed.
_TAGS = {"poisson": 0x9015, "uniform": 0x0F1E, "shuffle": 0x5F1E}


class PoissonOverflowError(RuntimeError):
  """A Poisson batch exceeded the static maximum; nothing is dropped, training stops."""


def poisson_max_batch_size(dataset_size: int, sampling_rate: float,
                           overflow_probability: float = 1e-12) -> int:
  """Smallest ``m`` with ``P(Binomial(N, q) > m) <= overflow_probability``.

  >>> poisson_max_batch_size(50000, 0.02) > 1000
  True
  """
  if not 0.0 < overflow_probability < 1.0:
    raise ValueError(f"`overflow_probability` must be in (0, 1); got {overflow_probability!r}.")
  if not 0.0 < sampling_rate <= 1.0:
    raise ValueError(f"`sampling_rate` must be in (0, 1]; got {sampling_rate!r}.")
  if sampling_rate == 1.0:
    return int(dataset_size)
  m = int(stats.binom.isf(overflow_probability, dataset_size, sampling_rate))
  m = max(0, min(m, dataset_size))
  while m < dataset_size and stats.binom.sf(m, dataset_size, sampling_rate) > overflow_probability:
    m += 1
  while m > 0 and stats.binom.sf(m - 1, dataset_size, sampling_rate) <= overflow_probability:
    m -= 1
  return max(m, 1)


def validated_seed(seed) -> int:
  """``seed`` as an int, or one drawn from the OS for ``None``; raises unless a non-negative
  integer (the samplers' secret seed)."""
  if seed is None:
    return noise_lib.random_seed()
  if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
    raise ValueError(f"`seed` must be a non-negative integer or None; got {seed!r}.")
  return int(seed)


def validated_max_batch_size(value, population: int, sampling_rate: float,
                             overflow_probability: float, name: str = "max_batch_size") -> int:
  """A Poisson sampler's static padded size: ``value``, an int in ``[1, population]``, or
  for ``None`` :func:`poisson_max_batch_size` of the population and rate."""
  if value is None:
    return poisson_max_batch_size(population, sampling_rate, overflow_probability)
  if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= population:
    raise ValueError(f"`{name}` must be an integer in [1, {population}]; got {value!r}.")
  return value


def _num_rows(a) -> int:
  """Rows of an array, tensor or ``tf.RaggedTensor`` (``np.shape`` cannot see a ragged one)."""
  if isinstance(a, tf.RaggedTensor):
    return int(a.nrows())
  return int(np.shape(a)[0])


def _as_tensor(a):
  """``a`` as a tensor; a ``tf.RaggedTensor`` stays ragged (rows of different lengths)."""
  return a if isinstance(a, tf.RaggedTensor) else tf.convert_to_tensor(a)


def _take_rows(a, idx):
  """Rows ``idx`` of a NumPy-convertible array, or of a ``tf.RaggedTensor`` (stays ragged)."""
  if isinstance(a, tf.RaggedTensor):
    return tf.gather(a, idx)
  return np.asarray(a)[idx]


def _leading_size(structure) -> int:
  sizes = {_num_rows(a) for a in tf.nest.flatten(structure)}
  if len(sizes) != 1:
    raise ValueError(
        f"All arrays must have the same number of examples; got sizes {sorted(sizes)}.")
  return sizes.pop()


@dataclasses.dataclass(frozen=True)
class Sampler:
  """Common part of the samplers (frozen, validated).

  Attributes:
    dataset_size: ``N``.
    batch_size: ``B`` (the expected batch size ``qN`` for Poisson).
    seed: non-negative int; ``None`` draws one from the OS (recorded here). Secret:
      not shown by ``repr``/``str``.
    spec: keyword only: the :class:`~tf_dpnsgd.accounting.AccountingSpec` of this
      sampler's batches (a :class:`~tf_dpnsgd.plan.PrivacyPlan` passes its own; same
      sampling, ``N``, ``B``); ``None``: :meth:`accounting_spec` builds one.
  """

  dataset_size: int
  batch_size: int
  seed: Optional[int] = dataclasses.field(default=None, repr=False)  # secret: not in repr
  spec: Optional[accounting.AccountingSpec] = dataclasses.field(default=None, kw_only=True)

  sampling: ClassVar[str] = ""

  def __post_init__(self):
    if self.sampling not in accounting.SAMPLINGS:
      raise TypeError("Use PoissonSampler, UniformSampler or ShuffleSampler (or make_sampler).")
    accounting.validate_dataset_and_batch(self.dataset_size, self.batch_size)
    object.__setattr__(self, "seed", validated_seed(self.seed))
    if self.spec is not None:
      if not isinstance(self.spec, accounting.AccountingSpec):
        raise TypeError(f"`spec` must be an AccountingSpec or None; got {self.spec!r}.")
      mine = (self.sampling, self.dataset_size, self.batch_size)
      theirs = (self.spec.sampling, self.spec.dataset_size, self.spec.batch_size)
      if mine != theirs:
        raise ValueError(f"`spec` accounts for (sampling, N, B) = {theirs}, but this sampler "
                         f"draws {mine}: the epsilon would not describe its batches.")

  # --- accounting --------------------------------------------------------
  @property
  def sampling_rate(self) -> float:
    return self.batch_size / self.dataset_size

  @property
  def neighboring_relation(self):
    return accounting.NEIGHBORING_RELATIONS[self.sampling]

  @property
  def steps_per_epoch(self) -> int:
    """``N // B`` (an epoch is nominal for Poisson and uniform sampling)."""
    return self.dataset_size // self.batch_size

  def accounting_spec(self, accountant=None, bound=None, conversion=None,
                      orders=None) -> accounting.AccountingSpec:
    """The accounting assumptions that match this sampler.

    Its :attr:`spec` (a plan's) when no argument is given; otherwise that spec
    (or, for a standalone sampler, ``accountant="rdp"``, ``bound="default"``,
    ``conversion="modern"``) with the given arguments replaced.
    """
    changes = {k: v for k, v in (("accountant", accountant), ("bound", bound),
                                 ("conversion", conversion), ("orders", orders))
               if v is not None}
    if self.spec is not None:
      return dataclasses.replace(self.spec, **changes) if changes else self.spec
    return accounting.make_spec(self.dataset_size, self.batch_size, self.sampling, **changes)

  def dp_event(self, noise_multiplier: float, steps: int = 1, accountant: Optional[str] = None):
    """The dp-accounting event of ``steps`` steps drawn by this sampler.

    The noise multiplier inside is in the convention of ``accountant``
    (default: the :attr:`spec`'s, else ``"rdp"``; see
    :meth:`tf_dpnsgd.accounting.AccountingSpec.accountant_noise_multiplier`);
    compose it into an accountant made by ``accounting_spec(...).make_accountant()``.
    """
    return self.accounting_spec(accountant).composed_event(noise_multiplier, steps)

  # --- index streams -----------------------------------------------------
  def _rng(self, counter: int) -> np.random.Generator:
    return np.random.default_rng([self.seed, _TAGS[self.sampling], int(counter)])

  def indices(self, step: int, population: Optional[participation.Population] = None
              ) -> np.ndarray:
    """Sorted distinct example indices (positions) of step ``step``: a pure function of
    the seed, the step and, for structured samplings, the examples' identities
    (``population``, :class:`tf_dpnsgd.participation.Population`; default: the positions
    ``0..N-1`` as identities, for a sampler used without data)."""
    raise NotImplementedError

  def _population(self, population) -> participation.Population:
    if population is None:
      return participation.Population.of_positions(self.dataset_size)
    if population.size != self.dataset_size:
      raise ValueError(f"This sampler was built for N = {self.dataset_size} examples, but the "
                       f"data holds {population.size}.")
    return population

  def population(self, x, y, example_ids=None) -> participation.Population:
    """The identities of the examples ``(x, y)`` (:class:`tf_dpnsgd.participation.Population`):
    their content digests, or ``example_ids`` (distinct ints or strings, one per example)."""
    self._check_data(x, y)
    return self._population(participation.Population.of_data(x, y, example_ids))

  def _check_step(self, step) -> int:
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
      raise ValueError(f"`step` must be a non-negative integer; got {step!r}.")
    return int(step)

  def _step_range(self, start_step, num_steps):
    start_step = self._check_step(start_step)
    if num_steps is None:
      return iter(_count(start_step))
    if isinstance(num_steps, bool) or not isinstance(num_steps, (int, np.integer)) \
        or num_steps < 0:
      raise ValueError(f"`num_steps` must be a non-negative integer or None; got {num_steps!r}.")
    return iter(range(start_step, start_step + int(num_steps)))

  # --- batches -----------------------------------------------------------
  def _element_indices(self, step: int, population=None):
    """``(indices, mask_or_None)`` for the element of step ``step``."""
    return self.indices(step, population), None

  def _check_data(self, x, y):
    for name, part in (("x", x), ("y", y)):
      n = _leading_size(part)
      if n != self.dataset_size:
        raise ValueError(f"This sampler was built for N = {self.dataset_size} examples, but "
                         f"`{name}` has {n}. Accounting with the wrong N is wrong accounting.")

  def numpy_batches(self, x, y, start_step: int = 0, num_steps: Optional[int] = None,
                    num_replicas: int = 1, example_ids=None) -> Iterator[tuple]:
    """Yields the batches of steps ``start_step, start_step + 1, ...`` as NumPy structures.

    ``x`` and ``y`` are arrays or nested structures of arrays with ``N`` rows.
    Infinite when ``num_steps`` is None (pass ``steps_per_epoch`` to ``fit``).
    Every tag, Poisson's ``dp_denominator`` included, has one (equal) entry per
    row, so that ``tf.distribute`` can split it with the batch. ``num_replicas``:
    see :meth:`dataset`.
    """
    population = self.population(x, y, example_ids)
    rows = self._padded_rows(num_replicas)
    for step in self._step_range(start_step, num_steps):
      idx, mask = self._replica_padded(step, rows, population)
      xb = tf.nest.map_structure(lambda a: _take_rows(a, idx), x)
      yb = tf.nest.map_structure(lambda a: _take_rows(a, idx), y)
      tags = {k: np.asarray(v) for k, v in self.tags(step, rows, population).items()}
      real = np.ones(idx.size, bool) if mask is None else mask
      tags[ledger_lib.DP_EXAMPLE_KEY] = np.where(real, idx, -1).astype(np.int64)  # padding: -1
      tags[ledger_lib.DP_IDENTITY_KEY] = np.where(real, population.identities[idx], -1)
      tags[ledger_lib.DP_DIGEST_KEY] = rows_lib.row_digests((xb, yb)).numpy()
      if mask is not None:
        # Keras' generator adapter needs rank >= 1; the train step reads element 0.
        tags[DP_MASK_KEY] = mask
        tags[DP_DENOMINATOR_KEY] = np.full([rows], self.denominator, np.float32)
      yield xb, yb, tags

  def dataset(self, x, y, start_step: int = 0, num_steps: Optional[int] = None,
              prefetch: int = 2, num_replicas: int = 1, replica_id: Optional[int] = None,
              augment=None, multiplicity: int = 1, example_ids=None) -> tf.data.Dataset:
    """A ``tf.data.Dataset`` of the batches from step ``start_step`` on (see :meth:`numpy_batches`).

    Every element has a static shape (``max_batch_size`` rows for Poisson),
    so the train function is traced once. Each iteration of the dataset
    starts again at ``start_step``: pass ``steps_per_epoch`` to ``fit`` (Keras
    then keeps one iterator across epochs), e.g. via
    :meth:`tf_dpnsgd.plan.PrivacyPlan.fit_kwargs`.

    ``num_replicas`` (``R``): the global batch (the same examples for any
    ``R``) is padded to a multiple of ``R`` rows with masked rows (index 0,
    ``dp_mask`` False: exactly zero contribution), so ``tf.distribute`` splits
    it into equal static shards; a padded uniform/shuffle batch then carries
    ``dp_mask`` and ``dp_denominator = B`` too.

    ``replica_id`` (``r`` in ``[0, R)``): only replica ``r``'s shard, rows
    ``[r P / R, (r + 1) P / R)`` of the padded global batch ``P`` (what
    ``tf.distribute`` would hand replica ``r``), gathered alone: one such
    pipeline per replica (:func:`tf_dpnsgd.distribution.per_replica_dataset`)
    replaces splitting one global pipeline. The tags and the denominator are
    the global batch's.

    ``start_step`` may be a callable returning the step, read each time an
    iterator starts (a plan passes the model's ledger step: a ``fit`` after
    a restore, e.g. ``BackupAndRestore``, continues where the ledger is).

    ``augment``: ``fn(x_i, y_i, seed) -> x_i'``, applied to each row alone before
    the rows are batched and tagged; ``multiplicity=K``: ``K`` views of each
    example on a new axis 1 (see :mod:`tf_dpnsgd.augmentation`).

    Participation is by example identity (:mod:`tf_dpnsgd.participation`): the content
    digest of each ``(x_i, y_i)``, or ``example_ids`` (distinct ints or strings, one per
    example). The same examples in another order give the same batches (shuffling's
    permutations and cyclic Poisson's parts are of the examples, not of positions); every
    row is tagged with its identity (``dp_identity``) for the guard's check.
    """
    aug = augmentation_lib.make(augment, multiplicity)
    population = self.population(x, y, example_ids)
    first_step = start_step if callable(start_step) else (lambda: start_step)
    self._step_range(first_step(), num_steps)  # validates now rather than inside tf.data
    x_t = tf.nest.map_structure(_as_tensor, x)
    y_t = tf.nest.map_structure(_as_tensor, y)
    padded = self._padded_rows(num_replicas)
    shard = _shard_rows(padded, num_replicas, replica_id)
    rows = shard.stop - shard.start

    def one(step):
      idx, mask = self._replica_padded(step, padded, population)
      mask = np.ones(padded, bool) if mask is None else mask
      return step, idx[shard].astype(np.int64), mask[shard]

    def index_stream():
      # Every iteration of the dataset restarts at `start_step` (deterministic), so a peek
      # by Keras does not consume steps; `fit` keeps one iterator when `steps_per_epoch` is set.
      # Steps come in blocks of up to STEPS_PER_BLOCK (one Python call each, unbatched in
      # tf.data); a step that raises (Poisson overflow) ends its block after the steps
      # before it, then raises on the next call, exactly where a step-by-step stream would.
      steps = self._step_range(first_step(), num_steps)
      while True:
        block, error = [], None
        for step in itertools.islice(steps, STEPS_PER_BLOCK):
          try:
            block.append(one(step))
          except PoissonOverflowError as e:
            error = e
            break
        if block:
          yield (np.array([b[0] for b in block], np.int64), np.stack([b[1] for b in block]),
                 np.stack([b[2] for b in block]))
        if error is not None:
          raise error
        if len(block) < STEPS_PER_BLOCK:
          return

    indices = tf.data.Dataset.from_generator(
        index_stream, output_signature=(tf.TensorSpec([None], tf.int64),
                                        tf.TensorSpec([None, rows], tf.int64),
                                        tf.TensorSpec([None, rows], tf.bool))).unbatch()
    with_mask = isinstance(self, PoissonSampler) or padded != self._rows_per_element
    denominator = float(self.denominator) if with_mask else None

    kind = ledger_lib.KIND_CODES[self.sampling]
    fingerprint = self.fingerprint
    seed_tag = self.seed_tag(population)
    period = self.tag_period
    identities = tf.constant(population.identities, tf.int64)

    # Traced by tf.data on every call (every fit) without AutoGraph: their Python control
    # flow is on static values only (a tensor in an `if` would raise while tracing, never
    # change the graph), and AutoGraph's conversion cost about a third of the trace.
    def tags_of(step, idx, mask, digests):
      tags = {ledger_lib.DP_KIND_KEY: tf.fill([rows], tf.constant(kind, tf.int32)),
              ledger_lib.DP_STEP_KEY: tf.fill([rows], step),
              ledger_lib.DP_SAMPLER_KEY: tf.fill([rows], tf.constant(fingerprint, tf.int64)),
              ledger_lib.DP_SEED_KEY: tf.fill([rows], tf.constant(seed_tag, tf.int64)),
              ledger_lib.DP_PERIOD_KEY: tf.fill([rows], tf.constant(period, tf.int64)),
              ledger_lib.DP_EXAMPLE_KEY: tf.where(mask, idx, tf.constant(-1, tf.int64)),
              ledger_lib.DP_IDENTITY_KEY: tf.where(mask, tf.gather(identities, idx),
                                                   tf.constant(-1, tf.int64)),
              ledger_lib.DP_DIGEST_KEY: digests}
      if with_mask:
        tags[DP_MASK_KEY] = mask
        # Per row (all equal), so that tf.distribute can split it with the batch.
        tags[DP_DENOMINATOR_KEY] = tf.fill([rows], tf.constant(denominator, tf.float32))
      return tags

    if aug is None:
      # Rows leave the sampler as the examples themselves: a row's digest is its example's
      # content digest, already computed for the population (row_digests depends on the
      # row alone), so it is gathered, not recomputed; the guard still recomputes it from
      # the batch it receives. With example_ids there are none: digested here.
      table = None if population.digests is None else tf.constant(population.digests,
                                                                   tf.int64)

      @tf.autograph.experimental.do_not_convert
      def batch(step, idx, mask):
        xb = tf.nest.map_structure(lambda t: tf.gather(t, idx), x_t)
        yb = tf.nest.map_structure(lambda t: tf.gather(t, idx), y_t)
        digests = (rows_lib.row_digests((xb, yb), xla=True) if table is None
                   else tf.gather(table, idx))
        return xb, yb, tags_of(step, idx, mask, digests)

      batches = indices.map(batch, num_parallel_calls=1, deterministic=True)
    else:
      @tf.autograph.experimental.do_not_convert
      def tag(step, idx, mask, xb, yb):  # the rows as augmented: digested here
        return xb, yb, tags_of(step, idx, mask, rows_lib.row_digests((xb, yb), xla=True))

      batches = augmentation_lib.per_example_batches(
          indices, x_t, y_t, rows, aug, augmentation_lib.augmentation_key(self.seed))
      batches = batches.map(tag, num_parallel_calls=1, deterministic=True)
    batches = batches.prefetch(prefetch)
    return batches if aug is not None else without_autotune(batches)  # augment: AUTOTUNE

  @property
  def _rows_per_element(self) -> int:
    return self.batch_size

  def _padded_rows(self, num_replicas) -> int:
    return distribution.padded_rows(self._rows_per_element, num_replicas)

  def _replica_padded(self, step: int, rows: int, population=None):
    """:meth:`_element_indices` padded to ``rows`` (padding: index 0, mask False)."""
    idx, mask = self._element_indices(step, population)
    extra = rows - idx.size
    if extra == 0:
      return idx, mask
    mask = np.ones(idx.size, bool) if mask is None else mask
    return (np.concatenate([idx, np.zeros(extra, idx.dtype)]),
            np.concatenate([mask, np.zeros(extra, bool)]))

  @property
  def fingerprint(self) -> int:
    """:func:`tf_dpnsgd.ledger.sampler_fingerprint` of this sampler (public fields only)."""
    return ledger_lib.sampler_fingerprint(self.sampling, self.dataset_size, self.batch_size)

  @property
  def seed_hash(self) -> int:
    """:func:`tf_dpnsgd.ledger.seed_hash` of the secret seed (the ledger keeps the hash)."""
    return ledger_lib.seed_hash(self.seed)

  def seed_tag(self, population=None) -> int:
    """The public ``dp_seed`` tag of this sampler's batches over ``population``: the seed
    hash, and for a structured sampling (:attr:`structured`) the data set's
    :func:`~tf_dpnsgd.participation.multiset_digest` too, so that the ledger, which pins
    the tag (:func:`tf_dpnsgd.ledger.seed_must_match`), refuses other data as it refuses
    another seed. The tag is saved with the ledger; the digest enters it only mixed with
    the hash of the secret seed, so without the seed it says nothing about the data. With a
    user-fixed guessable seed, a holder of a saved model could test whether a candidate
    data set is exactly the training set, as it could reproduce the sampling itself: leave
    ``seed=None`` (63 bits from the OS) for anything released."""
    if not self.structured:
      return self.seed_hash
    digest = self._population(population).digest
    return max(int(participation.mix([self.seed_hash], digest)[0]), 1)

  @property
  def structured(self) -> bool:
    """Whether participation is structured (an example's steps depend on the others'):
    shuffling and cyclic Poisson; Poisson and uniform steps are independent draws."""
    return False

  @property
  def tag_period(self) -> int:
    """Steps per epoch for shuffling (the ledger lets a new seed start only a new epoch), else 0."""
    return self.steps_per_epoch if self.sampling == "shuffle" else 0

  def tags(self, step: int, rows: int, population=None) -> dict:
    """The per-row step tags of step ``step``'s batch (see :mod:`tf_dpnsgd.ledger`; the row
    identity tags, ``dp_example``, ``dp_identity`` and ``dp_digest``, depend on the rows)."""
    return {ledger_lib.DP_KIND_KEY: np.full([rows], ledger_lib.KIND_CODES[self.sampling],
                                            np.int32),
            ledger_lib.DP_STEP_KEY: np.full([rows], step, np.int64),
            ledger_lib.DP_SAMPLER_KEY: np.full([rows], self.fingerprint, np.int64),
            ledger_lib.DP_SEED_KEY: np.full([rows], self.seed_tag(population), np.int64),
            ledger_lib.DP_PERIOD_KEY: np.full([rows], self.tag_period, np.int64)}

  @property
  def denominator(self) -> float:
    """What the noised sum is divided by: ``B`` (``qN`` for Poisson)."""
    return float(self.batch_size)


def without_autotune(dataset: tf.data.Dataset) -> tf.data.Dataset:
  """``dataset`` with tf.data's autotuning off (the same elements in the same order).

  For a sampler's pipeline whose parallelism and buffers are all fixed (one map call at a
  time, ``prefetch`` elements): there is nothing to tune, but with autotuning on, dropping
  its iterator at the end of every ``fit`` waited for tf.data's autotuning thread (0.1 s
  to 4 s on 2 shared cores, at ~4 ms of CPU; ~1 ms with it off: benchmarks/fit_fixed_cost.py). A
  stage with ``tf.data.AUTOTUNE`` chained after it runs at tf.data's default parallelism
  unless the caller turns autotuning on again (``with_options``).

  tf.data's default static rewrites are off too: they only restructure a pipeline (fuse
  or parallelise maps, drop no-op stages), never change its elements, and this one has
  nothing for them to do, but they cost ~10 ms of CPU at every iterator (every ``fit``).
  """
  options = tf.data.Options()
  options.autotune.enabled = False
  options.experimental_optimization.apply_default_optimizations = False
  return dataset.with_options(options)


#: Steps whose indices one call of the dataset's Python generator draws (fewer Python
#: calls per step: the per-replica pipelines of a strategy each run one generator).
STEPS_PER_BLOCK = 8


def _shard_rows(padded: int, num_replicas: int, replica_id: Optional[int]) -> slice:
  """Rows of the padded global batch that replica ``replica_id`` trains on (all if None).

  >>> _shard_rows(8, 2, 1), _shard_rows(8, 2, None)
  (slice(4, 8, None), slice(0, 8, None))
  """
  if replica_id is None:
    return slice(0, padded)
  if isinstance(replica_id, bool) or not isinstance(replica_id, (int, np.integer)) \
      or not 0 <= replica_id < num_replicas:
    raise ValueError(f"`replica_id` must be an integer in [0, num_replicas={num_replicas}); "
                     f"got {replica_id!r}.")
  per = padded // num_replicas
  return slice(int(replica_id) * per, (int(replica_id) + 1) * per)


def _count(start):
  step = start
  while True:
    yield step
    step += 1


@dataclasses.dataclass(frozen=True)
class PoissonSampler(Sampler):
  """Poisson sampling: step ``t`` includes each example independently with ``q = B / N``.

  Batches are padded to the static ``max_batch_size`` (padding rows repeat
  index 0 and carry ``dp_mask = False``; the DP train step gives them exactly
  zero weight) and the noised sum is divided by the expected batch size
  ``qN`` (``dp_denominator``), a data-independent constant, so the division
  is post-processing.

  Attributes:
    max_batch_size: static padded size; ``None`` picks the smallest ``m`` with
      ``P(Binomial(N, q) > m) <= overflow_probability``.
    overflow_probability: per-step probability of :class:`PoissonOverflowError`.

  Formal guarantee: realises ``PoissonSampledDpEvent(q, Gaussian)`` under
  add/remove-one neighbours; a batch that does not fit raises (it is never
  truncated or split).
  """

  max_batch_size: Optional[int] = None
  overflow_probability: float = 1e-12

  sampling: ClassVar[str] = "poisson"

  def __post_init__(self):
    super().__post_init__()
    object.__setattr__(self, "max_batch_size", validated_max_batch_size(
        self.max_batch_size, self.dataset_size, self.sampling_rate, self.overflow_probability))

  @property
  def denominator(self) -> float:
    """``qN``, the expected batch size."""
    return self.sampling_rate * self.dataset_size

  @property
  def _rows_per_element(self) -> int:
    return self.max_batch_size

  def indices(self, step: int, population=None) -> np.ndarray:
    step = self._check_step(step)
    include = self._rng(step).random(self.dataset_size) < self.sampling_rate
    return np.flatnonzero(include)

  def padded_indices(self, step: int, population=None) -> tuple[np.ndarray, np.ndarray]:
    """``(indices[max_batch_size], mask[max_batch_size])``; padding is index 0, mask False.

    Raises:
      PoissonOverflowError: the batch has more than ``max_batch_size`` examples.
    """
    idx = self.indices(step, population)
    if idx.size > self.max_batch_size:
      raise PoissonOverflowError(
          f"Poisson batch of step {step} has {idx.size} examples, more than max_batch_size "
          f"= {self.max_batch_size}. Examples are never dropped silently; raise "
          "max_batch_size (or lower overflow_probability) and resume from this step.")
    padded = np.zeros(self.max_batch_size, np.int64)
    padded[:idx.size] = idx
    mask = np.zeros(self.max_batch_size, bool)
    mask[:idx.size] = True
    return padded, mask

  def _element_indices(self, step: int, population=None):
    return self.padded_indices(step, population)


@dataclasses.dataclass(frozen=True)
class UniformSampler(Sampler):
  """Fixed-size sampling without replacement: every step a fresh uniform ``B``-subset.

  Formal guarantee: realises ``SampledWithoutReplacementDpEvent(N, B,
  Gaussian)`` under replace-one neighbours (see :mod:`tf_dpnsgd.accounting`
  for the factor 2 in the sensitivity).
  """

  sampling: ClassVar[str] = "uniform"

  def indices(self, step: int, population=None) -> np.ndarray:
    step = self._check_step(step)
    return np.sort(self._rng(step).choice(self.dataset_size, self.batch_size, replace=False))


@dataclasses.dataclass(frozen=True)
class ShuffleSampler(Sampler):
  """Epoch permutations cut into ``N // B`` disjoint batches (what ``model.fit`` does).

  No amplification by subsampling is proven for this order; the accountant
  counts each epoch as one full-batch Gaussian mechanism under replace-one.
  """

  sampling: ClassVar[str] = "shuffle"

  @property
  def unused_per_epoch(self) -> int:
    """``N mod B`` examples (a random set, new every epoch) are not in any batch of an epoch."""
    return self.dataset_size % self.batch_size

  @property
  def structured(self) -> bool:
    return True

  def permutation(self, epoch: int, population=None) -> np.ndarray:
    """Positions in epoch ``epoch``'s order: the examples sorted by a hash of the secret
    seed, the epoch and their identity (:func:`tf_dpnsgd.participation.epoch_order`), so
    the same examples in another order are the same permutation of examples."""
    population = self._population(population)
    key = int(participation.mix([self.seed], _TAGS[self.sampling])[0])
    return participation.epoch_order(population.identities, key, self._check_step(epoch))

  def indices(self, step: int, population=None) -> np.ndarray:
    step = self._check_step(step)
    epoch, position = divmod(step, self.steps_per_epoch)
    perm = self._cached_permutation(epoch, self._population(population))
    return np.sort(perm[position * self.batch_size:(position + 1) * self.batch_size])

  def _cached_permutation(self, epoch: int, population) -> np.ndarray:
    cache = self.__dict__.get("_perm_cache")
    if cache is None or cache[:2] != (epoch, population.layout):
      cache = (epoch, population.layout, self.permutation(epoch, population))
      self.__dict__["_perm_cache"] = cache  # a memo of a pure function; the sampler stays frozen
    return cache[2]


SAMPLERS = {cls.sampling: cls for cls in (PoissonSampler, UniformSampler, ShuffleSampler)}


def make_sampler(sampling: str, dataset_size: int, batch_size: int, seed: Optional[int] = None,
                 **kwargs) -> Sampler:
  """The sampler for ``sampling`` (``"poisson"``, ``"uniform"`` or ``"shuffle"``)."""
  if sampling not in SAMPLERS:
    raise ValueError(f"`sampling` must be one of {tuple(SAMPLERS)}; got {sampling!r}.")
  return SAMPLERS[sampling](dataset_size=dataset_size, batch_size=batch_size, seed=seed, **kwargs)


__all__ = ["PoissonOverflowError", "PoissonSampler", "SAMPLERS", "Sampler", "ShuffleSampler",
           "UniformSampler", "make_sampler", "poisson_max_batch_size", "validated_max_batch_size",
           "validated_seed"]
