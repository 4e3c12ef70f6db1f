"""Shared machinery of the absl launchers: flags, one run of an experiment, its records.

Flags are defined and read here and in the launcher modules only; the library
below takes plain arguments. :func:`run_experiment` takes an
:class:`ExperimentConfig` (a frozen dataclass built from the flags by
:func:`config_from_flags`), so sweeps and tests can call it directly.

A run with ``model_dir`` writes there:

* ``checkpoint.weights.h5``: model and optimizer state (incl. the noise RNG) at
  each epoch end; a rerun with the same ``model_dir`` resumes from it, and the
  sampler continues at the restored step, so the privacy report counts every
  step taken;
* ``history.json``: per-epoch metrics (``loss``, ``accuracy``, ``val_*``,
  ``epsilon``, ``learning_rate``, ``grad_norm``, ...), kept across resumes;
* ``tensorboard/``: the same scalars for TensorBoard;
* ``privacy_report.json``: epsilon, delta, noise multiplier, sampling,
  accountant, steps, dataset size, hyperparameters, package versions and
  final metrics.

The checkpoint holds the optimizer's noise seed: keep ``model_dir`` private;
publish the ``export_dir`` SavedModel and the privacy report.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import math
import os
from typing import Any, Callable, Optional

from absl import flags
from absl import logging
import keras
import numpy as np

import tf_dpnsgd
from tf_dpnsgd import export as export_lib
from tf_dpnsgd import schedules
from tf_dpnsgd.plan import PrivacyPlan

OPTIMIZERS = ("dpnsgd", "dpsgd", "dpadam", "dpnadam", "sgd")
SAMPLINGS = ("poisson", "uniform", "shuffle")


@dataclasses.dataclass(frozen=True)
class ExperimentConfig:
  """Everything one training run needs (validated in ``__post_init__``)."""

  optimizer: str = "dpnsgd"
  learning_rate: float = 0.1
  regularizer: Optional[float] = 0.01
  l2_norm_clip: Optional[float] = 1.0
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
  per_example: str = "auto"
  model_dir: Optional[str] = None
  export_dir: Optional[str] = None
  seed: Optional[int] = None
  verbose: int = 2

  def __post_init__(self):
    if self.optimizer not in OPTIMIZERS:
      raise ValueError(f"--optimizer must be one of {OPTIMIZERS}; got {self.optimizer!r}.")
    if self.sampling not in SAMPLINGS:
      raise ValueError(f"--sampling must be one of {SAMPLINGS}; got {self.sampling!r}.")
    if self.optimizer != "sgd":
      if (self.noise_multiplier is None) == (self.target_epsilon is None):
        raise ValueError("Give exactly one of --noise_multiplier and --target_epsilon "
                         "(both or neither were given).")
    elif self.noise_multiplier is not None or self.target_epsilon is not None:
      raise ValueError("--optimizer=sgd trains without privacy: drop --noise_multiplier / "
                       "--target_epsilon, or choose a DP optimizer.")
    if self.optimizer in ("dpnsgd", "dpnadam") and not (self.regularizer or 0) > 0:
      raise ValueError(f"--regularizer must be > 0 for {self.optimizer}; got {self.regularizer}.")
    if self.optimizer in ("dpsgd", "dpadam") and not (self.l2_norm_clip or 0) > 0:
      raise ValueError(f"--l2_norm_clip must be > 0 for {self.optimizer}; got {self.l2_norm_clip}.")
    if not self.learning_rate > 0:
      raise ValueError(f"--learning_rate must be > 0; got {self.learning_rate}.")
    if self.max_steps is not None and self.max_steps < 1:
      raise ValueError(f"--max_steps must be >= 1; got {self.max_steps}.")
    if not self.epochs > 0:
      raise ValueError(f"--epochs must be > 0; got {self.epochs}.")
    if self.physical_batch_size is not None and self.physical_batch_size > self.batch_size:
      raise ValueError(f"--physical_batch_size ({self.physical_batch_size}) must not exceed "
                       f"--batch_size ({self.batch_size}).")

  @property
  def private(self) -> bool:
    return self.optimizer != "sgd"

  def hyperparameters(self) -> dict:
    """The fields worth recording (no directories, no seed: it keys the sampler)."""
    d = dataclasses.asdict(self)
    for k in ("model_dir", "export_dir", "seed", "verbose"):
      d.pop(k)
    return d


def define_flags(**defaults) -> None:
  """Defines the flags shared by every launcher; ``defaults`` override per experiment."""
  d = {f.name: f.default for f in dataclasses.fields(ExperimentConfig)}
  d.update(defaults)
  flags.DEFINE_enum("optimizer", d["optimizer"], OPTIMIZERS, "Optimizer (sgd: non-private).")
  flags.DEFINE_float("learning_rate", d["learning_rate"], "Base learning rate.")
  flags.DEFINE_float("regularizer", d["regularizer"], "DP-NSGD/DP-NAdam regularizer r > 0.")
  flags.DEFINE_float("l2_norm_clip", d["l2_norm_clip"], "DP-SGD/DP-Adam clipping norm c > 0.")
  flags.DEFINE_float("noise_multiplier", d["noise_multiplier"],
                     "Noise std / sensitivity. Exclusive with --target_epsilon.")
  flags.DEFINE_float("target_epsilon", d["target_epsilon"],
                     "Calibrate the noise multiplier to this epsilon.")
  flags.DEFINE_float("delta", d["delta"], "Target delta.")
  flags.DEFINE_integer("batch_size", d["batch_size"], "Logical batch size (expected, for Poisson).")
  flags.DEFINE_integer("physical_batch_size", d["physical_batch_size"],
                       "Process each logical batch in chunks of this size (memory).")
  flags.DEFINE_float("epochs", d["epochs"], "Epochs (steps = floor(epochs * N / B)).")
  flags.DEFINE_integer("max_steps", d["max_steps"],
                       "Stop after this many steps; the report covers the steps taken.")
  flags.DEFINE_enum("sampling", d["sampling"], SAMPLINGS,
                    "Batch sampling; the accounting follows it.")
  flags.DEFINE_enum("accountant", d["accountant"], ("rdp", "pld"), "dp-accounting accountant.")
  flags.DEFINE_enum("bound", d["bound"], ("default", "paper", "min"),
                    "RDP bound for --sampling=uniform: dp-accounting, the paper's, or their min.")
  flags.DEFINE_enum("conversion", d["conversion"], ("modern", "classic"),
                    "RDP to (epsilon, delta) conversion.")
  flags.DEFINE_enum("lr_schedule", d["lr_schedule"], schedules.SCHEDULES,
                    "constant | step (x0.1 at 50%, x0.01 at 75%) | cyclic (0.02..1.0).")
  flags.DEFINE_float("momentum", d["momentum"], "SGD momentum (dpnsgd/dpsgd/sgd).")
  flags.DEFINE_float("weight_decay", d["weight_decay"], "Decoupled weight decay (0: none).")
  flags.DEFINE_enum("per_example", d["per_example"],
                    tuple(tf_dpnsgd.per_example.ENGINE_NAMES), "Per-example gradient engine.")
  flags.DEFINE_string("model_dir", d["model_dir"], "Checkpoints, TensorBoard, history, report.")
  flags.DEFINE_string("export_dir", d["export_dir"], "Write a serving SavedModel here.")
  flags.DEFINE_integer("seed", d["seed"], "Seed for init, sampling and noise (None: random).")
  flags.DEFINE_integer("verbose", d["verbose"], "Keras fit verbosity.")


def config_from_flags() -> ExperimentConfig:
  names = [f.name for f in dataclasses.fields(ExperimentConfig)]
  return ExperimentConfig(**{n: flags.FLAGS[n].value for n in names})


# --- the run -------------------------------------------------------------------
def make_optimizer(cfg: ExperimentConfig, noise_multiplier: Optional[float], total_steps: int):
  lr = schedules.make_schedule(cfg.lr_schedule, cfg.learning_rate, max(total_steps, 1))
  common = {"learning_rate": lr}
  if cfg.weight_decay:
    common["weight_decay"] = cfg.weight_decay
  if cfg.optimizer == "sgd":
    return keras.optimizers.SGD(momentum=cfg.momentum, **common)
  seed = cfg.seed
  private = {"noise_multiplier": noise_multiplier, "seed": seed, **common}
  if cfg.optimizer == "dpnsgd":
    return tf_dpnsgd.DPNSGD(regularizer=cfg.regularizer, momentum=cfg.momentum, **private)
  if cfg.optimizer == "dpsgd":
    return tf_dpnsgd.DPSGD(l2_norm_clip=cfg.l2_norm_clip, momentum=cfg.momentum, **private)
  if cfg.optimizer == "dpadam":
    return tf_dpnsgd.DPAdam(l2_norm_clip=cfg.l2_norm_clip, **private)
  return tf_dpnsgd.DPNAdam(regularizer=cfg.regularizer, **private)


def make_plan(cfg: ExperimentConfig, dataset_size: int) -> PrivacyPlan:
  """The privacy plan (validates B <= N, delta, the sampling/accountant pair)."""
  if cfg.batch_size > dataset_size:
    raise ValueError(f"--batch_size={cfg.batch_size} is larger than the training set "
                     f"({dataset_size} examples).")
  return PrivacyPlan(dataset_size=dataset_size, batch_size=cfg.batch_size,
                     sampling=cfg.sampling, delta=cfg.delta, epochs=cfg.epochs,
                     noise_multiplier=cfg.noise_multiplier if cfg.private else None,
                     target_epsilon=cfg.target_epsilon if cfg.private else None,
                     accountant=cfg.accountant, bound=cfg.bound, conversion=cfg.conversion,
                     seed=cfg.seed) if cfg.private else None


class _EpochRecorder(keras.callbacks.Callback):
  """Adds ``learning_rate`` to the logs and appends each epoch to ``history.json``."""

  def __init__(self, path: Optional[str], history: dict, print_fn=None):
    super().__init__()
    self.path, self.history, self.print_fn = path, history, print_fn

  def on_epoch_end(self, epoch, logs=None):
    logs = logs if logs is not None else {}
    opt = self.model.optimizer
    lr = opt.learning_rate
    logs["learning_rate"] = float(lr(opt.iterations) if callable(lr) else
                                  keras.ops.convert_to_numpy(lr))
    logs["steps"] = int(opt.iterations.numpy())
    self.history.setdefault("epoch", []).append(epoch + 1)
    for k, v in logs.items():
      self.history.setdefault(k, []).append(float(v))
    if self.path:
      with open(self.path, "w") as f:
        json.dump(self.history, f, indent=1)
    if self.print_fn:
      self.print_fn(epoch + 1, logs)


class _StopAtStep(keras.callbacks.Callback):
  def __init__(self, max_steps: int):
    super().__init__()
    self.max_steps = max_steps

  def on_train_batch_end(self, batch, logs=None):
    if int(self.model.optimizer.iterations.numpy()) >= self.max_steps:
      self.model.stop_training = True


def run_experiment(cfg: ExperimentConfig, build_model: Callable[[], keras.Model],
                   train: tuple, test: tuple, loss, export_fn=None, metrics=("accuracy",),
                   augment_fn=None, extra_report: Optional[dict] = None,
                   print_fn: Optional[Callable[[int, dict], Any]] = None) -> dict:
  """Trains ``build_model()`` on ``train`` with DP (or SGD), evaluates on ``test``.

  Args:
    cfg: the run's configuration.
    build_model: returns a fresh (non-private) Keras model.
    train, test: ``(x, y)`` with ``x`` an array or a dict of arrays.
    loss: a Keras loss (per-example losses are derived from it).
    export_fn: ``export_fn(model, export_dir)`` writes the serving SavedModel.
    augment_fn: optional ``tf.data`` transformation of the training stream.
    extra_report: fields added to the privacy report (e.g. the preset).
    print_fn: called with ``(epoch, logs)`` at each epoch end.

  Returns:
    The privacy report dict (also written to ``model_dir/privacy_report.json``).
  """
  x_train, y_train = train
  n = len(y_train)
  if cfg.export_dir and os.path.exists(cfg.export_dir):
    raise FileExistsError(f"--export_dir={cfg.export_dir} exists; choose a new one (an export "
                          "is never written over another). Checked before training.")
  plan = make_plan(cfg, n)
  if cfg.seed is not None:
    keras.utils.set_random_seed(cfg.seed)
  planned_steps = plan.num_steps if plan else math.floor(cfg.epochs * n / cfg.batch_size)
  if planned_steps < 1:
    raise ValueError(f"floor(epochs * N / B) = 0 steps (epochs={cfg.epochs}, N={n}, "
                     f"B={cfg.batch_size}): train longer or use a smaller batch.")
  total_steps = min(planned_steps, cfg.max_steps or planned_steps)
  sigma = plan.training_noise_multiplier if plan else None
  if plan:
    logging.info("Privacy plan: %s; noise_multiplier=%.4f for %d planned steps.",
                 plan.to_json(), sigma, planned_steps)

  base = build_model()
  model = (tf_dpnsgd.make_private(base, per_example=cfg.per_example,
                                  physical_batch_size=cfg.physical_batch_size)
           if plan else base)
  optimizer = make_optimizer(cfg, sigma, planned_steps)
  model.compile(optimizer=optimizer, loss=loss, metrics=list(metrics))
  if plan:
    plan.check_optimizer(optimizer)

  history, ckpt, hist_path = {}, None, None
  start_step = 0
  if cfg.model_dir:
    os.makedirs(cfg.model_dir, exist_ok=True)
    ckpt = os.path.join(cfg.model_dir, "checkpoint.weights.h5")
    hist_path = os.path.join(cfg.model_dir, "history.json")
    if os.path.exists(ckpt):
      model.optimizer.build(model.trainable_variables)
      model.load_weights(ckpt)
      start_step = int(model.optimizer.iterations.numpy())
      if os.path.exists(hist_path):
        with open(hist_path) as f:
          history = json.load(f)
      logging.info("Resumed from %s at step %d.", ckpt, start_step)

  callbacks = []
  tb_dir = os.path.join(cfg.model_dir, "tensorboard") if cfg.model_dir else None
  if plan:
    state = os.path.join(cfg.model_dir, "privacy_state.json") if cfg.model_dir else None
    callbacks += plan.callbacks(log_dir=tb_dir, state_path=state)
  callbacks.append(_EpochRecorder(hist_path, history, print_fn))
  if cfg.max_steps:
    callbacks.append(_StopAtStep(total_steps))
  if ckpt:
    callbacks.append(keras.callbacks.ModelCheckpoint(ckpt, save_weights_only=True))
  if tb_dir:
    callbacks.append(keras.callbacks.TensorBoard(tb_dir, write_graph=False))

  if plan:
    fit_kwargs = plan.fit_kwargs(start_step=start_step)
    data = plan.dataset(x_train, y_train, start_step=start_step)
  else:
    spe = max(1, n // cfg.batch_size)
    fit_kwargs = {"epochs": max(1, math.ceil(planned_steps / spe)), "steps_per_epoch": spe,
                  "initial_epoch": start_step // spe}
    import tensorflow as tf  # local: keep module import light
    data = (tf.data.Dataset.from_tensor_slices((x_train, y_train))
            .shuffle(n, seed=cfg.seed).repeat().batch(cfg.batch_size, drop_remainder=True))
  if augment_fn is not None:
    data = augment_fn(data)
  if start_step < total_steps:
    model.fit(data, validation_data=test, callbacks=callbacks, verbose=cfg.verbose, **fit_kwargs)
  # Release the generator-backed stream now, not at interpreter shutdown (where TF
  # logs "Error occurred when finalizing GeneratorDataset iterator").
  del data
  gc.collect()

  steps = int(model.optimizer.iterations.numpy())
  final = model.evaluate(*test, verbose=0, return_dict=True)
  report = {
      "private": bool(plan),
      "steps": steps,
      "dataset_size": n,
      "hyperparameters": cfg.hyperparameters(),
      "final_metrics": {k: float(v) for k, v in final.items()},
      "best_val_accuracy": max(history.get("val_accuracy", [float("nan")])),
  }
  if plan:
    report.update(plan.report(steps).to_dict())
    report["noise_multiplier"] = sigma
  else:
    report.update({"epsilon": math.inf, "delta": None,
                   "note": "--optimizer=sgd: non-private baseline, no privacy guarantee"})
  report.update(extra_report or {})
  if cfg.model_dir:
    export_lib.write_privacy_report(os.path.join(cfg.model_dir, "privacy_report.json"), **report)
  if cfg.export_dir:
    export_fn(base, cfg.export_dir)
    export_lib.write_privacy_report(os.path.join(cfg.export_dir, "privacy_report.json"), **report)
  return report


def print_epoch(epoch: int, logs: dict) -> None:
  """One line per epoch: loss, train/test accuracy and epsilon spent."""
  eps = logs.get("epsilon")
  eps_text = f"epsilon {eps:6.3f}" if eps is not None else "non-private"
  print(f"epoch {epoch:3d}  loss {logs.get('loss', float('nan')):.4f}  "
        f"train acc {logs.get('accuracy', float('nan')):.4f}  "
        f"test acc {logs.get('val_accuracy', float('nan')):.4f}  {eps_text}", flush=True)


def as_numpy_labels(y) -> np.ndarray:
  return np.asarray(y).astype("int32")
