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
"""

from __future__ import annotations

import inspect
import json
import math
import os
from typing import Optional

import keras
import tensorflow as tf

from tf_dpnsgd import ledger as ledger_lib

EPSILON_KEY = "epsilon"

# What the callback uses of a plan (a tf_dpnsgd.plan.PrivacyPlan has all of them). Checked
# by name, so that this module need not import the plan module (which imports this one).
PLAN_ATTRIBUTES = ("accountant", "sampling", "delta", "report", "check_ledger",
                   "check_optimizer", "step_accountant", "public_dict")


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
            f"(steps_per_execution = {self._lookahead()}).")
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


__all__ = ["EPSILON_KEY", "PrivacyBudgetExceededError", "PrivacyCallback", "steps_taken",
           "write_scalar"]
