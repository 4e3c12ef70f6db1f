"""Who may take part in which step: each sampling's participation rule, on example identity.

A sampler's accounting assumes a *participation pattern*: which steps an
example may appear in. Poisson and fixed-size (uniform) sampling draw every
step afresh, so any example may be in any step (at most once per step).
Structured samplings do not:

==================  =======================================  ==============================
sampling            an example may take part in               checked before each step
==================  =======================================  ==============================
``shuffle``         at most one step of each epoch            no identity twice in one epoch
``cyclic_poisson``  only steps ``t`` with ``t mod b`` equal   ``part_of(identity) == t mod b``
                    to its part (so steps ``b`` apart)
==================  =======================================  ==============================

These rules must hold for the *example*, not for its position in the arrays:
data reordered, reloaded or reshuffled between two ``fit`` calls (a ``tf.data``
pipeline with ``.shuffle(N)`` yields a new order on every pass) must not move
an example to another part or into a second batch of an epoch. So every rule
here is a function of the example's **identity**:

* by default the 63-bit content digest of the example as the user gave it, before
  augmentation (:func:`tf_dpnsgd.rows.row_digests` of ``(x_i, y_i)``), with
  repeated contents told apart by their rank among equal rows
  (:func:`identities`; equal rows are interchangeable, so which copy is which
  does not matter);
* or the user's ``example_ids`` (ints or strings, one per example, distinct).

The rules (pure functions of identities and a key):

* :func:`part_of`: cyclic Poisson's part of each example, ``mix(key, id) mod b``.
  The key is the sampler's public seed tag (:meth:`tf_dpnsgd.sampling.Sampler.seed_tag`),
  so the guard recomputes the part of every row from its ``dp_identity`` tag alone.
  The partition need not be secret: the accounting (Choquette-Choo et al. 2023,
  Thm. 4) holds for any fixed partition; the Poisson draws within a part stay
  keyed by the secret seed. An example's part does not depend on the other
  examples, so adding or removing one moves no other example.
* :func:`epoch_order`: shuffling's permutation of epoch ``e``, the examples sorted
  by ``mix(secret key, e, id)``; the same multiset of examples in any order gives
  the same batches.
* :func:`multiset_digest`: an order-free digest of the data set's identities. The
  seed tag of the structured samplings includes it, and the ledger pins the seed
  tag (within an epoch for shuffling, for the whole run under cyclic Poisson):
  data changed between fits (an example added, removed or edited) is refused
  there, since the plan's partition and permutations are of one data set.

The host-side check (:class:`ParticipationCheck`, called by :mod:`tf_dpnsgd.guard`
before every step, on every row's ``dp_identity`` tag) refuses a step whose rows
break the rule, before any op runs, whatever produced the batch.

References:
  Choquette-Choo et al. (2023), "(Amplified) Banded Matrix Factorization", Thm. 4
  (cyclic Poisson / b-min-separation).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np
import tensorflow as tf

from tf_dpnsgd import rows as rows_lib
from tf_dpnsgd.ledger import LedgerMismatchError

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)
_INT63 = np.uint64((1 << 63) - 1)
_DIGEST_CHUNK = 4096  # rows digested at once (bounds the host memory of identities())


class ParticipationError(LedgerMismatchError):
  """A row would take part in a step its sampling does not allow (refused before the step)."""


def _as_u64(values) -> np.ndarray:
  return np.asarray(values).astype(np.int64).view(np.uint64)


def mix(values, key) -> np.ndarray:
  """A keyed splitmix64 finalizer of int64 ``values`` (elementwise), as int63.

  >>> bool(mix([1, 2], 7)[0] != mix([1, 2], 7)[1]), bool((mix([5], 1) != mix([5], 2))[0])
  (True, True)
  """
  with np.errstate(over="ignore"):
    z = _as_u64(values) ^ (_as_u64(np.int64(key)) * _GOLDEN)
    z = (z ^ (z >> np.uint64(30))) * _MIX1
    z = (z ^ (z >> np.uint64(27))) * _MIX2
    z = z ^ (z >> np.uint64(31))
  return (z & _INT63).astype(np.int64)


def _rank_among_equal(values: np.ndarray) -> np.ndarray:
  """For each entry, how many equal entries come before it (0 for the first copy).

  >>> _rank_among_equal(np.array([7, 3, 7, 7, 3])).tolist()
  [0, 0, 1, 2, 1]
  """
  order = np.argsort(values, kind="stable")
  sorted_values = values[order]
  starts = np.r_[True, sorted_values[1:] != sorted_values[:-1]]
  group_start = np.maximum.accumulate(np.where(starts, np.arange(values.size), 0))
  ranks = np.empty(values.size, np.int64)
  ranks[order] = np.arange(values.size) - group_start
  return ranks


def _unique_identities(digests: np.ndarray) -> np.ndarray:
  """Digests made distinct: the ``k``-th copy of a repeated content gets ``mix(digest, k)``
  (the first copy keeps its digest)."""
  ranks = _rank_among_equal(digests)
  return np.where(ranks == 0, digests, mix(digests, ranks))


def content_digests(x, y) -> np.ndarray:
  """int64 ``[N]``: :func:`tf_dpnsgd.rows.row_digests` of every example ``(x_i, y_i)``."""
  n = int(np.shape(tf.nest.flatten(x)[0])[0])
  parts = []
  for start in range(0, n, _DIGEST_CHUNK):
    piece = tf.nest.map_structure(lambda a: a[start:start + _DIGEST_CHUNK], (x, y))
    parts.append(rows_lib.row_digests(piece, xla=True).numpy())
  return np.concatenate(parts) if parts else np.zeros([0], np.int64)


def ids_to_identities(example_ids) -> np.ndarray:
  """int64 identities of the user's ``example_ids`` (ints or strings; must be distinct).

  >>> ids_to_identities([3, 1]).tolist() == ids_to_identities(np.array([3, 1])).tolist()
  True
  """
  ids = np.asarray(example_ids)
  if ids.ndim != 1:
    raise ValueError(f"`example_ids` must be one id per example (a 1-D array); got shape "
                     f"{ids.shape}.")
  if ids.dtype.kind in "US" or ids.dtype == object:
    words = tf.strings.to_hash_bucket_fast(tf.constant([str(v) for v in ids.tolist()]),
                                           (1 << 63) - 1).numpy()
  elif ids.dtype.kind in "iu":
    words = ids.astype(np.int64)
  else:
    raise TypeError(f"`example_ids` must be integers or strings; got dtype {ids.dtype}.")
  if np.unique(words).size != words.size:
    raise ValueError("`example_ids` must be distinct (one id per example): a repeated id "
                     "would make two examples one for the participation checks.")
  return mix(words, 0x1D5)


@dataclasses.dataclass(frozen=True)
class Population:
  """The examples a sampler draws from, by identity (position ``i`` holds ``identities[i]``).

  Attributes:
    identities: distinct int64 ``[N]``.
    digest: :func:`multiset_digest` of them (order-free: the data set).
    layout: a digest of them in order (the data set and its row order: what maps
      examples back to positions; samplers key their memos by it).
    digests: int64 ``[N]``, :func:`content_digests` of the examples when the
      identities were derived from them (:meth:`of_data` without ``example_ids``),
      else None. Row ``i``'s :func:`tf_dpnsgd.rows.row_digests` depends on row ``i``
      alone, so a sampler tags a row gathered from example ``i`` (not augmented) with
      ``digests[i]`` instead of digesting it again (the same value).
  """

  identities: np.ndarray
  digest: int
  layout: int
  digests: Optional[np.ndarray] = dataclasses.field(default=None, repr=False, compare=False)

  @classmethod
  def of(cls, identities, digests=None) -> "Population":
    identities = np.asarray(identities, np.int64)
    if np.unique(identities).size != identities.size:
      raise ValueError("Example identities must be distinct.")
    if digests is not None:
      digests = np.asarray(digests, np.int64)
      if digests.shape != identities.shape:
        raise ValueError(f"{digests.size} content digests for {identities.size} examples.")
    layout = hash(identities.tobytes())
    return cls(identities, multiset_digest(identities), layout, digests)

  @classmethod
  def of_data(cls, x, y, example_ids=None) -> "Population":
    """The identities of ``(x, y)``: content digests (default, kept as :attr:`digests`) or
    ``example_ids``."""
    if example_ids is None:
      digests = content_digests(x, y)
      return cls.of(_unique_identities(digests), digests)
    return cls.of(ids_to_identities(example_ids))

  @classmethod
  def of_positions(cls, n: int) -> "Population":
    """Identities ``0..N-1``: positions as identities (a sampler used without data)."""
    return cls.of(np.arange(int(n), dtype=np.int64))

  @property
  def size(self) -> int:
    return int(self.identities.size)


def multiset_digest(identities) -> int:
  """An order-free int63 digest of a set of identities.

  >>> multiset_digest([1, 2, 3]) == multiset_digest([3, 1, 2]), multiset_digest([1, 2]) == \
multiset_digest([1, 3])
  (True, False)
  """
  with np.errstate(over="ignore"):
    total = np.sum(mix(identities, 0x5E7).view(np.uint64), dtype=np.uint64)  # wraps mod 2**64
  return int(mix(np.array([total], np.uint64).view(np.int64), len(identities))[0])


def part_of(identities, key: int, bands: int) -> np.ndarray:
  """Cyclic Poisson's part (in ``[0, bands)``) of each identity under ``key``.

  >>> p = part_of(np.arange(1000), key=11, bands=4)
  >>> sorted(set(p.tolist())), bool(abs(np.bincount(p) - 250).max() < 60)
  ([0, 1, 2, 3], True)
  """
  return (mix(identities, key) % int(bands)).astype(np.int64)


def epoch_order(identities, key: int, epoch: int) -> np.ndarray:
  """Positions of ``identities`` in the order of epoch ``epoch``'s permutation (keyed by the
  secret ``key``): a function of the identities, not of their positions.

  >>> ids = np.array([10, 20, 30, 40])
  >>> a = ids[epoch_order(ids, 5, 0)]
  >>> b = ids[::-1][epoch_order(ids[::-1], 5, 0)]
  >>> a.tolist() == b.tolist()
  True
  """
  identities = np.asarray(identities, np.int64)
  epoch_key = int(mix([int(epoch)], key)[0])
  return np.lexsort((identities, mix(identities, epoch_key)))


@dataclasses.dataclass
class ParticipationCheck:
  """Host state of the per-step participation check of one model (plain Python, not saved).

  Within one process it also remembers the identities each shuffle epoch already ran
  (``seen``); across processes the pinned seed tag (the ledger) keeps the permutation,
  a pure function of the secret seed, the data set and the epoch.
  """

  seen: dict = dataclasses.field(default_factory=dict)  # (seed tag, epoch) -> set of ids

  def check(self, kind: str, step: int, period: int, key: int, identities, offset: int = 0
            ) -> Optional[tuple]:
    """Raises :class:`ParticipationError` unless every identity may run in ``step``.

    Args:
      kind: the batch's sampling (``tf_dpnsgd.ledger.KIND_NAMES``).
      step: the ledger step the batch would be.
      period: the ``dp_period`` tag: steps per epoch (shuffle) or ``b`` (cyclic Poisson).
      key: the ``dp_seed`` tag (the sampler's public seed tag).
      identities: the ``dp_identity`` tags of the batch's REAL rows (all replicas).
      offset: the batch's place in one train-function call (for the message).

    Returns:
      What :meth:`commit` records once the step ran (None: nothing to record).
    """
    ids = np.asarray(identities, np.int64).reshape(-1)
    where = f"batch {offset} of this call" if offset else "this batch"
    repeats = ids.size - np.unique(ids).size
    if repeats:
      raise ParticipationError(
          f"tf_dpnsgd: {where} holds {repeats} row(s) repeating an example (by identity): "
          "each copy adds to the sum, multiplying its sensitivity. Feed the sampler's "
          "batches unchanged (plan.dataset / make_private's fit).")
    if kind == "cyclic_poisson":
      if period < 1:
        raise ParticipationError("tf_dpnsgd: a cyclic-Poisson batch without its number of "
                                 "parts (dp_period); build batches with plan.dataset(...).")
      wrong = int(np.sum(part_of(ids, key, period) != step % period))
      if wrong:
        raise ParticipationError(
            f"tf_dpnsgd: {wrong} row(s) of {where} (step {step}) belong to another part of "
            f"cyclic Poisson sampling (b = {period}): their examples may only run in steps "
            f"t with t mod {period} equal to their part, so they would run fewer than "
            f"{period} steps apart, outside the correlated noise's sensitivity and its "
            "accounting. Feed the plan's own batches (plan.dataset(x, y, model=model), or "
            "make_private's fit), which assign parts by example identity.")
      return None
    if kind == "shuffle" and period > 0:
      epoch = step // period
      seen = self.seen.get((key, epoch), set())
      again = seen.intersection(ids.tolist())
      if again:
        raise ParticipationError(
            f"tf_dpnsgd: {len(again)} example(s) of {where} (step {step}) already ran in "
            f"epoch {epoch}: shuffle accounting counts each example at most once per epoch. "
            "Feed the plan's own batches (plan.dataset / make_private's fit), which keep one "
            "permutation of the examples per epoch whatever their order.")
      return ((key, epoch), ids)
    return None

  def commit(self, record) -> None:
    """Records what :meth:`check` returned, once the step has run."""
    if record is None:
      return
    (key, epoch), ids = record
    for old in [k for k in self.seen if k[0] == key and k[1] < epoch]:
      del self.seen[old]  # an epoch ends before the next starts: only the latest is needed
    self.seen.setdefault((key, epoch), set()).update(ids.tolist())


__all__ = ["ParticipationCheck", "ParticipationError", "Population", "content_digests",
           "epoch_order", "ids_to_identities", "mix", "multiset_digest", "part_of"]
