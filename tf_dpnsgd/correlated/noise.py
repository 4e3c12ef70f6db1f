"""Correlated noise in the train step: ``w = C^{-1} z`` for a banded Toeplitz ``C``
(:class:`BandedNoise`) or a BLT (:class:`BLTNoise`, :func:`blt_step`; the ledger records
which BLT, :attr:`tf_dpnsgd.correlated.blt.BLTStrategy.ledger_code`, accounted without
amplification by a plan with the same ``blt=``).

The optimizer applies ``(sum_t + sigma S w_t) / D`` instead of
``(sum_t + sigma S z_t) / D``, with ``z_t`` the i.i.d. ``N(0, I)`` draw of
:mod:`tf_dpnsgd.noise` (the same stateless key ``(key, [lineage, generation, step])``:
a draw never repeats) and ``w = C^{-1} z`` computed forward, one step at a time::

    w_t = (z_t - sum_{k=1}^{b-1} c_k w_{t-k}) / c_0          (:func:`banded_step`)

so the released sequence is ``C^{-1}(C x + sigma S z)``: post-processing of the
matrix mechanism ``C x + sigma S z`` with sensitivity ``S`` per participation
(``||c|| = 1``, :mod:`tf_dpnsgd.correlated.strategy`). ``b = 1`` (``c = (1,)``) is
exactly the independent noise of :func:`tf_dpnsgd.noise.privatize` (the same draws).

State: the last ``b - 1`` noise tensors ``w_{t-1}, ..., w_{t-b+1}`` (one model-sized
buffer each) and the ledger position ``[lineage, generation, step]`` they continue,
kept as non-trainable optimizer variables (:class:`BandedNoise`), so every save path
that carries the optimizer's state carries them.

Fail closed (the step cannot assert under XLA, so the noise itself refuses): the step's
noise is NaN, and an assertion fails where assertions run, unless the buffers continue
the ledger exactly (same lineage and generation, next step) or the ledger is at step 0
with fresh buffers. So a correlated run does not continue after a rollback (the ledger's
``noise_generation`` moved: the history the recursion needs is not the one the
released steps used), nor from a new optimizer whose buffers are zero mid-run.
"""

from __future__ import annotations

from typing import Sequence

import keras
import numpy as np
import tensorflow as tf

from tf_dpnsgd import ledger as ledger_lib
from tf_dpnsgd import noise as noise_lib
from tf_dpnsgd.correlated import blt as blt_lib
from tf_dpnsgd.correlated import strategy as strategy_lib

FRESH = -1  # the position of buffers that never ran a step


def validate_coefficients(coefficients) -> tuple:
  """``(c_0, ..., c_{b-1})`` as floats with ``||c|| = 1`` and ``c_0 > 0``; raises otherwise."""
  c = tuple(float(v) for v in coefficients)
  normalized = strategy_lib.normalize(c)
  if c[0] <= 0 or abs(sum(v * v for v in c) - 1.0) > 1e-6:
    raise ValueError(f"band_coefficients must have c_0 > 0 and unit L2 norm (sensitivity 1 "
                     f"per participation); got {c}. Use tf_dpnsgd.correlated.bandmf("
                     f"num_steps, bands) or strategy.normalize. Normalized: "
                     f"{tuple(float(v) for v in normalized)}.")
  return c


def bandmf(num_steps: int, bands: int, momentum: float = 0.0) -> tuple:
  """The coefficients of the optimized ``bands``-banded strategy for ``num_steps`` steps
  (:func:`tf_dpnsgd.correlated.strategy.optimize_bands`), for ``band_coefficients=``."""
  return strategy_lib.optimize_bands(num_steps, bands, momentum).coefficients


def banded_step(z: Sequence[tf.Tensor], history: Sequence[Sequence[tf.Tensor]],
                coefficients: Sequence[float]) -> list:
  """``w_t = (z_t - sum_{k>=1} c_k w_{t-k}) / c_0`` per variable.

  Args:
    z: this step's i.i.d. draws, one tensor per variable.
    history: ``history[k - 1][j]`` is ``w_{t-k}`` of variable ``j`` (``k = 1..b-1``).
    coefficients: ``(c_0, ..., c_{b-1})``.
  """
  c = [float(v) for v in coefficients]
  out = []
  for j, zj in enumerate(z):
    acc = zj
    for k in range(1, len(c)):
      acc = acc - c[k] * tf.cast(history[k - 1][j], zj.dtype)
    out.append(acc / c[0])
  return out


def blt_step(z: Sequence[tf.Tensor], buffers: Sequence[Sequence[tf.Tensor]], theta, omega):
  """One step of ``w = C^{-1} z`` for a BLT (:mod:`tf_dpnsgd.correlated.blt`), per variable::

      w_t = z_t - sum_i omega_i s_{i,t},     s_{i,t+1} = theta_i s_{i,t} + w_t

  Args:
    z: this step's i.i.d. draws, one tensor per variable.
    buffers: ``buffers[i][j]`` is ``s_{i,t}`` of variable ``j``.
    theta, omega: the BLT's buffer decays and output scales.

  Returns:
    ``(w, new_buffers)``: ``w_t`` per variable and ``s_{i,t+1}``.
  """
  theta, omega = [float(v) for v in theta], [float(v) for v in omega]
  w = []
  for j, zj in enumerate(z):
    acc = zj
    for i, o in enumerate(omega):
      acc = acc - o * tf.cast(buffers[i][j], zj.dtype)
    w.append(acc)
  new = [[theta[i] * tf.cast(buffers[i][j], zj.dtype) + w[j] for j, zj in enumerate(z)]
         for i in range(len(theta))]
  return w, new


class _StreamNoise:
  """The state and step of a streaming ``C^{-1} z``, owned by a :class:`tf_dpnsgd.PrivateOptimizer`.

  Subclasses give the state's size (:meth:`_state_count`), the variable names
  (:attr:`_prefix`) and one step (:meth:`_next`); the position check, the draws and the
  update are shared (see the module doc).
  """

  _prefix = ""

  def __init__(self):
    self.history = []  # history[i][j]: state slot i of variable j
    self.position = None

  def _state_count(self) -> int:
    raise NotImplementedError

  def _state_name(self, i: int, j: int) -> str:
    raise NotImplementedError

  def _next(self, z, state):
    """``(w_t, new_state)`` from this step's draws and the state."""
    raise NotImplementedError

  def build(self, optimizer: keras.optimizers.Optimizer, var_list) -> None:
    """Creates the state (float32, one buffer per variable and slot) and the position."""
    self.history = [[optimizer.add_variable(shape=v.shape, dtype="float32",
                                            initializer="zeros", name=self._state_name(i, j),
                                            aggregation="only_first_replica")
                     for j, v in enumerate(var_list)]
                    for i in range(self._state_count())]
    self.position = optimizer.add_variable(
        shape=(3,), dtype="int64", name=f"{self._prefix}_position",
        initializer=keras.initializers.Constant(FRESH), aggregation="only_first_replica")

  def continues(self, stream: tf.Tensor) -> tf.Tensor:
    """Whether the buffers continue the ledger's ``[lineage, generation, step]``."""
    stream = tf.cast(stream, tf.int64)
    fresh = tf.reduce_all(tf.equal(self.position, FRESH)) & tf.equal(stream[-1], 0)
    return fresh | tf.reduce_all(tf.equal(self.position, stream))

  def host_continues(self, stream) -> bool:
    """:meth:`continues` on the host, for the guard's check before a step (eager; the
    in-graph check of :meth:`privatize` stays, but XLA drops assertions)."""
    if self.position is None:  # not built: the first step builds fresh buffers
      return int(stream[-1]) == 0
    position = [int(v) for v in np.asarray(self.position.numpy())]
    stream = [int(v) for v in stream]
    return (all(p == FRESH for p in position) and stream[-1] == 0) or position == stream

  def privatize(self, summed, denominator, *, key, step, stddev, user_seeded) -> list:
    """``(summed + stddev * w_t) / D``; advances the state to step ``t + 1``.

    ``step``: the ledger's ``[lineage, generation, step]`` (a vector: the position check
    needs all three). NaN noise (and a failed assertion where they run) unless
    :meth:`continues`.
    """
    if tf.is_tensor(stddev):
      raise ValueError("Correlated noise needs a fixed noise std (no adaptive clipping).")
    ctx = tf.distribute.get_replica_context()
    if ctx is not None and ctx.num_replicas_in_sync > 1:
      raise NotImplementedError("Correlated noise is not implemented under a tf.distribute "
                                "strategy with several replicas.")
    step = tf.cast(step, tf.int64)
    if step.shape.rank != 1 or step.shape[0] != 3:
      raise ValueError("Correlated noise needs the ledger's [lineage, generation, step].")
    ok = self.continues(step)
    check = tf.debugging.Assert(ok, [
        "tf_dpnsgd: the correlated-noise buffers (position [lineage, generation, step]) do "
        "not continue the model's privacy ledger at", step, "buffers at", self.position,
        ": after a rollback (noise_generation moved) or with a new optimizer mid-run the "
        "correlated mechanism cannot continue; train a new model (or restore the optimizer "
        "state saved with the ledger)."])
    seed = noise_lib.step_seed(tf.constant(key, tf.int64), noise_lib.stream(step, user_seeded))
    z = noise_lib.standard_normal(summed, seed)  # the draws of the independent mechanism
    # Snapshots (a variable's .value may alias it): every new slot reads the old state.
    state = [[tf.identity(h.value) for h in slot] for slot in self.history]
    w, new_state = self._next(z, state)
    w = [tf.where(ok, wj, tf.constant(float("nan"), tf.float32)) for wj in w]
    with tf.control_dependencies([check]):
      for slot, values in zip(self.history, new_state):
        for h, value in zip(slot, values):
          h.assign(value)
      self.position.assign(step + tf.constant([0, 0, 1], tf.int64))
      denominator = tf.cast(denominator, tf.float32)
      return [(s + tf.cast(stddev * wj, s.dtype)) / tf.cast(denominator, s.dtype)
              for s, wj in zip(summed, w)]


class BandedNoise(_StreamNoise):
  """``b``-banded ``C``: the state is ``w_{t-1}, ..., w_{t-b+1}`` (:func:`banded_step`)."""

  _prefix = "bandmf"

  def __init__(self, coefficients):
    super().__init__()
    self.coefficients = validate_coefficients(coefficients)

  @property
  def bands(self) -> int:
    return len(self.coefficients)

  def _state_count(self) -> int:
    return self.bands - 1

  def _state_name(self, i, j):
    return f"bandmf_w{i + 1}_{j}"

  def _next(self, z, state):
    w = banded_step(z, state, self.coefficients)
    return w, ([w] + state[:-1]) if state else []


BLT_BANDS = ledger_lib.BLT_BANDS  # the ledger records BLT noise as a code <= BLT_BANDS
noise_name = ledger_lib.noise_name


class BLTNoise(_StreamNoise):
  """A BLT ``C`` (:mod:`tf_dpnsgd.correlated.blt`): the state is ``d`` buffers
  ``s_{i,t}`` (:func:`blt_step`), whatever the number of steps."""

  _prefix = "blt"

  def __init__(self, theta, omega):
    super().__init__()
    self.strategy = blt_lib.BLTStrategy(tuple(theta), tuple(omega))

  @property
  def bands(self) -> int:
    """What the ledger records: the BLT's
    :attr:`~tf_dpnsgd.correlated.blt.BLTStrategy.ledger_code`."""
    return self.strategy.ledger_code

  def _state_count(self) -> int:
    return self.strategy.buffers

  def _state_name(self, i, j):
    return f"blt_s{i}_{j}"

  def _next(self, z, state):
    return blt_step(z, state, self.strategy.theta, self.strategy.omega)


def blt_noise(blt_parameters, adaptive_clip=None):
  """The optimizer's :class:`BLTNoise` for ``blt_parameters = (theta, omega)``, or None.
  Refuses adaptive clipping (its noise std changes every step)."""
  if blt_parameters is None:
    return None
  if adaptive_clip is not None:
    raise ValueError("blt_parameters (correlated noise) with quantile-adaptive clipping: the "
                     "noise std changes every step. Use a fixed clip.")
  theta, omega = blt_parameters
  return BLTNoise(theta, omega)


def banded_noise(band_coefficients, adaptive_clip=None):
  """The optimizer's :class:`BandedNoise`, or None for independent noise (``None`` or one
  coefficient: ``C = I``). Refuses adaptive clipping (its noise std changes every step)."""
  if band_coefficients is None or len(band_coefficients) == 1:
    if band_coefficients is not None:
      validate_coefficients(band_coefficients)
    return None
  if adaptive_clip is not None:
    raise ValueError("band_coefficients (correlated noise) with quantile-adaptive clipping: "
                     "the noise std changes every step, which the banded recursion does not "
                     "model. Use a fixed clip.")
  return BandedNoise(band_coefficients)


__all__ = ["BLTNoise", "BLT_BANDS", "BandedNoise", "FRESH", "banded_noise", "banded_step",
           "bandmf", "blt_noise", "blt_step", "noise_name", "validate_coefficients"]
