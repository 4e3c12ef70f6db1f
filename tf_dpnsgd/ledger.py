"""The privacy ledger: what the DP train step actually executed, bound to the weights.

This module is long (about 800 lines, a third of it docstrings): the ledger's
entries, its save hooks, its forward-only restore rule and its host checks are one
unit of state and must be read together.

An accountant turns a description of the run (how batches were drawn, how
many steps, which noise) into epsilon. That epsilon describes the training
only if the description is what ran. The ledger is the record of what ran,
written by the train step itself and nowhere else:

=========================  ==================================================
entry                      meaning
=========================  ==================================================
``steps``                  private steps this lineage executed (one noise
                           draw each); never decreases (see "Forward only")
``kind``                   the kind of batch every step consumed (one kind per
                           ledger): ``poisson``, ``uniform``, ``shuffle``
                           (tagged by :mod:`tf_dpnsgd.sampling`) or
                           ``untagged`` (drawn by Keras from in-memory arrays,
                           or user batches the user vouched for)
``sampler``                public fingerprint of the sampler (kind, ``N``, ``B``)
``sampler_seed_hash``      a hash of the sampler's secret seed
``user_seeded_steps``      steps whose noise came from a user-fixed seed
``min_noise_multiplier``   smallest noise multiplier any step used
``noise_generation``       restores that rolled the ledger back (each one moves
                           the noise to a fresh stream)
``lineage``                a random id naming this ledger's history
``flags``                  assumptions outside the Gaussian mechanism
                           (:mod:`tf_dpnsgd.coverage`)
``trainable_*``            what the DP step updates: a digest of the shapes and
                           dtypes of the trainable variables (names excluded: a
                           rebuilt model renames them), their count and size;
                           written by every step, checked by the guard
                           (:func:`trainable_signature`)
``privacy_unit``           what one step's contribution bound protects:
                           ``example`` (or a microbatch) or ``user`` (all rows
                           of one user id, :mod:`tf_dpnsgd.users`), with
                           ``unit_rows`` (``k``, a user's most rows per step);
                           written by every step, a model at one unit is
                           refused at the other (:mod:`tf_dpnsgd.guard`)
``adaptive_steps``         steps that also released quantile-adaptive
                           clipping's noised count (Andrew et al. 2021); with
                           ``min_clipped_count_stddev`` (the smallest count
                           noise they used), ``l2_norm_clip`` (the clip after
                           the last of them) and its settings
                           (``initial_l2_norm_clip``,
                           ``target_unclipped_quantile``, ``clip_learning_rate``)
=========================  ==================================================

Where it lives (the mechanism). The ledger is a Keras saveable object that
is NOT part of the model's weight list: ``get_weights``/``set_weights``
between a private model and its plain twin, and ``load_weights`` of a plain
checkpoint (a warm start), work as for any Keras model. It still travels
with the weights through every save path: Keras' saving walks the model's
attributes, so ``save``/``.keras``/``save_weights``/``load_weights``,
``ModelCheckpoint`` and ``BackupAndRestore`` carry it (its own
``save_own_variables``/``load_own_variables``), and the DP model exposes it
to ``tf.train.Checkpoint``. :func:`tf_dpnsgd.make_private` keeps it on the
wrapped Keras model too, so a second ``make_private`` of the same model
continues it, and records the trained weights' fingerprint on this machine
(:mod:`tf_dpnsgd.lineage`) so weights reloaded without it get it back.

Forward only. Every check runs on the host, before the step, in
:mod:`tf_dpnsgd.guard` (never as an in-graph assertion, which XLA removes).
A restore that would move the ledger back below the steps its lineage
already executed (``load_weights`` of an older checkpoint, ``BackupAndRestore``
after an interrupted ``fit``, ``tf.train.Checkpoint.restore``, in this process
or, through the lineage record, in another one on this machine) keeps the
executed count, merges the conservative values (smallest noise, all flags)
and increments ``noise_generation``: the noise of step ``t`` is keyed by
``(key, lineage, generation, t)``, so a rolled-back run never draws the same
noise twice.

Batch tags. A sampler's batch is ``(x, y, tags)`` with ``tags`` a dict of
per-row tensors (per row so that ``tf.distribute`` can split them):
``dp_kind`` (:data:`KIND_CODES`), ``dp_step`` (the sampler's step ``t``),
``dp_sampler`` (:func:`sampler_fingerprint`), ``dp_seed``
(:meth:`tf_dpnsgd.sampling.Sampler.seed_tag`: :func:`seed_hash` of the sampler
seed, with the data set's identity digest for shuffling and cyclic Poisson),
``dp_period`` (steps per epoch of a shuffle sampler, ``b`` for cyclic Poisson, 0
otherwise), ``dp_example`` (the row's example index), ``dp_identity`` (the
example's identity, :mod:`tf_dpnsgd.participation`) and ``dp_digest`` (its content
digest, :mod:`tf_dpnsgd.rows`); Poisson only (and padded batches): ``dp_mask`` and
``dp_denominator``.

Formal guarantee of the host checks (:meth:`PrivacyLedger.check_batch`): a
step runs only if

1. its kind equals the ledger's kind (once one step ran) and the kind the
   plan expects (once a :class:`~tf_dpnsgd.callbacks.PrivacyCallback`
   announced it with :meth:`PrivacyLedger.expect`);
2. tagged batches: every row's ``dp_step`` equals ``steps`` (no replay, no
   skip), the sampler fingerprint equals the ledger's, and, for ``shuffle``
   batches within an epoch, the sampler seed hash equals the ledger's (a new
   seed would be a new permutation: examples twice in one epoch; a new epoch
   may start with a new seed), and for ``cyclic_poisson`` batches after step 0
   too (a new seed would be a new partition for the rest of the run:
   :func:`seed_must_match`). Poisson and uniform steps
   are independent draws whatever the seed, so a resume with a fresh seed is
   accepted there;
3. untagged batches: only from in-memory arrays that Keras itself batches
   (each example at most once per batch), or when the model was built with
   ``trust_untagged_batches=True`` (then recorded in ``flags`` and listed by
   the report as an unverified assumption).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import weakref
from typing import Optional

import keras
import numpy as np
import tensorflow as tf

from tf_dpnsgd import lineage as lineage_lib

# --- batch keys (the samplers write them, the train step reads them) ---------
DP_MASK_KEY = "dp_mask"
DP_DENOMINATOR_KEY = "dp_denominator"
DP_KIND_KEY = "dp_kind"
DP_STEP_KEY = "dp_step"
DP_SAMPLER_KEY = "dp_sampler"
DP_SEED_KEY = "dp_seed"
DP_PERIOD_KEY = "dp_period"
DP_EXAMPLE_KEY = "dp_example"
DP_DIGEST_KEY = "dp_digest"  # row content, checked by the guard (tf_dpnsgd.rows)
DP_IDENTITY_KEY = "dp_identity"  # the example's identity (tf_dpnsgd.participation)
DP_USER_KEY = "dp_user"  # user-level batches only: the row's user identity (tf_dpnsgd.users)
TAG_KEYS = (DP_KIND_KEY, DP_STEP_KEY, DP_SAMPLER_KEY, DP_SEED_KEY, DP_PERIOD_KEY,
            DP_EXAMPLE_KEY, DP_DIGEST_KEY, DP_IDENTITY_KEY)
BATCH_KEYS = (DP_MASK_KEY, DP_DENOMINATOR_KEY, DP_USER_KEY) + TAG_KEYS

UNTAGGED = "untagged"
KIND_CODES = {"poisson": 1, "uniform": 2, "shuffle": 3, UNTAGGED: 4, "cyclic_poisson": 5,
              "user_poisson": 6}
# The privacy unit of the steps (``privacy_unit`` entry): an example (or a microbatch of
# examples), or a user's rows (tf_dpnsgd.users); 0: no step yet, or a ledger written before
# the entry existed (whose steps were all example-level).
UNIT_CODES = {"example": 1, "user": 2}
UNIT_NAMES = {v: k for k, v in UNIT_CODES.items()}
KIND_NAMES = {v: k for k, v in KIND_CODES.items()}
_LEDGER_NAME = "dp_privacy_ledger"
# Quantile-adaptive clipping: what its steps released, recorded by the step (the report
# reads it here, never from the optimizer).
ADAPTIVE_FIELDS = ("adaptive_steps", "min_clipped_count_stddev", "l2_norm_clip",
                   "initial_l2_norm_clip", "target_unclipped_quantile", "clip_learning_rate")
# Statistics releases are kept one by one (an event each, in the order they ran), never as a
# count and a minimum: a plan is checked against exactly these events.
MAX_RELEASES = 64
RELEASE_FIELD = "release_noise_multipliers"
WARM_START_FIELD = "warm_start_source"  # utf-8 bytes of the last file loaded without a ledger
_SOURCE_BYTES = 256
_FIELDS = ("steps", "kind", "expected_kind", "sampler", "sampler_seed_hash", "user_seeded_steps",
           "min_noise_multiplier", "noise_generation", "lineage", "flags", "releases",
           RELEASE_FIELD, WARM_START_FIELD, "noise_bands", "trainable_digest",
           "trainable_count", "trainable_size", "privacy_unit", "unit_rows") + ADAPTIVE_FIELDS
_MIN_FIELDS = ("min_noise_multiplier",)  # start at +inf
_BATCH_CHECK_FIELDS = ("steps", "kind", "expected_kind", "sampler", "sampler_seed_hash")
_SHAPES = {RELEASE_FIELD: (MAX_RELEASES,), WARM_START_FIELD: (_SOURCE_BYTES,)}
_OLD_FIELDS = ("steps", "kind", "expected_kind", "sampler", "user_seeded_steps",
               "min_noise_multiplier")  # files written before the seed hash existed
# In-process high-water marks, lineage -> (steps, state): a rollback of ANY ledger object of
# a lineage (two models loaded from one file) is seen, not only of the one that trained.
_PROCESS_REACHED: dict = {}

_log = logging.getLogger(__name__)


def host_value(variable) -> np.ndarray:
  """A Keras variable's current value on the host, by one ``ReadVariableOp``.

  Keras' ``variable.numpy()`` reads through its own dispatch, a second read and an
  identity: 2.7x the time (about 30 us a variable, measured 2026-11-29), and the guard reads
  the ledger's 25 variables three times before each step, 45% of a small model's fit
  (issue 47). The value is the same array. A distributed variable (no single handle outside
  a replica context) and anything not a plain ``tf.Variable`` underneath are read Keras' way.

  >>> v = keras.Variable(np.array([1, 2], np.int64))
  >>> host_value(v).tolist(), host_value(v).dtype
  ([1, 2], dtype('int64'))
  """
  backend_variable = getattr(variable, "value", None)
  if (isinstance(backend_variable, tf.Variable)
      and not isinstance(backend_variable, tf.distribute.DistributedValues)):
    return np.asarray(tf.raw_ops.ReadVariableOp(resource=backend_variable.handle,
                                                dtype=backend_variable.dtype).numpy())
  return np.asarray(variable.numpy())


def _python_value(value: np.ndarray):
  """A ledger entry's array as Python: an int or a float, or a list of them."""
  cast = float if value.dtype.kind == "f" else int
  return [cast(a) for a in value] if value.ndim else cast(value)


class LedgerMismatchError(ValueError):
  """The ledger (what ran) does not match the plan or the batch (what would be reported)."""


def sampler_fingerprint(sampling: str, dataset_size: int, batch_size: int) -> int:
  """A positive int63 naming the sampler's public parameters (not its seed).

  >>> sampler_fingerprint("poisson", 100, 10) == sampler_fingerprint("poisson", 100, 10)
  True
  >>> sampler_fingerprint("poisson", 100, 10) == sampler_fingerprint("uniform", 100, 10)
  False
  """
  text = f"{sampling}|{int(dataset_size)}|{int(batch_size)}".encode()
  value = int.from_bytes(hashlib.sha256(text).digest()[:8], "little") >> 1
  return max(value, 1)


def seed_hash(seed: int) -> int:
  """A positive int63 hash of a sampler seed: equal seeds, equal hashes.

  It lets the ledger refuse batches of a sampler with another seed without
  storing the seed. For a seed drawn from the OS (the default, 63 bits) the
  hash reveals nothing practical about it; a small user-chosen seed can be
  found from its hash by trying all seeds, like any user-fixed seed.

  >>> seed_hash(7) == seed_hash(7), seed_hash(7) == seed_hash(8)
  (True, False)
  """
  digest = hashlib.sha256(b"tf_dpnsgd.sampler_seed|" + str(int(seed)).encode()).digest()
  return max(int.from_bytes(digest[:8], "little") >> 1, 1)


def seed_must_match(kind: str, steps: int, period: int) -> bool:
  """Whether a batch of ``kind`` at ledger step ``steps`` must come from the sampler seed of
  the steps before it (the seed is secret; the ledger compares its hash).

  * ``shuffle`` within an epoch (``period`` steps): a new seed is a new permutation, so an
    example could run twice in one epoch;
  * ``cyclic_poisson`` after step 0: a new seed is a new partition, so an example could run
    in two steps fewer than ``b`` apart, outside the banded mechanism's sensitivity
    (disjoint columns) and the accounting (Choquette-Choo et al. 2023, Thm. 4 fixes one
    partition for the whole run);
  * ``poisson`` / ``uniform``: every step is an independent draw; any seed may resume.

  >>> seed_must_match("shuffle", 3, 5), seed_must_match("shuffle", 5, 5)
  (True, False)
  >>> seed_must_match("cyclic_poisson", 0, 0), seed_must_match("cyclic_poisson", 7, 0)
  (False, True)
  >>> seed_must_match("poisson", 7, 0)
  False
  """
  if kind == "shuffle":
    return period > 0 and steps % period != 0
  if kind == "cyclic_poisson":
    return steps > 0
  return False


_NEW_SEED_MESSAGES = {
    "shuffle": (
        "tf_dpnsgd: this shuffle batch comes from a sampler with another seed, or over other "
        "data (examples added, removed or edited), than the steps in the model's privacy "
        "ledger within this epoch. A new seed or data set is a new permutation, so examples "
        "would run twice in one epoch (shuffle accounting assumes at most once). Finish the "
        "epoch on the same data (any order) with the original plan's seed: "
        "PrivacyPlan(..., seed=<the seed of the first run>), kept as secret as the data "
        "(plan.seed), or use sampling='poisson', whose steps are independent whatever the "
        "seed."),
    "cyclic_poisson": (
        "tf_dpnsgd: this cyclic-Poisson batch comes from a sampler with another seed, or over "
        "other data (examples added, removed or edited; the same examples in any order are "
        "fine), than the steps in the model's privacy ledger. A new seed or data set is a "
        "new partition of the data, so an example could take part in two steps fewer than "
        "`bands` apart: the banded noise's sensitivity and its accounting hold for one "
        "partition per run (a model reloaded with make_private's own plan draws a new seed; "
        "the seed is never saved). Resume on the same examples with the original plan's "
        "seed: plan = PrivacyPlan(..., sampling='cyclic_poisson', bands=b, seed=<the first "
        "run's plan.seed>), kept as secret as the data, and model.fit(plan.dataset(x, y, "
        "model=model), **plan.fit_kwargs(model)); or train a new model."),
}


BLT_BANDS = -2  # noise_bands <= -2: BLT noise, -2 - a hash of which (BLTStrategy.ledger_code)


def noise_name(bands: int) -> str:
  """The mechanism a ``noise_bands`` code names (the ledger's entry, an optimizer's
  ``bands``), for messages.

  >>> noise_name(1), noise_name(4), noise_name(-1)
  ('independent noise (b = 1)', '4-banded noise (BandMF)', 'mixed noise')
  >>> noise_name(BLT_BANDS - 5)
  'BLT noise (parameters #5)'
  """
  if bands == 1:
    return "independent noise (b = 1)"
  if bands <= BLT_BANDS:
    return f"BLT noise (parameters #{BLT_BANDS - bands})"
  if bands < 0:
    return "mixed noise"
  return f"{bands}-banded noise (BandMF)"


def trainable_signature(variables) -> tuple:
  """``(digest, count, size)`` of the variables a DP step updates: an int63 digest of their
  sorted ``(shape, dtype)`` (not their names, which a rebuilt or reloaded model may change),
  how many they are and how many weights they hold. LoRA factors and the kernels they adapt
  differ in shape, so a model whose LoRA was merged into its kernels (Keras does that when
  it saves a ``.keras`` file) has another signature.

  >>> a = trainable_signature([tf.Variable(tf.zeros([4, 2])), tf.Variable(tf.zeros([2]))])
  >>> b = trainable_signature([tf.Variable(tf.zeros([2])), tf.Variable(tf.zeros([4, 2]))])
  >>> a == b, a[1:], trainable_signature([tf.Variable(tf.zeros([8]))])[0] == a[0]
  (True, (2, 10), False)
  """
  items = sorted(f"{tuple(int(d) for d in v.shape)}:{tf.as_dtype(v.dtype).name}"
                 for v in variables)
  digest = int.from_bytes(hashlib.sha256("|".join(items).encode()).digest()[:8], "little") >> 1
  size = sum(int(np.prod(v.shape)) for v in variables)
  return max(digest, 1), len(items), size


def _random_lineage() -> int:
  return max(int.from_bytes(os.urandom(8), "little") >> 1, 1)


@dataclasses.dataclass(frozen=True)
class BatchSummary:
  """What the host knows of one batch before the step (from :mod:`tf_dpnsgd.guard`)."""

  tagged: bool
  kind: int = 0
  step_min: int = 0
  step_max: int = 0
  sampler_min: int = 0
  sampler_max: int = 0
  seed_min: int = 0
  seed_max: int = 0
  period: int = 0

  @classmethod
  def merge(cls, summaries) -> "BatchSummary":
    """One summary of a batch split over replicas."""
    summaries = list(summaries)
    if len({s.tagged for s in summaries}) != 1:
      raise LedgerMismatchError("Some replicas' shards are tagged and others are not.")
    if not summaries[0].tagged:
      return summaries[0]
    kinds = {s.kind for s in summaries}
    kind = kinds.pop() if len(kinds) == 1 else -1
    return cls(True, kind, min(s.step_min for s in summaries),
               max(s.step_max for s in summaries), min(s.sampler_min for s in summaries),
               max(s.sampler_max for s in summaries), min(s.seed_min for s in summaries),
               max(s.seed_max for s in summaries), max(s.period for s in summaries))


class PrivacyLedger(keras.layers.Layer):
  """Record of the private steps a model's weights went through (see the module doc).

  Created by :class:`tf_dpnsgd.DPModel` / :func:`tf_dpnsgd.make_private`;
  read it as ``model.privacy_ledger`` (or :func:`ledger_of`). Not a part of
  ``model.weights``.
  """

  def __init__(self, **kwargs):
    kwargs.setdefault("name", _LEDGER_NAME)
    super().__init__(**kwargs)
    dtypes = {"kind": "int32", "expected_kind": "int32", "privacy_unit": "int32",
              "min_noise_multiplier": "float32",
              RELEASE_FIELD: "float64", WARM_START_FIELD: "int32"}
    dtypes.update({name: "float32" for name in ADAPTIVE_FIELDS[1:]})
    self._vars = {}
    for name in _FIELDS:
      init = (keras.initializers.Constant(np.inf)
              if name in _MIN_FIELDS or name == "min_clipped_count_stddev" else "zeros")
      self._vars[name] = self.add_weight(shape=_SHAPES.get(name, ()),
                                         dtype=dtypes.get(name, "int64"),
                                         initializer=init, trainable=False, name=name,
                                         aggregation="only_first_replica")
      setattr(self, f"_var_{name}", self._vars[name])  # a tf.train.Checkpoint dependency
    self._vars["lineage"].assign(_random_lineage())
    object.__setattr__(self, "_snapshot", None)  # untracked: see _note
    self.built = True

  # --- reading (eager) -------------------------------------------------------
  def state(self) -> dict:
    """All entries as Python values."""
    return self._entries(self._vars)

  def _entries(self, names) -> dict:
    """The entries ``names`` as Python values, each read now (one read a variable)."""
    return {name: _python_value(host_value(self._vars[name])) for name in names}

  @property
  def steps(self) -> int:
    """Private steps taken (what every report counts)."""
    return int(host_value(self._vars["steps"]))

  @property
  def kind(self) -> Optional[str]:
    """The kind of batch all steps consumed (None before the first step)."""
    return KIND_NAMES.get(int(host_value(self._vars["kind"])))

  @property
  def sampler(self) -> int:
    return int(host_value(self._vars["sampler"]))

  @property
  def sampler_seed_hash(self) -> int:
    return int(host_value(self._vars["sampler_seed_hash"]))

  @property
  def user_seeded_steps(self) -> int:
    return int(host_value(self._vars["user_seeded_steps"]))

  @property
  def min_noise_multiplier(self) -> float:
    return float(host_value(self._vars["min_noise_multiplier"]))

  @property
  def noise_bands(self) -> int:
    """``b`` of the noise every step used (1: independent; -1: steps of different ``b``;
    ``<=`` :data:`BLT_BANDS`: BLT noise, which one), see :func:`noise_name`."""
    return int(host_value(self._vars["noise_bands"])) or 1  # 0: no step, or written before it

  @property
  def trained_signature(self) -> tuple:
    """``(digest, count, size)`` of what the last step updated (:func:`trainable_signature`;
    zeros before the first step or in a file written before this entry existed)."""
    return tuple(int(host_value(self._vars[name])) for name in
                 ("trainable_digest", "trainable_count", "trainable_size"))

  @property
  def privacy_unit(self) -> Optional[str]:
    """``"example"`` or ``"user"``: the unit every step bounded (None before the first step;
    ``"example"`` for a ledger written before this entry existed)."""
    code = int(host_value(self._vars["privacy_unit"]))
    if code == 0:
      return "example" if self.steps else None
    return UNIT_NAMES.get(code, f"unknown ({code})")

  @property
  def unit_rows(self) -> int:
    """``k``, the most rows of one user a user-level step used (0 for example-level)."""
    return int(host_value(self._vars["unit_rows"]))

  @property
  def noise_generation(self) -> int:
    return int(host_value(self._vars["noise_generation"]))

  @property
  def lineage(self) -> int:
    return int(host_value(self._vars["lineage"]))

  @property
  def releases(self) -> int:
    """Gaussian releases of training-set statistics made for this model before or between
    its steps (:mod:`tf_dpnsgd.private_stats`); the plan composes them with the steps."""
    return int(host_value(self._vars["releases"]))

  @property
  def release_noise_multipliers(self) -> tuple:
    """The noise multiplier of each release, in the order they ran (one Gaussian
    mechanism each on the whole training set, sensitivity-normalized)."""
    # The two entries release_list reads, not the whole state (read before every step).
    return tuple(release_list({"releases": self.releases,
                               RELEASE_FIELD: host_value(self._vars[RELEASE_FIELD])}))

  def release_events(self) -> list:
    """The dp-accounting events of the releases (what the accountant composes)."""
    import dp_accounting  # pylint: disable=g-import-not-at-top
    return [dp_accounting.GaussianDpEvent(m) for m in self.release_noise_multipliers]

  @property
  def warm_start_source(self) -> Optional[str]:
    """The last file whose weights were loaded without a privacy ledger (None if none)."""
    return _decode_source(self.state()[WARM_START_FIELD])

  @property
  def flags(self) -> int:
    """Bits of :mod:`tf_dpnsgd.coverage`: assumptions outside the Gaussian mechanism."""
    return int(host_value(self._vars["flags"]))

  def adaptive_clipping(self) -> Optional[dict]:
    """What quantile-adaptive clipping's steps released (None if no step used it):
    ``steps``, ``min_clipped_count_stddev``, ``l2_norm_clip`` (now), ``initial_l2_norm_clip``,
    ``target_unclipped_quantile``, ``clip_learning_rate``."""
    steps = int(host_value(self._vars["adaptive_steps"]))  # the only read when none ran
    if not steps:
      return None
    return dict({name: float(host_value(self._vars[name])) for name in ADAPTIVE_FIELDS[1:]},
                steps=steps)

  def to_dict(self) -> dict:
    """The public entries (no seed, no key; the seed hash is left out too)."""
    return {"steps": self.steps, "batch_kind": self.kind, "privacy_unit": self.privacy_unit,
            "max_examples_per_user": self.unit_rows or None,
            "user_seeded_noise_steps": self.user_seeded_steps,
            "min_noise_multiplier": (None if self.steps == 0 else self.min_noise_multiplier),
            "noise_generation": self.noise_generation, "flags": self.flags,
            "releases": list(self.release_noise_multipliers),
            "warm_start_source": self.warm_start_source}

  # --- host-side writes (eager) ----------------------------------------------
  def expect(self, sampling: Optional[str]) -> None:
    """Refuse (before the step) any batch not of kind ``sampling`` (None: no expectation)."""
    self._host_write("expected_kind", 0 if sampling is None else KIND_CODES[sampling])

  def add_flags(self, bits: int) -> None:
    """ORs ``bits`` (:mod:`tf_dpnsgd.coverage`) into :attr:`flags`; flags are never cleared."""
    self.sync()
    self._host_write("flags", self.flags | int(bits))

  def record_release(self, noise_multiplier: float) -> None:
    """Records one Gaussian release of training-set statistics as its own event (never
    removed): its noise multiplier, in order after the releases before it."""
    noise_multiplier = float(noise_multiplier)
    if not (noise_multiplier > 0 and np.isfinite(noise_multiplier)):
      raise ValueError(f"A release needs a finite noise multiplier > 0; got "
                       f"{noise_multiplier!r}.")
    self.sync()
    made = self.releases
    if made >= MAX_RELEASES:
      raise ValueError(f"The privacy ledger holds at most {MAX_RELEASES} statistics releases; "
                       "release the statistics of several channels together instead.")
    values = np.array(host_value(self._vars[RELEASE_FIELD]))
    values[made] = noise_multiplier
    self._vars[RELEASE_FIELD].assign(values)
    self._vars["releases"].assign(made + 1)
    state = self.state()
    self._note(state)
    lineage_lib.record_steps(self.lineage, self.steps, releases=self.release_noise_multipliers)
    owner = getattr(self, "_weights_owner", None)
    owner = owner() if owner is not None else None
    if owner is not None and owner.built and owner.get_weights():
      # Weights reloaded without this ledger (base.save + load_model) get it back here.
      lineage_lib.record_weights(lineage_lib.fingerprint(owner.get_weights()), state)

  def record_warm_start(self, source: str) -> None:
    """Weights were loaded from ``source``, a file without a privacy ledger: the user's claim
    that they are public (a pretrained checkpoint). Flags the ledger (never cleared) and keeps
    the file name for the report's ``not_covered``."""
    from tf_dpnsgd import coverage  # pylint: disable=g-import-not-at-top
    self.sync()
    self._vars[WARM_START_FIELD].assign(_encode_source(source))
    self._vars["flags"].assign(self.flags | coverage.WARM_START)
    self._note(self.state())

  def adopt_lineage(self, lineage: int) -> None:
    """Takes ``lineage`` (worker 0's, under a multi-worker strategy) if no step ran yet.

    The lineage keys the noise: workers with different lineages would add
    independent draws that the all-reduce averages (noise ``sqrt(workers)``
    times too small). A ledger that already ran keeps its own; the guard then
    refuses workers whose lineages differ.
    """
    if self.steps == 0 and int(lineage) != self.lineage:
      self._host_write("lineage", int(lineage))

  def _host_write(self, name: str, value) -> None:
    self.sync()  # first take notice of any restore, so the write cannot hide it
    self._vars[name].assign(value)
    self._note(self.state())

  def _assign(self, state: dict) -> None:
    for name, value in state.items():
      if name in self._vars:
        self._vars[name].assign(value)

  def sync(self) -> None:
    """Host: take notice of state written from outside the train step (a restore).

    If the ledger now counts fewer steps than its lineage already executed
    (in this process, or on this machine per :mod:`tf_dpnsgd.lineage`), the
    executed count comes back, the conservative values are merged and the
    noise moves to a new generation. Called before every train function call
    and after every load.
    """
    state = self.state()
    if state == self._snapshot:
      return
    lineage = state["lineage"]
    reached = _PROCESS_REACHED.get(lineage)
    recorded = lineage_lib.max_steps(lineage)
    if reached is None or recorded > reached[0]:
      reached = (recorded, None)
    old_releases = list(lineage_lib.max_releases(lineage))
    if reached[1] is not None:
      old_releases = merge_releases(old_releases, release_list(reached[1]))
    lost = merge_releases(release_list(state), old_releases) != release_list(state)
    if state["steps"] < reached[0] or lost:
      merged = dict(state, steps=max(state["steps"], reached[0]),
                    noise_generation=max(state["noise_generation"],
                                         (reached[1] or {}).get("noise_generation", 0)) + 1)
      if reached[1] is not None:
        old = reached[1]
        merged["min_noise_multiplier"] = min(state["min_noise_multiplier"],
                                             old["min_noise_multiplier"])
        merged["user_seeded_steps"] = max(state["user_seeded_steps"], old["user_seeded_steps"])
        merged["flags"] = state["flags"] | old["flags"]
        merged["adaptive_steps"] = max(state["adaptive_steps"], old.get("adaptive_steps", 0))
        merged["min_clipped_count_stddev"] = min(state["min_clipped_count_stddev"],
                                                 old.get("min_clipped_count_stddev", np.inf))
        merged[WARM_START_FIELD] = (state[WARM_START_FIELD] if any(state[WARM_START_FIELD])
                                    else old.get(WARM_START_FIELD, state[WARM_START_FIELD]))
      releases = merge_releases(release_list(state), old_releases)
      if len(releases) > MAX_RELEASES:
        raise ValueError("The privacy ledger's merged history holds more than "
                         f"{MAX_RELEASES} statistics releases.")
      merged["releases"] = len(releases)
      merged[RELEASE_FIELD] = releases + [0.0] * (MAX_RELEASES - len(releases))
      _log.warning(
          "tf_dpnsgd: the privacy ledger was restored to step %d, but its lineage already "
          "executed %d private steps; it keeps counting %d (the steps of the abandoned branch "
          "stay in the epsilon) and moves the noise to a fresh stream.", state["steps"],
          reached[0], reached[0])
      self._assign(merged)
      state = self.state()
    self._note(state)

  def _note(self, state: dict) -> None:
    # A plain attribute: Keras' and TensorFlow's tracking wrap a dict assigned to a layer
    # (a TrackedDict over the 25 entries, the 64 releases and the 256 warm-start bytes), about
    # 0.35 ms before every step for a value only this class reads (issue 47).
    object.__setattr__(self, "_snapshot", state)
    lineage = state["lineage"]
    old = _PROCESS_REACHED.get(lineage)
    if old is None or state["steps"] >= old[0]:
      _PROCESS_REACHED[lineage] = (state["steps"], state)

  def after_steps(self) -> None:
    """Host: the train function ran; remember how far this lineage got."""
    self._note(self.state())

  def save_own_variables(self, store):
    arrays = {name: host_value(v) for name, v in self._vars.items()}  # one read each
    for name, value in arrays.items():
      store[name] = value  # an array (0-d for a scalar), as Keras' numpy() gave
    state = {name: _python_value(value) for name, value in arrays.items()}
    lineage_lib.record_steps(state["lineage"], state["steps"], releases=release_list(state))

  def load_own_variables(self, store):
    keys = list(store.keys()) if hasattr(store, "keys") else []
    if not keys:
      # A file without a ledger (weights of a plain model: a warm start). The weights change
      # by hand, the ledger keeps what this lineage executed and names the file.
      source = getattr(self, "_loading_source", None) or "the loaded file"
      _log.warning("tf_dpnsgd: %s holds no privacy ledger: its weights are taken as public "
                   "(a warm start; the report lists it as not covered); the model keeps its "
                   "own ledger (%d steps).", source, self.steps)
      self.record_warm_start(source)
      return
    if "steps" in keys:
      values = {name: store[name] for name in _FIELDS if name in keys}
      if values.get("releases") and RELEASE_FIELD not in values:
        raise ValueError("This file's privacy ledger counts statistics releases without their "
                         "noise multipliers (written by an older tf_dpnsgd); it cannot be "
                         "accounted. Train again with this version.")
    else:
      values = {name: store[str(i)] for i, name in enumerate(_OLD_FIELDS)}
    self._assign({k: np.asarray(v) for k, v in values.items()})
    self.sync()

  # --- host-side checks ------------------------------------------------------
  def check_batch(self, summary: BatchSummary, offset: int = 0,
                  untagged_allowed: bool = False, untagged_hint: str = "") -> None:
    """Raises :class:`LedgerMismatchError` unless the batch continues this ledger.

    Args:
      summary: the batch's tags as seen on the host.
      offset: the batch is the ``offset``-th of those about to run in one call.
      untagged_allowed: whether an untagged batch is acceptable here (Keras
        batching in-memory arrays, or the user's ``trust_untagged_batches``).
      untagged_hint: what to do instead, for the error message.
    """
    state = self._entries(_BATCH_CHECK_FIELDS)  # what this check reads, read now: 5 of 25
    steps = state["steps"] + int(offset)
    kind = summary.kind if summary.tagged else KIND_CODES[UNTAGGED]
    if summary.tagged and kind not in KIND_NAMES:
      raise LedgerMismatchError("A batch mixes tags of different samplers.")
    if not summary.tagged and not untagged_allowed:
      raise LedgerMismatchError(
          "tf_dpnsgd: this batch carries no sampler tags, so the DP step cannot verify how it "
          "was drawn (a user tf.data pipeline may repeat an example within a batch or an "
          "epoch, e.g. oversampling a rare class, which multiplies its sensitivity). Feed "
          "model.fit(plan.dataset(x, y, model=model), **plan.fit_kwargs(model)), or pass the "
          "in-memory arrays to fit (Keras batches them, each example at most once per batch)."
          f"{untagged_hint}")
    expected, recorded = state["expected_kind"], state["kind"]
    if expected not in (0, kind):
      raise LedgerMismatchError(
          f"tf_dpnsgd: this batch is of kind {KIND_NAMES.get(kind)!r} but the privacy plan "
          f"accounts for {KIND_NAMES.get(expected)!r} batches ('untagged' means drawn by Keras "
          "from arrays). Feed model.fit(plan.dataset(x, y, model=model), "
          "**plan.fit_kwargs(model)) instead of arrays with batch_size, so the batches are the "
          "ones accounted for.")
    if recorded not in (0, kind):
      raise LedgerMismatchError(
          f"tf_dpnsgd: the model's privacy ledger holds steps of another batch kind "
          f"({KIND_NAMES.get(recorded)!r}) than this batch ({KIND_NAMES.get(kind)!r}): one "
          "model's privacy ledger follows one sampling (another sampling); keep feeding "
          "batches from the same plan.dataset(...).")
    if not summary.tagged:
      return
    if not summary.step_min == summary.step_max == steps:
      raise LedgerMismatchError(
          f"tf_dpnsgd: the batch is sampler step {summary.step_min} but the model has taken "
          f"{steps} private steps: a replayed or skipped batch would be accounted as fresh. "
          "Continue the stream with plan.dataset(x, y, model=model) (or "
          "start_step=model.privacy_ledger.steps) and plan.fit_kwargs(model).")
    if summary.sampler_min != summary.sampler_max or \
        state["sampler"] not in (0, summary.sampler_min):
      raise LedgerMismatchError(
          "tf_dpnsgd: this batch comes from a sampler with another sampling, N or B than the "
          "steps in the model's privacy ledger; one model follows one plan.")
    if summary.seed_min != summary.seed_max:
      raise LedgerMismatchError("tf_dpnsgd: the rows of this batch come from samplers with "
                                "different seeds.")
    if (seed_must_match(KIND_NAMES[kind], steps, summary.period)
        and state["sampler_seed_hash"] not in (0, summary.seed_min)):
      raise LedgerMismatchError(_NEW_SEED_MESSAGES[KIND_NAMES[kind]])

  # --- the train step (graph) -----------------------------------------------
  def step(self) -> tf.Tensor:
    """The index of the step being taken (= steps taken so far)."""
    return self._vars["steps"].value

  def noise_stream(self) -> tf.Tensor:
    """``[lineage, generation, step]`` (int64): what keys this step's noise draw."""
    return tf.stack([self._vars["lineage"].value, self._vars["noise_generation"].value,
                     self._vars["steps"].value])

  def record(self, tags, noise_multiplier: float, user_seeded: bool,
             adaptive: Optional[dict] = None, bands: int = 1,
             trainable_variables=None, unit_rows: int = 0) -> list:
    """Assign ops recording one executed private step (run after the update).

    ``adaptive``: under quantile-adaptive clipping, what the step released besides the
    gradient (:meth:`tf_dpnsgd.PrivateOptimizer.apply_private_gradients`): its count
    noise ``clipped_count_stddev``, the new ``l2_norm_clip`` and the clip's settings.
    ``unit_rows``: ``k`` of a user-level step (its unit is then a user); 0: an example.
    """
    v = self._vars
    if tags is None:
      kind = tf.constant(KIND_CODES[UNTAGGED], tf.int32)
    else:
      kind = tf.cast(tags[DP_KIND_KEY][0], tf.int32)
    ops = [v["steps"].assign_add(tf.constant(1, tf.int64)), v["kind"].assign(kind),
           v["min_noise_multiplier"].assign(tf.minimum(
               v["min_noise_multiplier"].value, tf.constant(noise_multiplier, tf.float32)))]
    if tags is not None:
      ops.append(v["sampler"].assign(tf.cast(tags[DP_SAMPLER_KEY][0], tf.int64)))
      ops.append(v["sampler_seed_hash"].assign(tf.cast(tags[DP_SEED_KEY][0], tf.int64)))
    unit = UNIT_CODES["user" if unit_rows else "example"]
    ops += [v["privacy_unit"].assign(tf.constant(unit, tf.int32)),
            v["unit_rows"].assign(tf.constant(int(unit_rows), tf.int64))]
    old_bands, bands = v["noise_bands"].value, tf.constant(int(bands), tf.int64)
    ops.append(v["noise_bands"].assign(tf.where(  # correlated noise: 1 b per ledger, else -1
        tf.equal(old_bands, 0) | tf.equal(old_bands, bands), bands, tf.constant(-1, tf.int64))))
    if user_seeded:
      ops.append(v["user_seeded_steps"].assign_add(tf.constant(1, tf.int64)))
    if trainable_variables is not None:  # what this step updated (fixed when traced)
      ops += [v[name].assign(tf.constant(int(value), tf.int64)) for name, value in
              zip(("trainable_digest", "trainable_count", "trainable_size"),
                  trainable_signature(trainable_variables))]
    if adaptive is not None:
      f32 = lambda name: tf.cast(adaptive[name], tf.float32)  # noqa: E731
      ops += [v["adaptive_steps"].assign_add(tf.constant(1, tf.int64)),
              v["min_clipped_count_stddev"].assign(tf.minimum(
                  v["min_clipped_count_stddev"].value, f32("clipped_count_stddev")))]
      ops += [v[name].assign(f32(name)) for name in ADAPTIVE_FIELDS[2:]]
    return ops


def bind_weights_owner(ledger: "PrivacyLedger", model) -> None:
  """Remembers (weakly) the model whose weights ``ledger`` describes: a release records
  their fingerprint with the ledger's state (:mod:`tf_dpnsgd.lineage`)."""
  object.__setattr__(ledger, "_weights_owner", weakref.ref(model))


def weights_owner(ledger: "PrivacyLedger"):
  """The model bound by :func:`bind_weights_owner`, or None."""
  ref = getattr(ledger, "_weights_owner", None)
  return ref() if ref is not None else None


def release_list(state: dict) -> list:
  """The noise multipliers of a ledger state's releases, in order."""
  return [float(m) for m in list(state.get(RELEASE_FIELD, []))[:int(state.get("releases", 0))]]


def merge_releases(a, b) -> list:
  """The releases of two histories of one lineage: their common prefix, then what each
  branch released after it (a rolled-back release was still released, so it stays).

  >>> merge_releases([8.0, 8.0], [8.0, 8.0, 2.0])
  [8.0, 8.0, 2.0]
  >>> merge_releases([8.0, 4.0], [8.0, 2.0])
  [8.0, 4.0, 2.0]
  """
  a, b = [float(x) for x in a], [float(x) for x in b]
  common = 0
  while common < min(len(a), len(b)) and a[common] == b[common]:
    common += 1
  return a + b[common:]


def _encode_source(source: str) -> np.ndarray:
  raw = str(source).encode("utf-8")[-_SOURCE_BYTES:]
  out = np.zeros(_SOURCE_BYTES, np.int32)
  out[:len(raw)] = list(raw)
  return out


def _decode_source(values) -> Optional[str]:
  raw = bytes(int(v) for v in values if int(v))
  return raw.decode("utf-8", errors="replace") if raw else None


def ledger_of(model) -> PrivacyLedger:
  """The :class:`PrivacyLedger` of a DP model; ``TypeError`` for any other model."""
  ledger = getattr(model, "privacy_ledger", None)
  if not isinstance(ledger, PrivacyLedger):
    raise TypeError(f"{model!r} has no privacy ledger: build it with tf_dpnsgd.DPModel or "
                    "tf_dpnsgd.make_private.")
  return ledger


def parse_batch_weights(sample_weight):
  """Splits the third batch element into ``(mask, denominator, tags)``; rejects anything else.

  ``mask``/``denominator`` are None unless the batch is Poisson-padded;
  ``tags`` is None for an untagged batch.
  """
  if sample_weight is None:
    return None, None, None
  if not (isinstance(sample_weight, dict) and set(sample_weight) & set(BATCH_KEYS)):
    raise ValueError(
        "DP training does not accept `sample_weight` or `class_weight`: weights change each "
        "example's contribution and hence the sensitivity the privacy guarantee relies on. "
        "Resample or reweight the loss instead; batches from plan.dataset(...) carry their "
        "own padding mask and tags.")
  unknown = set(sample_weight) - set(BATCH_KEYS)
  if unknown:
    raise ValueError(f"Unknown keys {sorted(unknown)} in the DP batch weights.")
  tags = None
  present = [k for k in TAG_KEYS if k in sample_weight]
  if present:
    if len(present) != len(TAG_KEYS):
      raise ValueError(f"A tagged DP batch needs all of {list(TAG_KEYS)}; got {present}. "
                       "Build batches with plan.dataset(...).")
    tags = {k: sample_weight[k] for k in TAG_KEYS}
    if DP_USER_KEY in sample_weight:
      tags[DP_USER_KEY] = sample_weight[DP_USER_KEY]
  mask = denominator = None
  if DP_MASK_KEY in sample_weight:
    if DP_DENOMINATOR_KEY not in sample_weight:
      raise ValueError(
          f"A '{DP_MASK_KEY}' batch needs '{DP_DENOMINATOR_KEY}' (the expected batch size "
          "qN for Poisson sampling); use tf_dpnsgd.sampling to build such batches.")
    mask = tf.cast(sample_weight[DP_MASK_KEY], tf.bool)
    denominator = tf.reshape(tf.cast(sample_weight[DP_DENOMINATOR_KEY], tf.float32), [-1])[0]
  elif DP_DENOMINATOR_KEY in sample_weight:
    raise ValueError(f"'{DP_DENOMINATOR_KEY}' without '{DP_MASK_KEY}'.")
  return mask, denominator, tags


__all__ = ["BATCH_KEYS", "BatchSummary", "DP_DENOMINATOR_KEY", "DP_KIND_KEY", "DP_MASK_KEY",
           "DP_DIGEST_KEY", "DP_EXAMPLE_KEY", "DP_IDENTITY_KEY", "DP_PERIOD_KEY",
           "DP_SAMPLER_KEY", "DP_SEED_KEY", "DP_STEP_KEY", "DP_USER_KEY", "KIND_CODES",
           "LedgerMismatchError",
           "PrivacyLedger", "UNTAGGED", "ledger_of", "parse_batch_weights",
           "sampler_fingerprint", "seed_hash", "trainable_signature"]
