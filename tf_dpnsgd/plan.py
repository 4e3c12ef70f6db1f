"""One plan object: the sampler, the noise multiplier, the event and the report, together.

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
>>> plan.report().epsilon <= 2.0
True

Training::

    optimizer = tf_dpnsgd.DPNSGD(learning_rate=0.1, regularizer=0.01,
                                 noise_multiplier=plan.training_noise_multiplier)
    model.compile(optimizer=optimizer, loss=...)
    model.fit(plan.dataset(x, y), callbacks=plan.callbacks(), **plan.fit_kwargs())

Resuming (after restoring the model and optimizer from a checkpoint)::

    start = int(model.optimizer.iterations)
    model.fit(plan.dataset(x, y, start_step=start), callbacks=plan.callbacks(),
              **plan.fit_kwargs(start_step=start))
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from typing import Optional

from tf_dpnsgd import accounting
from tf_dpnsgd import sampling as sampling_lib


@dataclasses.dataclass(frozen=True)
class PrivacyPlan:
  """The privacy-relevant configuration of one training run (frozen, validated).

  Attributes:
    dataset_size: ``N``.
    batch_size: ``B`` (expected batch size ``qN`` for Poisson).
    sampling: ``"poisson"``, ``"uniform"`` or ``"shuffle"``.
    delta: in (0, 1).
    steps / epochs: exactly one; ``steps = floor(epochs * N / B)``.
    noise_multiplier / target_epsilon: exactly one; a target is met by
      calibrating ``sigma`` (bisection to ``calibration_tolerance``).
    accountant, bound, conversion: see :class:`tf_dpnsgd.accounting.AccountingSpec`.
    seed: sampler seed (``None``: drawn from the OS and recorded). Keep it secret.
    max_batch_size, overflow_probability: Poisson padding (see
      :class:`tf_dpnsgd.sampling.PoissonSampler`).
    calibration_tolerance: absolute tolerance on the calibrated ``sigma``.
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
  seed: Optional[int] = None
  max_batch_size: Optional[int] = None
  overflow_probability: float = 1e-12
  calibration_tolerance: float = 1e-3

  def __post_init__(self):
    accounting.validate_dataset_and_batch(self.dataset_size, self.batch_size)
    accounting.validate_delta(self.delta)
    if (self.steps is None) == (self.epochs is None):
      raise ValueError("Give exactly one of `steps` and `epochs`.")
    if self.steps is not None:
      accounting.validate_steps(self.steps)
    else:
      accounting.steps_from_epochs(self.epochs, self.dataset_size, self.batch_size)
    if (self.noise_multiplier is None) == (self.target_epsilon is None):
      raise ValueError("Give exactly one of `noise_multiplier` and `target_epsilon`.")
    if self.noise_multiplier is not None:
      accounting.validate_noise_multiplier(self.noise_multiplier)
    else:
      accounting.validate_target_epsilon(self.target_epsilon)
    if not self.calibration_tolerance > 0:
      raise ValueError(f"`calibration_tolerance` must be > 0; got {self.calibration_tolerance!r}.")
    if self.sampling != "poisson" and self.max_batch_size is not None:
      raise ValueError("`max_batch_size` applies to Poisson sampling only.")
    self.spec  # validates the sampling/accountant/bound/conversion combination
    if self.num_steps == 0:
      raise ValueError("The plan has zero steps (floor(epochs * N / B) = 0).")
    # Fix the seed now, so every sampler and record of this plan agrees on it.
    object.__setattr__(self, "seed", self.sampler.seed)

  # --- derived, cached (pure functions of the fields) ----------------------
  @functools.cached_property
  def spec(self) -> accounting.AccountingSpec:
    return accounting.make_spec(self.dataset_size, self.batch_size, self.sampling,
                                self.accountant, self.bound, self.conversion)

  @functools.cached_property
  def num_steps(self) -> int:
    """Total number of steps the claim covers."""
    if self.steps is not None:
      return int(self.steps)
    return accounting.steps_from_epochs(self.epochs, self.dataset_size, self.batch_size)

  @functools.cached_property
  def training_noise_multiplier(self) -> float:
    """The noise multiplier to train with: the given one, or calibrated to ``target_epsilon``."""
    if self.noise_multiplier is not None:
      return float(self.noise_multiplier)
    return accounting.calibrate_noise_multiplier(self.spec, self.target_epsilon, self.num_steps,
                                                 self.delta, self.calibration_tolerance)

  @functools.cached_property
  def sampler(self) -> sampling_lib.Sampler:
    kwargs = {}
    if self.sampling == "poisson":
      kwargs = {"max_batch_size": self.max_batch_size,
                "overflow_probability": self.overflow_probability}
    return sampling_lib.make_sampler(self.sampling, self.dataset_size, self.batch_size,
                                     seed=self.seed, **kwargs)

  @functools.cached_property
  def step_accountant(self) -> accounting.StepAccountant:
    """Epsilon after any number of steps at the training noise multiplier (cached)."""
    return accounting.StepAccountant(self.spec, self.training_noise_multiplier, self.delta)

  # --- the four things the plan yields ---------------------------------------
  def dp_event(self, steps: Optional[int] = None):
    """The sampler's dp-accounting event for ``steps`` (default: all planned) steps."""
    steps = self.num_steps if steps is None else steps
    return self.sampler.dp_event(self.training_noise_multiplier, steps, self.accountant)

  def epsilon(self, steps: Optional[int] = None) -> float:
    return self.step_accountant.epsilon(self.num_steps if steps is None else steps)

  def report(self, steps: Optional[int] = None) -> accounting.PrivacyReport:
    """The privacy report after ``steps`` (default: all planned) steps."""
    steps = self.num_steps if steps is None else steps
    target = None if self.target_epsilon is None else float(self.target_epsilon)
    return self.step_accountant.report(
        steps, target_epsilon=target,
        calibration_tolerance=None if target is None else self.calibration_tolerance)

  # --- training helpers ------------------------------------------------------
  def dataset(self, x, y, start_step: int = 0):
    """The sampler's infinite ``tf.data`` stream from ``start_step`` (see :meth:`fit_kwargs`)."""
    return self.sampler.dataset(x, y, start_step=start_step)

  def fit_kwargs(self, start_step: int = 0) -> dict:
    """``epochs``, ``steps_per_epoch`` and ``initial_epoch`` for ``model.fit``.

    ``epochs * steps_per_epoch`` may exceed :attr:`num_steps` when ``N / B`` is
    not an integer; :meth:`callbacks` stops training at the planned budget.
    """
    spe = self.spec.steps_per_epoch
    if isinstance(start_step, bool) or not isinstance(start_step, int) or start_step < 0:
      raise ValueError(f"`start_step` must be a non-negative integer; got {start_step!r}.")
    return {"epochs": max(1, math.ceil(self.num_steps / spe)), "steps_per_epoch": spe,
            "initial_epoch": start_step // spe}

  def callbacks(self, log_dir=None, state_path=None, stop_at_budget: bool = True) -> list:
    """``[PrivacyCallback]`` logging epsilon and (by default) stopping at the planned epsilon."""
    from tf_dpnsgd import callbacks as callbacks_lib  # local: callbacks imports this module
    budget = self.epsilon() if stop_at_budget else None
    return [callbacks_lib.PrivacyCallback(self, epsilon_budget=budget, log_dir=log_dir,
                                          state_path=state_path)]

  def check_optimizer(self, optimizer) -> None:
    """Raises ``ValueError`` unless ``optimizer`` adds the noise this plan accounts for."""
    sigma = getattr(optimizer, "noise_multiplier", None)
    if sigma is None:
      raise ValueError(f"{optimizer!r} is not a DP optimizer (no `noise_multiplier`).")
    expected = self.training_noise_multiplier
    if not math.isclose(float(sigma), expected, rel_tol=1e-9, abs_tol=0.0):
      raise ValueError(
          f"The optimizer's noise_multiplier ({float(sigma)!r}) differs from the plan's "
          f"({expected!r}): the reported epsilon would not describe this training. Build the "
          "optimizer with noise_multiplier=plan.training_noise_multiplier.")
    if self.sampling == "poisson" and getattr(optimizer, "num_microbatches", None):
      raise ValueError("Poisson-sampled (padded, masked) batches cannot be split into "
                       "microbatches; use num_microbatches=None.")

  # --- records ----------------------------------------------------------------
  def to_dict(self) -> dict:
    """The fields (with the resolved seed); ``PrivacyPlan(**d)`` rebuilds the plan."""
    return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

  def to_json(self) -> str:
    return json.dumps(self.to_dict(), sort_keys=True)

  @classmethod
  def from_json(cls, text: str) -> "PrivacyPlan":
    return cls(**json.loads(text))


__all__ = ["PrivacyPlan"]
