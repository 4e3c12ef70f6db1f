"""The host-side guard around Keras' train function: verify the step, or refuse it.

Every call of a DP model's ``train_function`` goes through :func:`wrap`,
which, before Keras' compiled step runs on any batch:

1. takes notice of a restore of the privacy ledger (:meth:`PrivacyLedger.sync`:
   a rollback keeps the executed count and moves the noise to a new stream);
2. takes the call's batches (``steps_per_execution`` of them) from the
   iterator and reads their sampler tags on the host, in a small function
   compiled WITHOUT XLA (:func:`make_batch_reader`), together with the
   optimizer's own step checks (adaptive clipping's count noise);
3. checks, in Python, that each batch continues the ledger
   (:meth:`PrivacyLedger.check_batch`: no replay or skip, the same sampler
   and, for shuffling, the same seed; untagged batches only from in-memory
   arrays Keras batches itself, or when the user vouched for them), and that
   its rows are the ones the sampler tagged (:mod:`tf_dpnsgd.rows`: the reader
   recomputes each row's content digest; no real row changed after the
   sampler, e.g. by a ``.map`` mixing rows, and none repeats an example);
   and that every real row may take part in this step by its sampling's rule,
   checked on the row's example identity (:mod:`tf_dpnsgd.participation`:
   cyclic Poisson, each row's part is ``t mod b``; shuffling, no example twice
   in one epoch; every sampling, no example twice in one step); and that the
   batch's privacy unit is the model's and the ledger's, each user-level unit
   holding the rows of one user, no user in two units (:mod:`tf_dpnsgd.users`);
4. at the start of every ``fit`` under a multi-worker strategy, checks that
   all workers hold the same ledger step and sampler seed (a collective);
5. on the first batch after every ``compile``, probes the forward pass:
   examples that interact (:mod:`tf_dpnsgd.interaction`); with ``length_key``,
   on the call's batches until one has a row shorter than the padded length,
   rows whose output depends on their padding length
   (:mod:`tf_dpnsgd.padding_probe`: chunks are cut to their longest row);
   under XLA, for every new batch shape, traces the engine's per-example pass
   with the batch's STATIC shapes (:func:`make_structure_check`), so that
   the engines' shape checks (one row per example: e.g. tokens folded into
   the batch axis before a Dense) are decided while tracing, in Python, and
   cannot be compiled away; variable writes in the forward pass are refused
   by the engines while tracing (:mod:`tf_dpnsgd.per_example.stateless`) and
   a forward pass that cannot be reproduced with every random op frozen by
   the probe;
6. only then runs the step, and records on the host how far the lineage got.

Why on the host: an in-graph ``tf.debugging.Assert`` orders only what
depends on it and XLA (``jit_compile=True``) removes it, so a check there
can silently vanish. Here a failed check raises before any op of the step
ran: weights, optimizer state, noise stream and ledger are untouched.
"""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

from tf_dpnsgd import coverage
from tf_dpnsgd import distribution
from tf_dpnsgd import forward_checks
from tf_dpnsgd import interaction
from tf_dpnsgd import ledger as ledger_lib
from tf_dpnsgd import padding_probe
from tf_dpnsgd import participation
from tf_dpnsgd import rows as rows_lib
from tf_dpnsgd import users as users_lib



class GuardState:
  """Per-model guard state (plain Python, never saved)."""

  def __init__(self):
    self.probe_pending = True  # probe the next batch (set again by every compile)
    self.padding_probe_pending = True  # length_key: rows vs their padding (idem)
    self.fit_checks_pending = False  # set by every fit
    self.batch_source = None  # "arrays" while a fit draws from in-memory arrays
    self.participation = participation.ParticipationCheck()  # who ran in which step
    self.restored_compile = False  # compiled by load_model, not (yet) by the user

  def untagged_allowed(self, model):
    """``(allowed, hint, vouched)`` for an untagged batch in the current call."""
    if self.batch_source == "arrays":
      return True, "", False
    if getattr(model, "trust_untagged_batches", False):
      return True, "", True
    return False, (" Or, if the pipeline provably yields each example at most once per batch "
                   "and once per epoch, build the model with trust_untagged_batches=True: the "
                   "report then lists that assumption as not verified."), False


def _tags_row(tags):
  steps = tf.cast(tags[ledger_lib.DP_STEP_KEY], tf.int64)
  sampler = tf.cast(tags[ledger_lib.DP_SAMPLER_KEY], tf.int64)
  seed = tf.cast(tags[ledger_lib.DP_SEED_KEY], tf.int64)
  kind = tf.cast(tags[ledger_lib.DP_KIND_KEY], tf.int64)
  period = tf.reduce_max(tf.cast(tags[ledger_lib.DP_PERIOD_KEY], tf.int64))
  kinds = tf.where(tf.equal(tf.reduce_min(kind), tf.reduce_max(kind)), kind[0],
                   tf.constant(-1, tf.int64))
  return tf.stack([kinds, tf.reduce_min(steps), tf.reduce_max(steps), tf.reduce_min(sampler),
                   tf.reduce_max(sampler), tf.reduce_min(seed), tf.reduce_max(seed), period])


def _row_identity(x, y, mask, tags):
  """``(examples, real, digest_ok, identities, users)`` per row: the ``dp_example`` tags,
  the unmasked rows, whether each row's digest, recomputed now, is the one the sampler
  tagged, the ``dp_identity`` tags and the ``dp_user`` tags (empty if the batch has none:
  not user-level)."""
  examples = tf.cast(tags[ledger_lib.DP_EXAMPLE_KEY], tf.int64)
  real = tf.ones_like(examples, tf.bool) if mask is None else tf.cast(mask, tf.bool)
  digest_ok = tf.equal(rows_lib.row_digests((x, y), xla=True),
                       tf.cast(tags[ledger_lib.DP_DIGEST_KEY], tf.int64))
  users = (tf.cast(tags[ledger_lib.DP_USER_KEY], tf.int64) if ledger_lib.DP_USER_KEY in tags
           else tf.zeros([0], tf.int64))
  return (examples, real, digest_ok, tf.cast(tags[ledger_lib.DP_IDENTITY_KEY], tf.int64),
          users)


def make_batch_reader(model):
  """``fn(data) -> per-replica (int64[8] tag summary, examples, real, digest_ok,
  identities)``, running the optimizer's step checks (the last four: :func:`_row_identity`,
  empty if untagged).

  Compiled without XLA (its assertions run), or run eagerly when the model
  runs eagerly.
  """
  strategy = model.distribute_strategy

  def replica_fn(data):
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    mask, denominator, tags = ledger_lib.parse_batch_weights(sample_weight)
    checks = []
    step_checks = getattr(model.optimizer, "step_checks", None)
    if step_checks is not None:  # adaptive clipping: 2 sigma_b > sigma for this batch
      local = denominator is None
      if local:
        microbatches = getattr(model, "num_microbatches", None)
        denominator = (microbatches if microbatches
                       else tf.shape(tf.nest.flatten(x)[0], out_type=tf.int64)[0])
      checks = list(step_checks(denominator, local_denominator=local))
    with tf.control_dependencies(checks):
      if tags is None:
        none = tf.zeros([0], tf.int64)
        return (tf.zeros([8], tf.int64), none, tf.cast(none, tf.bool), tf.cast(none, tf.bool),
                none, none)
      return (tf.identity(_tags_row(tags)),) + _row_identity(x, y, mask, tags)

  def read(data):
    return strategy.run(replica_fn, args=(data,))

  if model.run_eagerly:
    return read
  # No branch here tests a tensor: AutoGraph would only transpile (about 1 s of a process's
  # first fit, 18 functions) to the same graph.
  return tf.function(read, jit_compile=False, reduce_retracing=True, autograph=False)


def summarize(reader, strategy, data) -> tuple:
  """The host's ``(BatchSummary, RowCheck, identities, users)`` of one (possibly
  distributed) batch: its tags (:class:`~tf_dpnsgd.ledger.BatchSummary`), its rows over
  all local replicas (:class:`~tf_dpnsgd.rows.RowCheck`), the identities of its real rows
  (:mod:`tf_dpnsgd.participation`; None if untagged) and, for a user-level batch,
  ``(dp_user tags, real)`` of all its rows (:mod:`tf_dpnsgd.users`; else None)."""
  _, _, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
  tagged = isinstance(sample_weight, dict) and ledger_lib.DP_KIND_KEY in sample_weight
  summary, examples, real, digest_ok, identities, users = (
      [np.asarray(v) for v in strategy.experimental_local_results(part)]
      for part in reader(data))
  if not tagged:
    return ledger_lib.BatchSummary(False), rows_lib.RowCheck(), None, None
  merged = ledger_lib.BatchSummary.merge(
      ledger_lib.BatchSummary(True, *[int(v) for v in t]) for t in summary)
  real = np.concatenate(real).astype(bool)
  users = np.concatenate(users)
  return (merged, rows_lib.count_problems(np.concatenate(examples), real,
                                          np.concatenate(digest_ok)),
          np.concatenate(identities)[real],
          (users, real) if ledger_lib.DP_USER_KEY in sample_weight else None)


def check_units(model, ledger, user_rows) -> None:
  """The privacy unit of every batch is the model's and the ledger's, and a user-level
  batch's units each hold one user, none twice (:mod:`tf_dpnsgd.users`). Raises before
  any op of the step."""
  rows_per_user = getattr(model, "_dp_rows_per_user", None)
  users_lib.check_ledger_unit(rows_per_user, ledger)
  for offset, pair in enumerate(user_rows):
    where = f"batch {offset} of this call" if offset else "this batch"
    users, real = (None, None) if pair is None else pair
    users_lib.check_user_batch(rows_per_user, users, real, where)


def check_participation(state, ledger, summaries, identities) -> list:
  """Each tagged batch's real rows may run in its step by its sampling's rule, checked on
  their identities (:class:`tf_dpnsgd.participation.ParticipationCheck`); returns what to
  commit once the steps ran. Raises before any op of the step."""
  records = []
  for offset, (summary, ids) in enumerate(zip(summaries, identities)):
    if not summary.tagged:
      continue
    kind = ledger_lib.KIND_NAMES[summary.kind]
    records.append(state.participation.check(kind, ledger.steps + offset, summary.period,
                                             summary.seed_min, ids, offset))
  return records


def _check_workers(strategy, ledger, summary) -> None:
  """Scenario: workers resuming from different checkpoints or with different seeds."""
  if not distribution.is_multi_worker(strategy):
    return
  distribution.check_same_on_all_workers(strategy, ledger.steps, "privacy ledger step")
  distribution.check_same_on_all_workers(strategy, ledger.lineage, "privacy ledger lineage")
  distribution.check_same_on_all_workers(strategy, ledger.noise_generation,
                                         "privacy ledger noise generation")
  distribution.check_same_on_all_workers(strategy, summary.seed_min if summary.tagged else 0,
                                         "sampler seed (hash)")


def make_structure_check(model):
  """``check(data)``: under XLA, :func:`tf_dpnsgd.forward_checks.verify_step_structure`
  once per new batch shape signature (see the module doc); without XLA the engines'
  own checks run in the step's graph and nothing is added here."""
  seen = set()
  strategy = model.distribute_strategy

  def check(data):
    if not model.jit_compile:
      return
    signature = forward_checks.shape_signature(data, strategy)
    if signature in seen:
      return
    forward_checks.verify_step_structure(model, data)
    seen.add(signature)

  return check


def _take(iterator, count):
  stream = iter(iterator)
  batches = [next(stream)]  # StopIteration: end of the data, as Keras expects
  for _ in range(count - 1):
    try:
      batches.append(next(stream))
    except StopIteration:
      break
  return batches


def _check_correlated_noise(model, ledger) -> None:
  """Correlated noise (:mod:`tf_dpnsgd.correlated`): the optimizer's ``b`` must be the one
  of the steps in the ledger (independent noise, ``b = 1``, cannot continue a correlated
  history, nor the reverse), and its buffers must continue the ledger's
  ``[lineage, generation, step]`` (a rollback, a reloaded model whose optimizer state was
  not restored, or a new optimizer mid-run cannot continue the banded stream).
  Checked on the host before the step: nothing runs, nothing is counted."""
  optimizer = getattr(model, "optimizer", None)
  bands = getattr(optimizer, "bands", 1)
  if ledger.steps and ledger.noise_bands != bands:
    raise ledger_lib.LedgerMismatchError(
        f"tf_dpnsgd: the model's privacy ledger holds {ledger.steps} steps of "
        f"{ledger_lib.noise_name(ledger.noise_bands)}, but the optimizer adds "
        f"{ledger_lib.noise_name(bands)}: correlated and independent noise (or two "
        "strategies) cannot be "
        "mixed in one model's history, which no plan accounts for. Compile with the optimizer "
        "of the steps that ran (model.save / load_model keeps it), or train a new model.")
  band = getattr(optimizer, "band_noise", None)
  if band is None:
    return
  stream = (ledger.lineage, ledger.noise_generation, ledger.steps)
  if not band.host_continues(stream):
    raise ledger_lib.LedgerMismatchError(
        "tf_dpnsgd: the correlated-noise buffers of the optimizer do not continue the model's "
        f"privacy ledger (at step {ledger.steps}, noise generation {ledger.noise_generation}): "
        "after a rollback, a reload without the optimizer's state, or with a new optimizer "
        "mid-run, the banded mechanism cannot continue. Restore the optimizer state saved "
        "with the ledger (model.save / load_model), or train a new model.")


def _check_restored_training(model, ledger, state) -> None:
  """After ``load_model`` (a compile restored from a file, not the user's), the step must
  continue the training the ledger recorded: the same trainable variables (by shape and
  dtype, :func:`tf_dpnsgd.ledger.trainable_signature`) and the optimizer's own state.

  Why: Keras merges LoRA factors into the kernels when it saves a ``.keras`` file, so a
  reloaded LoRA model would silently train every kernel, and Keras skips an optimizer state
  whose variables do not match (only a warning), so momentum or Adam's moments would restart
  mid-plan. Neither is a privacy failure (the steps are still counted), but neither is the
  training the user set up: both are refused until the user compiles again, which accepts
  the model as it is. Checked on the host before the step: nothing runs, nothing is counted.
  """
  if not state.restored_compile or not ledger.steps:
    return
  digest, count, size = ledger.trained_signature
  now = ledger_lib.trainable_signature(model.trainable_variables)
  if digest and now[0] != digest:
    raise ledger_lib.LedgerMismatchError(
        f"tf_dpnsgd: what trains changed since the model's last private step: its privacy "
        f"ledger's steps updated {count} variables ({size:,} weights), this reloaded model "
        f"would update {now[1]} ({now[2]:,} weights). Keras merges LoRA factors into the "
        "kernels when it saves a .keras file, so a reloaded LoRA model trains whole kernels "
        "unless LoRA is enabled again. Enable LoRA on the same layers with the same rank "
        "(e.g. backbone.enable_lora(rank, target_names) or layer.enable_lora(rank)), freeze "
        "what was frozen, then model.compile(...) with the DP optimizer; or, to train this "
        "set on purpose, model.compile(...) again (a compile by you accepts the model as "
        "it is).")
  if int(model.optimizer.iterations.numpy()) == 0:
    raise ledger_lib.LedgerMismatchError(
        f"tf_dpnsgd: the optimizer's state was not restored with the model (Keras skips a "
        f"saved optimizer state that does not match, with only a warning), but the privacy "
        f"ledger holds {ledger.steps} steps: the run would restart its momentum / moments "
        "mid-plan. Load a file whose optimizer matches the model, or model.compile(...) "
        "with a fresh DP optimizer to restart it on purpose.")
  state.restored_compile = False  # checked once: the steps now continue the ledger


def _build_and_choose_engine(model, data) -> None:
  """A subclassed model compiled before it was built: build it on the first batch's
  features (a forward pass, nothing trained), then choose the per-example engine."""
  if not model.built:
    if distribution.num_replicas(model.distribute_strategy) > 1:
      raise ValueError(f"Build model '{model.name}' before fit under a tf.distribute "
                       "strategy: call it on a batch or model.build(input_shape) in scope.")
    x, _, _ = keras.utils.unpack_x_y_sample_weight(data)
    model(x, training=False)
  model._dp_resolve_engine()


def wrap(model, main):
  """Returns the guarded train function around Keras' ``main`` (see the module doc)."""
  state = model._dp_guard
  ledger = ledger_lib.ledger_of(model)
  strategy = model.distribute_strategy
  reader = make_batch_reader(model)
  probe = interaction.make_probe_function(model)
  padding = padding_probe.make_padding_probe_function(model)  # None without length_key
  structure = make_structure_check(model)

  def function(iterator):
    ledger.sync()
    batches = _take(iterator, max(1, int(model.steps_per_execution)))
    if getattr(model, "_dp_engine", None) is None:
      _build_and_choose_engine(model, batches[0])
    summaries, row_checks, identities, user_rows = zip(*[summarize(reader, strategy, data)
                                                         for data in batches])
    if state.fit_checks_pending:
      _check_workers(strategy, ledger, summaries[0])
      state.fit_checks_pending = False
    _check_correlated_noise(model, ledger)
    _check_restored_training(model, ledger, state)
    allowed, hint, vouched = state.untagged_allowed(model)
    for offset, summary in enumerate(summaries):
      ledger.check_batch(summary, offset, untagged_allowed=allowed, untagged_hint=hint)
    for offset, row_check in enumerate(row_checks):
      rows_lib.check_rows(row_check, offset)
    participations = check_participation(state, ledger, summaries, identities)
    check_units(model, ledger, user_rows)
    if state.probe_pending:
      tested, interacting = probe(batches[0])
      if any(bool(t) for t in strategy.experimental_local_results(interacting)):
        raise interaction.ExampleInteractionError(
            interaction.interaction_message(f"model '{model.name}'"))
      state.probe_pending = not any(bool(t) for t in strategy.experimental_local_results(tested))
    if padding is not None and state.padding_probe_pending:  # chunks cut only if rows allow
      state.padding_probe_pending = padding_probe.check_batches(padding, model, batches)
    for data in batches:
      structure(data)
    if vouched and any(not s.tagged for s in summaries):
      ledger.add_flags(coverage.UNVERIFIED_BATCHES)
    try:
      out = main(batches)
    finally:
      ledger.after_steps()
    for record in participations:
      state.participation.commit(record)
    return out

  return function


__all__ = ["GuardState", "make_batch_reader", "summarize", "wrap"]
