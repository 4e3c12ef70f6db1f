"""The privacy ledger: what the DP train step actually executed, owned by the model.

An accountant turns a description of the run (how batches were drawn, how
many steps, which noise) into epsilon. That epsilon describes the training
only if the description is what ran. The ledger is the record of what ran,
written by the train step itself and nowhere else:

=====================  ======================================================
entry                  meaning
=====================  ======================================================
``steps``              private steps taken (one noise draw each)
``kind``               the kind of batch every step consumed (one kind per
                       ledger): ``poisson``, ``uniform``, ``shuffle`` (tagged
                       by :mod:`tf_dpnsgd.sampling`) or ``untagged`` (a
                       fixed-size batch Keras drew itself)
``sampler``            fingerprint of the sampler (kind, ``N``, ``B``) that
                       tagged the batches
``user_seeded_steps``  steps whose noise came from a user-fixed seed
``min_noise``          smallest noise multiplier any step used
=====================  ======================================================

It lives in the model's (non-trainable) weights, so ``save_weights`` /
``load_weights``, ``.keras`` files and checkpoints carry it whatever the
optimizer's state (a freshly compiled optimizer, a recompile, a new
optimizer object). The noise of step ``t`` is keyed by ``steps``, so a new
optimizer continues the noise stream instead of repeating it.

Data flows one way: sampler tags -> train step (:meth:`PrivacyLedger.check`
before the update, :meth:`PrivacyLedger.record` after it) -> ledger ->
:meth:`tf_dpnsgd.plan.PrivacyPlan.report` / the privacy callback, which read
only the ledger.

Batch tags. A sampler's batch is ``(x, y, tags)`` with ``tags`` a dict of
per-row tensors (per row so that ``tf.distribute`` can split them):

* ``dp_kind`` (int32): :data:`KIND_CODES` of the sampler;
* ``dp_step`` (int64): the sampler's step index ``t``;
* ``dp_sampler`` (int64): :func:`sampler_fingerprint`;
* Poisson only: ``dp_mask`` (bool, padding rows False) and
  ``dp_denominator`` (the expected batch size ``qN``).

Formal guarantee of the checks (run in the graph before the optimizer update,
so a refused step changes nothing): a step is refused unless

1. its kind equals the ledger's kind (once one step ran) and the kind the
   plan expects (once a :class:`~tf_dpnsgd.callbacks.PrivacyCallback`
   announced it with :meth:`PrivacyLedger.expect`);
2. for tagged batches: every row's ``dp_step`` equals ``steps`` (no replay,
   no skip) and the sampler fingerprint equals the ledger's.
"""

from __future__ import annotations

import hashlib
from typing import Optional

import keras
import numpy as np
import tensorflow as tf

# --- batch keys (the samplers write them, the train step reads them) ---------
DP_MASK_KEY = "dp_mask"
DP_DENOMINATOR_KEY = "dp_denominator"
DP_KIND_KEY = "dp_kind"
DP_STEP_KEY = "dp_step"
DP_SAMPLER_KEY = "dp_sampler"
TAG_KEYS = (DP_KIND_KEY, DP_STEP_KEY, DP_SAMPLER_KEY)
BATCH_KEYS = (DP_MASK_KEY, DP_DENOMINATOR_KEY) + TAG_KEYS

UNTAGGED = "untagged"
KIND_CODES = {"poisson": 1, "uniform": 2, "shuffle": 3, UNTAGGED: 4}
KIND_NAMES = {v: k for k, v in KIND_CODES.items()}
_LEDGER_NAME = "dp_privacy_ledger"


class LedgerMismatchError(ValueError):
  """The ledger (what ran) does not match the plan (what would be reported)."""


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


def _counter(layer, name, dtype="int64", initializer="zeros"):
  return layer.add_weight(shape=(), dtype=dtype, initializer=initializer, trainable=False,
                          name=name, aggregation="only_first_replica")


class PrivacyLedger(keras.layers.Layer):
  """Non-trainable record of the private steps a model executed (see the module doc).

  Created by :class:`tf_dpnsgd.DPModel` / :func:`tf_dpnsgd.make_private`;
  read it as ``model.privacy_ledger`` (or :func:`ledger_of`).
  """

  def __init__(self, **kwargs):
    kwargs.setdefault("name", _LEDGER_NAME)
    super().__init__(**kwargs)
    self._steps = _counter(self, "steps")
    self._kind = _counter(self, "kind", "int32")
    self._expected_kind = _counter(self, "expected_kind", "int32")
    self._sampler = _counter(self, "sampler")
    self._user_seeded = _counter(self, "user_seeded_steps")
    self._min_noise = _counter(self, "min_noise_multiplier", "float32",
                               keras.initializers.Constant(np.inf))
    self.built = True

  # --- reading (eager) -------------------------------------------------------
  @property
  def steps(self) -> int:
    """Private steps taken (what every report counts)."""
    return int(self._steps.numpy())

  @property
  def kind(self) -> Optional[str]:
    """The kind of batch all steps consumed (None before the first step)."""
    code = int(self._kind.numpy())
    return KIND_NAMES.get(code)

  @property
  def sampler(self) -> int:
    return int(self._sampler.numpy())

  @property
  def user_seeded_steps(self) -> int:
    return int(self._user_seeded.numpy())

  @property
  def min_noise_multiplier(self) -> float:
    return float(self._min_noise.numpy())

  def to_dict(self) -> dict:
    return {"steps": self.steps, "batch_kind": self.kind,
            "user_seeded_noise_steps": self.user_seeded_steps,
            "min_noise_multiplier": (None if self.steps == 0 else self.min_noise_multiplier)}

  # --- announcing the plan (eager) ------------------------------------------
  def expect(self, sampling: Optional[str]) -> None:
    """Refuse (in the train step) any batch not of kind ``sampling`` (None: no expectation)."""
    code = 0 if sampling is None else KIND_CODES[sampling]
    self._expected_kind.assign(code)

  # --- the train step (graph) -----------------------------------------------
  def step(self) -> tf.Tensor:
    """The index of the step being taken (= steps taken so far); keys the noise."""
    return self._steps.value

  def check(self, tags, offset=0) -> list:
    """Assert ops refusing a batch that does not continue this ledger (see module doc).

    Args:
      tags: ``None`` (an untagged batch) or a dict with :data:`TAG_KEYS`.
      offset: the batch is the ``offset``-th of those about to run (host-side
        checks of several batches before one multi-step call).

    Returns:
      The assert ops; run the step under ``tf.control_dependencies`` on them.
    """
    if tags is None:
      kind = tf.constant(KIND_CODES[UNTAGGED], tf.int32)
    else:
      kind = tf.cast(tags[DP_KIND_KEY][0], tf.int32)
    steps = self._steps.value + tf.cast(offset, tf.int64)
    expected = self._expected_kind.value
    recorded = self._kind.value
    ops = [
        tf.debugging.Assert(
            tf.logical_or(tf.equal(expected, 0), tf.equal(expected, kind)),
            ["tf_dpnsgd: this batch is not of the kind the privacy plan accounts for (batch "
             "kind code, expected code; 1=poisson 2=uniform 3=shuffle 4=untagged, i.e. drawn "
             "by Keras from arrays): ", kind, expected,
             ". Feed model.fit(plan.dataset(x, y, model=model), **plan.fit_kwargs(model)) "
             "instead of arrays with batch_size, so the batches are the ones accounted for."]),
        tf.debugging.Assert(
            tf.logical_or(tf.equal(recorded, 0), tf.equal(recorded, kind)),
            ["tf_dpnsgd: the model's privacy ledger holds steps of another batch kind (ledger "
             "code, batch code; 1=poisson 2=uniform 3=shuffle 4=untagged): ", recorded, kind,
             ". One model's privacy ledger follows one sampling; keep feeding batches from "
             "the same plan.dataset(...)."]),
    ]
    if tags is not None:
      step_tag = tf.cast(tags[DP_STEP_KEY], tf.int64)
      sampler = tf.cast(tags[DP_SAMPLER_KEY], tf.int64)
      ops += [
          tf.debugging.Assert(
              tf.logical_and(tf.equal(tf.reduce_min(step_tag), steps),
                             tf.equal(tf.reduce_max(step_tag), steps)),
              ["tf_dpnsgd: the batch is sampler step ", tf.reduce_min(step_tag),
               " but the model has taken ", steps, " private steps: a replayed or skipped "
               "batch would be accounted as fresh. Continue the stream with "
               "plan.dataset(x, y, model=model) (or start_step=model.privacy_ledger.steps) "
               "and plan.fit_kwargs(model)."]),
          tf.debugging.Assert(
              tf.logical_or(tf.equal(self._sampler.value, 0),
                            tf.equal(self._sampler.value, sampler[0])),
              ["tf_dpnsgd: this batch comes from a sampler with another sampling, N or B "
               "than the steps in the model's privacy ledger; one model follows one plan."]),
      ]
    return ops

  def record(self, tags, noise_multiplier: float, user_seeded: bool) -> list:
    """Assign ops recording one executed private step (run after the update)."""
    if tags is None:
      kind = tf.constant(KIND_CODES[UNTAGGED], tf.int32)
      sampler = None
    else:
      kind = tf.cast(tags[DP_KIND_KEY][0], tf.int32)
      sampler = tf.cast(tags[DP_SAMPLER_KEY][0], tf.int64)
    ops = [self._steps.assign_add(tf.constant(1, tf.int64)), self._kind.assign(kind),
           self._min_noise.assign(tf.minimum(self._min_noise.value,
                                             tf.constant(noise_multiplier, tf.float32)))]
    if sampler is not None:
      ops.append(self._sampler.assign(sampler))
    if user_seeded:
      ops.append(self._user_seeded.assign_add(tf.constant(1, tf.int64)))
    return ops


def check_batches_on_host(model) -> None:
  """Wraps ``model.train_function`` so each batch's tags are checked before the step runs.

  XLA (``jit_compile=True``) compiles assertions away, so the in-step checks of
  :meth:`PrivacyLedger.check` would silently vanish. The wrapper takes the
  ``steps_per_execution`` batches of a call from the iterator, checks each one
  in a separate (non-XLA) function that raises on a mismatch, together with
  the optimizer's own ``step_checks`` for that batch (adaptive clipping's
  count noise), and only then runs the compiled step on them.
  """
  ledger = ledger_of(model)
  inner = model.train_function
  strategy = model.distribute_strategy

  @tf.function(jit_compile=False, reduce_retracing=True)
  def check(data, offset):
    def replica_check(data):
      x, _, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
      _, denominator, tags = parse_batch_weights(sample_weight)
      checks = list(ledger.check(tags, offset))
      step_checks = getattr(model.optimizer, "step_checks", None)
      if step_checks is not None:  # e.g. adaptive clipping's 2 sigma_b > sigma for this batch
        local = denominator is None
        if local:
          microbatches = getattr(model, "num_microbatches", None)
          denominator = (microbatches if microbatches
                         else tf.shape(tf.nest.flatten(x)[0], out_type=tf.int64)[0])
        checks += list(step_checks(denominator, local_denominator=local))
      with tf.control_dependencies(checks):
        return tf.constant(True)
    return strategy.run(replica_check, args=(data,))

  def function(iterator):
    stream = iter(iterator)
    batches = []
    for _ in range(max(1, int(model.steps_per_execution))):
      try:
        batches.append(next(stream))
      except StopIteration:
        if not batches:
          raise
        break
    for offset, data in enumerate(batches):
      check(data, tf.constant(offset, tf.int64))
    return inner(batches)

  model.train_function = function


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


__all__ = ["BATCH_KEYS", "DP_DENOMINATOR_KEY", "DP_KIND_KEY", "DP_MASK_KEY", "DP_SAMPLER_KEY",
           "DP_STEP_KEY", "KIND_CODES", "LedgerMismatchError", "PrivacyLedger", "UNTAGGED",
           "ledger_of", "parse_batch_weights", "sampler_fingerprint"]
