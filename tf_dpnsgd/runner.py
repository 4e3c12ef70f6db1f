"""One training run, shared by the launchers and the canary audit: build, fit, stop, count.

:func:`build` makes the model under a ``tf.distribute`` strategy (private with
:func:`tf_dpnsgd.make_private`, or plain for a non-private baseline) and
compiles it; :func:`restore` resumes it from a checkpoint; :func:`fit` trains
it on ``(x, y)`` up to a step count and returns what ran (:class:`Trained`:
steps, seconds, the privacy report of the model's ledger).

How the batches reach Keras' ``fit``:

=======================  ==============================================================
the model ...            :func:`fit` calls
=======================  ==============================================================
owns its plan            ``model.fit(x, y, validation_data=..., callbacks=...)``: the
(``own_plan=True``)      one-call path (:mod:`tf_dpnsgd.owned_plan`); the model draws
                         the plan's batches and sets the step counts itself
trains under ``plan``    ``model.fit(plan.dataset(x, y, model=model),
(the explicit path)      callbacks=plan.callbacks(...), **plan.fit_kwargs(model))``:
                         for a ``tf.distribute`` strategy or a per-example augmentation
has no plan              ``sampler``'s batches (an audit without noise: no claim), or
                         Keras' shuffled batches of ``batch_size`` (non-private SGD)
=======================  ==============================================================

In the first two the plan's :class:`~tf_dpnsgd.callbacks.PrivacyCallback`
logs epsilon and stops at the budget; ``stop_after`` stops at a step count
(``--max_steps``, or the audit's steps without a plan). Callbacks defined here
only observe or stop at a public step count (``dp_observes_only``).
"""

from __future__ import annotations

import dataclasses
import gc
import json
import math
import time
from typing import Callable, Optional, Sequence

import keras
import tensorflow as tf

from tf_dpnsgd import callbacks as callbacks_lib
from tf_dpnsgd import ledger as ledger_lib
from tf_dpnsgd import training


def steps_of(model) -> int:
  """Steps taken: the privacy ledger's for a DP model, the optimizer's otherwise."""
  if isinstance(getattr(model, "privacy_ledger", None), ledger_lib.PrivacyLedger):
    return model.privacy_ledger.steps
  return int(model.optimizer.iterations.numpy())


def make_strategy(name: str = "none", tpu: Optional[str] = None):
  """The ``tf.distribute`` strategy called ``name``: ``"none"`` (the current one),
  ``"mirrored"`` (this machine's GPUs), ``"multi_worker"`` (``TF_CONFIG``) or ``"tpu"``
  (at address ``tpu``); see docs/distributed.md."""
  if name == "mirrored":
    return tf.distribute.MirroredStrategy()
  if name == "multi_worker":
    return tf.distribute.MultiWorkerMirroredStrategy()
  if name == "tpu":
    resolver = tf.distribute.cluster_resolver.TPUClusterResolver(tpu=tpu)
    tf.config.experimental_connect_to_cluster(resolver)
    tf.tpu.experimental.initialize_tpu_system(resolver)
    return tf.distribute.TPUStrategy(resolver)
  if name != "none":
    raise ValueError(f"Unknown strategy {name!r}: none, mirrored, multi_worker or tpu.")
  return tf.distribute.get_strategy()


def build(build_model: Callable[[], keras.Model], optimizer, *, loss,
          metrics: Sequence = (), private: bool = True, plan=None, own_plan: bool = False,
          strategy=None, per_example: str = "auto",
          physical_batch_size: Optional[int] = None, length_key: Optional[str] = None) -> tuple:
  """Builds and compiles ``build_model()`` under ``strategy``; returns ``(base, model)``.

  Args:
    build_model: returns a fresh, non-private Keras model (``base``).
    optimizer: the optimizer (a DP one when ``private``), made under ``strategy``'s scope.
    loss, metrics: as ``compile``.
    private: make the model private (:func:`tf_dpnsgd.make_private`); False: ``base``
      itself trains (a non-private baseline).
    plan: the :class:`~tf_dpnsgd.plan.PrivacyPlan` of the run (None: no claim); the
      optimizer must add its noise (checked here).
    own_plan: the model owns ``plan`` (``make_private(base, plan=plan)``): plain ``fit``.
    strategy: a ``tf.distribute`` strategy (default: the current one).
    per_example, physical_batch_size, length_key: as :func:`tf_dpnsgd.make_private`.

  Raises:
    ValueError: the optimizer's noise is not the plan's.
  """
  strategy = strategy or tf.distribute.get_strategy()
  with strategy.scope():
    base = build_model()
    model = base
    if private:
      owned = {"plan": plan} if own_plan else {}
      model = training.make_private(base, per_example=per_example,
                                    physical_batch_size=physical_batch_size,
                                    length_key=length_key, **owned)
    if plan is not None:
      plan.check_optimizer(optimizer)  # before compile (an owned plan checks it there too)
    model.compile(optimizer=optimizer, loss=loss, metrics=list(metrics))
  return base, model


def checkpoint_has_ledger(path: str) -> bool:
  """Whether the Keras weights file ``path`` (``.weights.h5``) holds a privacy ledger: a
  group ``privacy_ledger`` with variables, as a DP model's ``save_weights`` writes it. Any
  other file (a plain model's weights, not HDF5): False."""
  import h5py  # pylint: disable=import-outside-toplevel

  if not h5py.is_hdf5(path):
    return False
  found = []

  def visit(name, obj):
    if (isinstance(obj, h5py.Group) and name.rsplit("/", 1)[-1] == "privacy_ledger"
        and isinstance(obj.get("vars"), h5py.Group) and len(obj["vars"])):
      found.append(name)

  with h5py.File(path, "r") as f:
    f.visititems(visit)
  return bool(found)


def restore(model: keras.Model, path: str, strategy=None) -> int:
  """Loads the checkpoint ``path`` (weights, optimizer state and the privacy ledger) into
  ``model``; returns the steps it had taken.

  Raises:
    ValueError: ``model`` is private and ``path`` holds no privacy ledger
      (:func:`checkpoint_has_ledger`): resuming it would start DP training from weights no
      epsilon covers (a non-private run's, say). A deliberate warm start from public
      weights is not a resume.
  """
  private = isinstance(getattr(model, "privacy_ledger", None), ledger_lib.PrivacyLedger)
  if private and not checkpoint_has_ledger(path):
    raise ValueError(f"Cannot resume the private model from {path}: the file holds no privacy "
                     "ledger (the weights of a non-private model, or not a DP checkpoint), so "
                     "the weights it holds are outside any epsilon. Train from a new "
                     "directory.")
  strategy = strategy or tf.distribute.get_strategy()
  with strategy.scope():
    model.optimizer.build(model.trainable_variables)
  model.load_weights(path)  # restores the privacy ledger with the weights
  return steps_of(model)


@dataclasses.dataclass(frozen=True)
class Trained:
  """What one :func:`fit` ran: ``steps`` (all the model's steps so far), ``seconds`` of
  training, ``report`` (the plan's report of the model's ledger; None without a plan)."""

  steps: int
  seconds: float
  report: Optional[object] = None


def fit(model: keras.Model, x, y, *, total_steps: int, plan=None, sampler=None,
        batch_size: Optional[int] = None, shuffle_seed: Optional[int] = None,
        stop_after: Optional[int] = None, callbacks: Sequence = (),
        privacy_log_dir: Optional[str] = None, privacy_state_path: Optional[str] = None,
        validation_data=None, verbose=0, augment_fn=None,
        progress_bar: bool = False) -> Trained:
  """Trains ``model`` on ``(x, y)`` until ``total_steps`` steps (counted from its start).

  Args:
    model: from :func:`build` (maybe :func:`restore`\\ d).
    x, y: the training examples (arrays or dicts of arrays).
    total_steps: the step count the run ends at (the fit arguments cover no more
      epochs than it needs; the progress bar counts to it).
    plan: the run's plan, owned by ``model`` or not (see the module docstring).
    sampler: without a plan, the sampler that draws the batches; neither: Keras'
      shuffled batches of ``batch_size`` (``shuffle_seed``: public data order).
    stop_after: stop once the model has taken this many steps (None: the plan's
      budget, or the end of the fit arguments).
    callbacks: the caller's, after the plan's.
    privacy_log_dir, privacy_state_path: the plan callback's ``log_dir`` and
      ``state_path`` (:class:`~tf_dpnsgd.callbacks.PrivacyCallback`).
    validation_data, verbose: as ``fit``.
    augment_fn: a per-example augmentation ``fn(x_i, y_i, seed) -> x_i'`` (explicit
      path only): the sampler applies it to each row alone (``plan.dataset(...,
      augment=augment_fn)``, :mod:`tf_dpnsgd.augmentation`); without a plan or a
      sampler, to each example before Keras-style batching.
    progress_bar: add a :class:`StepProgbar` (for ``verbose``). Unless it shows every
      step (``verbose=1``), a :class:`~tf_dpnsgd.callbacks.StepReporter` prints a line for
      slow steps and at least every 30 s, with epsilon and an ETA.

  Returns:
    :class:`Trained`.
  """
  owned = plan is not None and getattr(model, "privacy_plan", None) is plan
  start = steps_of(model)
  privacy = ([] if plan is None else
             plan.callbacks(log_dir=privacy_log_dir, state_path=privacy_state_path))
  stops = [StopAtStep(stop_after)] if stop_after else []
  progress = [StepProgbar(start, total_steps)] if progress_bar else []
  if not (progress_bar and verbose == 1):  # no per-step bar (verbose 0, or 2: a line an epoch)
    progress.append(callbacks_lib.StepReporter(start, total_steps, plan))
  everything = privacy + stops + list(callbacks) + progress
  began = time.perf_counter()
  if owned:
    if augment_fn is not None:
      raise ValueError("`augment_fn` is given to the sampler's stream: use a plan the model "
                       "does not own (plan.dataset(..., augment=...)), not the one-call path.")
    if start < total_steps:  # the model draws its plan's batches (tf_dpnsgd.owned_plan)
      model.fit(x, y, validation_data=validation_data, callbacks=everything, verbose=verbose)
  else:
    data, fit_kwargs = _stream(model, x, y, plan, sampler, batch_size, shuffle_seed, start,
                               total_steps, augment_fn)
    fit_only_steps_to_run(fit_kwargs, total_steps)
    if start < total_steps:
      model.fit(data, validation_data=validation_data, callbacks=everything, verbose=verbose,
                **fit_kwargs)
    # Release the generator-backed stream now, not at interpreter shutdown (where TF
    # logs "Error occurred when finalizing GeneratorDataset iterator").
    del data
  gc.collect()
  seconds = time.perf_counter() - began
  return Trained(steps=steps_of(model), seconds=seconds,
                 report=None if plan is None else plan.report(model))


def _stream(model, x, y, plan, sampler, batch_size, shuffle_seed, start, total_steps,
            augment_fn):
  """``(dataset, fit_kwargs)`` of the explicit path, or of a run without a plan."""
  if plan is not None:
    return plan.dataset(x, y, model=model, augment=augment_fn), plan.fit_kwargs(model)
  if sampler is not None:
    data = sampler.dataset(x, y, start_step=start, augment=augment_fn)
    spe = sampler.steps_per_epoch
  else:
    n = len(y)
    spe = max(1, n // batch_size)
    data = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(n, seed=shuffle_seed).repeat()
    if augment_fn is not None:  # one example at a time, a stateless seed each
      seeds = tf.data.Dataset.random(seed=shuffle_seed, rerandomize_each_iteration=True)
      data = tf.data.Dataset.zip((data, seeds.batch(2))).map(
          lambda xy, seed: (augment_fn(xy[0], xy[1], seed), xy[1]))
    data = data.batch(batch_size, drop_remainder=True)
  return data, {"epochs": max(1, math.ceil(total_steps / spe)), "steps_per_epoch": spe,
                "initial_epoch": start // spe}


def fit_only_steps_to_run(fit_kwargs: dict, total_steps: int) -> None:
  """Trims ``fit_kwargs["epochs"]`` to the epochs that hold the steps that will run
  (``--max_steps`` may stop long before the planned epochs)."""
  spe = fit_kwargs["steps_per_epoch"]
  needed = max(fit_kwargs.get("initial_epoch", 0) + 1, math.ceil(total_steps / spe))
  fit_kwargs["epochs"] = min(fit_kwargs["epochs"], needed)


# --- callbacks that observe, or stop at a public step count ---------------------------
class StopAtStep(keras.callbacks.Callback):
  """Stops training once the model has taken ``max_steps`` steps (:func:`steps_of`)."""

  dp_observes_only = True  # stops at a public step count, not on a metric

  def __init__(self, max_steps: int):
    super().__init__()
    self.max_steps = max_steps

  def on_train_batch_end(self, batch, logs=None):
    if steps_of(self.model) >= self.max_steps:
      self.model.stop_training = True


class EpochRecorder(keras.callbacks.Callback):
  """Adds ``learning_rate`` and ``steps`` to the logs and appends each epoch to ``path``
  (``history.json``) and ``history``; calls ``print_fn(epoch, logs)``.

  ``history.json`` holds the exact (unprivatized) training loss and accuracy: keep
  it private (tf_dpnsgd.coverage.steering_callbacks)."""

  dp_observes_only = True  # records; never changes training

  def __init__(self, path: Optional[str], history: dict, print_fn=None):
    super().__init__()
    self.path, self.history, self.print_fn = path, history, print_fn

  def on_epoch_end(self, epoch, logs=None):
    logs = logs if logs is not None else {}
    opt = self.model.optimizer
    lr = opt.learning_rate
    logs["learning_rate"] = float(lr(opt.iterations) if callable(lr) else
                                  keras.ops.convert_to_numpy(lr))
    logs["steps"] = steps_of(self.model)
    self.history.setdefault("epoch", []).append(epoch + 1)
    for k, v in logs.items():
      self.history.setdefault(k, []).append(float(v))
    if self.path:
      with open(self.path, "w") as f:
        json.dump(self.history, f, indent=1)
    if self.print_fn:
      self.print_fn(epoch + 1, logs)


class StepProgbar(callbacks_lib.ProgressBar):
  """The DP progress bar (:class:`tf_dpnsgd.callbacks.ProgressBar`: what a user reads; each
  epoch counts the steps it runs), counting from ``start_step`` (a non-private model has no
  ledger to read it from).

  Keras sets the bar's target to ``steps_per_epoch`` and, when training stops
  early (``--max_steps``, the privacy budget, a last partial epoch), still
  finalizes the bar at that target: a 59-step run showed ``1052/1052``.
  """

  def __init__(self, start_step: int, total_steps: int):
    super().__init__(total_steps=total_steps)
    self.start_step = int(start_step)

  def on_train_begin(self, logs=None):
    super().on_train_begin(logs)
    self._steps_done = self.start_step


__all__ = ["EpochRecorder", "StepProgbar", "StopAtStep", "Trained", "build",
           "checkpoint_has_ledger", "fit", "fit_only_steps_to_run", "make_strategy", "restore",
           "steps_of"]
