"""Cyclic Poisson sampling (b-min-separation) and the checks that bind correlated noise.

:class:`CyclicPoissonSampler`: each example belongs to part
``mix(key, identity) mod b`` (:func:`tf_dpnsgd.participation.part_of`: a function of
the example's identity, its content digest or the user's id, never of its position,
so reordered, reshuffled or reloaded data keep every example in its part; parts have
``N / b`` examples in expectation); step ``t`` includes each example of part
``t mod b`` independently with probability ``q_b = bB/N`` (expected batch size ``B``,
padded and masked like :class:`tf_dpnsgd.sampling.PoissonSampler`, divided by the
constant ``B``). The guard recomputes every row's part from its ``dp_identity`` tag
before each step (:class:`tf_dpnsgd.participation.ParticipationCheck`). An example can
take part only in steps ``b`` apart: with a
``b``-banded strategy of unit column norm (:mod:`tf_dpnsgd.correlated.strategy`)
its participations touch disjoint coordinates of ``C x``.

Accounting (Choquette-Choo et al. 2023, Thm. 4; the partition is conditioned
on, as there): the banded mechanism with this sampling is dominated by DP-SGD
with Poisson sampling at rate ``q_b`` and noise multiplier ``sigma`` composed
``ceil(T / b)`` times: ``SelfComposed(PoissonSampled(q_b, Gaussian(sigma)),
ceil(T / b))`` (:class:`tf_dpnsgd.accounting.AccountingSpec` with
``sampling="cyclic_poisson"``, ``bands=b``). ``b = 1`` is Poisson sampling.

Fail closed: the plan (``PrivacyPlan(sampling="cyclic_poisson", bands=b)``),
the optimizer (``band_coefficients`` of length ``b``) and the ledger (which
records the ``b`` of every step's noise, :attr:`tf_dpnsgd.ledger.PrivacyLedger.noise_bands`)
must agree: :func:`check_optimizer_bands`, :func:`check_ledger_noise`.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Optional

import numpy as np

from tf_dpnsgd import accounting
from tf_dpnsgd import ledger as ledger_lib
from tf_dpnsgd import participation
from tf_dpnsgd import sampling as sampling_lib

_TAG = 0xC1C1  # this sampler's streams (the Poisson draws of each step)


@dataclasses.dataclass(frozen=True)
class CyclicPoissonSampler(sampling_lib.PoissonSampler):
  """Poisson sampling within part ``t mod b`` of a secret partition (see the module doc).

  Attributes:
    bands: ``b``, the number of parts (the minimum separation of an example's steps).

  Formal guarantee: realises ``PoissonSampledDpEvent(bB/N, Gaussian)`` once per ``b``
  steps per example (``ceil(T / b)`` compositions) for a ``b``-banded strategy of unit
  column norm; a batch that does not fit ``max_batch_size`` raises.
  """

  bands: int = 1

  sampling: ClassVar[str] = "cyclic_poisson"

  def __post_init__(self):
    b = self.bands
    if isinstance(b, bool) or not isinstance(b, (int, np.integer)) or b < 1 \
        or b * self.batch_size > self.dataset_size:
      raise ValueError(f"`bands` must be an integer in [1, N / B]; got {b!r}.")
    if self.spec is not None and self.spec.bands != b:
      raise ValueError(f"`spec` accounts for bands={self.spec.bands}, this sampler draws {b}.")
    if self.max_batch_size is None:
      # Over the keyed partition and the draws, a step's batch size is Binomial(N, B/N)
      # (each example is in the step's part w.p. 1/b, then drawn w.p. bB/N).
      object.__setattr__(self, "max_batch_size", sampling_lib.poisson_max_batch_size(
          self.dataset_size, self.batch_size / self.dataset_size, self.overflow_probability))
    super().__post_init__()

  @property
  def sampling_rate(self) -> float:
    """``q_b = bB / N``, the rate within a part."""
    return self.bands * self.batch_size / self.dataset_size

  @property
  def denominator(self) -> float:
    """``B``, the expected batch size (``q_b`` times the part size ``N / b``)."""
    return float(self.batch_size)

  @property
  def fingerprint(self) -> int:
    return ledger_lib.sampler_fingerprint(f"cyclic_poisson/{self.bands}", self.dataset_size,
                                          self.batch_size)

  def accounting_spec(self, accountant=None, bound=None, conversion=None, orders=None):
    if self.spec is None:
      changes = {k: v for k, v in (("accountant", accountant), ("bound", bound),
                                   ("conversion", conversion), ("orders", orders))
                 if v is not None}
      return accounting.make_spec(self.dataset_size, self.batch_size, self.sampling,
                                  bands=self.bands, **changes)
    return super().accounting_spec(accountant, bound, conversion, orders)

  def _rng(self, counter: int) -> np.random.Generator:
    return np.random.default_rng([self.seed, _TAG, int(counter)])

  @property
  def structured(self) -> bool:
    return True

  @property
  def tag_period(self) -> int:
    """``b``: the guard checks each row's part against ``t mod b``."""
    return self.bands

  def part(self, index: int, population=None) -> np.ndarray:
    """Sorted positions of the examples of part ``index`` (by identity, see the module doc)."""
    population = self._population(population)
    cache = self.__dict__.get("_parts")
    if cache is None or cache[0] != population.layout:
      parts = participation.part_of(population.identities, self.seed_tag(population), self.bands)
      cache = (population.layout, [np.flatnonzero(parts == p) for p in range(self.bands)])
      self.__dict__["_parts"] = cache  # a memo of a pure function; the sampler stays frozen
    return cache[1][int(index)]

  def indices(self, step: int, population=None) -> np.ndarray:
    step = self._check_step(step)
    members = self.part(step % self.bands, population)
    return members[self._rng(step).random(members.size) < self.sampling_rate]


def make_sampler(sampling: str, dataset_size: int, batch_size: int,
                 seed: Optional[int] = None, **kwargs) -> sampling_lib.Sampler:
  """:func:`tf_dpnsgd.sampling.make_sampler`, and ``"cyclic_poisson"`` (``bands`` from the
  ``spec`` keyword)."""
  if sampling != "cyclic_poisson":
    return sampling_lib.make_sampler(sampling, dataset_size, batch_size, seed=seed, **kwargs)
  spec = kwargs.get("spec")
  kwargs.setdefault("bands", 1 if spec is None else spec.bands)
  return CyclicPoissonSampler(dataset_size=dataset_size, batch_size=batch_size, seed=seed,
                              **kwargs)


def check_optimizer_bands(optimizer, bands: int, blt=None) -> None:
  """Raises ``ValueError`` unless ``optimizer``'s noise is the plan's: ``b``-banded (1:
  independent), or exactly the plan's BLT (``blt``, a
  :class:`~tf_dpnsgd.correlated.blt.BLTStrategy`, or None)."""
  used = getattr(optimizer, "bands", 1)
  if blt is not None:
    if used != blt.ledger_code:
      raise ValueError(
          f"The plan accounts for BLT noise with theta={blt.theta}, omega={blt.omega}, but the "
          f"optimizer adds {ledger_lib.noise_name(used)}: the epsilon (the sensitivity of "
          "that BLT) would not describe it. Leave blt_parameters unset on the optimizer (a "
          "private model's plan hands its BLT over at compile), or give "
          "blt_parameters=[list(theta), list(omega)] of plan.blt.")
    return
  if used <= ledger_lib.BLT_BANDS:
    raise ValueError(
        "The optimizer adds BLT noise (blt_parameters), but the plan accounts for "
        f"{ledger_lib.noise_name(bands)}: a BLT's columns overlap at every distance, so the "
        "amplification of cyclic Poisson sampling (Choquette-Choo et al. 2023, Thm. 4) does "
        "not apply. Use a plan with sampling='cyclic_poisson', bands=b and blt=(theta, omega) "
        "(accounted without amplification; make_private(..., noise='blt')), or "
        "band_coefficients (BandMF) or independent noise.")
  if used != bands:
    raise ValueError(
        f"The optimizer adds noise with b = {used} bands but the plan accounts for b = {bands} "
        "(1: independent noise): give the optimizer band_coefficients=tf_dpnsgd.correlated."
        "noise.bandmf(plan.num_steps, plan.bands), or a plan with sampling='cyclic_poisson' "
        "and bands equal to the optimizer's.")


def check_ledger_noise(ledger, bands: int, blt=None) -> list:
  """Raises :class:`~tf_dpnsgd.ledger.LedgerMismatchError` unless every step in ``ledger``
  used the plan's noise (``b`` bands, or the BLT ``blt``); returns notes for the report."""
  recorded = ledger.noise_bands
  expected = bands if blt is None else blt.ledger_code
  if recorded != expected:
    raise ledger_lib.LedgerMismatchError(
        f"The model's privacy ledger holds steps of {ledger_lib.noise_name(recorded)}, but "
        f"this plan accounts for {ledger_lib.noise_name(expected)}: correlated and "
        "independent noise (or two strategies) cannot be mixed in one model's history, and "
        "the plan's epsilon is for its own strategy only.")
  if bands == 1 and blt is None:
    return []
  if blt is None:
    notes = [f"Correlated noise: a {bands}-banded matrix factorization (BandMF) with cyclic "
             "Poisson sampling, accounted as DP-SGD over ceil(steps / b) steps "
             "(Choquette-Choo et al. 2023, Thm. 4)."]
  else:
    notes = [f"Correlated noise: a BLT with {blt.buffers} buffer(s) (theta={blt.theta}, "
             f"omega={blt.omega}) under cyclic Poisson sampling with separation b = {bands}, "
             "accounted WITHOUT amplification: the steps so far are one Gaussian mechanism of "
             "sensitivity minsep_sensitivity(BLT, steps, b) (McMahan, Xu, Zhang 2024, Thm. 2)."]
  if ledger.noise_generation:
    notes.append(f"The ledger was rolled back {ledger.noise_generation} time(s); the "
                 "correlated stream refuses to continue after a rollback (the guard refuses "
                 "the step before it runs), so every accounted step is of one stream; the "
                 "steps of the abandoned branch stay counted.")
  return notes


__all__ = ["CyclicPoissonSampler", "check_ledger_noise", "check_optimizer_bands",
           "make_sampler"]
