"""The assumptions behind a number: :class:`AccountingSpec` and the dp-accounting events.

Every number in :mod:`tf_dpnsgd.accounting` is for the Gaussian mechanism
applied to the SUM of per-example contributions, each with L2 norm at most
``S`` (the transform's ``sensitivity``: 1 for normalization, ``c`` for
clipping), with noise ``N(0, (sigma * S)^2 I)``. ``sigma`` is the *noise
multiplier*, the unit used everywhere in this package.

=========  ======================  ==================================  =========================
sampling   neighbours              dp-accounting event (per step)      accountants
=========  ======================  ==================================  =========================
poisson    add/remove one          ``PoissonSampled(q, Gaussian(s))``  ``rdp``, ``pld``
uniform    replace one             ``SampledWithoutReplacement(N, B,   ``rdp`` (+ the paper's
                                   Gaussian(s/2))``                    bound, alone or ``min``)
shuffle    replace one             ``Gaussian(s/2)`` (rdp) or          ``rdp``, ``pld``
                                   ``Gaussian(s)`` (pld), composed
                                   once per epoch; no amplification
user_      add/remove one USER     ``PoissonSampled(q, Gaussian(s))``  ``rdp``, ``pld``
poisson    (all of their rows)     with ``q = B/U`` over ``U`` users
=========  ======================  ==================================  =========================

``user_poisson`` (:mod:`tf_dpnsgd.users`) is Poisson sampling with the privacy unit a
user: ``N`` is the number of users ``U``, ``B`` the expected users per batch, and the
sum is over users' bounded contributions, so the numbers are Poisson's over ``U`` units.

Replace-one doubles the sensitivity: swapping one example for another can
move the sum by ``2S``. dp-accounting (0.6) is inconsistent about who pays
for that (google/differential-privacy issue #378):

* its RDP accountant does NOT double: ``GaussianDpEvent(m)`` is accounted as
  ``alpha / (2 m^2)`` whatever the neighbouring relation, and
  ``SampledWithoutReplacementDpEvent`` uses Wang, Balle, Kasiviswanathan
  (2019) Thm. 9 with the base mechanism's RDP ``alpha / (2 m^2)``. So we pass
  ``m = sigma / 2`` (noise std over the replace-one sensitivity ``2S``);
* its PLD accountant DOES double for ``REPLACE_ONE`` (it compares
  ``mu(x - S)`` with ``mu(x + S)``), so we pass ``m = sigma``;
* its PLD accountant has no sampling-without-replacement event at all, so
  ``uniform`` + ``pld`` is an unsupported pair (:class:`UnsupportedAccountingError`).

``tests/test_accounting.py`` pins all three facts against closed forms, so an
upgrade of dp-accounting that changes them fails loudly.

BLT noise (``blt=(theta, omega)`` with ``sampling="cyclic_poisson"``, ``bands=b``: an
example takes part only in steps ``b`` apart) is accounted WITHOUT amplification: the
first ``T`` steps release ``C_T x + sigma S z`` (the optimizer applies ``C^{-1}`` of it,
post-processing), one Gaussian mechanism whose sensitivity is ``S * s_T`` with
``s_T = minsep_sensitivity(blt, T, b)`` (McMahan, Xu, Zhang 2024, Thm. 2; Gaussian
noise with a lower-triangular ``C`` stays private under adaptively chosen inputs,
Denisov et al. 2022). Its event is ``GaussianDpEvent(sigma / s_T)``; its RDP,
``s_T^2`` times one unit-sensitivity Gaussian's (:meth:`AccountingSpec.rdp_scale`).
Poisson sampling within a part only removes participations, which cannot raise the
sensitivity of these non-negative coefficients.

Shuffling (``model.fit``'s own order, or :class:`tf_dpnsgd.sampling.ShuffleSampler`)
has no proven amplification. We report the bound without amplification: with
the permutation independent of the data, replacing one example changes the
input of exactly one step per epoch, so ``T`` steps are ``ceil(T / (N // B))``
adaptive compositions of the Gaussian mechanism with sensitivity ``2S``
(parallel composition within an epoch, sequential across epochs).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Optional

import dp_accounting
import numpy as np

from tf_dpnsgd.accounting.paper_bound import (PaperBoundConditionError, paper_bound_conditions,
                                              paper_conditions_message)
from tf_dpnsgd.accounting.validation import (AccountingError, UnsupportedAccountingError,
                                             _validate_choice, validate_dataset_and_batch,
                                             validate_noise_multiplier, validate_steps)

NeighboringRelation = dp_accounting.NeighboringRelation

SAMPLINGS = ("poisson", "uniform", "shuffle", "cyclic_poisson", "user_poisson")
ACCOUNTANTS = ("rdp", "pld")
BOUNDS = ("default", "paper", "min")
CONVERSIONS = ("modern", "classic")

NEIGHBORING_RELATIONS = {
    "poisson": NeighboringRelation.ADD_OR_REMOVE_ONE,
    "cyclic_poisson": NeighboringRelation.ADD_OR_REMOVE_ONE,
    "user_poisson": NeighboringRelation.ADD_OR_REMOVE_ONE,  # one user, all of their rows
    "uniform": NeighboringRelation.REPLACE_ONE,
    "shuffle": NeighboringRelation.REPLACE_ONE,
}

# Noise multiplier handed to dp-accounting = sigma / factor (see module docstring).
_REPLACE_ONE_RDP_FACTOR = 2.0


def _grid(start, stop, step):
  return [round(float(v), 6) for v in np.arange(start, stop + step / 2, step)]


# Dense order grid (about 300 orders; dp-accounting's default has 156).
DEFAULT_ORDERS = tuple(sorted(set(
    _grid(1.05, 3.0, 0.05) + _grid(3.1, 10.0, 0.1) + _grid(10.25, 32.0, 0.25)
    + _grid(33, 64, 1) + _grid(66, 128, 2) + _grid(136, 256, 8) + _grid(288, 1024, 32))))

# dp-accounting's sampling-without-replacement bound costs O(alpha^2) per
# integer order up to 256 (fractional orders interpolate the two integers), so
# its grid is denser where the optimum lies and sparse where it is costly.
WOR_ORDERS = tuple(sorted(set(
    _grid(1.1, 1.9, 0.1) + _grid(2.0, 10.0, 0.25) + _grid(11, 64, 1)
    + [72.0, 80.0, 96.0, 112.0, 128.0, 320.0, 384.0, 512.0, 768.0, 1024.0])))


@dataclasses.dataclass(frozen=True)
class AccountingSpec:
  """How batches are drawn and how epsilon is computed for them.

  Attributes:
    dataset_size: ``N``.
    batch_size: ``B`` (expected batch size ``qN`` for Poisson).
    sampling: ``"poisson"``, ``"uniform"`` or ``"shuffle"`` (see module docstring).
    accountant: ``"rdp"`` or ``"pld"`` (dp-accounting).
    bound: ``"default"`` (dp-accounting), ``"paper"`` (the paper's bound alone)
      or ``"min"`` (pointwise minimum of both RDP curves); the last two only
      for ``uniform`` sampling with the ``rdp`` accountant.
    conversion: RDP to (epsilon, delta): ``"modern"`` or ``"classic"``
      (``rdp`` only).
    orders: RDP orders; ``None`` picks :data:`DEFAULT_ORDERS` (or
      :data:`WOR_ORDERS` for uniform sampling).
    releases: noise multipliers of Gaussian releases of statistics of the
      WHOLE training set made before training (e.g. the private feature
      normalization of :mod:`tf_dpnsgd.private_stats`): each a sum of
      per-example vectors of L2 norm at most ``S_j`` noised with
      ``N(0, (sigma_j S_j)^2 I)``, composed once with the training steps
      (no sampling; replace-one doubles their sensitivity like a step's).

  Raises:
    AccountingError: for invalid sizes; :class:`UnsupportedAccountingError`
      for combinations no implemented analysis covers.
  """

  dataset_size: int
  batch_size: int
  sampling: str
  accountant: str = "rdp"
  bound: str = "default"
  conversion: str = "modern"
  orders: Optional[tuple] = None
  releases: tuple = ()
  bands: int = 1  # cyclic_poisson: b parts, b-banded correlated noise (docs/correlated_noise.md)
  blt: tuple = ()  # (theta, omega): BLT noise, b-min-separation, no amplification

  def __post_init__(self):
    validate_dataset_and_batch(self.dataset_size, self.batch_size)
    _validate_bands(self.sampling, self.bands, self.dataset_size, self.batch_size)
    object.__setattr__(self, "blt", _validate_blt(self.blt, self.sampling, self.bound))
    _validate_choice("sampling", self.sampling, SAMPLINGS)
    _validate_choice("accountant", self.accountant, ACCOUNTANTS)
    _validate_choice("bound", self.bound, BOUNDS)
    _validate_choice("conversion", self.conversion, CONVERSIONS)
    if self.sampling == "uniform" and self.accountant == "pld":
      raise UnsupportedAccountingError(
          "sampling='uniform' (fixed-size batches without replacement) has no PLD analysis "
          "in dp-accounting (its PLD accountant does not support "
          "SampledWithoutReplacementDpEvent). Use accountant='rdp', or Poisson sampling.")
    if self.bound != "default" and self.sampling != "uniform":
      raise UnsupportedAccountingError(
          f"bound={self.bound!r} is the paper's bound for sampling WITHOUT replacement "
          f"(Bun et al. 2018 Thm. 11); it does not apply to sampling={self.sampling!r}. "
          "Use bound='default'.")
    if self.bound != "default" and self.accountant != "rdp":
      raise UnsupportedAccountingError(
          f"bound={self.bound!r} is an RDP bound; use accountant='rdp'.")
    if self.accountant == "pld" and self.conversion != "modern":
      raise UnsupportedAccountingError(
          "conversion='classic' converts RDP; the PLD accountant computes (epsilon, delta) "
          "directly. Use conversion='modern' with accountant='pld'.")
    if self.orders is not None:
      orders = tuple(float(a) for a in self.orders)
      if not orders or any(not a > 1.0 or not math.isfinite(a) for a in orders):
        raise AccountingError(f"`orders` must be finite numbers > 1; got {self.orders!r}.")
      object.__setattr__(self, "orders", orders)
    object.__setattr__(self, "releases",
                       tuple(validate_noise_multiplier(r) for r in self.releases))
    if self.bound != "default":
      # Fail early when the paper's sigma-independent condition (q < 0.1) fails; the
      # others depend on sigma and are checked by rdp_curve.
      failed = [c for c in paper_bound_conditions(self.sampling_rate, 1.0)
                if c[0] == "sampling_ratio"]
      if failed:
        raise PaperBoundConditionError(
            "sampling_ratio",
            paper_conditions_message(failed, f"at q = B/N = {self.sampling_rate:.4g}")
            + " Use bound='default' (dp-accounting) instead.")

  # --- derived quantities ------------------------------------------------
  @property
  def sampling_rate(self) -> float:
    """``q = B / N`` (cyclic Poisson: ``q_b = B / (N / b)``, the rate within a part)."""
    return self.bands * self.batch_size / self.dataset_size

  @property
  def neighboring_relation(self) -> NeighboringRelation:
    return NEIGHBORING_RELATIONS[self.sampling]

  @property
  def steps_per_epoch(self) -> int:
    """``N // B``: a full epoch of the shuffle sampler (nominal for the others)."""
    return self.dataset_size // self.batch_size

  @property
  def rdp_orders(self) -> tuple:
    if self.orders is not None:
      return self.orders
    return WOR_ORDERS if self.sampling == "uniform" else DEFAULT_ORDERS

  @functools.cached_property  # the accountant asks at every new step count
  def blt_strategy(self):
    """The :class:`~tf_dpnsgd.correlated.blt.BLTStrategy` of :attr:`blt`, or None."""
    return _blt_strategy(self.blt) if self.blt else None

  def blt_sensitivity(self, steps: int) -> float:
    """``s_T``: the sensitivity of the first ``steps`` steps of the BLT mechanism per unit
    of per-example bound (participations ``bands`` apart; see the module docstring)."""
    from tf_dpnsgd.correlated import blt as blt_lib  # pylint: disable=import-outside-toplevel
    steps = validate_steps(steps)
    return blt_lib.minsep_sensitivity(self.blt_strategy, steps, self.bands) if steps else 0.0

  def rdp_scale(self, steps: int) -> float:
    """The RDP of ``steps`` steps over the RDP of one :meth:`event`: the number of
    compositions, or ``s_T^2`` for BLT noise (one Gaussian mechanism of sensitivity
    ``s_T``; its RDP ``alpha s_T^2 / (2 sigma^2)`` is ``s_T^2`` times a unit one's)."""
    if self.blt:
      return self.blt_sensitivity(steps) ** 2
    return self.compositions(steps)

  def compositions(self, steps: int) -> int:
    """How many times the per-composition event is composed for ``steps`` steps.

    One per step, except for shuffling: one per epoch touched, since each
    example is in at most one batch of an epoch.
    """
    steps = validate_steps(steps)
    if self.sampling == "shuffle":
      return -(-steps // self.steps_per_epoch)
    if self.sampling == "cyclic_poisson":  # each example's part runs every b-th step
      return -(-steps // self.bands)
    return steps

  def accountant_noise_multiplier(self, noise_multiplier: float) -> float:
    """The noise multiplier in the convention the chosen dp-accounting accountant expects.

    ``sigma`` (std over the per-example bound ``S``) for add/remove and for
    PLD; ``sigma / 2`` (std over the replace-one sensitivity ``2S``) for the
    RDP accountant under replace-one, which does not double by itself.
    """
    sigma = validate_noise_multiplier(noise_multiplier)
    if self.neighboring_relation is NeighboringRelation.REPLACE_ONE and self.accountant == "rdp":
      return sigma / _REPLACE_ONE_RDP_FACTOR
    return sigma

  def event(self, noise_multiplier: float) -> dp_accounting.DpEvent:
    """The dp-accounting event of ONE composition (a step; an epoch for shuffling; for BLT
    noise, the Gaussian mechanism of sensitivity 1, see :meth:`rdp_scale`)."""
    m = self.accountant_noise_multiplier(noise_multiplier)
    gaussian = dp_accounting.GaussianDpEvent(m)
    if self.blt:
      return gaussian
    if self.sampling in ("poisson", "cyclic_poisson", "user_poisson"):
      return dp_accounting.PoissonSampledDpEvent(self.sampling_rate, gaussian)
    if self.sampling == "uniform":
      return dp_accounting.SampledWithoutReplacementDpEvent(
          self.dataset_size, self.batch_size, gaussian)
    return gaussian

  def release_events(self) -> list:
    """The dp-accounting events of the :attr:`releases` (full-data Gaussian mechanisms)."""
    return [dp_accounting.GaussianDpEvent(self.accountant_noise_multiplier(r))
            for r in self.releases]

  def release_rdp(self, orders) -> np.ndarray:
    """RDP of all :attr:`releases` together at ``orders``: ``sum_j alpha / (2 m_j^2)``,
    ``m_j`` in the accountant's convention (:meth:`accountant_noise_multiplier`)."""
    orders = np.asarray(orders, dtype=float)
    total = sum(1.0 / (2.0 * self.accountant_noise_multiplier(r) ** 2) for r in self.releases)
    return orders * total

  def composed_event(self, noise_multiplier: float, steps: int) -> dp_accounting.DpEvent:
    """The event of a whole run of ``steps`` steps (after the :attr:`releases`, if any)."""
    if self.blt:  # one Gaussian mechanism of sensitivity s_T (0 steps: nothing released)
      sensitivity = self.blt_sensitivity(steps)
      run = dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(
          self.accountant_noise_multiplier(noise_multiplier) / (sensitivity or 1.0)),
                                              1 if steps else 0)
    else:
      run = dp_accounting.SelfComposedDpEvent(self.event(noise_multiplier),
                                              self.compositions(steps))
    if not self.releases:
      return run
    steps_events = [run] if self.compositions(steps) else []  # PLD refuses a 0-fold event
    return dp_accounting.ComposedDpEvent(self.release_events() + steps_events)

  def make_accountant(self) -> dp_accounting.PrivacyAccountant:
    """A fresh dp-accounting accountant with this spec's neighbouring relation and orders."""
    if self.accountant == "pld":
      return dp_accounting.pld.PLDAccountant(self.neighboring_relation)
    return dp_accounting.rdp.RdpAccountant(list(self.rdp_orders), self.neighboring_relation)

  def assumptions(self) -> dict:
    """The assumptions behind a number from this spec, as readable strings."""
    relation = {
        NeighboringRelation.ADD_OR_REMOVE_ONE: "add/remove one example",
        NeighboringRelation.REPLACE_ONE: "replace one example",
    }[self.neighboring_relation]
    if self.sampling == "user_poisson":
      relation = "add/remove one user (all of their rows: user-level DP)"
    sampling = {
        "poisson": f"Poisson sampling: each step includes each example independently with "
                   f"probability q = B/N = {self.sampling_rate:.6g} (variable batch size).",
        "uniform": f"Each step draws a fresh uniformly random subset of exactly B = "
                   f"{self.batch_size} of N = {self.dataset_size} examples, without "
                   "replacement, independently across steps.",
        "cyclic_poisson": f"Cyclic Poisson sampling (b-min-separation, b = {self.bands}): a "
                          "secret permutation splits the data into b parts; step t includes "
                          "each example of part t mod b w.p. q_b = bB/N = "
                          f"{self.sampling_rate:.6g}; " + (
                              "with BLT correlated noise, accounted WITHOUT amplification as "
                              "one Gaussian mechanism of sensitivity s_T = "
                              "minsep_sensitivity(BLT, T, b) (McMahan, Xu, Zhang 2024, Thm. 2)."
                              if self.blt else
                              "with b-banded correlated noise of sensitivity 1 per "
                              "participation, accounted as DP-SGD at q_b over ceil(steps / b) "
                              "steps (Choquette-Choo et al. 2023, Thm. 4)."),
        "user_poisson": f"User-level Poisson sampling: each step includes each USER "
                        f"independently with probability q = B/U = {self.sampling_rate:.6g} "
                        f"(U = {self.dataset_size} users, B = {self.batch_size} expected per "
                        "batch), at most k rows of each (tf_dpnsgd.users).",
        "shuffle": f"Each epoch is a random permutation cut into {self.steps_per_epoch} "
                   "disjoint batches (each example at most once per epoch). NO amplification "
                   "by subsampling is proven for shuffling, so none is claimed: every epoch is "
                   "accounted as a full-batch Gaussian mechanism.",
    }[self.sampling]
    if self.neighboring_relation is NeighboringRelation.ADD_OR_REMOVE_ONE:
      sensitivity = ("the noised sum changes by at most S (the per-example bound) between "
                     "neighbours")
    else:
      sensitivity = ("the noised sum changes by up to 2S between neighbours (one bounded "
                     "contribution swapped for another); accounted explicitly")
    if self.sampling == "user_poisson":
      sensitivity = sensitivity.replace("per-example bound", "per-user bound")
    if self.accountant == "pld":
      accountant = "dp-accounting PLD accountant (connect-the-dots, pessimistic)"
    elif self.bound == "default":
      accountant = "dp-accounting RDP accountant"
    elif self.bound == "paper":
      accountant = ("the paper's RDP bound 7 q^2 alpha / s^2 for alpha <= (s^2/2) "
                    "log(1/q), with s = sigma/2 (replace-one sensitivity), valid under Bun et "
                    "al. 2018 Thm. 11's conditions q < 0.1, rho = 1/(2 s^2) <= 0.1 and "
                    "log(1/q) >= 3 rho (2 + log2(1/rho))")
    else:
      accountant = ("pointwise minimum of the dp-accounting RDP bound and the paper's bound "
                    "(s = sigma/2; only where Bun et al. 2018 Thm. 11's conditions hold)")
    conversion = "n/a (PLD gives (epsilon, delta) directly)" if self.accountant == "pld" else {
        "modern": "RDP -> (epsilon, delta): Canonne-Kamath-Steinke 2020 (dp-accounting default)",
        "classic": "RDP -> (epsilon, delta): epsilon = RDP(a) + log(1/delta)/(a-1) (Mironov 2017)",
    }[self.conversion]
    out = {
        "neighboring_relation": relation,
        "sampling": sampling,
        "sensitivity": "noise multiplier sigma = noise std / S; " + sensitivity,
        "accountant": accountant,
        "conversion": conversion,
        "protects": "every intermediate model (all noised updates are released).",
    }
    if self.releases:
      sigmas = ", ".join(f"{r:.6g}" for r in self.releases)
      out["releases"] = (f"{len(self.releases)} Gaussian release(s) of whole-training-set "
                         f"statistics before training (noise multipliers {sigmas}; exact "
                         "Gaussian RDP, no sampling), composed with the steps.")
    return out


def _validate_bands(sampling, bands, dataset_size, batch_size) -> None:
  if isinstance(bands, bool) or not isinstance(bands, (int, np.integer)) or bands < 1:
    raise AccountingError(f"`bands` must be a positive integer; got {bands!r}.")
  if bands != 1 and sampling != "cyclic_poisson":
    raise UnsupportedAccountingError(
        f"bands={bands} (correlated noise) is accounted only with sampling='cyclic_poisson' "
        f"(b-min-separation); got sampling={sampling!r}.")
  if bands * batch_size > dataset_size:
    raise AccountingError(f"cyclic Poisson sampling needs b * B <= N (rate q_b = bB/N <= 1); "
                          f"got b={bands}, B={batch_size}, N={dataset_size}.")


def _blt_strategy(blt):
  from tf_dpnsgd.correlated import blt as blt_lib  # pylint: disable=import-outside-toplevel
  return blt_lib.BLTStrategy(*blt)


def _validate_blt(blt, sampling, bound) -> tuple:
  """``()`` or ``((theta...), (omega...))`` as floats (JSON gives lists); raises unless a
  valid BLT (non-negative, non-increasing coefficients) under cyclic Poisson sampling."""
  if blt is None or (not isinstance(blt, str) and len(blt) == 0):
    return ()
  if isinstance(blt, str) or len(blt) != 2:
    raise AccountingError(f"`blt` must be (theta, omega) of a BLT; got {blt!r}.")
  try:
    strategy = _blt_strategy(blt)
  except ValueError as e:
    raise AccountingError(f"`blt`: {e}") from e
  if sampling != "cyclic_poisson":
    raise UnsupportedAccountingError(
        f"blt= (BLT noise) is accounted only with sampling='cyclic_poisson' (each example at "
        f"most once every `bands` steps); got sampling={sampling!r}.")
  if bound != "default":
    raise UnsupportedAccountingError("blt= is accounted with bound='default' only.")
  return (strategy.theta, strategy.omega)


def make_spec(dataset_size, batch_size, sampling, accountant="rdp", bound="default",
              conversion="modern", orders=None, releases=(), bands=1, blt=()) -> AccountingSpec:
  return AccountingSpec(dataset_size=dataset_size, batch_size=batch_size, sampling=sampling,
                        accountant=accountant, bound=bound, conversion=conversion,
                        orders=None if orders is None else tuple(orders),
                        releases=tuple(releases), bands=bands, blt=blt)


__all__ = ["ACCOUNTANTS", "AccountingSpec", "BOUNDS", "CONVERSIONS", "DEFAULT_ORDERS",
           "NEIGHBORING_RELATIONS", "NeighboringRelation", "SAMPLINGS", "WOR_ORDERS",
           "make_spec"]
