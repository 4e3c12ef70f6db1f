"""Tests for tf_dpnsgd.plan: one object yields the sampler, sigma, event and report."""

import dataclasses

import numpy as np
import pytest

import tf_dpnsgd
from tf_dpnsgd import accounting
from tf_dpnsgd import sampling
from tf_dpnsgd.plan import PrivacyPlan

BASE = dict(dataset_size=20000, batch_size=200, delta=1e-5, seed=4)


def test_plan_with_sigma_and_epochs():
  plan = PrivacyPlan(sampling="poisson", epochs=2.5, noise_multiplier=1.3, **BASE)
  assert plan.num_steps == 250  # floor(2.5 * 20000 / 200)
  assert plan.training_noise_multiplier == 1.3
  assert isinstance(plan.sampler, sampling.PoissonSampler) and plan.sampler.seed == 4
  report = plan.planned_report()
  assert report.steps == 250 and report.target_epsilon is None
  assert report.epsilon == pytest.approx(accounting.compute_epsilon(
      20000, 200, 1.3, 1e-5, "poisson", steps=250).epsilon)
  assert plan.epsilon(10) < report.epsilon
  # The sampler holds the plan's spec (one source of truth); its event, composed in
  # dp-accounting directly, gives the report's epsilon.
  assert plan.sampler.spec is plan.spec
  ledger = plan.spec.make_accountant()
  ledger.compose(plan.dp_event())
  assert ledger.get_epsilon(1e-5) == pytest.approx(report.epsilon, rel=1e-12)


@pytest.mark.slow
@pytest.mark.parametrize("sampling_name,kwargs", [
    ("poisson", {}), ("shuffle", {"accountant": "pld"}),
    ("uniform", {"bound": "min", "conversion": "classic"})])
def test_plan_with_target_epsilon_calibrates(sampling_name, kwargs):
  plan = PrivacyPlan(sampling=sampling_name, steps=300, target_epsilon=3.0, **BASE, **kwargs)
  sigma = plan.training_noise_multiplier
  report = plan.planned_report()
  assert report.noise_multiplier == sigma
  assert report.epsilon <= 3.0
  assert report.target_epsilon == 3.0 and report.calibration_tolerance == plan.calibration_tolerance
  assert accounting.epsilon_for(plan.spec, sigma - plan.calibration_tolerance, 300, 1e-5) > 3.0
  assert plan.sampler.sampling == sampling_name


def test_plan_round_trips_with_its_seed():
  plan = PrivacyPlan(sampling="uniform", steps=10, noise_multiplier=2.0,
                     **{**BASE, "seed": None})
  assert isinstance(plan.seed, int)  # drawn once and recorded
  again = PrivacyPlan.from_json(plan.to_json())
  assert again == plan
  np.testing.assert_array_equal(again.sampler.indices(3), plan.sampler.indices(3))


def test_check_optimizer():
  plan = PrivacyPlan(sampling="poisson", steps=10, noise_multiplier=1.1, **BASE)
  plan.check_optimizer(tf_dpnsgd.DPNSGD(learning_rate=0.1, regularizer=0.01, noise_multiplier=1.1))
  with pytest.raises(ValueError, match="differs from the plan"):
    plan.check_optimizer(tf_dpnsgd.DPSGD(learning_rate=0.1, l2_norm_clip=1.0,
                                         noise_multiplier=1.0))
  with pytest.raises(ValueError, match="microbatches"):
    plan.check_optimizer(tf_dpnsgd.DPSGD(learning_rate=0.1, l2_norm_clip=1.0,
                                         noise_multiplier=1.1, num_microbatches=2))


def test_shuffle_plan_may_finish_its_last_epoch_for_free():
  # Shuffling is accounted per epoch, so steps 201..300 cost nothing beyond step 201:
  # the planned budget stop lets the last started epoch finish.
  plan = PrivacyPlan(sampling="shuffle", steps=201, noise_multiplier=1.0, **BASE)
  assert plan.epsilon(300) == plan.epsilon(201) < plan.epsilon(301)
  assert plan.step_accountant.max_steps(plan.epsilon()) == 300


def test_fit_kwargs():
  plan = PrivacyPlan(sampling="shuffle", epochs=2.5, noise_multiplier=1.0, **BASE)
  assert plan.fit_kwargs() == {"epochs": 3, "steps_per_epoch": 100, "initial_epoch": 0}
  assert plan.fit_kwargs(start_step=130)["initial_epoch"] == 1


def test_report_needs_the_model_not_a_step_count():
  plan = PrivacyPlan(sampling="poisson", steps=10, noise_multiplier=1.0, **BASE)
  with pytest.raises(TypeError, match="planned_report"):
    plan.report()  # pylint: disable=no-value-for-parameter
  with pytest.raises(TypeError, match="planned_report"):
    plan.report(10)


def test_public_dict_has_no_seed():
  plan = PrivacyPlan(sampling="poisson", steps=10, noise_multiplier=1.0, **BASE)
  assert "seed" not in plan.public_dict() and str(plan.seed) not in str(plan.public_dict())


@pytest.mark.parametrize("change,match", [
    (dict(epochs=1), "exactly one of `steps` and `epochs`"),
    (dict(steps=None), "exactly one of `steps` and `epochs`"),
    (dict(target_epsilon=1.0), "exactly one of `noise_multiplier`"),
    (dict(noise_multiplier=None), "exactly one of `noise_multiplier`"),
    (dict(noise_multiplier=0.0), "noise_multiplier"),
    (dict(batch_size=30000), "q = B/N"),
    (dict(delta=1.5), "delta"),
    (dict(sampling="uniform", accountant="pld"), "no PLD analysis"),
    (dict(sampling="poisson", bound="paper"), "WITHOUT replacement"),
    (dict(steps=0), "zero steps"),
    (dict(sampling="uniform", max_batch_size=300), "Poisson sampling only"),
    # sigma 3.6 under replace-one: rho = 0.154 > 0.1, outside Bun et al.'s Thm 11.
    (dict(sampling="uniform", bound="paper", noise_multiplier=3.6), "rho"),
])
def test_plan_rejects_bad_input(change, match):
  fields = dict(sampling="poisson", steps=10, noise_multiplier=1.0, **BASE)
  fields.update(change)
  with pytest.raises(ValueError, match=match):
    PrivacyPlan(**fields)


def test_plan_is_frozen():
  plan = PrivacyPlan(sampling="poisson", steps=10, noise_multiplier=1.0, **BASE)
  with pytest.raises(dataclasses.FrozenInstanceError):
    plan.noise_multiplier = 2.0


def test_epochs_are_whole_keras_epochs_when_n_over_b_is_not_whole():
  """Issue 31: N/B = 6.9 used to give fit_kwargs of 23 epochs of 6 steps for epochs=20
  (138 steps); an epoch is now round(N/B) = 7 steps, 20 epochs are 140 steps, and the
  epsilon is that of exactly those steps."""
  fields = dict(dataset_size=69, batch_size=10, delta=1e-5, noise_multiplier=1.0, seed=0)
  plan = PrivacyPlan(sampling="poisson", epochs=20, **fields)
  assert plan.steps_per_epoch == 7 and plan.num_steps == 140
  assert plan.fit_kwargs() == {"epochs": 20, "steps_per_epoch": 7, "initial_epoch": 0}
  assert plan.epsilon() == pytest.approx(accounting.compute_epsilon(
      69, 10, 1.0, 1e-5, "poisson", steps=140).epsilon)
  shuffled = PrivacyPlan(sampling="shuffle", epochs=20, **fields)  # a permutation's batches
  assert shuffled.steps_per_epoch == 6 and shuffled.num_steps == 120
  assert shuffled.fit_kwargs()["epochs"] == 20 and shuffled.spec.compositions(120) == 20
  partial = PrivacyPlan(sampling="poisson", epochs=2.5, **fields)
  assert partial.num_steps == 17 and partial.fit_kwargs()["epochs"] == 3  # last one partial
  assert PrivacyPlan(sampling="poisson", epochs=1, **{**fields, "dataset_size": 74}
                     ).steps_per_epoch == 7  # 7.4 rounds down
  assert PrivacyPlan(sampling="poisson", epochs=1, **{**fields, "dataset_size": 75}
                     ).steps_per_epoch == 8  # 7.5 rounds up


def test_extended_keeps_sigma_and_counts_from_the_first_step():
  plan = PrivacyPlan(sampling="poisson", epochs=2, target_epsilon=2.0, **BASE)
  sigma = plan.training_noise_multiplier
  longer = plan.extended(epochs=3)
  assert longer.training_noise_multiplier == sigma and longer.num_steps == 300
  assert longer.seed == plan.seed and longer.epsilon(plan.num_steps) == plan.epsilon()
  budget = plan.extended(target_epsilon=3.0)
  assert budget.training_noise_multiplier == sigma
  assert budget.num_steps % plan.steps_per_epoch == 0  # whole epochs
  assert budget.epsilon() <= 3.0 < budget.epsilon(budget.num_steps + plan.steps_per_epoch)
  by_steps = PrivacyPlan(sampling="poisson", steps=10, noise_multiplier=1.0, **BASE)
  assert by_steps.extended(target_epsilon=by_steps.epsilon(37)).num_steps == 37
