"""Shared machinery of the absl launchers: flags, one run of an experiment, its records.

Flags are defined and read here and in the launcher modules only; the library
below takes plain arguments. :func:`run_experiment` takes an
:class:`ExperimentConfig` (a frozen dataclass built from the flags by
:func:`config_from_flags`), so sweeps and tests can call it directly.

A run with ``model_dir`` writes there:

* ``checkpoint.weights.h5``: model and optimizer state (and the model's privacy
  ledger; never the noise key) at each epoch end; a rerun of the same run resumes
  from it (``run.json``: private or not, plan, dataset; any other run is refused,
  :mod:`tf_dpnsgd.launch.resume`), the sampler continuing at the restored step;
* ``run.json``: what trained the checkpoint (written before training);
* ``history.json``: per-epoch metrics (``loss``, ``accuracy``, ``val_*``, ``epsilon``,
  ``learning_rate``, ``grad_norm``, ...), kept across resumes; ``tensorboard/``: the same;
* ``privacy_report.json``: the run's :class:`~tf_dpnsgd.records.RunRecord`
  (epsilon, delta, noise multiplier, sampling, accountant, steps, dataset
  size, hyperparameters, final metrics, ``not_covered``: what the model depends on
  outside the Gaussian mechanism, see :mod:`tf_dpnsgd.coverage`) and package versions.

Seeds. ``--seed`` fixes only what is public: initialisation and data order
(the non-private shuffle, augmentation, dropout masks). The DP noise and the
batch sampler always draw their seeds from the OS (a resumed run draws new
ones), so two runs never release the same noise, and no seed is logged or
written anywhere, with one exception below. A ``--sampling=shuffle`` run therefore
resumes only at an epoch boundary (a new permutation mid-epoch would repeat
examples within the epoch). Publish the ``export_dir`` SavedModel (which holds no
optimizer or RNG state) and the privacy report.

Correlated noise (``--noise=bandmf --bands=b``: cyclic Poisson sampling, the
optimizer's ``band_coefficients`` optimized for the plan's steps, ``b`` and
``--momentum``; docs/correlated_noise.md) must keep one partition of the data for
the whole run. Such a run writes its sampler seed, a secret, to
``model_dir/sampler_seed.secret`` (owner-only) and a resume reads it back
(:mod:`tf_dpnsgd.launch.resume`); the noise buffers resume from the checkpoint. The
``model_dir`` of such a run is as private as the data. The noise seed is still
drawn from the OS on resume (fresh ``z_t``; the buffers carry the correlation).

Flag errors (both ``--noise_multiplier`` and ``--target_epsilon`` given, ``--optimizer=sgd``
with either, a regularizer <= 0, ...) are absl flag validators (exit status 1). When
neither privacy flag is given, a private optimizer calibrates to the
launcher's default ``--target_epsilon``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from typing import Any, Callable, Optional

from absl import flags
from absl import logging
import keras
import numpy as np

import tf_dpnsgd
from tf_dpnsgd import accounting
from tf_dpnsgd import distribution
from tf_dpnsgd import export as export_lib
from tf_dpnsgd import noise as noise_lib
from tf_dpnsgd import noise_choice
from tf_dpnsgd.correlated import blt as blt_lib
from tf_dpnsgd import runner
from tf_dpnsgd import schedules
from tf_dpnsgd.launch import logs
from tf_dpnsgd.launch import resume
from tf_dpnsgd.plan import PrivacyPlan
from tf_dpnsgd.records import RunRecord

from tf_dpnsgd.launch.validation import (  # noqa: F401 (re-exported: the launchers' API)
    ADAPTIVE_FLAGS, CHECKS, NOISES, NON_PRIVATE, OPTIMIZERS, PRIVACY_FLAGS, SAMPLINGS, STRATEGIES,
    LaunchError, check_bands_fit, non_private_message, resolve_privacy)


def _workload_momentum(cfg) -> float:
  """``--momentum`` for DP-SGD / DP-NSGD, 0 for DP-Adam / DP-NAdam (as ``make_private``)."""
  return cfg.momentum if cfg.optimizer in ("dpsgd", "dpnsgd") else 0.0


def resolve_auto_noise(cfg, dataset_size: int):
  """``(cfg, choice)``: ``--noise=auto`` replaced by what :mod:`tf_dpnsgd.noise_choice` chooses
  for ``N`` (independent, Poisson; or bandmf, cyclic Poisson), and the ``NoiseChoice`` (``None``
  for another ``--noise``). Public settings only: a rerun (a resume) chooses the same."""
  if cfg.noise != "auto":
    return cfg, None
  try:
    choice = noise_choice.choose_bands(
        dataset_size=int(dataset_size), batch_size=cfg.batch_size, delta=cfg.delta,
        target_epsilon=cfg.target_epsilon, epochs=cfg.epochs, accountant=cfg.accountant,
        momentum=float(_workload_momentum(cfg) or 0.0),
        max_bands=int(cfg.bands or noise_choice.DEFAULT_MAX_BANDS), conversion=cfg.conversion,
        releases=tuple(cfg.releases))
    chosen = dataclasses.replace(cfg, noise=choice.noise, sampling=choice.sampling,
                                 bands=choice.bands if choice.bands > 1 else None)
  except ValueError as e:
    raise LaunchError(str(e)) from None
  logging.info("%s", choice.describe())
  return chosen, choice


def band_coefficients(cfg, num_steps: int):
  """The optimizer's ``band_coefficients`` (``None``: not BandMF): the ``b``-banded
  strategy optimized for ``num_steps`` steps and the optimizer's momentum."""
  if cfg.noise != "bandmf":
    return None
  return tf_dpnsgd.correlated.noise.bandmf(int(num_steps), int(cfg.bands),
                                           momentum=_workload_momentum(cfg))


def blt_parameters(cfg, num_steps: int):
  """The plan's and the optimizer's BLT ``[theta, omega]`` (``None``: not BLT): the
  ``--blt_buffers`` BLT optimized for ``num_steps`` steps, separation ``--bands`` and the
  optimizer's momentum (deterministic: the plan and the optimizer get the same floats, and
  the plan refuses an optimizer whose BLT differs)."""
  if cfg.noise != "blt":
    return None
  return _optimized_blt(int(num_steps), int(cfg.blt_buffers or 2), int(cfg.bands),
                        float(_workload_momentum(cfg) or 0.0))


@functools.lru_cache(maxsize=8)
def _optimized_blt(steps, buffers, bands, momentum):
  """Deterministic, so cached: the plan and the optimizer ask for it (one L-BFGS run, not two)."""
  return blt_lib.optimize_blt(steps, buffers, bands, momentum=momentum).parameters()



@dataclasses.dataclass(frozen=True)
class ExperimentConfig:
  """Everything one training run needs (validated in ``__post_init__``)."""

  optimizer: str = "dpnsgd"
  learning_rate: float = 0.1
  regularizer: Optional[float] = 0.01
  l2_norm_clip: Optional[float] = 1.0
  target_unclipped_quantile: Optional[float] = None
  clip_learning_rate: Optional[float] = None
  clipped_count_stddev: Optional[float] = None
  noise_multiplier: Optional[float] = None
  target_epsilon: Optional[float] = None
  delta: float = 1e-5
  batch_size: int = 256
  physical_batch_size: Optional[int] = None
  epochs: float = 1.0
  max_steps: Optional[int] = None
  sampling: str = "poisson"
  accountant: str = "rdp"
  bound: str = "default"
  conversion: str = "modern"
  lr_schedule: str = "constant"
  momentum: float = 0.0
  weight_decay: float = 0.0
  ema_momentum: Optional[float] = None  # exponential moving average of the weights (None: off)
  per_example: str = "auto"
  model_dir: Optional[str] = None
  export_dir: Optional[str] = None
  seed: Optional[int] = None
  verbose: int = 2
  distribution_strategy: str = "none"
  tpu: Optional[str] = None
  noise: str = "independent"  # or "bandmf" / "blt" (with bands and sampling="cyclic_poisson")
  bands: Optional[int] = None
  blt_buffers: Optional[int] = None  # --noise=blt: buffers of the BLT (None: 2)
  releases: tuple = ()  # noise multipliers of pre-training releases (tf_dpnsgd.private_stats)

  def __post_init__(self):
    if self.optimizer not in NON_PRIVATE:
      if (self.noise_multiplier is None) == (self.target_epsilon is None):
        raise ValueError("Give exactly one of --noise_multiplier and --target_epsilon "
                         "(both or neither were given).")
    elif self.noise_multiplier is not None or self.target_epsilon is not None:
      raise ValueError(non_private_message(self.optimizer))
    values = dataclasses.asdict(self)
    for _, check in CHECKS:
      check(values)

  @property
  def private(self) -> bool:
    return self.optimizer not in NON_PRIVATE

  def hyperparameters(self) -> dict:
    """The fields worth recording (no directories; no seed: the report writer refuses
    ``seed`` fields, and --seed only fixes the initialisation)."""
    d = dataclasses.asdict(self)
    for k in ("model_dir", "export_dir", "seed", "verbose", "distribution_strategy", "tpu"):
      d.pop(k)
    return d


def define_flags(flag_values: Optional[flags.FlagValues] = None, **defaults) -> None:
  """Defines the flags shared by every launcher; ``defaults`` override per experiment.

  Also registers the validators (:data:`CHECKS` and :func:`resolve_privacy`),
  so a bad combination fails at flag parsing with a one-line message.
  ``flag_values``: default ``absl.flags.FLAGS`` (tests pass their own).
  """
  fv = flags.FLAGS if flag_values is None else flag_values
  d = {f.name: f.default for f in dataclasses.fields(ExperimentConfig)}
  d.update(defaults)
  kw = {"flag_values": fv}
  eps_default = (f" Default: {d['target_epsilon']:g} when --noise_multiplier is not given."
                 if d["target_epsilon"] is not None else "")
  flags.DEFINE_enum("optimizer", d["optimizer"], OPTIMIZERS,
                    "Optimizer (sgd, adam: non-private baselines; give no --noise_multiplier/"
                    "--target_epsilon).",
                    **kw)
  flags.DEFINE_float("learning_rate", d["learning_rate"], "Base learning rate.", **kw)
  flags.DEFINE_float("regularizer", d["regularizer"], "DP-NSGD/DP-NAdam regularizer r > 0.", **kw)
  flags.DEFINE_float("l2_norm_clip", d["l2_norm_clip"], "DP-SGD/DP-Adam clipping norm c > 0.",
                     **kw)
  flags.DEFINE_float("target_unclipped_quantile", d["target_unclipped_quantile"],
                     "DP-SGD/DP-Adam: quantile-adaptive clipping (Andrew et al. 2021) towards "
                     "this fraction of unclipped examples, from --l2_norm_clip. None: fixed clip.",
                     **kw)
  flags.DEFINE_float("clip_learning_rate", d["clip_learning_rate"],
                     "Adaptive clipping: eta_C of C <- C exp(-eta_C (b - gamma)) (default 0.2).",
                     **kw)
  flags.DEFINE_float("clipped_count_stddev", d["clipped_count_stddev"],
                     "Adaptive clipping: noise std of the unclipped count (default batch/20); "
                     "--noise_multiplier / the calibrated sigma is the effective one of both "
                     "queries.", **kw)
  flags.DEFINE_float("noise_multiplier", d["noise_multiplier"],
                     "Noise std / sensitivity. Exclusive with --target_epsilon.", **kw)
  flags.DEFINE_float("target_epsilon", d["target_epsilon"],
                     "Calibrate the noise multiplier to this epsilon. Exclusive with "
                     "--noise_multiplier." + eps_default, **kw)
  flags.DEFINE_float("delta", d["delta"], "Target delta.", **kw)
  flags.DEFINE_integer("batch_size", d["batch_size"], "Logical batch size (expected, for Poisson).",
                       **kw)
  flags.DEFINE_integer("physical_batch_size", d["physical_batch_size"],
                       "Process each logical batch in chunks of this size (memory).", **kw)
  flags.DEFINE_float("epochs", d["epochs"], "Epochs: floor(epochs * round(N / B)) steps "
                     "(N // B for shuffle).", **kw)
  flags.DEFINE_integer("max_steps", d["max_steps"],
                       "Stop after this many steps; the report covers the steps taken.", **kw)
  flags.DEFINE_enum("sampling", d["sampling"], SAMPLINGS,
                    "Batch sampling; the accounting follows it. cyclic_poisson goes with "
                    "--noise=bandmf (which sets it when --sampling is not given).", **kw)
  flags.DEFINE_enum("noise", d["noise"], NOISES,
                    "DP noise: independent (DP-SGD's fresh Gaussian each step) | bandmf (banded "
                    "matrix-factorization noise, correlated across --bands steps, under cyclic "
                    "Poisson sampling; docs/correlated_noise.md) | blt (buffered linear Toeplitz "
                    "noise under the same sampling, accounted without amplification) | auto "
                    "(independent or bandmf with at most --bands bands, default 32: whichever "
                    "the accounting predicts leaves less noise at --target_epsilon).",
                    **kw)
  flags.DEFINE_integer("bands", d["bands"],
                       "--noise=bandmf: the number of bands b >= 2; --noise=blt: the separation "
                       "b >= 1 of an example's steps (b * batch_size <= N, b <= steps); the "
                       "strategy is optimized for the planned steps, b and --momentum.", **kw)
  flags.DEFINE_integer("blt_buffers", d["blt_buffers"],
                       "--noise=blt: the BLT's number of buffers d >= 1 (default 2; each is a "
                       "model-sized optimizer variable).", **kw)
  flags.DEFINE_enum("accountant", d["accountant"], ("rdp", "pld"), "dp-accounting accountant.",
                    **kw)
  flags.DEFINE_enum("bound", d["bound"], ("default", "paper", "min"),
                    "RDP bound for --sampling=uniform: dp-accounting, the paper's, or their min.",
                    **kw)
  flags.DEFINE_enum("conversion", d["conversion"], ("modern", "classic"),
                    "RDP to (epsilon, delta) conversion.", **kw)
  flags.DEFINE_enum("lr_schedule", d["lr_schedule"], schedules.SCHEDULES,
                    "constant | step (x0.1 at 50%, x0.01 at 75%) | cyclic (0.02..1.0).", **kw)
  flags.DEFINE_float("momentum", d["momentum"], "SGD momentum (dpnsgd/dpsgd/sgd).", **kw)
  flags.DEFINE_float("weight_decay", d["weight_decay"], "Decoupled weight decay (0: none).", **kw)
  flags.DEFINE_float("ema_momentum", d["ema_momentum"],
                     "Keep an exponential moving average of the weights with this momentum in "
                     "(0, 1) (e.g. 0.99; De et al. 2022) and end training on it: a function of "
                     "the noised updates, so free of privacy cost. The per-epoch validation "
                     "metrics are of the raw weights, the final ones of the average.", **kw)
  flags.DEFINE_enum("per_example", d["per_example"],
                    tuple(tf_dpnsgd.per_example.ENGINE_NAMES), "Per-example gradient engine.",
                    **kw)
  flags.DEFINE_string("model_dir", d["model_dir"],
                      "Checkpoints, TensorBoard, history, report (keep private: the checkpoint "
                      "holds the noise state; a --noise=bandmf run also keeps its secret sampler "
                      "seed here, owner-only, to resume the same partition: as private as the "
                      "data).", **kw)
  flags.DEFINE_string("export_dir", d["export_dir"], "Write a serving SavedModel here.", **kw)
  flags.DEFINE_integer("seed", d["seed"],
                       "Seed of initialisation and data order only (non-private shuffle, "
                       "augmentation, dropout). The DP noise and the batch sampler always "
                       "draw their seeds from the OS. None: random.", **kw)
  flags.DEFINE_integer("verbose", d["verbose"], "Keras fit verbosity.", **kw)
  flags.DEFINE_enum("distribution_strategy", d["distribution_strategy"], STRATEGIES,
                    "tf.distribute strategy: none | mirrored (this machine's GPUs) | "
                    "multi_worker (TF_CONFIG; see docs/distributed.md) | tpu (with --tpu). "
                    "Only the chief writes reports, checkpoints and exports.", **kw)
  flags.DEFINE_string("tpu", d["tpu"], "TPU address or name for --distribution_strategy=tpu.",
                      **kw)

  def validator(names, check):
    def checker(values):
      try:
        check(adapt_unset_flags({**{n: fv[n].value for n in _FIELD_NAMES}, **values},
                                _set_by_user(fv)))
      except ValueError as e:
        raise flags.ValidationError(str(e)) from None
      return True
    flags.register_multi_flags_validator(list(names), checker, flag_values=fv)

  for names, check in CHECKS:
    validator(names, check)

  def privacy(values):
    resolve_privacy(values["optimizer"], values["noise_multiplier"], values["target_epsilon"],
                    _explicit(fv))
  validator(("optimizer",) + PRIVACY_FLAGS, privacy)


_FIELD_NAMES = tuple(f.name for f in dataclasses.fields(ExperimentConfig)
                     if f.name != "releases")  # set by cifar10.py, not a common flag


def _explicit(fv) -> set:
  """Privacy flags set on the command line, in a flag file or by assignment."""
  return {n for n in PRIVACY_FLAGS if not fv[n].using_default_value}


def _set_by_user(fv) -> set:
  """The shared flags set on the command line, in a flag file or by assignment."""
  return {n for n in _FIELD_NAMES if not fv[n].using_default_value}


def adapt_unset_flags(values: dict, set_by_user) -> dict:
  """``values`` with the flags the user did not set adapted to the ones they did.

  A launcher's default ``--physical_batch_size`` (e.g. 250) larger than the
  ``--batch_size`` the user gave (e.g. 64) becomes that batch size (one chunk
  per batch), instead of failing. A ``--physical_batch_size`` the user set
  (command line or flag file) is never changed: a wrong one stays an error.
  ``--noise=bandmf`` without ``--sampling`` samples cyclic-Poisson (an explicit other
  ``--sampling`` stays an error). Returns a new dict; ``values`` is not modified.
  """
  out = dict(values)
  if out.get("noise") in ("bandmf", "blt") and "sampling" not in set_by_user:
    out["sampling"] = "cyclic_poisson"  # the sampling BandMF and BLT are accounted under
  physical, batch = out.get("physical_batch_size"), out.get("batch_size")
  if ("physical_batch_size" not in set_by_user and physical is not None and batch is not None
      and batch >= 1 and physical > batch):
    out["physical_batch_size"] = batch
  return out


def config_from_flags(flag_values: Optional[flags.FlagValues] = None) -> ExperimentConfig:
  """The run's config from the parsed flags (privacy flags resolved by
  :func:`resolve_privacy`).

  Raises:
    LaunchError: an invalid combination (normally caught earlier by the validators).
  """
  fv = flags.FLAGS if flag_values is None else flag_values
  values = adapt_unset_flags({n: fv[n].value for n in _FIELD_NAMES}, _set_by_user(fv))
  try:
    values["noise_multiplier"], values["target_epsilon"] = resolve_privacy(
        values["optimizer"], values["noise_multiplier"], values["target_epsilon"], _explicit(fv))
    return ExperimentConfig(**values)
  except LaunchError:
    raise
  except ValueError as e:
    raise LaunchError(str(e)) from None


def main_with_usage_errors(main: Callable) -> Callable:
  """Wraps a launcher's ``main``: a :class:`LaunchError` (or an existing export
  directory) exits with status 1 and one ``FATAL`` line on stderr, no traceback."""
  import functools

  @functools.wraps(main)
  def wrapped(argv):
    logs.quiet_tensorflow_info()
    try:
      return main(argv)
    except (LaunchError, FileExistsError) as e:
      raise SystemExit(f"FATAL Flags error: {e}") from None
  return wrapped


# --- the run -------------------------------------------------------------------
def make_optimizer(cfg: ExperimentConfig, noise_multiplier: Optional[float], total_steps: int):
  lr = schedules.make_schedule(cfg.lr_schedule, cfg.learning_rate, max(total_steps, 1))
  common = {"learning_rate": lr}
  if cfg.weight_decay:
    common["weight_decay"] = cfg.weight_decay
  if cfg.ema_momentum is not None:  # post-processing of the noised updates (keras use_ema)
    common.update(use_ema=True, ema_momentum=cfg.ema_momentum)
  if cfg.optimizer == "sgd":
    return keras.optimizers.SGD(momentum=cfg.momentum, **common)
  if cfg.optimizer == "adam":
    return keras.optimizers.Adam(**common)
  # No `seed`: the noise seed always comes from the OS (cfg.seed is public: init, data order).
  private = {"noise_multiplier": noise_multiplier, **common}
  bands = band_coefficients(cfg, total_steps)
  if bands is not None:
    private["band_coefficients"] = bands
  blt = blt_parameters(cfg, total_steps)
  if blt is not None:
    private["blt_parameters"] = blt
  if cfg.optimizer == "dpnsgd":
    return tf_dpnsgd.DPNSGD(regularizer=cfg.regularizer, momentum=cfg.momentum, **private)
  adaptive = {n: getattr(cfg, n) for n in ADAPTIVE_FLAGS}
  try:
    if cfg.optimizer == "dpsgd":
      return tf_dpnsgd.DPSGD(l2_norm_clip=cfg.l2_norm_clip, momentum=cfg.momentum, **private,
                             **adaptive)
    if cfg.optimizer == "dpadam":
      return tf_dpnsgd.DPAdam(l2_norm_clip=cfg.l2_norm_clip, **private, **adaptive)
  except ValueError as e:  # e.g. --clipped_count_stddev too small for the noise
    raise LaunchError(str(e)) from None
  return tf_dpnsgd.DPNAdam(regularizer=cfg.regularizer, **private)


def make_plan(cfg: ExperimentConfig, dataset_size: int,
              sampler_seed: Optional[int] = None) -> Optional[PrivacyPlan]:
  """The privacy plan (validates B <= N, delta, the sampling/accountant pair); None for sgd.

  ``sampler_seed``: ``None`` (the launchers: an OS seed, never ``cfg.seed``, which is
  public); tests may fix it.
  """
  if cfg.batch_size > dataset_size:
    raise LaunchError(f"--batch_size={cfg.batch_size} is larger than the training set "
                      f"({dataset_size} examples).")
  if not cfg.private:
    return None
  cfg, _ = resolve_auto_noise(cfg, dataset_size)
  bands = {"bands": cfg.bands} if cfg.noise in ("bandmf", "blt") else {}
  try:
    if bands:
      check_bands_fit(cfg.bands, cfg.batch_size, dataset_size)
    plan = PrivacyPlan(dataset_size=dataset_size, batch_size=cfg.batch_size,
                       sampling=cfg.sampling, delta=cfg.delta, epochs=cfg.epochs,
                       noise_multiplier=cfg.noise_multiplier,
                       target_epsilon=cfg.target_epsilon, accountant=cfg.accountant,
                       bound=cfg.bound, conversion=cfg.conversion, seed=sampler_seed,
                       releases=cfg.releases, **bands)
    if bands:
      check_bands_fit(cfg.bands, cfg.batch_size, dataset_size, plan.num_steps)
    if cfg.noise == "blt":  # the BLT for the plan's steps (calibration then includes it)
      plan = dataclasses.replace(plan, blt=blt_parameters(cfg, plan.num_steps))
    return plan
  except ValueError as e:
    raise LaunchError(str(e)) from None


def run_experiment(cfg: ExperimentConfig, build_model: Callable[[], keras.Model],
                   train: tuple, test: tuple, loss, export_fn=None, metrics=("accuracy",),
                   augment_fn=None, extra_report: Optional[dict] = None,
                   print_fn: Optional[Callable[[int, dict], Any]] = None,
                   after_training: Optional[Callable] = None, not_covered=(),
                   length_key: Optional[str] = None) -> dict:
  """Trains ``build_model()`` on ``train`` with DP (or SGD), evaluates on ``test``.

  A private run on the default strategy takes the one-call path: the model owns
  its plan (``make_private(model, plan=plan)``) and trains with a plain
  ``fit(x, y, validation_data=test)``. A ``tf.distribute`` strategy, a
  per-example augmentation (``augment_fn``) or ``--max_steps`` takes the explicit
  one (``plan.dataset``, ``plan.callbacks``, ``plan.fit_kwargs`` cut to the steps
  that run). Both run in :mod:`tf_dpnsgd.runner`.

  Args:
    cfg: the run's configuration.
    build_model: returns a fresh (non-private) Keras model.
    train, test: ``(x, y)`` with ``x`` an array or a dict of arrays.
    loss: a Keras loss (per-example losses are derived from it).
    export_fn: ``export_fn(model, export_dir)`` writes the serving SavedModel.
    augment_fn: optional ``fn(x_i, y_i, seed) -> x_i'``: ``plan.dataset``'s ``augment``.
    extra_report: fields added to the privacy report (e.g. the preset).
    print_fn: called with ``(epoch, logs)`` at each epoch end.
    after_training: ``(model, plan, final_metrics) -> dict`` of fields added to the report
      (e.g. the canary audit's ``"audit"`` entry, :mod:`tf_dpnsgd.launch.canary_audit`).
    not_covered: sentences added to a private run's ``not_covered`` (releases the launcher
      makes outside the epsilon, e.g. a canary audit of training rows).

  Returns:
    The run's :class:`~tf_dpnsgd.records.RunRecord`, also written (``to_dict()``, plus
    package versions) to ``privacy_report.json`` in ``model_dir`` and ``export_dir``.
  """
  x_train, y_train = train
  n = len(y_train)
  cfg, choice = resolve_auto_noise(cfg, n) if cfg.private else (cfg, None)
  if cfg.export_dir and os.path.exists(cfg.export_dir):
    raise FileExistsError(f"--export_dir={cfg.export_dir} exists; choose a new one (an export "
                          "is never written over another). Checked before training.")
  strategy = runner.make_strategy(cfg.distribution_strategy, cfg.tpu)
  chief = distribution.is_chief(strategy)
  # A fresh OS sampler seed in every run and every resume; under several workers worker
  # 0's, shared, so that every worker draws the same batches.
  sampler_seed = (distribution.broadcast_int(strategy, noise_lib.random_seed())
                  if distribution.is_multi_worker(strategy) else None)
  if cfg.private and resume.keeps_sampler_seed(cfg.sampling):
    # Correlated noise resumes on its first steps' partition (the secret seed kept,
    # owner-only, in model_dir) or not at all; a fresh run draws an OS seed.
    has_ckpt = bool(cfg.model_dir) and os.path.exists(
        os.path.join(cfg.model_dir, "checkpoint.weights.h5"))
    try:
      sampler_seed = resume.sampler_seed_to_resume(cfg.model_dir, cfg.sampling, has_ckpt)
    except resume.ResumeError as e:
      raise LaunchError(str(e)) from None
  plan = make_plan(cfg, n, sampler_seed=sampler_seed)
  if cfg.seed is not None:  # public: initialisation and data order only
    keras.utils.set_random_seed(cfg.seed)
  planned_steps = plan.num_steps if plan else accounting.planned_steps(cfg.epochs, n,
                                                                       cfg.batch_size)
  if planned_steps < 1:
    raise LaunchError(f"floor(epochs * steps per epoch) = 0 steps (epochs={cfg.epochs}, N={n}, "
                      f"B={cfg.batch_size}): train longer or use a smaller batch.")
  total_steps = min(planned_steps, cfg.max_steps or planned_steps)
  sigma = plan.training_noise_multiplier if plan else None
  if plan:
    logging.info("Privacy plan: %s; noise_multiplier=%.4f for %d planned steps.",
                 json.dumps(plan.public_dict(), sort_keys=True), sigma, planned_steps)

  with strategy.scope():
    optimizer = make_optimizer(cfg, sigma, planned_steps)
  if plan:
    try:
      plan.check_optimizer(optimizer)
    except ValueError as e:  # e.g. adaptive clipping's count noise too small for the batch
      raise LaunchError(str(e)) from None
  own_plan = (bool(plan) and cfg.distribution_strategy == "none" and augment_fn is None
              and not cfg.max_steps)  # else the explicit path (epochs cut to --max_steps)
  base, model = runner.build(build_model, optimizer, loss=loss, metrics=metrics,
                             private=cfg.private, plan=plan, own_plan=own_plan,
                             strategy=strategy, per_example=cfg.per_example,
                             physical_batch_size=cfg.physical_batch_size,
                             length_key=length_key if cfg.physical_batch_size else None)

  history, ckpt, hist_path = {}, None, None
  start_step = 0
  if cfg.model_dir:
    os.makedirs(cfg.model_dir, exist_ok=True)
    ckpt = os.path.join(cfg.model_dir, "checkpoint.weights.h5")
    hist_path = os.path.join(cfg.model_dir, "history.json")
    marker = resume.run_marker(cfg.private, plan.public_dict() if plan else None,
                               (extra_report or {}).get("dataset"))
    if os.path.exists(ckpt):  # only the run that wrote it continues (tf_dpnsgd.launch.resume)
      try:
        resume.check_resume(cfg.model_dir, resume.read_marker(cfg.model_dir), marker,
                            runner.checkpoint_has_ledger(ckpt))
        start_step = runner.restore(model, ckpt, strategy)
        resume.check_resume_point(plan, start_step)
      except resume.ResumeError as e:
        raise LaunchError(str(e)) from None
      if os.path.exists(hist_path):
        with open(hist_path) as f:
          history = json.load(f)
      logging.info("Resumed from %s at step %d.", ckpt, start_step)
    if chief:
      resume.write_marker(cfg.model_dir, marker)
      if plan and resume.keeps_sampler_seed(plan.sampling):
        resume.write_sampler_seed(cfg.model_dir, plan.seed)  # secret: owner-only, never logged
  if not chief:  # only the chief writes (checkpoints, history, TensorBoard, reports, export)
    ckpt = hist_path = None

  tb_dir = os.path.join(cfg.model_dir, "tensorboard") if cfg.model_dir and chief else None
  callbacks = [runner.EpochRecorder(hist_path, history, print_fn)]
  if ckpt:
    callbacks.append(keras.callbacks.ModelCheckpoint(ckpt, save_weights_only=True))
  if tb_dir:
    callbacks.append(keras.callbacks.TensorBoard(tb_dir, write_graph=False))
  state = os.path.join(cfg.model_dir, "privacy_state.json") if cfg.model_dir and chief else None
  trained = runner.fit(
      model, x_train, y_train, total_steps=total_steps, plan=plan, batch_size=cfg.batch_size,
      shuffle_seed=cfg.seed, stop_after=total_steps if cfg.max_steps else None,
      callbacks=callbacks, privacy_log_dir=tb_dir, privacy_state_path=state,
      validation_data=test, verbose=cfg.verbose, augment_fn=augment_fn,
      progress_bar=bool(cfg.verbose))

  final = model.evaluate(*test, verbose=0, return_dict=True)
  run = {"hyperparameters": cfg.hyperparameters(),
         "final_metrics": {k: float(v) for k, v in final.items()},
         "best_val_accuracy": max(history.get("val_accuracy", [float("nan")])),
         "extra": dict(extra_report or {})}
  if plan:  # the noise mechanism the epsilon is for (the plan's bands: 1 = independent)
    run["extra"].update(noise=cfg.noise, bands=plan.bands)
    if choice is not None:  # --noise=auto: what it chose from (public settings only)
      run["extra"].update(noise_choice={"requested": "auto", **choice.to_dict()})
    if plan.blt:
      run["extra"].update(blt=[list(v) for v in plan.blt])
  if after_training is not None:
    run["extra"].update(after_training(model, plan, run["final_metrics"]))
  if plan:
    record = RunRecord.from_privacy_report(trained.report, noise_multiplier=sigma, **run)
    record = dataclasses.replace(record, not_covered=record.not_covered + tuple(not_covered))
  else:  # no epsilon at all (JSON has no inf), and "private": false
    record = RunRecord.non_private(steps=trained.steps, dataset_size=n, **run)
  if cfg.model_dir and chief:
    export_lib.write_privacy_report(os.path.join(cfg.model_dir, "privacy_report.json"),
                                    **record.to_dict())
  if cfg.export_dir and chief:
    export_fn(base, cfg.export_dir)
    export_lib.write_privacy_report(os.path.join(cfg.export_dir, "privacy_report.json"),
                                    **record.to_dict())
  return record


def as_numpy_labels(y) -> np.ndarray:
  return np.asarray(y).astype("int32")
