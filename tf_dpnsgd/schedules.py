"""Learning-rate schedules of the paper's CIFAR-10 experiments (Yang et al. 2022).

Each schedule is a pure multiplier function of the step (``*_multiplier``)
and a thin, serializable Keras 3 ``LearningRateSchedule`` returning
``base_lr * multiplier(step)``. The schedule only changes the step size, not
the noise or the sensitivity, so it costs no privacy.

  * constant: ``base_lr``.
  * step: x1 until 50% of training, x0.1 until 75%, then x0.01: the paper's
    "x0.1 at epoch 50 and x0.01 at epoch 75 of 100", scaled to any length.
  * cyclic: the paper's cyclic schedule "between 0.02 and 1.0", read as a
    triangular multiplier: linear from 0.02 up to 1.0 over the first half of
    each cycle and back down to 0.02 over the second half, one cycle over the
    whole run by default (one-cycle shape); 0.02 after the last step.
"""

from __future__ import annotations

import math

import keras
import tensorflow as tf


# --- pure multipliers -------------------------------------------------------
def step_multiplier(step, total_steps, boundaries=(0.5, 0.75), factors=(0.1, 0.01)):
  """Piecewise-constant multiplier: 1, then ``factors[i]`` from ``boundaries[i] * total_steps``.

  Args:
    step: current step (0-based), scalar tensor or number.
    total_steps: steps of the whole run.
    boundaries: increasing fractions of the run where the factor changes.
    factors: multiplier in force from each boundary on.

  Returns:
    float32 scalar tensor.
  """
  step = tf.cast(step, tf.float32)
  multiplier = tf.constant(1.0)
  for fraction, factor in zip(boundaries, factors):
    at = float(round(fraction * total_steps))
    multiplier = tf.where(step >= at, tf.constant(float(factor)), multiplier)
  return multiplier


def cyclic_multiplier(step, total_steps, low=0.02, high=1.0, num_cycles=1, peak_fraction=0.5):
  """Triangular multiplier: ``low`` -> ``high`` -> ``low`` in each of ``num_cycles`` cycles.

  Args:
    step: current step (0-based).
    total_steps: steps of the whole run (split into equal cycles).
    low, high: multiplier at the ends and at the peak of a cycle.
    num_cycles: number of triangles over the run.
    peak_fraction: where in a cycle the peak lies, in (0, 1).

  Returns:
    float32 scalar tensor; ``low`` at step 0 and from ``total_steps`` on.
  """
  step = tf.cast(step, tf.float32)
  cycle = float(total_steps) / num_cycles
  position = tf.math.floormod(step, cycle) / cycle  # in [0, 1)
  rising = position / peak_fraction
  falling = (1.0 - position) / (1.0 - peak_fraction)
  shape = tf.where(position < peak_fraction, rising, falling)
  multiplier = low + (high - low) * shape
  return tf.where(step >= float(total_steps), tf.constant(float(low)), multiplier)


# --- validation ---------------------------------------------------------------
def _positive_float(value, name):
  if isinstance(value, bool) or not isinstance(value, (int, float)) \
      or not math.isfinite(value) or value <= 0:
    raise ValueError(f"`{name}` must be a positive finite number; got {value!r}.")
  return float(value)


def _positive_int(value, name):
  if isinstance(value, bool) or not isinstance(value, int) or value < 1:
    raise ValueError(f"`{name}` must be a positive integer; got {value!r}.")
  return value


# --- Keras schedules ------------------------------------------------------------
@keras.saving.register_keras_serializable(package="tf_dpnsgd")
class ConstantSchedule(keras.optimizers.schedules.LearningRateSchedule):
  """``base_lr`` at every step."""

  def __init__(self, base_lr):
    self.base_lr = _positive_float(base_lr, "base_lr")

  def __call__(self, step):
    return tf.constant(self.base_lr, tf.float32)

  def get_config(self):
    return {"base_lr": self.base_lr}


@keras.saving.register_keras_serializable(package="tf_dpnsgd")
class StepSchedule(keras.optimizers.schedules.LearningRateSchedule):
  """``base_lr * step_multiplier(step, total_steps, boundaries, factors)``."""

  def __init__(self, base_lr, total_steps, boundaries=(0.5, 0.75), factors=(0.1, 0.01)):
    self.base_lr = _positive_float(base_lr, "base_lr")
    self.total_steps = _positive_int(total_steps, "total_steps")
    self.boundaries = tuple(float(b) for b in boundaries)
    self.factors = tuple(_positive_float(f, "factors[i]") for f in factors)
    if len(self.boundaries) != len(self.factors):
      raise ValueError(f"`boundaries` and `factors` differ in length: {self.boundaries} vs "
                       f"{self.factors}.")
    if any(not 0.0 < b < 1.0 for b in self.boundaries) or list(self.boundaries) != sorted(
        set(self.boundaries)):
      raise ValueError(f"`boundaries` must be increasing fractions in (0, 1); got "
                       f"{self.boundaries}.")

  def __call__(self, step):
    return self.base_lr * step_multiplier(step, self.total_steps, self.boundaries, self.factors)

  def get_config(self):
    return {"base_lr": self.base_lr, "total_steps": self.total_steps,
            "boundaries": list(self.boundaries), "factors": list(self.factors)}


@keras.saving.register_keras_serializable(package="tf_dpnsgd")
class CyclicSchedule(keras.optimizers.schedules.LearningRateSchedule):
  """``base_lr * cyclic_multiplier(step, total_steps, low, high, num_cycles, peak_fraction)``."""

  def __init__(self, base_lr, total_steps, low=0.02, high=1.0, num_cycles=1, peak_fraction=0.5):
    self.base_lr = _positive_float(base_lr, "base_lr")
    self.total_steps = _positive_int(total_steps, "total_steps")
    self.low = _positive_float(low, "low")
    self.high = _positive_float(high, "high")
    if self.low > self.high:
      raise ValueError(f"`low` must not exceed `high`; got low={low}, high={high}.")
    self.num_cycles = _positive_int(num_cycles, "num_cycles")
    if self.num_cycles > self.total_steps:
      raise ValueError(f"`num_cycles`={num_cycles} exceeds `total_steps`={total_steps}.")
    self.peak_fraction = float(peak_fraction)
    if not 0.0 < self.peak_fraction < 1.0:
      raise ValueError(f"`peak_fraction` must lie in (0, 1); got {peak_fraction!r}.")

  def __call__(self, step):
    return self.base_lr * cyclic_multiplier(step, self.total_steps, self.low, self.high,
                                            self.num_cycles, self.peak_fraction)

  def get_config(self):
    return {"base_lr": self.base_lr, "total_steps": self.total_steps, "low": self.low,
            "high": self.high, "num_cycles": self.num_cycles,
            "peak_fraction": self.peak_fraction}


# --- factories --------------------------------------------------------------------
def constant_schedule(base_lr):
  """A :class:`ConstantSchedule`."""
  return ConstantSchedule(base_lr)


def step_schedule(base_lr, total_steps):
  """The paper's step schedule: x0.1 at 50% and x0.01 at 75% of ``total_steps``."""
  return StepSchedule(base_lr, total_steps)


def cyclic_schedule(base_lr, total_steps, low=0.02, high=1.0, num_cycles=1):
  """The paper's cyclic schedule: ``base_lr`` times a triangle from ``low`` to ``high``."""
  return CyclicSchedule(base_lr, total_steps, low=low, high=high, num_cycles=num_cycles)


SCHEDULES = ("constant", "step", "cyclic")


def make_schedule(name, base_lr, total_steps):
  """The schedule called ``name`` (one of :data:`SCHEDULES`) with its paper defaults.

  Args:
    name: ``"constant"``, ``"step"`` or ``"cyclic"``.
    base_lr: peak / initial learning rate.
    total_steps: optimizer steps of the whole run (epochs x steps per epoch).

  Returns:
    A ``keras.optimizers.schedules.LearningRateSchedule``.
  """
  if name == "constant":
    return constant_schedule(base_lr)
  if name == "step":
    return step_schedule(base_lr, total_steps)
  if name == "cyclic":
    return cyclic_schedule(base_lr, total_steps)
  raise ValueError(f"Unknown learning-rate schedule {name!r}; expected one of {SCHEDULES}.")


__all__ = ["ConstantSchedule", "CyclicSchedule", "SCHEDULES", "StepSchedule",
           "constant_schedule", "cyclic_multiplier", "cyclic_schedule", "make_schedule",
           "step_multiplier", "step_schedule"]
