"""One plan object: the sampler, the noise multiplier, the event and the report, together.

This module is long (about 620 lines): the plan's fields and everything derived from them
(sampler, noise, event, report, ledger checks) are one frozen object, kept in one file.

A :class:`PrivacyPlan` holds the few numbers a privacy claim rests on
(``N``, ``B``, the sampling, steps or epochs, ``sigma`` or a target
epsilon, ``delta``) and derives everything else from them, so the batches
that train the model, the noise the optimizer adds and the epsilon that is
reported cannot drift apart:

>>> plan = PrivacyPlan(dataset_size=50000, batch_size=1000, sampling="poisson",
...                    epochs=100, target_epsilon=2.0, delta=1e-5, seed=0)
>>> plan.num_steps
5000
>>> sigma = plan.training_noise_multiplier          # calibrated; give it to the optimizer
>>> plan.planned_report().epsilon <= 2.0
True

Training::

    optimizer = tf_dpnsgd.DPNSGD(learning_rate=0.1, regularizer=0.01,
                                 noise_multiplier=plan.training_noise_multiplier)
    model.compile(optimizer=optimizer, loss=...)
    model.fit(plan.dataset(x, y, model=model), callbacks=plan.callbacks(),
              **plan.fit_kwargs(model))
    print(plan.report(model).epsilon)      # what the model's privacy ledger executed

Resuming, a second ``fit``, a recompile: the same three lines. ``model=model``
continues the sampler stream at the model's privacy-ledger step (restored by
``load_weights`` and ``.keras`` loading), so no batch is replayed or skipped;
the train step refuses one that would be.

The report reads only the model's ledger (:mod:`tf_dpnsgd.ledger`): the steps
actually taken, the kind of batch they consumed and the smallest noise
multiplier used. With quantile-adaptive clipping that multiplier is the
effective one of the gradient and count queries together
(:mod:`tf_dpnsgd.accounting.adaptive`), so calibration, the accountant and the
ledger check need nothing else; the report adds a note with the split. It refuses (:class:`tf_dpnsgd.ledger.LedgerMismatchError`)
to describe a ledger that does not match the plan, e.g. Poisson accounting
for batches that Keras drew itself.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from typing import Optional


from tf_dpnsgd import accounting
from tf_dpnsgd import callbacks as callbacks_lib
from tf_dpnsgd import coverage
from tf_dpnsgd import distribution
from tf_dpnsgd import ledger as ledger_lib
from tf_dpnsgd import sampling as sampling_lib
from tf_dpnsgd import users as users_lib
from tf_dpnsgd.correlated import sampling as correlated_lib


@dataclasses.dataclass(frozen=True)
class PrivacyPlan:
  """The privacy-relevant configuration of one training run (frozen, validated).

  Attributes:
    dataset_size: ``N``.
    batch_size: ``B`` (expected batch size ``qN`` for Poisson).
    sampling: ``"poisson"``, ``"uniform"`` or ``"shuffle"``.
    delta: in (0, 1).
    steps / epochs: exactly one; ``steps = floor(epochs * steps_per_epoch)``, so that
      ``epochs`` whole Keras epochs of :attr:`steps_per_epoch` steps run (see
      :meth:`fit_kwargs`) and the epsilon is that of exactly those steps.
    noise_multiplier / target_epsilon: exactly one; a target is met by
      calibrating ``sigma`` (bisection to ``calibration_tolerance``).
    accountant, bound, conversion: see :class:`tf_dpnsgd.accounting.AccountingSpec`.
    seed: sampler seed (``None``: drawn from the OS and recorded). Keep it secret: it
      is left out of ``repr``/``str`` and :meth:`public_dict`; only :meth:`to_dict` /
      :meth:`to_json` (to rebuild the plan, kept private like a checkpoint) hold it.
    max_batch_size, overflow_probability: Poisson padding (see
      :class:`tf_dpnsgd.sampling.PoissonSampler`).
    calibration_tolerance: absolute tolerance on the calibrated ``sigma``.
    releases: noise multipliers of the Gaussian releases of whole-training-set
      statistics made before training (:mod:`tf_dpnsgd.private_stats`, e.g.
      Tramer and Boneh's private feature normalization: two releases). They
      are composed with the steps in every epsilon, so a target epsilon
      leaves less for training; the model's ledger records each release
      made, and a report refuses a ledger with a release the plan does not
      account for.
    bands, blt: ``b`` cyclic Poisson parts, ``b``-banded or BLT ``(theta, omega)`` noise.
  """

  dataset_size: int
  batch_size: int
  sampling: str
  delta: float
  steps: Optional[int] = None
  epochs: Optional[float] = None
  noise_multiplier: Optional[float] = None
  target_epsilon: Optional[float] = None
  accountant: str = "rdp"
  bound: str = "default"
  conversion: str = "modern"
  seed: Optional[int] = dataclasses.field(default=None, repr=False)  # secret: not in repr
  max_batch_size: Optional[int] = None
  overflow_probability: float = 1e-12
  calibration_tolerance: float = 1e-3
  releases: tuple = ()
  bands: int = 1  # sampling="cyclic_poisson": b parts, b-banded noise (tf_dpnsgd.correlated)
  blt: tuple = ()  # (theta, omega): BLT noise, accounted without amplification
  user_key: Optional[str] = None  # sampling="user_poisson": the user id column (tf_dpnsgd.users)
  max_examples_per_user: Optional[int] = None  # sampling="user_poisson": k rows per user

  def __post_init__(self):
    users_lib.validate_plan(self.sampling, self.max_examples_per_user, self.user_key,
                            self.releases)
    object.__setattr__(self, "releases", tuple(
        accounting.validate_noise_multiplier(r) for r in self.releases))
    accounting.validate_dataset_and_batch(self.dataset_size, self.batch_size)
    accounting.validate_delta(self.delta, self.dataset_size)
    if (self.steps is None) == (self.epochs is None):
      raise ValueError("Give exactly one of `steps` and `epochs`.")
    if self.steps is not None:
      accounting.validate_steps(self.steps)
    else:
      accounting.planned_steps(self.epochs, self.dataset_size, self.batch_size, self.sampling)
    if (self.noise_multiplier is None) == (self.target_epsilon is None):
      raise ValueError("Give exactly one of `noise_multiplier` and `target_epsilon`.")
    if self.noise_multiplier is not None:
      accounting.validate_noise_multiplier(self.noise_multiplier)
    else:
      accounting.validate_target_epsilon(self.target_epsilon)
    if not self.calibration_tolerance > 0:
      raise ValueError(f"`calibration_tolerance` must be > 0; got {self.calibration_tolerance!r}.")
    if self.sampling not in ("poisson", "cyclic_poisson", "user_poisson") \
        and self.max_batch_size is not None:
      raise ValueError("`max_batch_size` applies to Poisson sampling only.")
    self.spec  # validates the sampling/accountant/bound/conversion combination
    object.__setattr__(self, "blt", self.spec.blt)  # as tuples of floats (JSON gives lists)
    if self.num_steps == 0:
      raise ValueError("The plan has zero steps (floor(epochs * steps_per_epoch) = 0).")
    if self.noise_multiplier is not None:
      # Fail now, not at the first callback, when the accountant cannot account for this
      # sigma (e.g. bound="paper" outside Bun et al.'s Thm 11).
      self.step_accountant  # pylint: disable=pointless-statement
    # Fix the seed now, so every sampler and record of this plan agrees on it.
    object.__setattr__(self, "seed", self.sampler.seed)

  # --- derived, cached (pure functions of the fields) ----------------------
  @functools.cached_property
  def spec(self) -> accounting.AccountingSpec:
    return accounting.make_spec(self.dataset_size, self.batch_size, self.sampling,
                                self.accountant, self.bound, self.conversion,
                                releases=self.releases, bands=self.bands, blt=self.blt)

  @functools.cached_property
  def steps_per_epoch(self) -> int:
    """Steps of one epoch (one Keras epoch in :meth:`fit_kwargs`).

    Shuffling: ``N // B``, the batches of one permutation (the accountant counts
    epochs). Poisson and uniform sampling: ``round(N / B)`` (halves up), the
    steps whose expected number of examples is closest to one pass over the data.

    >>> PrivacyPlan(dataset_size=1437, batch_size=128, sampling="poisson", epochs=40,
    ...             noise_multiplier=1.0, delta=1e-5, seed=0).steps_per_epoch
    11
    """
    return accounting.steps_per_epoch(self.dataset_size, self.batch_size, self.sampling)

  @functools.cached_property
  def num_steps(self) -> int:
    """Total number of steps the claim covers: ``steps``, or
    ``floor(epochs * steps_per_epoch)`` (whole epochs for a whole ``epochs``)."""
    if self.steps is not None:
      return int(self.steps)
    # floor(epochs * steps_per_epoch), exactly (epochs read as its decimal value).
    return accounting.planned_steps(self.epochs, self.dataset_size, self.batch_size,
                                    self.sampling)

  @functools.cached_property
  def training_noise_multiplier(self) -> float:
    """The noise multiplier to train with: the given one, or calibrated to ``target_epsilon``."""
    if self.noise_multiplier is not None:
      return float(self.noise_multiplier)
    return accounting.calibrate_noise_multiplier(self.spec, self.target_epsilon, self.num_steps,
                                                 self.delta, self.calibration_tolerance)

  @functools.cached_property
  def sampler(self) -> sampling_lib.Sampler:
    if self.sampling == users_lib.SAMPLING:  # N = users, B = users per batch
      return users_lib.UserPoissonSampler(
          self.dataset_size, self.batch_size, self.max_examples_per_user, seed=self.seed,
          max_users=self.max_batch_size, overflow_probability=self.overflow_probability,
          spec=self.spec)
    kwargs = {}
    if self.sampling in ("poisson", "cyclic_poisson"):
      kwargs = {"max_batch_size": self.max_batch_size,
                "overflow_probability": self.overflow_probability}
    return correlated_lib.make_sampler(self.sampling, self.dataset_size, self.batch_size,
                                       seed=self.seed, spec=self.spec, **kwargs)

  @functools.cached_property
  def step_accountant(self) -> accounting.StepAccountant:
    """Epsilon after any number of steps at the training noise multiplier (cached)."""
    return accounting.StepAccountant(self.spec, self.training_noise_multiplier, self.delta)

  # --- the four things the plan yields ---------------------------------------
  def dp_event(self, steps: Optional[int] = None):
    """The sampler's dp-accounting event for ``steps`` (default: all planned) steps (the
    sampler holds this plan's :attr:`spec`)."""
    steps = self.num_steps if steps is None else steps
    return self.sampler.dp_event(self.training_noise_multiplier, steps)

  def epsilon(self, steps: Optional[int] = None) -> float:
    return self.step_accountant.epsilon(self.num_steps if steps is None else steps)

  def planned_report(self) -> accounting.PrivacyReport:
    """The report the plan promises if all planned steps run (planning only)."""
    return self._report(self.num_steps)

  def _report(self, steps: int, notes=(), releases=None) -> accounting.PrivacyReport:
    """The report for ``steps`` steps and ``releases`` (default: the planned ones)."""
    target = None if self.target_epsilon is None else float(self.target_epsilon)
    accountant = self.step_accountant
    if releases is not None and tuple(releases) != self.releases:
      accountant = accounting.StepAccountant(self._spec_with_releases(releases),
                                             self.training_noise_multiplier, self.delta)
    report = accountant.report(
        steps, target_epsilon=target,
        calibration_tolerance=None if target is None else self.calibration_tolerance)
    notes = tuple(notes) + users_lib.report_notes(self)
    if notes:
      report = dataclasses.replace(report, notes=tuple(report.notes) + tuple(notes))
    return report

  def check_ledger(self, ledger) -> list:
    """Raises :class:`~tf_dpnsgd.ledger.LedgerMismatchError` unless this plan can account
    for what ``ledger`` (or a model's ledger) recorded; returns notes for the report."""
    ledger = _as_ledger(ledger)
    self._check_releases(ledger)
    users_lib.check_ledger_unit(self.max_examples_per_user, ledger)
    steps = ledger.steps
    if steps == 0:
      return []
    kind = ledger.kind
    notes = []
    if kind == ledger_lib.UNTAGGED:
      if self.sampling != "shuffle":
        raise ledger_lib.LedgerMismatchError(
            f"The model's privacy ledger holds {steps} steps on batches that Keras drew "
            f"itself (model.fit(x, y, batch_size=...)), but this plan accounts for "
            f"{self.sampling} sampling: that epsilon would not describe the training. Train "
            "on model.fit(plan.dataset(x, y, model=model), **plan.fit_kwargs(model)); for "
            "the honest epsilon of what ran, report it with a plan of sampling='shuffle'.")
      notes.append("The batches were drawn by Keras (untagged), not by the plan's sampler: "
                   "each step is accounted as one full Gaussian mechanism, with no "
                   "assumption about epochs (conservative).")
    elif kind != self.sampling or ledger.sampler != self.sampler.fingerprint:
      raise ledger_lib.LedgerMismatchError(
          f"The model's privacy ledger holds {steps} steps of {kind} batches from another "
          f"sampler (sampling, N or B) than this plan's ({self.sampling}, "
          f"N={self.dataset_size}, B={self.batch_size}); report them with the plan that "
          "drew them.")
    notes += correlated_lib.check_ledger_noise(ledger, self.bands, self.spec.blt_strategy)
    sigma = self.training_noise_multiplier
    used = ledger.min_noise_multiplier
    if used < sigma * (1 - 1e-6):
      raise ledger_lib.LedgerMismatchError(
          f"A step in the model's privacy ledger used noise_multiplier {used:.6g}, below the "
          f"plan's {sigma:.6g}: the plan's epsilon would understate it. Build the optimizer "
          "with noise_multiplier=plan.training_noise_multiplier.")
    seeded = ledger.user_seeded_steps
    if seeded:
      notes.append(f"{seeded} of {steps} steps drew their noise from a user-fixed seed: a "
                   "reproducibility experiment. Anyone who knows the seed can remove the "
                   "noise; do not release such a model as private.")
    return notes

  def _check_releases(self, ledger) -> None:
    """Refuses a ledger whose releases this plan does not account for, event by event.

    Each release the ledger recorded must be matched by a planned release of at most its
    noise multiplier (the planned epsilon then bounds the releases' part): the ledger's
    multipliers and the plan's, each sorted, must satisfy ``plan[i] <= ledger[i]`` for
    every release made (:func:`releases_covered`), never a count and a minimum.
    """
    made = ledger.release_noise_multipliers
    if len(made) > len(self.releases):
      raise ledger_lib.LedgerMismatchError(
          f"The model's privacy ledger records {len(made)} release(s) of training-set "
          f"statistics (noise multipliers {_fmt(made)}; e.g. private feature normalization), "
          f"but this plan accounts for {len(self.releases)}: its epsilon would leave them "
          "out. Give the plan releases=(...) with the noise multiplier of each release.")
    if not releases_covered(self.releases, made):
      raise ledger_lib.LedgerMismatchError(
          f"The releases recorded in the model's privacy ledger (noise multipliers "
          f"{_fmt(made)}) are not covered by the plan's ({_fmt(self.releases)}): a release "
          "used less noise than the planned release it would be matched with (below the "
          "plan), so the plan's epsilon would understate it. Give the plan the releases "
          "that ran: releases=model.privacy_ledger.release_noise_multipliers.")

  def _spec_with_releases(self, releases) -> accounting.AccountingSpec:
    releases = tuple(releases)
    if releases == self.releases:
      return self.spec
    return dataclasses.replace(self.spec, releases=releases)

  def report(self, model=None) -> accounting.PrivacyReport:
    """The privacy report of what ``model`` (or its ``privacy_ledger``) executed.

    The accountant composes the ledger's events: its steps (at the plan's noise
    multiplier, which every step's is checked against) and exactly the statistics
    releases the ledger recorded (not the planned ones).

    Raises:
      LedgerMismatchError: the ledger's steps or releases are not what this plan
        accounts for.
    """
    ledger = _as_ledger(model)
    notes = self.check_ledger(ledger)
    steps = ledger.steps
    releases = ledger.release_noise_multipliers
    if ledger.kind == ledger_lib.UNTAGGED:
      # One composition per step: the shuffle accountant with one batch per "epoch".
      spec = accounting.make_spec(self.dataset_size, self.dataset_size, "shuffle",
                                  self.accountant, self.bound, self.conversion,
                                  releases=releases)
      report = accounting.StepAccountant(spec, self.training_noise_multiplier,
                                         self.delta).report(steps)
      return dataclasses.replace(report, notes=tuple(report.notes) + tuple(notes),
                                 not_covered=coverage.not_covered(model))
    if steps > self.num_steps:
      notes.append(f"{steps} steps ran, more than the {self.num_steps} planned; the epsilon "
                   "covers all of them.")
    notes.extend(self._adaptive_clipping_notes(ledger))
    # What the model depends on outside the Gaussian mechanism (tf_dpnsgd.coverage).
    return dataclasses.replace(
        self._report(steps, notes, releases=releases),
        not_covered=tuple(coverage.not_covered(model)) + users_lib.not_covered(self))

  def _adaptive_clipping_notes(self, ledger) -> list:
    """What the report says about adaptive clipping's count query, from what the ledger
    recorded (nothing if no step used it; the optimizer is never read back)."""
    adaptive = ledger.adaptive_clipping()
    if adaptive is None:
      return []
    sigma = self.training_noise_multiplier
    sigma_b = adaptive["min_clipped_count_stddev"]
    try:
      sigma_grad = f"{accounting.gradient_noise_multiplier(sigma, sigma_b):.6g}"
    except accounting.AccountingError:
      sigma_grad = "undefined (2 sigma_b <= sigma: such steps were refused)"
    return [f"Quantile-adaptive clipping (Andrew et al. 2021): each step released the "
            f"clipped gradient sum (noise multiplier sigma_grad = {sigma_grad}) and a noised "
            f"count of unclipped examples (sensitivity 1/2, std sigma_b = {sigma_b:.6g}); "
            f"the epsilon accounts for both through the effective noise multiplier "
            f"(sigma_grad^-2 + (2 sigma_b)^-2)^(-1/2) = {sigma:.6g}. Clip now: "
            f"{adaptive['l2_norm_clip']:.6g} (initial "
            f"{adaptive['initial_l2_norm_clip']:.6g}, target unclipped quantile "
            f"{adaptive['target_unclipped_quantile']:.6g}, clip learning rate "
            f"{adaptive['clip_learning_rate']:.6g})."]

  def epsilon_of(self, model) -> float:
    """Epsilon of what ``model``'s ledger executed (see :meth:`report`)."""
    return self.report(model).epsilon

  def extended(self, *, target_epsilon: Optional[float] = None,
               epochs: Optional[float] = None, steps: Optional[int] = None) -> "PrivacyPlan":
    """This plan with more steps at the SAME noise multiplier (what
    ``model.extend_privacy_plan`` does for a model that owns its plan).

    The steps already taken used :attr:`training_noise_multiplier`; the new plan
    fixes it (``noise_multiplier=``), so its epsilon for the ledger's steps is
    exact, and counts every step from the first.

    Args:
      target_epsilon: the new total budget: as many steps as fit in it (whole
        epochs for a plan of ``epochs``).
      epochs / steps: the new total, counted from the first step.
      Exactly one of the three.

    Returns:
      A new plan (same data set, batch size, sampling, accountant, releases and
      sampler seed) with more steps than this one.

    Raises:
      ValueError: not exactly one argument, or no more steps than this plan.
    """
    given = {k: v for k, v in (("target_epsilon", target_epsilon), ("epochs", epochs),
                               ("steps", steps)) if v is not None}
    if len(given) != 1:
      raise ValueError("Extend a privacy plan by exactly one of `target_epsilon`, `epochs` "
                       f"and `steps` (the new totals); got {sorted(given) or 'none'}.")
    sigma = self.training_noise_multiplier
    if target_epsilon is not None:
      fits = self.step_accountant.max_steps(accounting.validate_target_epsilon(target_epsilon))
      epochs, steps = ((fits // self.steps_per_epoch, None) if self.epochs is not None
                       else (None, fits))  # whole epochs for a plan of epochs
    if (steps if steps is not None else epochs * self.steps_per_epoch) > self.num_steps:
      new = dataclasses.replace(self, noise_multiplier=sigma, target_epsilon=None,
                                epochs=epochs, steps=steps)
      if new.num_steps > self.num_steps:
        return new
    raise ValueError(
        f"The extended plan ({given}) would not run more than the {self.num_steps} steps "
        f"this plan runs (epsilon {self.epsilon():.4g} at noise multiplier {sigma:.6g}): "
        "give a larger total, counted from the first step.")

  # --- training helpers ------------------------------------------------------
  def dataset(self, x, y, start_step: Optional[int] = None, model=None,
              num_replicas: Optional[int] = None, *, augment=None, multiplicity: int = 1,
              user_ids=None, **removed):
    """The sampler's infinite ``tf.data`` stream (see :meth:`fit_kwargs`).

    Args:
      x, y: the ``N`` training examples.
      start_step: the first step's index; default: ``model``'s ledger step, or 0.
      model: the DP model this stream feeds; the stream then continues its
        privacy ledger (after a resume, a second ``fit`` or a recompile), and
        is cut for its ``distribute_strategy``.
      num_replicas: replicas the global batch is split over (default: those of
        ``model``'s strategy, else 1); the batch is padded with masked rows to
        a multiple of it (see :mod:`tf_dpnsgd.distribution`).
      augment: optional per-example augmentation ``fn(x_i, y_i, seed) -> x_i'``:
        one example's inputs and label (one row of each leaf) and a stateless
        seed (int64 ``[2]``, fresh for each example, step and view) in, that
        example's new inputs out. The sampler applies it to each row alone
        before batching and tagging (:mod:`tf_dpnsgd.augmentation`), in every
        replica's pipeline, padding rows included (masked: they contribute
        zero). ``fn`` must read only its arguments and public constants.
      multiplicity: ``K`` views of each example (``fn`` with ``K`` seeds),
        stacked on a new axis 1 of every ``x`` leaf (``[B, K, ...]``); the
        model must then average over the views INSIDE each example's loss, so
        that the views share one clipped/normalized contribution: e.g.
        ``make_private(views.multi_view(head, K))`` compiled with
        ``loss=views.view_mean_loss()`` (:mod:`tf_dpnsgd.models.views`;
        evaluate ``head`` on plain inputs). Needs ``augment``.
      user_ids: user-level plans (``sampling="user_poisson"``): one user id per row;
        default: ``x[user_key]`` (removed from ``x`` before the model sees it).

    Augmentation goes through ``augment`` only. The batches carry each row's
    example index and content digest (:mod:`tf_dpnsgd.rows`); a ``.map``,
    ``.concatenate`` or ``flat_map`` on the returned stream that changes a
    row (MixUp across rows, a dtype cast) or repeats an example or a batch
    is refused before the step (:class:`~tf_dpnsgd.ledger.LedgerMismatchError`):
    a batch-level transformation can make one example reach several rows and
    multiply its sensitivity.

    Returns:
      A ``tf.data.Dataset`` of global batches; under ``model``'s single-worker
      strategy with several replicas, a ``tf.distribute`` distributed dataset
      with one pipeline per replica, each gathering only its own shard
      (:func:`tf_dpnsgd.distribution.per_replica_dataset`; ``fit`` takes it
      as it is). Either way replica ``r`` trains on the same rows.

    Raises:
      ValueError: under a multi-worker strategy, when this plan's sampler seed
        is not worker 0's (the workers would draw different batches).
      TypeError: ``transform=`` (the removed batch-level hook) or another
        unknown argument.
    """
    _refuse_removed_arguments(removed)
    strategy = None if model is None else model.distribute_strategy
    if num_replicas is None:
      num_replicas = 1 if strategy is None else distribution.num_replicas(strategy)
    if strategy is not None:
      distribution.check_same_on_all_workers(strategy, self.sampler.seed_hash,
                                             "plan's sampler seed")
    first = _start_step(start_step, model)
    if model is not None:
      # Read the ledger again whenever an iterator starts: a restore between now and then
      # (BackupAndRestore, load_weights) moves the stream with the ledger.
      ledger = ledger_lib.ledger_of(model)

      def first():  # noqa: F811
        ledger.sync()
        return ledger.steps

    unit = {}
    if self.sampling == users_lib.SAMPLING:
      if user_ids is None:
        x, user_ids = users_lib.split_user_column(x, self.user_key)
      unit = {"user_ids": user_ids}
    elif user_ids is not None:
      raise ValueError("`user_ids` is for user-level plans (sampling='user_poisson').")

    def stream(replica):
      return self.sampler.dataset(x, y, start_step=first, num_replicas=num_replicas,
                                  replica_id=replica, augment=augment,
                                  multiplicity=multiplicity, **unit)

    if (strategy is not None and num_replicas > 1
        and num_replicas == distribution.num_replicas(strategy)
        and not distribution.is_multi_worker(strategy)):
      return distribution.per_replica_dataset(strategy, stream)
    return stream(None)

  def fit_kwargs(self, model=None, start_step: Optional[int] = None) -> dict:
    """``epochs``, ``steps_per_epoch`` and ``initial_epoch`` for ``model.fit``.

    ``initial_epoch`` follows ``model``'s privacy ledger (or ``start_step``).
    A plan of whole ``epochs`` runs exactly ``epochs`` Keras epochs of
    :attr:`steps_per_epoch` steps; otherwise the last Keras epoch is partial
    and :meth:`callbacks` stops training at the planned budget (the progress
    bar labels it, :class:`~tf_dpnsgd.callbacks.ProgressBar`).
    """
    start_step = _start_step(start_step, model)
    spe = self.steps_per_epoch
    return {"epochs": max(1, math.ceil(self.num_steps / spe)), "steps_per_epoch": spe,
            "initial_epoch": start_step // spe}

  def callbacks(self, log_dir=None, state_path=None, stop_at_budget: bool = True) -> list:
    """``[PrivacyCallback]`` logging epsilon and (by default) stopping at the planned epsilon."""
    budget = self.epsilon() if stop_at_budget else None
    return [callbacks_lib.PrivacyCallback(self, epsilon_budget=budget, log_dir=log_dir,
                                          state_path=state_path)]

  def check_optimizer(self, optimizer) -> None:
    """Raises ``ValueError`` unless ``optimizer`` adds the noise this plan accounts for."""
    sigma = getattr(optimizer, "noise_multiplier", None)
    if sigma is None:
      raise ValueError(f"{optimizer!r} is not a DP optimizer (no `noise_multiplier`).")
    expected = self.training_noise_multiplier
    correlated_lib.check_optimizer_bands(optimizer, self.bands, self.spec.blt_strategy)
    if not math.isclose(float(sigma), expected, rel_tol=1e-9, abs_tol=0.0):
      raise ValueError(
          f"The optimizer's noise_multiplier ({float(sigma)!r}) differs from the plan's "
          f"({expected!r}): the reported epsilon would not describe this training. Build the "
          "optimizer with noise_multiplier=plan.training_noise_multiplier.")
    if getattr(optimizer, "adaptive_clip", None) is not None:
      # The count query must leave room in the budget: 2 sigma_b > sigma (raises otherwise).
      accounting.gradient_noise_multiplier(
          expected, optimizer.resolved_clipped_count_stddev(self.batch_size))
    if "poisson" in self.sampling and getattr(optimizer, "num_microbatches", None):
      raise ValueError("Poisson-sampled (padded, masked) batches cannot be split into "
                       "microbatches; use num_microbatches=None.")

  # --- records ----------------------------------------------------------------
  def to_dict(self) -> dict:
    """The fields (with the resolved seed); ``PrivacyPlan(**d)`` rebuilds the plan.

    Contains the sampler seed, a secret: log or publish :meth:`public_dict` instead.
    """
    d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
    d["releases"] = list(self.releases)  # as JSON gives it back, so records compare equal
    d["blt"] = [list(v) for v in self.spec.blt]
    return d

  def public_dict(self) -> dict:
    """The fields without the sampler seed (safe to log, record and publish)."""
    d = self.to_dict()
    d.pop("seed")
    return d

  def to_json(self) -> str:
    return json.dumps(self.to_dict(), sort_keys=True)

  @classmethod
  def from_json(cls, text: str) -> "PrivacyPlan":
    return cls(**json.loads(text))


def _refuse_removed_arguments(removed: dict) -> None:
  """``plan.dataset``'s batch-level ``transform=`` is gone (no shim: a 0.x package)."""
  if "transform" in removed:
    raise TypeError(
        "PrivacyPlan.dataset no longer takes `transform=` (a function of the batch stream): "
        "it could mix rows (MixUp) or duplicate them (a batch followed by an augmented copy), "
        "so one example could move the sum by a multiple of the sensitivity. Pass a "
        "per-example augmentation instead: augment=fn with fn(x_i, y_i, seed) -> x_i' (and "
        "multiplicity=K for K views of each example, averaged in its loss).")
  if removed:
    raise TypeError(f"PrivacyPlan.dataset got unexpected argument(s) {sorted(removed)}.")


def releases_covered(planned, made) -> bool:
  """Whether planned releases account for the releases ``made`` (noise multipliers): each
  release made is matched with a distinct planned one of at most its noise multiplier.

  With both sorted ascending, the ``i``-th smallest made must be at least the ``i``-th
  smallest planned (the greedy matching is optimal; RDP decreases with the multiplier).

  >>> releases_covered((8.0, 8.0, 8.0, 2.0), (8.0, 8.0, 2.0, 2.0))  # issue 30, scenario 7
  False
  >>> releases_covered((2.0, 2.0, 8.0), (8.0, 2.0))
  True
  """
  planned, made = sorted(float(m) for m in planned), sorted(float(m) for m in made)
  if len(made) > len(planned):
    return False
  return all(m >= p * (1 - 1e-6) for p, m in zip(planned, made))


def _fmt(values) -> str:
  return "(" + ", ".join(f"{float(v):.6g}" for v in values) + ")"


def _as_ledger(model_or_ledger) -> ledger_lib.PrivacyLedger:
  if isinstance(model_or_ledger, ledger_lib.PrivacyLedger):
    return model_or_ledger
  if model_or_ledger is None or isinstance(model_or_ledger, (int, float)):
    raise TypeError(
        "PrivacyPlan.report takes the trained DP model (or its privacy_ledger), whose ledger "
        "records the steps that ran; planned_report() gives the plan's promise and "
        f"epsilon(steps) a hypothetical step count. Got {model_or_ledger!r}.")
  return ledger_lib.ledger_of(model_or_ledger)


def _start_step(start_step, model) -> int:
  if model is not None:
    taken = ledger_lib.ledger_of(model).steps
    if start_step is not None and start_step != taken:
      raise ValueError(f"start_step={start_step!r} but the model's privacy ledger has taken "
                       f"{taken} steps; omit start_step to continue the ledger.")
    return taken
  if start_step is None:
    return 0
  if isinstance(start_step, bool) or not isinstance(start_step, int) or start_step < 0:
    raise ValueError(f"`start_step` must be a non-negative integer; got {start_step!r}.")
  return start_step


__all__ = ["PrivacyPlan"]

