"""``noise="auto"``: independent noise or BandMF, whichever leaves less noise in the model.

At one target epsilon, each mechanism needs its own noise multiplier (calibrated
here by the package's own plan, i.e. its accounting), and its strategy leaves its
own error in what the optimizer applies: the root mean squared error of the
prefix sums of the (momentum) updates per coordinate, in units of the per-example
bound, ``sqrt(sigma_b^2 ||A C_b^{-1}||_F^2 / n)``. With ``b = 1`` (``C = I``) this
is DP-SGD's independent noise under Poisson sampling at ``B/N``, amplified; with
``b >= 2`` BandMF under cyclic Poisson sampling at ``bB/N`` over ``ceil(n/b)``
compositions (Choquette-Choo et al. 2023, Thm. 4). Amplified BandMF picks ``b``
this way, so that ``b = 1`` (DP-SGD) is kept wherever correlation does not pay:
at small epsilon amplification by sampling beats correlation (their Fig. 1;
``docs/correlated_noise.md`` measured it on CIFAR-10).

The choice is a function of public quantities only (``N``, ``B``, the steps,
epsilon, delta, the momentum): it releases nothing, and a rerun of the same
settings chooses the same ``b``. It predicts noise, not accuracy; the CIFAR-10
study reports how far one follows the other.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

from tf_dpnsgd import plan as plan_lib
from tf_dpnsgd.correlated import strategy as strategy_lib

DEFAULT_MAX_BANDS = 32  # BandMF keeps b - 1 model-sized buffers: the default caps that memory


def prefix_sum_rms(noise_multiplier: float, strategy: strategy_lib.BandedStrategy) -> float:
  """RMS error of one prefix sum per coordinate: ``sqrt(sigma^2 ||A C^{-1}||_F^2 / n)``.

  >>> round(prefix_sum_rms(2.0, strategy_lib.identity_strategy(3)), 6)  # 2 sqrt((1+2+3)/3)
  2.828427
  """
  return float((noise_multiplier ** 2 * strategy.error / strategy.n) ** 0.5)


def candidate_bands(num_steps: int, batch_size: int, dataset_size: int,
                    max_bands: int = DEFAULT_MAX_BANDS) -> tuple:
  """1 and the powers of two up to the largest feasible ``b`` (``b B <= N``, ``b <= n``,
  ``b <= max_bands``), and that largest ``b`` itself.

  >>> candidate_bands(490, 1024, 50000, 32)
  (1, 2, 4, 8, 16, 32)
  >>> candidate_bands(490, 1024, 50000, 64)
  (1, 2, 4, 8, 16, 32, 48)
  """
  if isinstance(max_bands, bool) or not isinstance(max_bands, int) or max_bands < 1:
    raise ValueError(f"the largest number of bands must be an int >= 1; got {max_bands!r}.")
  top = min(int(max_bands), int(num_steps), int(dataset_size) // int(batch_size))
  out, b = [], 1
  while b <= top:
    out.append(b)
    b *= 2
  if top >= 1 and out[-1] != top:
    out.append(top)
  return tuple(out)


@dataclasses.dataclass(frozen=True)
class NoiseChoice:
  """The mechanism ``noise="auto"`` chose, and the table it chose from.

  Attributes:
    bands: 1 (independent noise, Poisson sampling) or ``b >= 2`` (BandMF, cyclic Poisson).
    rows: ``((b, noise_multiplier, rms), ...)`` for every candidate, ``b`` ascending.
  """

  bands: int
  rows: tuple

  @property
  def noise(self) -> str:
    return "independent" if self.bands == 1 else "bandmf"

  @property
  def sampling(self) -> str:
    return "poisson" if self.bands == 1 else "cyclic_poisson"

  def rms(self, bands: int) -> float:
    return dict((b, r) for b, _, r in self.rows)[bands]

  def to_dict(self) -> dict:
    """For reports: the choice and every candidate's multiplier and predicted error."""
    return {"chosen": self.noise, "bands": self.bands,
            "predicted_rms_vs_independent": self.rms(self.bands) / self.rms(1),
            "candidates": [{"bands": b, "noise_multiplier": s, "rms_prefix_sum_error": r}
                           for b, s, r in self.rows]}

  def describe(self) -> str:
    ratio = self.rms(self.bands) / self.rms(1)
    what = ("independent noise (b=1): no BandMF candidate predicts less noise" if self.bands == 1
            else f"BandMF with b={self.bands} bands ({ratio:.3f}x independent noise's error)")
    table = ", ".join(f"b={b}: sigma {s:.4g}, error {r:.4g}" for b, s, r in self.rows)
    return f"noise='auto' chose {what}. Candidates: {table}."


def best_of(rows) -> int:
  """The ``b`` of least predicted error; a tie goes to fewer bands (less memory, and ``b = 1``
  is plain DP-SGD).

  >>> best_of([(1, 1.0, 5.0), (2, 1.2, 5.0), (4, 2.0, 6.0)])
  1
  """
  return min(rows, key=lambda row: (row[2], row[0]))[0]


@functools.lru_cache(maxsize=32)
def choose_bands(*, dataset_size: int, batch_size: int, delta: float, target_epsilon: float,
                 epochs: Optional[float] = None, steps: Optional[int] = None,
                 accountant: str = "rdp", momentum: float = 0.0,
                 max_bands: int = DEFAULT_MAX_BANDS, conversion: str = "modern",
                 releases: tuple = ()) -> NoiseChoice:
  """Independent noise or BandMF with ``b`` bands at ``target_epsilon``, by predicted error.

  Each candidate ``b`` (:func:`candidate_bands`) gets the plan's calibrated noise multiplier
  and its optimized strategy (``optimize_bands`` for the plan's steps and ``momentum``).
  ``conversion`` and ``releases`` (noise multipliers of releases composed with the steps)
  as the run's plan has them, so that each candidate's multiplier is the one it would run at.

  Raises:
    ValueError: the plan's own errors (an epsilon it cannot reach, ...).
  """
  if target_epsilon is None:
    raise ValueError("noise='auto' compares the mechanisms at one epsilon: give "
                     "`target_epsilon` (a fixed noise multiplier means a different epsilon "
                     "for each).")
  common = dict(dataset_size=int(dataset_size), batch_size=int(batch_size), delta=delta,
                epochs=epochs, steps=steps, accountant=accountant,
                target_epsilon=float(target_epsilon), conversion=conversion,
                releases=tuple(releases))
  n = plan_lib.PrivacyPlan(sampling="poisson", **common).num_steps
  rows = []
  for b in candidate_bands(n, batch_size, dataset_size, max_bands):
    if b == 1:
      plan = plan_lib.PrivacyPlan(sampling="poisson", **common)
    else:
      plan = plan_lib.PrivacyPlan(sampling="cyclic_poisson", bands=b, **common)
    sigma = plan.training_noise_multiplier
    rows.append((b, float(sigma),
                 prefix_sum_rms(sigma, strategy_lib.optimize_bands(n, b, momentum))))
  return NoiseChoice(best_of(rows), tuple(rows))
