"""Keras callback: epsilon spent, in the progress bar, ``history`` and TensorBoard; budget stop.

:class:`PrivacyCallback` reads the number of private steps from the model's
privacy ledger (:mod:`tf_dpnsgd.ledger`: written by the train step, saved with
the model's weights, checkpoints and ``.keras`` files whatever the optimizer),
so a resumed, recompiled or twice-fitted run reports epsilon for every step
taken since the start, never fewer. At ``on_train_begin`` it tells the ledger
which batch kind the plan accounts for (the train step then refuses any other,
e.g. batches Keras draws from arrays) and checks that the ledger's past steps
are ones the plan can account for.
Epsilon comes from the plan's :class:`tf_dpnsgd.accounting.StepAccountant`
(per-step RDP cached, composed linearly: a batch costs one conversion).

Budget stop: ``fit`` checks ``model.stop_training`` only *after* a batch, so
setting it before a batch cannot prevent that batch. The callback therefore
decides after each batch whether the NEXT execution (``steps_per_execution``
steps) would exceed the budget and, if so, stops there. The largest step
count within budget is found once, at ``on_train_begin``; a ``fit`` that
starts with no step left raises :class:`PrivacyBudgetExceededError` before
any step. The budget is never crossed.

Logged keys: ``epsilon`` (batch and epoch logs, hence the progress bar and
``history.history["epsilon"]``; Keras' TensorBoard callback records it as
``epoch_epsilon`` when it comes after this callback in the list) and, with
``log_dir``, the scalar ``epsilon`` against the global step in
``log_dir/privacy`` (written with ``tf.summary.write`` and the scalar
plugin's metadata, so it works without the ``tensorboard`` package, which
``tf.summary.scalar`` and Keras' TensorBoard callback need).

A budget stop names the one way to go on: ``model.extend_privacy_plan(...)``
(:data:`EXTEND_ADVICE`). :class:`ProgressBar` is the progress bar of a DP
model's ``fit``: the loss, metrics and epsilon, not the diagnostics.
"""

from __future__ import annotations

import inspect
import json
import math
import os
from typing import Optional

import keras
from keras.src.utils import io_utils  # Keras' own printer (interactive or absl logging)
import tensorflow as tf

from tf_dpnsgd import ledger as ledger_lib

EPSILON_KEY = "epsilon"

# What the callback uses of a plan (a tf_dpnsgd.plan.PrivacyPlan has all of them). Checked
# by name, so that this module need not import the plan module (which imports this one).
PLAN_ATTRIBUTES = ("accountant", "sampling", "delta", "report", "check_ledger",
                   "check_optimizer", "step_accountant", "public_dict")


# How to go on once a plan's steps have run (named by the errors that refuse more steps).
EXTEND_ADVICE = ("To train on (the epsilon grows), extend the plan: "
                 "model.extend_privacy_plan(target_epsilon=...) or (epochs=...), the new total "
                 "counted from the first step, then fit again; on the explicit path "
                 "plan = plan.extended(...) and its callbacks().")

# Logged keys that are diagnostics, not what a user reads while training: kept in
# `history` (and TensorBoard), left out of the progress bar (ProgressBar); the clip
# (`l2_norm_clip`) is shown only when it adapts.
DIAGNOSTIC_KEYS = frozenset({"grad_norm", "nonfinite_examples", "steps", "learning_rate"})
CLIP_KEY = "l2_norm_clip"


class PrivacyBudgetExceededError(RuntimeError):
  """Training was asked to take a step that would spend more than the privacy budget."""


def _scalar_metadata():
  """TensorBoard's scalar-plugin metadata, built from TF's own protos.

  ``tf.summary.scalar`` needs the ``tensorboard`` package installed;
  ``tf.summary.write`` with this metadata writes the same event without it.
  """
  from tensorflow.core.framework import summary_pb2  # pylint: disable=g-direct-tensorflow-import
  return summary_pb2.SummaryMetadata(
      plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name="scalars"),
      data_class=summary_pb2.DATA_CLASS_SCALAR)


def write_scalar(name: str, value: float, step: int) -> None:
  """Writes a TensorBoard scalar to the default summary writer (no tensorboard import)."""
  tf.summary.write(name, tf.constant(value, tf.float32), step=step, metadata=_scalar_metadata())


def steps_taken(model) -> int:
  """Private steps taken so far by ``model``, from its privacy ledger."""
  return ledger_lib.ledger_of(model).steps


def _is_plan(plan) -> bool:
  """Whether ``plan`` has every attribute in :data:`PLAN_ATTRIBUTES` (looked up without
  evaluating properties, so a plan's cached calibration is not triggered here)."""
  missing = object()
  return all(inspect.getattr_static(plan, name, missing) is not missing
             for name in PLAN_ATTRIBUTES)


class PrivacyCallback(keras.callbacks.Callback):
  """Logs epsilon spent and optionally stops training before it exceeds a budget.

  Put it BEFORE ``keras.callbacks.TensorBoard`` in the callbacks list (Keras'
  History and progress bar always come after user callbacks).

  Args:
    plan: the :class:`tf_dpnsgd.plan.PrivacyPlan` the run follows.
    epsilon_budget: stop before any step after which epsilon would exceed
      this; ``None`` disables the stop.
    log_dir: also write the scalar ``epsilon`` to ``log_dir/privacy``.
    state_path: JSON file recording the step count, epsilon and plan at each
      epoch end; a later ``fit`` whose model ledger has fewer steps than
      recorded (a model that was not restored) or a different plan raises.
    update_freq: ``"batch"``, ``"epoch"`` or ``"auto"`` (batch for RDP, epoch
      for PLD, whose epsilon is costlier).
    check_optimizer: check at ``on_train_begin`` that the optimizer's noise
      multiplier is the plan's.

  Attributes:
    epsilon: the last epsilon computed; ``steps``: the step count it is for;
    stopped_by_budget: whether the budget stopped training.
  """

  def __init__(self, plan, epsilon_budget: Optional[float] = None,
               log_dir: Optional[str] = None, state_path: Optional[str] = None,
               update_freq: str = "auto", check_optimizer: bool = True):
    super().__init__()
    if not _is_plan(plan):
      raise TypeError(f"`plan` must be a tf_dpnsgd.plan.PrivacyPlan; got {plan!r}.")
    if epsilon_budget is not None:
      epsilon_budget = float(epsilon_budget)
      if math.isnan(epsilon_budget) or epsilon_budget < 0:
        raise ValueError(f"`epsilon_budget` must be >= 0 or None; got {epsilon_budget!r}.")
    if update_freq not in ("auto", "batch", "epoch"):
      raise ValueError(f"`update_freq` must be 'auto', 'batch' or 'epoch'; got {update_freq!r}.")
    if update_freq == "auto":
      update_freq = "batch" if plan.accountant == "rdp" else "epoch"
    self.plan = plan
    self.epsilon_budget = epsilon_budget
    self.log_dir = log_dir
    self.state_path = state_path
    self.update_freq = update_freq
    self.check_optimizer = check_optimizer
    self.epsilon = None
    self.steps = None
    self.stopped_by_budget = False
    self._max_steps = None
    self._writer = None

  # --- helpers ----------------------------------------------------------------
  def _lookahead(self) -> int:
    return max(1, int(getattr(self.model, "steps_per_execution", 1) or 1))

  def _update(self, logs) -> None:
    self.steps = steps_taken(self.model)
    self.epsilon = self.plan.report(self.model).epsilon
    if logs is not None:
      logs[EPSILON_KEY] = self.epsilon
    if self._writer is not None:
      with self._writer.as_default():
        write_scalar(EPSILON_KEY, self.epsilon, self.steps)

  def _read_state(self):
    if not self.state_path or not os.path.exists(self.state_path):
      return None
    with open(self.state_path) as f:
      return json.load(f)

  def _write_state(self) -> None:
    if not self.state_path or self.steps is None:
      return
    record = {"steps": self.steps, "epsilon": self.epsilon, "delta": self.plan.delta,
              "plan": self.plan.public_dict()}
    tmp = self.state_path + ".tmp"
    with open(tmp, "w") as f:
      json.dump(record, f, sort_keys=True)
    os.replace(tmp, self.state_path)

  # --- Keras hooks ------------------------------------------------------------
  def on_train_begin(self, logs=None):
    optimizer = self.model.optimizer
    if self.check_optimizer:
      self.plan.check_optimizer(optimizer)
    ledger = ledger_lib.ledger_of(self.model)
    self.plan.check_ledger(ledger)  # past steps must be ones this plan accounts for
    ledger.expect(self.plan.sampling)  # the train step refuses any other batch kind
    steps = ledger.steps
    state = self._read_state()
    if state is not None:
      if state.get("plan") != self.plan.public_dict():
        raise ValueError(f"{self.state_path} records a different privacy plan; one run must "
                         "follow one plan (or use a new state_path).")
      if steps < state["steps"]:
        raise ValueError(
            f"The model's privacy ledger has {steps} steps but {self.state_path} records "
            f"{state['steps']}: restore the model from the checkpoint (load_weights restores "
            "the ledger) so that epsilon counts every step taken.")
    if self.log_dir and self._writer is None:
      self._writer = tf.summary.create_file_writer(os.path.join(self.log_dir, "privacy"))
    self.stopped_by_budget = False
    if self.epsilon_budget is not None:
      self._max_steps = self.plan.step_accountant.max_steps(self.epsilon_budget)
      if steps + self._lookahead() > self._max_steps:
        raise PrivacyBudgetExceededError(
            f"No further step fits in the privacy budget epsilon = {self.epsilon_budget:g}: "
            f"{steps} steps taken, at most {self._max_steps} allowed "
            f"(steps_per_execution = {self._lookahead()}). {EXTEND_ADVICE}")
    self.steps = steps
    self.epsilon = self.plan.report(self.model).epsilon

  def on_train_batch_end(self, batch, logs=None):
    if self.update_freq == "batch" or self.epsilon_budget is not None:
      self.steps = steps_taken(self.model)
    if self.update_freq == "batch":
      self._update(logs)
    if self.epsilon_budget is None:
      return
    if self.steps > self._max_steps:  # cannot happen unless steps_per_execution changed mid-run
      raise PrivacyBudgetExceededError(
          f"{self.steps} steps exceed the {self._max_steps} that fit in epsilon = "
          f"{self.epsilon_budget:g}.")
    if self.steps + self._lookahead() > self._max_steps:
      self.model.stop_training = True
      self.stopped_by_budget = True

  def on_epoch_end(self, epoch, logs=None):
    self._update(logs)
    self._write_state()

  def on_train_end(self, logs=None):
    self._update(None)
    self._write_state()
    if self._writer is not None:
      self._writer.flush()


class ProgressBar(keras.callbacks.ProgbarLogger):
  """Keras' progress bar for DP training: what a user reads, and the steps that run.

  * Shows the loss, the compiled metrics, ``epsilon`` and the clipping statistics
    (``clipped_fraction`` with clipping, ``l2_norm_clip`` with adaptive clipping);
    the diagnostics in :data:`DIAGNOSTIC_KEYS` stay in ``history`` and TensorBoard
    but not on the bar (``nonfinite_examples`` is shown when it is not 0).
  * After the first step of each ``fit``, one line: its time (tracing, compilation, the
    first-batch checks) and the process' peak memory, the cost known before a long run
    commits to its length (Keras' bar's ETA counts from the second step).
  * With ``total_steps`` (the plan's), an epoch that holds fewer steps than
    ``steps_per_epoch`` (a partial last epoch, or one cut by the budget) is
    labelled ``Epoch 3/3 (partial: 50 of 100 steps)`` and its bar counts to the
    steps that ran, not to ``steps_per_epoch`` (Keras finalizes a stopped bar at
    its target).

  ``fit`` of a DP model adds one unless a ``ProgbarLogger`` is among the callbacks.

  Args:
    total_steps: the step count training ends at, counted from the first step
      (None: unknown, every epoch is shown as full).
  """

  dp_observes_only = True  # displays; never changes training

  def __init__(self, total_steps: Optional[int] = None, clock=None):
    super().__init__()
    import time  # pylint: disable=g-import-not-at-top
    self._clock = clock or time.perf_counter
    self.total_steps = None if total_steps is None else int(total_steps)
    self.steps_per_epoch = None
    self._steps_done = 0
    self._hidden = DIAGNOSTIC_KEYS | {CLIP_KEY}

  def set_params(self, params):
    super().set_params(params)
    self.steps_per_epoch = self.target

  def on_train_begin(self, logs=None):
    super().on_train_begin(logs)
    ledger = getattr(self.model, "privacy_ledger", None)
    self._steps_done = ledger.steps if isinstance(ledger, ledger_lib.PrivacyLedger) else 0
    adaptive = getattr(getattr(self.model, "optimizer", None), "adaptive_clip", None)
    self._hidden = DIAGNOSTIC_KEYS | (frozenset() if adaptive is not None else {CLIP_KEY})
    self._began, self._reported_first = self._clock(), False

  def on_train_batch_end(self, batch, logs=None):
    super().on_train_batch_end(batch, logs)
    if self.verbose and not self._reported_first:
      self._reported_first = True
      io_utils.print_msg("\n" + first_step_text(self._clock() - self._began, peak_rss_gib()))

  def on_epoch_begin(self, epoch, logs=None):
    spe, partial = self.steps_per_epoch, False
    if spe is not None and self.total_steps is not None:
      self.target = max(1, min(spe, self.total_steps - self._steps_done))
      partial = self.target < spe
    self._reset_progbar()
    self._maybe_init_progbar()
    if self.verbose and (self.epochs > 1 or partial):
      label = f" (partial: {self.target} of {spe} steps)" if partial else ""
      io_utils.print_msg(f"Epoch {epoch + 1}/{self.epochs}{label}")

  def on_epoch_end(self, epoch, logs=None):
    if self.target is not None and 0 < self.seen < self.target:
      self.target = self.seen  # stopped early: show the steps that ran
      if self.progbar is not None:
        self.progbar.target = self.seen
    self._steps_done += self.seen
    super().on_epoch_end(epoch, logs)

  def _update_progbar(self, batch, logs=None):
    super()._update_progbar(batch, shown(logs, self._hidden))

  def _finalize_progbar(self, logs):
    super()._finalize_progbar(shown(logs, self._hidden))


def eta_text(seconds: float) -> str:
  """``h:mm:ss`` of a non-negative duration.

  >>> eta_text(3725.4)
  '1:02:05'
  """
  seconds = int(round(max(float(seconds), 0.0)))
  return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


class StepReporter(keras.callbacks.Callback):
  """Per-step progress lines for long runs without a progress bar (the launchers' default
  ``--verbose=0``): nothing runs silent for minutes.

  Prints a line after the first step, after every step that took at least
  ``slow_step_s`` and otherwise at most every ``every_s`` seconds:
  ``step t/T  loss L  epsilon e  s/step d  ETA h:mm:ss``. The first step's line
  gives its time alone (tracing, compilation and the first-batch checks) and no ETA;
  from the second step on, the ETA is the mean time of the steps after the first
  times the steps left (the first step's tracing would inflate it many times over
  on a short run); the first two lines also give the process' peak RSS, the memory
  the steps reached before the run commits to its length; epsilon is the plan's
  for the ledger's steps (public: a function of the step count), the loss the
  unprivatized training loss every progress bar shows.

  Args:
    start_step, total_steps: the ledger's step when the run starts, and where it ends.
    plan: the run's :class:`~tf_dpnsgd.plan.PrivacyPlan` (None: no epsilon shown).
    clock, print_fn: for tests.
  """

  dp_observes_only = True  # it prints; it never changes training (tf_dpnsgd.coverage)

  def __init__(self, start_step: int, total_steps: int, plan=None, every_s: float = 30.0,
               slow_step_s: float = 2.0, clock=None, print_fn=None):
    super().__init__()
    import time  # pylint: disable=g-import-not-at-top
    self.start_step, self.total_steps, self.plan = int(start_step), int(total_steps), plan
    self.every_s, self.slow_step_s = float(every_s), float(slow_step_s)
    self._clock = clock or time.perf_counter
    self._print = print_fn or (lambda line: print(line, flush=True))

  def on_train_begin(self, logs=None):
    self._step = self.start_step
    self._began = self._last_step = self._last_line = self._clock()
    self._first_end = None

  def on_train_batch_end(self, batch, logs=None):
    self._step += 1
    now = self._clock()
    took, self._last_step = now - self._last_step, now
    done = self._step - self.start_step
    if done == 1:
      self._first_end = now
    if not (done <= 2 or took >= self.slow_step_s or now - self._last_line >= self.every_s):
      return
    self._last_line = now
    parts = [f"step {self._step}/{self.total_steps}"]
    loss = (logs or {}).get("loss")
    if loss is not None:
      parts.append(f"loss {float(loss):.4f}")
    if self.plan is not None:
      parts.append(f"epsilon {self.plan.epsilon(self._step):.3f}")
    if done == 1:
      parts.append(f"first step {took:.2f} s (tracing, compilation, checks; ETA from step 2)")
    else:
      per_step = (now - self._first_end) / (done - 1)
      parts += [f"{per_step:.2f} s/step",
                f"ETA {eta_text(per_step * max(self.total_steps - self._step, 0))}"]
    if done <= 2:  # the cost before the run commits: the memory the first steps reached
      parts.append(f"peak RSS {peak_rss_gib():.1f} GiB")
    self._print("  ".join(parts))


def first_step_text(seconds: float, peak_gib: float) -> str:
  """The first-step line of :class:`ProgressBar`.

  >>> first_step_text(86.04, 11.27)
  'first step 86.0 s (tracing, compilation, first-batch checks; the ETA counts from step 2), peak RSS 11.3 GiB'
  """
  return (f"first step {seconds:.1f} s (tracing, compilation, first-batch checks; the ETA "
          f"counts from step 2), peak RSS {peak_gib:.1f} GiB")


def peak_rss_gib() -> float:
  """This process' peak resident memory so far, in GiB (Linux ``ru_maxrss``: KiB)."""
  import resource  # pylint: disable=g-import-not-at-top
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def with_progress_bar(callbacks, total_steps: Optional[int] = None) -> list:
  """``callbacks`` with a :class:`ProgressBar` appended, unless a ``ProgbarLogger`` is
  among them already."""
  callbacks = list(callbacks or [])
  if not any(isinstance(c, keras.callbacks.ProgbarLogger) for c in callbacks):
    callbacks.append(ProgressBar(total_steps=total_steps))
  return callbacks


def shown(logs, hidden=DIAGNOSTIC_KEYS | {CLIP_KEY}):
  """The entries of ``logs`` that the progress bar shows: all but ``hidden``, and
  ``nonfinite_examples`` when it is not 0 (see :class:`ProgressBar`).

  >>> shown({"loss": 0.5, "grad_norm": 2.0, "nonfinite_examples": 0.0, "epsilon": 1.0})
  {'loss': 0.5, 'epsilon': 1.0}
  >>> shown({"loss": 0.5, "nonfinite_examples": 3.0})
  {'loss': 0.5, 'nonfinite_examples': 3.0}
  """
  if logs is None:
    return None
  return {k: v for k, v in logs.items()
          if k not in hidden or (k == "nonfinite_examples" and _nonzero(v))}


def _nonzero(value) -> bool:
  try:
    return float(value) != 0.0
  except (TypeError, ValueError):
    return True


__all__ = ["CLIP_KEY", "DIAGNOSTIC_KEYS", "EPSILON_KEY", "EXTEND_ADVICE", "PrivacyBudgetExceededError",
           "StepReporter", "eta_text", "first_step_text",
           "PrivacyCallback", "ProgressBar", "shown", "steps_taken", "with_progress_bar",
           "write_scalar"]
