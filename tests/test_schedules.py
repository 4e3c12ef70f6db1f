"""Learning-rate schedules: values at key steps, serialization, use in a DP optimizer."""

import json

import keras
import numpy as np
import pytest

import tf_dpnsgd
from tf_dpnsgd import schedules


def values(schedule, steps):
  return [float(schedule(step)) for step in steps]


def test_step_schedule_paper_milestones():
  schedule = schedules.step_schedule(0.4, total_steps=100)  # "epochs" 50 and 75 of 100
  np.testing.assert_allclose(
      values(schedule, [0, 49, 50, 74, 75, 99, 500]),
      [0.4, 0.4, 0.04, 0.04, 0.004, 0.004, 0.004], rtol=1e-6)


def test_step_schedule_scales_to_other_lengths():
  schedule = schedules.step_schedule(1.0, total_steps=390 * 40)  # 40 epochs of 390 steps
  np.testing.assert_allclose(values(schedule, [7799, 7800, 11699, 11700]),
                             [1.0, 0.1, 0.1, 0.01], rtol=1e-6)


def test_cyclic_schedule_triangle_between_002_and_1():
  schedule = schedules.cyclic_schedule(2.0, total_steps=100)
  np.testing.assert_allclose(
      values(schedule, [0, 25, 50, 75, 99, 100, 1000]),
      [2 * 0.02,  # start at the bottom
       2 * (0.02 + 0.98 * 0.5),  # half way up
       2.0,  # peak at mid-run
       2 * (0.02 + 0.98 * 0.5),  # half way down
       2 * (0.02 + 0.98 * 0.02),  # one step before the end
       2 * 0.02, 2 * 0.02],  # bottom from the end on
      rtol=1e-5)


def test_cyclic_schedule_several_cycles():
  schedule = schedules.CyclicSchedule(1.0, total_steps=100, num_cycles=2)
  np.testing.assert_allclose(values(schedule, [0, 25, 50, 75]), [0.02, 1.0, 0.02, 1.0],
                             rtol=1e-5)


def test_constant_schedule():
  assert values(schedules.constant_schedule(0.3), [0, 10 ** 6]) == pytest.approx([0.3, 0.3])


@pytest.mark.parametrize("schedule", [
    schedules.ConstantSchedule(0.1),
    schedules.StepSchedule(0.1, 100, boundaries=(0.3, 0.6, 0.9), factors=(0.5, 0.25, 0.1)),
    schedules.CyclicSchedule(0.1, 100, low=0.1, high=2.0, num_cycles=3, peak_fraction=0.25),
])
def test_serialization_round_trip(schedule):
  clone = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(schedule))
  assert type(clone) is type(schedule)
  assert clone.get_config() == schedule.get_config()
  steps = [0, 10, 33, 50, 66, 95, 120]
  np.testing.assert_allclose(values(clone, steps), values(schedule, steps))


def test_dp_optimizer_serializes_its_schedule():
  optimizer = tf_dpnsgd.DPNSGD(learning_rate=schedules.step_schedule(0.5, 10), regularizer=0.1,
                               noise_multiplier=1.0, seed=0)
  config = json.loads(json.dumps(keras.saving.serialize_keras_object(optimizer)))
  assert config["config"]["learning_rate"]["registered_name"] == "tf_dpnsgd>StepSchedule"
  restored = keras.saving.deserialize_keras_object(config)
  schedule = restored.inner_optimizer._learning_rate  # the wrapped optimizer steps
  assert isinstance(schedule, schedules.StepSchedule)
  assert float(schedule(6)) == pytest.approx(0.05)


@pytest.mark.parametrize("make", [
    lambda: schedules.step_schedule(0.0, 10),
    lambda: schedules.step_schedule(0.1, 0),
    lambda: schedules.StepSchedule(0.1, 10, boundaries=(0.75, 0.5)),
    lambda: schedules.CyclicSchedule(0.1, 10, low=2.0, high=1.0),
    lambda: schedules.CyclicSchedule(0.1, 10, peak_fraction=1.0),
    lambda: schedules.CyclicSchedule(0.1, 10, num_cycles=11),
    lambda: schedules.make_schedule("cosine", 0.1, 10),
])
def test_invalid_arguments_raise(make):
  with pytest.raises(ValueError):
    make()


def test_make_schedule_by_name():
  """Each name builds its schedule with the base rate and the length given (values at the
  milestones, not only the type)."""
  steps = [0, 4, 5, 7, 8, 9]
  step = schedules.make_schedule("step", 0.1, 10)  # x0.1 from step 5, x0.01 from step 7.5
  assert isinstance(step, schedules.StepSchedule)
  np.testing.assert_allclose(values(step, steps), [0.1, 0.1, 0.01, 0.01, 0.001, 0.001],
                             rtol=1e-6)
  cyclic = schedules.make_schedule("cyclic", 0.1, 10)  # 0.02 -> 1.0 at mid-run -> 0.02
  assert isinstance(cyclic, schedules.CyclicSchedule)
  np.testing.assert_allclose(values(cyclic, [0, 5, 10]), [0.1 * 0.02, 0.1, 0.1 * 0.02],
                             rtol=1e-5)
  constant = schedules.make_schedule("constant", 0.1, 10)
  assert isinstance(constant, schedules.ConstantSchedule)
  np.testing.assert_allclose(values(constant, steps), [0.1] * len(steps), rtol=1e-6)
