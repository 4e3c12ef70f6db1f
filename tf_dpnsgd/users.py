"""User-level DP: the privacy unit is a person (one user id), however many rows they have.

Example-level DP protects one row. When one person contributes many rows (messages,
ratings, sessions), their rows together can move the model by many times the
per-example bound, and the example-level epsilon tells them only what group privacy
allows (:func:`tf_dpnsgd.accounting.group_privacy_epsilon`: ``k`` times the epsilon,
and worse in delta). User-level DP makes the user the unit:

==================  ===================================================================
part                what happens (and where)
==================  ===================================================================
identity            each row's user id (ints or strings, one per row; a missing id is
                    refused) becomes an int63 user identity (:func:`user_identities`)
bound ``k``         each user keeps at most ``k`` rows: the first ``k`` of its rows in
                    the order of a public keyed hash of their row identities
                    (:class:`UserTable`): a function of the user's own rows only, the
                    same whatever the row order, never of the other users
sampling            Poisson over the ``U`` users at ``q = B / U``: each step includes
                    each user independently (:class:`UserPoissonSampler`), with all of
                    its kept rows, laid out as ``max_users`` slots of ``k`` rows
                    (padding rows and padding slots masked)
contribution        per user slot, the gradient of the MEAN loss of the user's real
                    rows, normalized (DP-NSGD) or clipped (DP-SGD) ONCE
                    (:mod:`tf_dpnsgd.per_example.units`: the layer-wise engine where
                    the model has rules, else one user at a time); sum over users,
                    one noise draw, divided by ``B``
host checks         before each step (:mod:`tf_dpnsgd.guard`, :func:`check_user_batch`):
                    every unit holds the rows of at most one user, no user is in two
                    units, the batch's unit is the model's and the ledger's
accounting          ``PoissonSampledDpEvent(B/U, Gaussian(sigma))`` per step, add/remove
                    one user (sampling ``"user_poisson"`` of :mod:`tf_dpnsgd.accounting`)
==================  ===================================================================

Why the mean: the bound is applied to the combined gradient, so the sensitivity is ``S``
with the mean or the sum; the mean keeps its scale independent of the user's row count,
so clipping treats a user with one row and one with ``k`` alike (docs/user_level.md).

Formal guarantee: with every unit holding one user's rows and no user in two units
(checked on the host before the step), replacing, adding or removing all the rows of one
user moves the noiseless sum by at most ``S`` (add/remove) or ``2S`` (replace); the
accounted event is Poisson sampling of users at ``q = B/U``. Padding rows add exactly 0
to their user's loss (``tf.where``); a padding slot, or a user whose gradient is not
finite, contributes exactly 0.

Not covered: one person under two ids is two users; rows beyond ``k`` are never used (a
count of the private data, not released: :func:`bound_diagnostics`, NOT private); no
augmentation, multi-replica layout or correlated noise at the user level yet (refused).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import ClassVar, Optional

import numpy as np
import tensorflow as tf

from tf_dpnsgd import accounting
from tf_dpnsgd import ledger as ledger_lib
from tf_dpnsgd import participation
from tf_dpnsgd import rows as rows_lib
from tf_dpnsgd import sampling as sampling_lib
from tf_dpnsgd.sampling import PoissonOverflowError

PRIVACY_UNITS = ("example", "user")
SAMPLING = "user_poisson"
#: ``per_example`` settings with a user-level form (tf_dpnsgd.per_example.units): the
#: layer-wise engine in either mode, ``tf.vectorized_map`` over users, the per-user loop,
#: or ``auto`` (layer-wise where every layer has a rule, else the loop).
UNIT_ENGINES = ("auto", "layerwise", "two_pass", "vectorized", "microbatch")
_USER_TAG = 0x05E4  # keys user identities apart from example identities
_KEEP_KEY = 0x4B45  # the public key of the k-row selection rule
_STREAM_TAG = 0x05E9  # the sampler's NumPy stream, apart from the example samplers'


class UnitMismatchError(ledger_lib.LedgerMismatchError):
  """A batch, model, plan or ledger at one privacy unit met one at another (refused)."""


class MissingUserIdError(ValueError):
  """A row without a user id: its user could not be bounded (refused, never guessed)."""


# --- identities ---------------------------------------------------------------------
def _is_missing(value) -> bool:
  if value is None:
    return True
  if isinstance(value, (float, np.floating)) and math.isnan(value):
    return True
  return isinstance(value, (str, bytes)) and not value


def user_identities(user_ids) -> np.ndarray:
  """int63 identities of one user id per row (ints or strings; equal ids, equal identities).

  ========================  =================================================
  ids                       result
  ========================  =================================================
  ints (any int dtype)      ``mix(id)``
  strings / bytes           ``mix(hash(id))`` (63-bit FarmHash of the text)
  ``None``, NaN, ``""``     :class:`MissingUserIdError` (never a user of its own)
  floats, bools, mixtures   ``TypeError`` (say which ids are the same user)
  ========================  =================================================

  >>> a = user_identities(["ann", "bob", "ann"])
  >>> bool(a[0] == a[2]), bool(a[0] != a[1])
  (True, True)
  >>> user_identities([7, 7]).tolist() == user_identities(np.array([7, 7], np.int32)).tolist()
  True
  """
  ids = user_ids.numpy() if tf.is_tensor(user_ids) else np.asarray(user_ids)
  if ids.ndim != 1 or ids.size == 0:
    raise ValueError(f"User ids must be one id per row (a non-empty 1-D array); got shape "
                     f"{ids.shape}.")
  kind = ids.dtype.kind
  if kind == "O":
    values = ids.tolist()
    missing = [i for i, v in enumerate(values) if _is_missing(v)]
    if missing:
      raise MissingUserIdError(
          f"{len(missing)} row(s) have no user id (None, NaN or empty; first at row "
          f"{missing[0]}): user-level DP cannot bound a user it cannot name. Drop those rows "
          "or give them their real ids (a row of unknown owner is not its own user).")
    if all(isinstance(v, (str, bytes)) for v in values):
      kind, ids = "U", np.array([v.decode() if isinstance(v, bytes) else v for v in values])
    elif all(isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))
             for v in values):
      kind, ids = "i", np.array(values, np.int64)
    else:
      raise TypeError("User ids must be all integers or all strings (an int 3 and a string "
                      "'3' would be two users, or one, by accident); convert them first.")
  if kind in "US":
    if kind == "S":
      ids = np.char.decode(ids)
    empty = np.flatnonzero(np.char.str_len(ids.astype(str)) == 0)
    if empty.size:
      raise MissingUserIdError(
          f"{empty.size} row(s) have an empty user id (first at row {empty[0]}): user-level "
          "DP cannot bound a user it cannot name. Drop those rows or give their real ids.")
    words = tf.strings.to_hash_bucket_fast(tf.constant(ids.astype(str).tolist()),
                                           (1 << 63) - 1).numpy()
    return participation.mix(words, _USER_TAG + 1)
  if kind in "iu":
    return participation.mix(ids.astype(np.int64), _USER_TAG)
  if kind == "f":
    raise TypeError(f"User ids are floats ({ids.dtype}): a NaN would be a missing id and "
                    "1.0/1 the same user by accident. Give ints or strings.")
  raise TypeError(f"User ids must be integers or strings; got dtype {ids.dtype}.")


@dataclasses.dataclass(frozen=True)
class UserTable:
  """The users of a data set and the (at most ``k``) rows each one contributes.

  Attributes:
    users: int64 ``[U]``, the distinct user identities, sorted (the sampler's user order:
      a function of the set of users, not of the row order).
    rows: int64 ``[U, k]``, row positions of each user's kept rows; -1 past the user's
      last kept row.
    counts: int64 ``[U]``, every user's number of rows (a count of the private data: for
      :func:`bound_diagnostics` only, never released).

  The rule (data-independent, documented): a user's rows are ordered by
  ``mix(KEEP_KEY, row identity)`` (a public keyed hash, ties by identity) and the first
  ``k`` are kept. It depends only on that user's own rows, so adding or removing another
  user changes nothing here, and reordering the data changes nothing at all.
  """

  users: np.ndarray
  rows: np.ndarray
  counts: np.ndarray

  @classmethod
  def of(cls, user_identity, row_identity, k: int) -> "UserTable":
    """The table of rows whose user identities are ``user_identity`` ([N]) and whose row
    identities (:mod:`tf_dpnsgd.participation`, distinct) are ``row_identity``."""
    users = np.asarray(user_identity, np.int64)
    rows = np.asarray(row_identity, np.int64)
    order = np.lexsort((rows, participation.mix(rows, _KEEP_KEY), users))
    sorted_users = users[order]
    starts = np.r_[True, sorted_users[1:] != sorted_users[:-1]]
    group = np.cumsum(starts) - 1
    first = np.flatnonzero(starts)
    rank = np.arange(order.size) - first[group]
    table = np.full([first.size, int(k)], -1, np.int64)
    keep = rank < k
    table[group[keep], rank[keep]] = order[keep]
    counts = np.diff(np.r_[first, order.size]).astype(np.int64)
    return cls(sorted_users[first], table, counts)

  num_users = property(lambda self: int(self.users.size))


def kept_rows(x, y, user_ids, k: int, example_ids=None) -> np.ndarray:
  """Sorted positions of the rows user-level training at bound ``k`` draws from: each
  user's first ``k`` rows in :class:`UserTable`'s public hash order (the table the sampler
  builds, :meth:`UserPoissonSampler.table`). Example-level training on these rows alone
  gives every user at most ``k`` rows, the premise of a group-privacy statement."""
  population = participation.Population.of_data(x, y, example_ids)
  table = UserTable.of(user_identities(user_ids), population.identities, k)
  return np.sort(table.rows[table.rows >= 0])


def num_users(user_ids) -> int:
  """``U``, the number of distinct users among ``user_ids`` (one per row).

  >>> num_users([3, 1, 3])
  2
  """
  return int(np.unique(user_identities(user_ids)).size)


def bound_diagnostics(user_ids, max_examples_per_user: int) -> dict:
  """NOT PRIVATE: how the bound ``k`` cuts this data (for the data owner, never released).

  Returns ``{"users", "rows", "users_truncated", "rows_unused"}``: the number of users, of
  rows, of users with more than ``k`` rows, and of rows user-level training never uses.
  These are exact counts of the private data; publishing them is a release no epsilon
  covers.

  >>> bound_diagnostics(["a", "a", "a", "b"], 2)
  {'users': 2, 'rows': 4, 'users_truncated': 1, 'rows_unused': 1}
  """
  k = validate_max_examples_per_user(max_examples_per_user)
  _, counts = np.unique(user_identities(user_ids), return_counts=True)
  return {"users": int(counts.size), "rows": int(counts.sum()),
          "users_truncated": int(np.sum(counts > k)),
          "rows_unused": int(np.sum(np.maximum(counts - k, 0)))}


def validate_max_examples_per_user(k) -> int:
  if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
    raise ValueError(f"`max_examples_per_user` (k, the most rows of one user a step uses) "
                     f"must be an integer >= 1; got {k!r}.")
  return int(k)


def split_user_column(x, user_key):
  """``(x without its user column, the user ids)`` of dict inputs ``x``.

  The model never sees the ids. If one entry remains, it is returned itself (so
  ``{"pixels": images, "user": ids}`` feeds a single-input model); else the dict.
  """
  if not isinstance(x, dict):
    raise ValueError(
        f"User-level DP reads each row's user id from the inputs: give x as a dict with the "
        f"ids under {user_key!r} (e.g. {{'features': x, {user_key!r}: ids}}), or a dataset of "
        "such dicts; the column is removed before the model sees the inputs.")
  if user_key not in x:
    raise MissingUserIdError(f"The inputs have no user id column {user_key!r} (keys: "
                             f"{sorted(x)}); user-level DP needs one id per row.")
  rest = {k: v for k, v in x.items() if k != user_key}
  if not rest:
    raise ValueError(f"The inputs hold only the user ids ({user_key!r}); add the features.")
  ids = x[user_key]
  return (next(iter(rest.values())) if len(rest) == 1 else rest), ids


# --- the sampler --------------------------------------------------------------------
def _rows_of(structure) -> int:
  sizes = {int(np.shape(a)[0]) for a in tf.nest.flatten(structure)}
  if len(sizes) != 1:
    raise ValueError(f"All arrays must have the same number of rows; got {sorted(sizes)}.")
  return sizes.pop()


@dataclasses.dataclass(frozen=True)
class UserPoissonSampler:
  """Poisson sampling of USERS: step ``t`` includes each of the ``U`` users independently
  with ``q = B / U``, with its (at most ``k``) kept rows (:class:`UserTable`).

  The batch is ``max_users`` slots of ``k`` rows: slot ``j`` holds the ``j``-th included
  user's kept rows, then padding rows (the user's first row again, ``dp_mask`` False);
  slots past the included users are padding (row 0, masked). ``dp_user`` tags every real
  row with its user identity (-1 for padding), ``dp_denominator`` is ``B`` (public).

  Attributes:
    num_users: ``U``.
    batch_size: ``B``, the expected number of users per batch.
    max_examples_per_user: ``k``.
    seed: secret (``None``: from the OS); not in ``repr``.
    max_users: static number of user slots; ``None``: the smallest ``m`` with
      ``P(Binomial(U, q) > m) <= overflow_probability``.
    overflow_probability: per-step probability of :class:`PoissonOverflowError` (a step
      is never truncated).
    spec: keyword only, the plan's :class:`~tf_dpnsgd.accounting.AccountingSpec`.

  Formal guarantee: realises ``PoissonSampledDpEvent(B/U, Gaussian)`` over users
  (add/remove one user); a user is in at most one slot of a step, by construction
  (one slot per included user) and by the guard's check (:func:`check_user_batch`).
  """

  num_users: int
  batch_size: int
  max_examples_per_user: int
  seed: Optional[int] = dataclasses.field(default=None, repr=False)
  max_users: Optional[int] = None
  overflow_probability: float = 1e-12
  spec: Optional[accounting.AccountingSpec] = dataclasses.field(default=None, kw_only=True)

  sampling: ClassVar[str] = SAMPLING

  def __post_init__(self):
    accounting.validate_dataset_and_batch(self.num_users, self.batch_size)
    validate_max_examples_per_user(self.max_examples_per_user)
    object.__setattr__(self, "seed", sampling_lib.validated_seed(self.seed))
    object.__setattr__(self, "max_users", sampling_lib.validated_max_batch_size(
        self.max_users, self.num_users, self.sampling_rate, self.overflow_probability,
        name="max_users"))
    if self.spec is not None:
      theirs = (self.spec.sampling, self.spec.dataset_size, self.spec.batch_size)
      if theirs != (SAMPLING, self.num_users, self.batch_size):
        raise ValueError(f"`spec` accounts for (sampling, N, B) = {theirs}, but this sampler "
                         f"draws ({SAMPLING!r}, {self.num_users}, {self.batch_size}).")

  # --- accounting ---------------------------------------------------------------------
  @property
  def dataset_size(self) -> int:
    """``U``: the plan's ``N`` is the number of privacy units."""
    return self.num_users

  sampling_rate = property(lambda self: self.batch_size / self.num_users)

  @property
  def denominator(self) -> float:
    """``qU = B``, the expected number of users per batch (public)."""
    return float(self.batch_size)

  rows_per_batch = property(lambda self: self.max_users * self.max_examples_per_user)

  def accounting_spec(self) -> accounting.AccountingSpec:
    return self.spec or accounting.make_spec(self.num_users, self.batch_size, SAMPLING)

  def dp_event(self, noise_multiplier: float, steps: int = 1):
    """``steps`` compositions of ``PoissonSampledDpEvent(B/U, Gaussian(sigma))``."""
    return self.accounting_spec().composed_event(noise_multiplier, steps)

  @property
  def fingerprint(self) -> int:
    """The public fingerprint (sampling, ``U``, ``B`` and ``k``) the ledger pins."""
    return ledger_lib.sampler_fingerprint(f"{SAMPLING}/k={self.max_examples_per_user}",
                                          self.num_users, self.batch_size)

  seed_hash = property(lambda self: ledger_lib.seed_hash(self.seed))

  def seed_tag(self, population=None) -> int:
    del population  # independent steps: any seed may resume (as Poisson over examples)
    return self.seed_hash

  # --- users and rows -----------------------------------------------------------------
  def table(self, x, y, user_ids, example_ids=None) -> tuple:
    """``(UserTable, row Population)`` of the data (validated against ``U``)."""
    n = _rows_of((x, y))
    ids = user_identities(user_ids)
    if ids.size != n:
      raise ValueError(f"User ids: {ids.size} for {n} rows; give one per row.")
    population = participation.Population.of_data(x, y, example_ids)
    table = UserTable.of(ids, population.identities, self.max_examples_per_user)
    if table.num_users != self.num_users:
      raise ValueError(f"This sampler was built for U = {self.num_users} users, but the data "
                       f"holds {table.num_users}. Accounting with the wrong U is wrong "
                       "accounting.")
    return table, population

  def users(self, step: int) -> np.ndarray:
    """Sorted indices (into :attr:`UserTable.users`) of the users of step ``step``."""
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
      raise ValueError(f"`step` must be a non-negative integer; got {step!r}.")
    rng = np.random.default_rng([self.seed, _STREAM_TAG, int(step)])
    return np.flatnonzero(rng.random(self.num_users) < self.sampling_rate)

  def layout(self, step: int, table: UserTable) -> tuple:
    """``(positions, mask, users)``, each ``[max_users * k]``: the rows of step ``step``.

    Raises:
      PoissonOverflowError: more than ``max_users`` users were drawn.
    """
    chosen = self.users(step)
    if chosen.size > self.max_users:
      raise PoissonOverflowError(
          f"User-level Poisson batch of step {step} has {chosen.size} users, more than "
          f"max_users = {self.max_users}. Users are never dropped silently; raise "
          "max_batch_size (or lower overflow_probability) and resume from this step.")
    k = self.max_examples_per_user
    slots = np.full([self.max_users, k], -1, np.int64)
    slots[:chosen.size] = table.rows[chosen]
    mask = slots >= 0
    fill = np.zeros([self.max_users, 1], np.int64)  # padding slots: row 0, masked
    fill[:chosen.size, 0] = table.rows[chosen, 0]  # padding rows: the user's first row
    positions = np.where(mask, slots, fill)
    users = np.full([self.max_users, k], -1, np.int64)
    users[:chosen.size] = table.users[chosen][:, None]
    users = np.where(mask, users, -1)
    return positions.reshape(-1), mask.reshape(-1), users.reshape(-1)

  def _tags(self, step, positions, mask, users, identities, digests) -> dict:
    rows = positions.shape[0]
    fill = lambda v, d: np.full([rows], v, d)  # noqa: E731
    return {ledger_lib.DP_KIND_KEY: fill(ledger_lib.KIND_CODES[SAMPLING], np.int32),
            ledger_lib.DP_STEP_KEY: fill(step, np.int64),
            ledger_lib.DP_SAMPLER_KEY: fill(self.fingerprint, np.int64),
            ledger_lib.DP_SEED_KEY: fill(self.seed_tag(), np.int64),
            ledger_lib.DP_PERIOD_KEY: fill(0, np.int64),
            ledger_lib.DP_EXAMPLE_KEY: np.where(mask, positions, -1).astype(np.int64),
            ledger_lib.DP_IDENTITY_KEY: np.where(mask, identities[positions], -1),
            ledger_lib.DP_DIGEST_KEY: digests,
            ledger_lib.DP_MASK_KEY: mask,
            ledger_lib.DP_DENOMINATOR_KEY: fill(self.denominator, np.float32),
            ledger_lib.DP_USER_KEY: users}

  def numpy_batches(self, x, y, user_ids, start_step: int = 0, num_steps: int = 1,
                    example_ids=None):
    """Yields ``(x, y, tags)`` of steps ``start_step, ...`` as NumPy (tests, inspection)."""
    table, population = self.table(x, y, user_ids, example_ids)
    for step in range(int(start_step), int(start_step) + int(num_steps)):
      positions, mask, users = self.layout(step, table)
      xb = tf.nest.map_structure(lambda a: np.asarray(a)[positions], x)
      yb = tf.nest.map_structure(lambda a: np.asarray(a)[positions], y)
      digests = rows_lib.row_digests((xb, yb)).numpy()
      yield xb, yb, self._tags(step, positions, mask, users, population.identities, digests)

  def dataset(self, x, y, user_ids=None, start_step=0, num_steps: Optional[int] = None,
              prefetch: int = 2, num_replicas: int = 1, replica_id=None, augment=None,
              multiplicity: int = 1, example_ids=None) -> tf.data.Dataset:
    """The ``tf.data`` stream of batches from ``start_step`` on (a callable is read each
    time an iterator starts, as :meth:`tf_dpnsgd.sampling.Sampler.dataset`)."""
    if user_ids is None:
      raise MissingUserIdError("A user-level sampler needs the user id of every row "
                               "(user_ids=..., or the plan's user_key column).")
    if augment is not None or multiplicity != 1:
      raise ValueError("User-level sampling does not augment (yet): augment= and "
                       "multiplicity= are example-level. Augment the rows before fit.")
    if num_replicas != 1 or replica_id not in (None, 0):
      raise ValueError("User-level sampling runs on one replica (yet): a user's slot must "
                       "not be split across replicas. Train without a multi-replica strategy.")
    table, population = self.table(x, y, user_ids, example_ids)
    first_step = start_step if callable(start_step) else (lambda: start_step)
    rows = self.rows_per_batch
    x_t, y_t = tf.nest.map_structure(tf.convert_to_tensor, (x, y))
    identities = tf.constant(population.identities, tf.int64)
    zeros = np.zeros([rows], np.int64)
    static = self._tags(0, zeros, zeros > 0, zeros, population.identities, zeros)

    def index_stream():
      step = first_step()
      steps = itertools.count(step) if num_steps is None else range(step, step + num_steps)
      for t in steps:
        positions, mask, users = self.layout(t, table)
        yield np.int64(t), positions, mask, users

    indices = tf.data.Dataset.from_generator(
        index_stream, output_signature=(tf.TensorSpec([], tf.int64),
                                        tf.TensorSpec([rows], tf.int64),
                                        tf.TensorSpec([rows], tf.bool),
                                        tf.TensorSpec([rows], tf.int64)))

    def gather_and_tag(step, positions, mask, users):
      xb = tf.nest.map_structure(lambda t: tf.gather(t, positions), x_t)
      yb = tf.nest.map_structure(lambda t: tf.gather(t, positions), y_t)
      tags = {k: tf.constant(v) for k, v in static.items()}
      tags[ledger_lib.DP_STEP_KEY] = tf.fill([rows], step)
      tags[ledger_lib.DP_EXAMPLE_KEY] = tf.where(mask, positions, tf.constant(-1, tf.int64))
      tags[ledger_lib.DP_IDENTITY_KEY] = tf.where(mask, tf.gather(identities, positions),
                                                  tf.constant(-1, tf.int64))
      tags[ledger_lib.DP_DIGEST_KEY] = rows_lib.row_digests((xb, yb), xla=True)
      tags[ledger_lib.DP_MASK_KEY] = mask
      tags[ledger_lib.DP_USER_KEY] = users
      return xb, yb, tags

    return sampling_lib.without_autotune(indices.map(
        gather_and_tag, num_parallel_calls=1, deterministic=True).prefetch(prefetch))


# --- host checks (tf_dpnsgd.guard) --------------------------------------------------
def check_user_batch(rows_per_user: Optional[int], users, real, where: str = "this batch"
                     ) -> None:
  """Raises unless a batch's rows may run as the model's units (before the step).

  Args:
    rows_per_user: the model's ``k`` (user-level), or None/0 (example-level).
    users: the ``dp_user`` tags of all rows (int64 ``[R]``), or None if the batch has none.
    real: bool ``[R]``, the rows the step counts (``dp_mask``).

  Raises:
    UnitMismatchError: a user-level batch for an example-level model, or the reverse.
    ParticipationError: a unit holding rows of two users, a real row without a user, or
      a user in two units of one step (its contribution would be bounded twice).
  """
  if not rows_per_user:
    if users is not None:
      raise UnitMismatchError(
          f"tf_dpnsgd: {where} is user-level (each user's rows tagged with dp_user) but the "
          "model bounds each ROW: a user with k rows would move the sum by k times the "
          "bound while the plan accounts for one. Make the model private at the user level: "
          "make_private(model, privacy_unit='user', user_key=..., max_examples_per_user=k, "
          "...).")
    return
  if users is None:
    raise UnitMismatchError(
        f"tf_dpnsgd: the model bounds each USER's contribution (privacy_unit='user', k = "
        f"{rows_per_user}) but {where} carries no user tags: its rows are not laid out by "
        "user. Feed the model's own plan (a plain fit with the user_key column, or "
        "plan.dataset(x, y, model=model)).")
  k = int(rows_per_user)
  users = np.asarray(users, np.int64).reshape(-1)
  real = np.asarray(real, bool).reshape(-1)
  if users.size % k or real.size != users.size:
    raise participation.ParticipationError(
        f"tf_dpnsgd: {where} has {users.size} rows, not whole units of k = {k} rows.")
  if np.any(real & (users < 0)):
    raise participation.ParticipationError(
        f"tf_dpnsgd: {where} has a real row without a user (dp_user -1).")
  u, r = users.reshape(-1, k), real.reshape(-1, k)
  big = np.iinfo(np.int64)
  low = np.where(r, u, big.max).min(axis=1)
  high = np.where(r, u, big.min).max(axis=1)
  used = r.any(axis=1)
  if np.any(used & (low != high)):
    raise participation.ParticipationError(
        f"tf_dpnsgd: a unit of {where} holds rows of two users: their combined gradient "
        "would be bounded once for two people. Feed the plan's own batches.")
  slot_users = low[used]
  if np.unique(slot_users).size != slot_users.size:
    raise participation.ParticipationError(
        f"tf_dpnsgd: a user fills two units of {where}: their contribution would be bounded "
        "twice, doubling the sensitivity. Feed the plan's own batches.")


def check_ledger_unit(rows_per_user: Optional[int], ledger) -> None:
  """Raises :class:`UnitMismatchError` unless steps at ``rows_per_user`` (None: example) may
  continue ``ledger``: one model's ledger follows one privacy unit (and one ``k``)."""
  if not ledger.steps:
    return
  unit = "user" if rows_per_user else "example"
  if ledger.privacy_unit != unit or (rows_per_user and ledger.unit_rows not in (0, rows_per_user)):
    had = ledger.privacy_unit + (f", k = {ledger.unit_rows}" if ledger.unit_rows else "")
    now = unit + (f", k = {rows_per_user}" if rows_per_user else "")
    raise UnitMismatchError(
        f"tf_dpnsgd: the model's privacy ledger holds {ledger.steps} steps at the "
        f"{had} level, but this step would bound each {now}: a model trained at one "
        "privacy unit cannot continue at another (no accountant composes the two "
        "claims). Train a new model for the other unit.")


# --- plans and reports --------------------------------------------------------------
def validate_plan(sampling: str, max_examples_per_user, user_key, releases=()) -> None:
  """The unit fields of a :class:`~tf_dpnsgd.plan.PrivacyPlan` (raises what to do)."""
  if sampling != SAMPLING:
    if max_examples_per_user is not None or user_key is not None:
      raise ValueError(f"`max_examples_per_user` and `user_key` are user-level settings: use "
                       f"sampling={SAMPLING!r} (make_private(privacy_unit='user', ...)); got "
                       f"sampling={sampling!r}.")
    return
  validate_max_examples_per_user(max_examples_per_user)
  if user_key is not None and not isinstance(user_key, str):
    raise ValueError(f"`user_key` must be the name of the user id column; got {user_key!r}.")
  if releases:
    raise ValueError("Statistics releases (private_stats) bound one EXAMPLE each; a "
                     "user-level plan cannot compose them. Release statistics per user "
                     "first, or use no releases.")


def privacy_unit(sampling: str) -> str:
  """The unit a sampling protects.

  >>> privacy_unit("user_poisson"), privacy_unit("poisson")
  ('user', 'example')
  """
  return "user" if sampling == SAMPLING else "example"


def report_notes(plan) -> tuple:
  """What a user-level plan's report says about its unit (nothing for example-level)."""
  if plan.sampling != SAMPLING:
    return ()
  k = plan.max_examples_per_user
  return (f"User-level DP: the privacy unit is a user (user id column "
          f"{plan.user_key!r}), not a row. The epsilon holds for adding or removing ALL the "
          f"rows of one user: {plan.dataset_size} users, Poisson-sampled at q = B/U = "
          f"{plan.batch_size}/{plan.dataset_size}, each contributing at most k = {k} rows "
          "per step (the first k of its rows in a public hash order of their identities; "
          "rows beyond k are never used, and how many is not released), its mean-loss "
          "gradient bounded once.",)


def not_covered(plan) -> tuple:
  """What a user-level epsilon takes on trust (listed in the report's ``not_covered``)."""
  if plan.sampling != SAMPLING:
    return ()
  return ("User ids as given: the unit is the id, so one person under two ids is two users "
          "(each protected, not the person) and ids shared by several people protect them "
          "together only.",)


__all__ = ["MissingUserIdError", "PRIVACY_UNITS", "UnitMismatchError", "UserPoissonSampler",
           "UserTable", "bound_diagnostics", "check_ledger_unit", "check_user_batch", "kept_rows",
           "not_covered", "num_users", "privacy_unit", "report_notes", "split_user_column",
           "user_identities", "validate_max_examples_per_user", "validate_plan"]
