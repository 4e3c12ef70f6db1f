"""The Gaussian mechanism on summed contributions: seeded, keyed by the ledger step.

Phase 2 of the DP step (:mod:`tf_dpnsgd.step.algorithm`) in one place: what the
mechanism is configured with (the transform, which carries its sensitivity
``S``: :func:`make_transform`; adaptive clipping's count noise:
:func:`make_adaptive_clip`; the key: :func:`noise_key`) and what it computes
(:func:`privatize`: ``(sum + N(0, (sigma S)^2 I)) / D``, one draw and one
all-reduce per step; :func:`privatize_count`: adaptive clipping's count query).
The Keras optimizer (:class:`tf_dpnsgd.PrivateOptimizer`) holds the
configuration and calls these functions.

The noise for step ``t`` is a pure function of ``(key, t)`` (stateless
``tf.random.stateless_normal`` with Philox named, :data:`NOISE_ALG`) where ``t`` is the model's
privacy-ledger step (:mod:`tf_dpnsgd.ledger`), saved with the model's weights:
a resumed run, a recompile or a new optimizer continues the stream and never
repeats a draw, and two runs with the same user seed draw identical noise when both
run with the same ``jit_compile`` setting (XLA's normal sampler maps the same key to
different, equally N(0, 1) numbers: tests/test_xla.py).

Formal guarantee: given ``summed = sum_i h_i g_i`` where every contribution has
L2 norm <= ``sensitivity``, ``add_gaussian_noise`` returns ``summed + N(0, s^2 I)``
with ``s = noise_multiplier * sensitivity``: the Gaussian mechanism with
noise multiplier ``noise_multiplier`` (in units of the sensitivity), which is
what :mod:`tf_dpnsgd.accounting` accounts.

Adaptive clipping: ``noise_multiplier`` is the EFFECTIVE multiplier of the
two queries of each step (what every accountant uses): the gradient gets
``sigma_grad = (sigma^-2 - (2 sigma_b)^-2)^(-1/2)`` times the clip ``C_t`` of
that step (read before the step, the same value that clipped), the centered
count of unclipped units gets ``N(0, sigma_b^2)`` from an independent stream,
and only then does the optimizer move the clip to ``C_{t+1}``
(:func:`tf_dpnsgd.transforms.quantile_clip_update`); see
:mod:`tf_dpnsgd.accounting.adaptive`.

Secrecy: by default the key is drawn from the OS (:func:`random_seed`) when
the optimizer is built and is never stored (not a variable: no checkpoint,
``.keras`` file or export holds it). Whoever knows the key and two successive
checkpoints can subtract the noise; a user-fixed ``seed`` is therefore for
reproducibility experiments only, and the privacy report says when one was used.
"""

from __future__ import annotations

import os
from typing import Sequence

import tensorflow as tf

from tf_dpnsgd import transforms
from tf_dpnsgd.accounting import adaptive as _adaptive
from tf_dpnsgd.accounting import validation as _validation

# Adaptive clipping's split of the effective noise multiplier (see
# :mod:`tf_dpnsgd.accounting.adaptive`), re-exported for the optimizers.
gradient_noise_multiplier = _adaptive.gradient_noise_multiplier
default_clipped_count_stddev = _adaptive.default_clipped_count_stddev
validate_clipped_count_stddev = _adaptive.validate_clipped_count_stddev


def validate_noise_multiplier(noise_multiplier) -> float:
  """Returns ``noise_multiplier`` as a float; raises unless it is a finite number >= 0.

  :func:`tf_dpnsgd.accounting.validate_noise_multiplier` with ``allow_zero=True`` (0 adds
  no noise); the error is an :class:`~tf_dpnsgd.accounting.AccountingError`, a ``ValueError``.
  """
  return _validation.validate_noise_multiplier(noise_multiplier, allow_zero=True)


def random_seed() -> int:
  """A 63-bit seed from the OS entropy pool (used when the user gives none)."""
  return int.from_bytes(os.urandom(8), "little") >> 1


def step_seed(seed: tf.Tensor, counter: tf.Tensor) -> tf.Tensor:
  """The ``[2]`` stateless seed of noise draw ``counter``: a scalar, or a vector of
  counters folded in one after another (e.g. the ledger's ``[lineage, generation, step]``)."""
  out = tf.cast(seed, tf.int64)
  counter = tf.cast(counter, tf.int64)
  parts = [counter] if counter.shape.rank == 0 else tf.unstack(counter)
  for part in parts:
    out = tf.random.experimental.stateless_fold_in(out, part)
  return out


def add_gaussian_noise(summed: Sequence[tf.Tensor], stddev: float,
                       seed: tf.Tensor) -> list[tf.Tensor]:
  """Returns ``summed[k] + N(0, stddev^2)`` elementwise, one independent stream per tensor.

  Args:
    summed: per-variable sums of bounded contributions.
    stddev: ``noise_multiplier * sensitivity`` (a Python 0 returns ``summed``
      unchanged); a scalar tensor under adaptive clipping (``sigma_grad * C_t``).
    seed: ``[2]`` stateless seed for this step (see :func:`step_seed`).
  """
  if not tf.is_tensor(stddev) and stddev == 0:
    return list(summed)
  return [s + tf.cast(stddev * z, s.dtype) for s, z in zip(summed, standard_normal(summed, seed))]


def standard_normal(summed: Sequence[tf.Tensor], seed: tf.Tensor) -> list[tf.Tensor]:
  """``N(0, I)`` draws shaped like ``summed``, stream ``k`` for tensor ``k`` (float32).

  Draw ``k`` is ``tf.random.stateless_normal(shape_k, seed=stateless_fold_in(seed, k),
  alg="philox")``, bit for bit (eager, graph and XLA; tests/test_noise.py), built
  with a handful of ops for all tensors instead of ~58 per tensor (:func:`_philox_streams`):
  the step's trace is 4-8x cheaper in its noise (a 64-variable model: 3713 -> 487 ops).

  Each draw waits for its tensor: the draws depend on the seed only, so the
  executor could otherwise make them all at the start of the step and hold a
  model-sized buffer through the per-example pass (measured: 105 MiB on a
  MiniLM-size BERT's two-pass step).
  """
  summed = list(summed)
  out = []
  alg = tf.constant(_PHILOX, tf.int32)  # one constant for every draw and every scrambling
  for s, (key, counter) in zip(summed, _philox_streams(seed, len(summed), alg)):
    with tf.control_dependencies([s]):
      out.append(tf.raw_ops.StatelessRandomNormalV2(
          shape=tf.shape(s), key=key, counter=counter, alg=alg, dtype=tf.float32))
  return out


_PHILOX = 1  # TensorFlow's RNG algorithm id of Philox (``alg="philox"``)
_PHILOX_SCRAMBLE_KEY = 0x02461E293EC8F720  # TensorFlow's seed scrambling key for Philox


def _philox_streams(seed: tf.Tensor, n: int,
                    alg: tf.Tensor) -> list[tuple[tf.Tensor, tf.Tensor]]:
  """The Philox ``(key [1], counter [2])`` pairs of ``stateless_fold_in(seed, k)``, k < n.

  What ``tf.random.stateless_normal(..., seed=stateless_fold_in(seed, k), alg="philox")``
  computes before its draw, for all ``k`` at once: ``stateless_fold_in(seed, k)`` is
  ``[u, k]`` with ``u`` the seed's one full-range int32 draw (``k`` a Python int: int32),
  the same for every ``k``; Philox's seed scrambling maps a seed ``s`` to four uint32
  ``m = Philox(key=0x02461E293EC8F720, counter=uint64(s))``, then
  ``key = m0 | m1 << 32`` and ``counter = [0, m2 | m3 << 32]``. One scrambling draw per
  stream (their counters differ in the high word: no single draw covers them); the rest
  is shared. ``alg``: the int32 constant of Philox (``_PHILOX``), the caller's.
  """
  if n == 0:
    return []
  u = tf.random.stateless_uniform([], seed=seed, dtype=tf.int32, minval=None, maxval=None)
  seeds = tf.stack([tf.fill([n], u), tf.range(n, dtype=tf.int32)], axis=1)
  scramble_key = tf.constant([_PHILOX_SCRAMBLE_KEY], tf.uint64)
  four = tf.constant([4], tf.int32)
  mix = tf.stack([tf.raw_ops.StatelessRandomUniformFullIntV2(
      shape=four, key=scramble_key, counter=counter, alg=alg, dtype=tf.uint32)
                  for counter in tf.unstack(tf.cast(seeds, tf.uint64), num=n)])
  mix = tf.cast(mix, tf.uint64)  # [n, 4]
  words = tf.bitwise.bitwise_or(mix[:, 0::2],
                                tf.bitwise.left_shift(mix[:, 1::2], tf.constant(32, tf.uint64)))
  keys = tf.split(words[:, 0], n)  # n x [1]
  counters = tf.unstack(tf.stack([tf.zeros([n], tf.uint64), words[:, 1]], axis=1), num=n)
  return list(zip(keys, counters))


def gradient_noise_multiplier_tensor(noise_multiplier: float, clipped_count_stddev):
  """:func:`gradient_noise_multiplier` in TF, for a ``sigma_b`` known only in the step.

  ``sigma_b`` defaults to the denominator / 20, which under Poisson sampling
  arrives with the batch. Returns ``(sigma_grad, checks)``: ``sigma_grad`` is
  NaN when ``2 sigma_b <= sigma_eff`` (so nothing informative is released even
  where assertions are dropped, e.g. under XLA) and ``checks`` holds the
  assertion that fails the step loudly otherwise.
  """
  s = float(noise_multiplier)
  if s == 0:
    return tf.constant(0.0), []
  b = tf.cast(clipped_count_stddev, tf.float32)
  count_multiplier = b / _adaptive.COUNT_SENSITIVITY
  ok = count_multiplier > s
  inverse_square = s ** -2 - tf.math.divide_no_nan(1.0, tf.square(count_multiplier))
  sigma = tf.where(ok, tf.math.rsqrt(tf.maximum(inverse_square, 1e-30)), float("nan"))
  check = tf.debugging.Assert(ok, [
      "adaptive clipping: 2 * clipped_count_stddev must exceed noise_multiplier "
      f"({s!r}); clipped_count_stddev (default: expected batch size / 20) =", b])
  return sigma, [check]


def noised_unclipped_fraction(centered_count, clipped_count_stddev, denominator,
                              seed: tf.Tensor) -> tf.Tensor:
  """``b_t = (sum_i (1[unclipped_i] - 1/2) + N(0, sigma_b^2)) / m + 1/2``: the count query.

  Args:
    centered_count: :func:`tf_dpnsgd.transforms.centered_unclipped_count` of
      the step (sensitivity 1/2).
    clipped_count_stddev: ``sigma_b`` (float or scalar tensor; 0: no noise).
    denominator: ``m``, the public (expected) number of units, the same one
      the gradient sum is divided by.
    seed: ``[2]`` stateless seed of this step's count draw; a stream
      independent of the gradient noise (the optimizer keys it differently).

  Returns:
    The noised fraction of unclipped units (float32 scalar; with ``m`` units
    in the batch, ``sum_i 1[unclipped_i] / m`` plus noise of std ``sigma_b / m``).

  References:
    Andrew et al. (2021), Algorithm 1 (``b~ = (sum_i b_i + N(0, sigma_b^2)) / m``);
    tensorflow-privacy ``QuantileEstimatorQuery`` (the +-1/2 centering).
  """
  z = tf.random.stateless_normal([], seed=seed, dtype=tf.float32, alg=NOISE_ALG)
  noised = tf.cast(centered_count, tf.float32) + tf.cast(clipped_count_stddev, tf.float32) * z
  return noised / tf.cast(denominator, tf.float32) + 0.5


# --- what the mechanism is configured with ----------------------------------------------
# Philox named: the same draws as TensorFlow's default ("auto_select") without XLA, and
# under XLA on CPU about 40x faster to run than the default's compiled generator (6.3 M
# normals: 0.17 s vs 6.8-8.4 s, measured; README "XLA").
NOISE_ALG = "philox"
if NOISE_ALG != "philox":  # standard_normal derives Philox's keys and counters itself
  raise ImportError("tf_dpnsgd.noise: standard_normal's streams are Philox's (_philox_streams); "
                    "another NOISE_ALG needs its own key derivation.")
NOISE_TAG = 0x5EED  # separates the noise stream from other uses of the same seed
COUNT_TAG = 0xC0C7  # adaptive clipping's count noise: a stream independent of the gradient's

# The keyword arguments of quantile-adaptive clipping (Andrew et al. 2021).
ADAPTIVE_KEYS = ("target_unclipped_quantile", "clip_learning_rate", "clipped_count_stddev")


def make_transform(regularizer=None, l2_norm_clip=None) -> transforms.Transform:
  """``Normalize(regularizer)`` or ``Clip(l2_norm_clip)``: exactly one must be given."""
  if (regularizer is None) == (l2_norm_clip is None):
    raise ValueError("Give exactly one of `regularizer` (per-example normalization, "
                     "DP-NSGD) and `l2_norm_clip` (per-example clipping, DP-SGD).")
  if regularizer is not None:
    return transforms.Normalize(regularizer)
  return transforms.Clip(l2_norm_clip)


def make_adaptive_clip(noise_multiplier, regularizer=None, l2_norm_clip=None,
                       target_unclipped_quantile=None, clip_learning_rate=None,
                       clipped_count_stddev=None):
  """``(AdaptiveClip or None, clipped_count_stddev or None)``, validated.

  ``target_unclipped_quantile=None`` keeps the clip fixed (and then the two
  other arguments must be None). ``clipped_count_stddev=None`` means
  ``m / 20`` for a step of ``m`` (expected) units, or 0 when
  ``noise_multiplier = 0`` (no privacy claimed).

  Raises:
    ValueError: adaptive arguments with normalization (DP-NSGD has no clip),
      a quantile outside [0, 1], a negative ``clip_learning_rate``, or
      ``2 clipped_count_stddev <= noise_multiplier``.
  """
  given = {k: v for k, v in zip(ADAPTIVE_KEYS, (target_unclipped_quantile, clip_learning_rate,
                                                clipped_count_stddev)) if v is not None}
  if not given:
    return None, None
  if l2_norm_clip is None:
    raise ValueError(
        f"{sorted(given)}: quantile-adaptive clipping adapts a clip, but this optimizer "
        "normalizes (`regularizer`, DP-NSGD / DP-NAdam), whose sensitivity is 1 whatever the "
        "norms. Use DPSGD / DPAdam / make_private_optimizer(..., l2_norm_clip=...) for "
        "adaptive clipping, or drop these arguments.")
  if target_unclipped_quantile is None:
    raise ValueError(f"{sorted(given)} given without `target_unclipped_quantile`: set it "
                     "(e.g. 0.5) for adaptive clipping, or drop them for a fixed clip.")
  adaptive = transforms.AdaptiveClip(
      l2_norm_clip, target_unclipped_quantile,
      transforms.DEFAULT_CLIP_LEARNING_RATE if clip_learning_rate is None
      else clip_learning_rate)
  if clipped_count_stddev is not None:
    clipped_count_stddev = validate_clipped_count_stddev(clipped_count_stddev)
    gradient_noise_multiplier(noise_multiplier, clipped_count_stddev)  # may raise
  return adaptive, clipped_count_stddev


def noise_key(seed=None) -> tuple:
  """The gradient noise's key ``(seed, NOISE_TAG)``, the seed drawn from the OS unless the
  user fixed one. A Python value, never a variable: no checkpoint or export holds it."""
  return (seed if seed is not None else random_seed(), NOISE_TAG)


def count_stddev(clipped_count_stddev, noise_multiplier, denominator):
  """Adaptive clipping's ``sigma_b`` for a step of ``denominator`` (expected) units (float
  or tensor): the one given, else ``denominator / 20`` (0 when ``noise_multiplier`` is 0)."""
  if clipped_count_stddev is not None:
    return clipped_count_stddev
  if noise_multiplier == 0:
    return 0.0
  if tf.is_tensor(denominator):
    return tf.cast(denominator, tf.float32) * default_clipped_count_stddev(1.0)
  return default_clipped_count_stddev(denominator)


def step_gradient_noise_multiplier(noise_multiplier, sigma_b) -> tuple:
  """``(sigma_grad, checks)`` of adaptive clipping for the count noise ``sigma_b``: a float
  and no checks, or (``sigma_b`` known only in the step) a tensor and its assertions."""
  if tf.is_tensor(sigma_b) and tf.get_static_value(sigma_b) is not None:
    sigma_b = float(tf.get_static_value(sigma_b))
  if tf.is_tensor(sigma_b):
    return gradient_noise_multiplier_tensor(noise_multiplier, sigma_b)
  return gradient_noise_multiplier(noise_multiplier, sigma_b), []


def sum_noise_stddev(noise_multiplier, sensitivity, denominator, *, adaptive=False,
                     clipped_count_stddev=None) -> tuple:
  """``(std of the noise on the sum, checks)``: ``sigma S``, or under adaptive clipping
  ``sigma_grad S`` for a step of ``denominator`` units; 0 when ``sigma = 0`` (also for
  an infinite clip, where ``0 * inf`` would be NaN)."""
  if noise_multiplier == 0:
    return 0.0, []
  if not adaptive:
    return noise_multiplier * sensitivity, []
  sigma_grad, checks = step_gradient_noise_multiplier(
      noise_multiplier, count_stddev(clipped_count_stddev, noise_multiplier, denominator))
  return sigma_grad * tf.cast(sensitivity, tf.float32), checks


# --- what it computes in the step ----------------------------------------------------------
def _replicas():
  ctx = tf.distribute.get_replica_context()
  return ctx, (ctx.num_replicas_in_sync if ctx is not None else 1)


def global_denominator(denominator, local_denominator=False) -> tf.Tensor:
  """The step's denominator over all replicas (summed if it counts this replica's units)."""
  ctx, replicas = _replicas()
  denominator = tf.cast(denominator, tf.float32)
  if local_denominator and replicas > 1:
    denominator = ctx.all_reduce(tf.distribute.ReduceOp.SUM, denominator)
  return denominator


def stream(step, user_seeded: bool) -> tf.Tensor:
  """The counter(s) keying this step's draw: the ledger's ``[lineage, generation, step]``
  (without the lineage for a user-fixed seed, so that a reproducibility run replays in a
  new model), or a scalar step."""
  step = tf.cast(step, tf.int64)
  if step.shape.rank == 1 and user_seeded:
    step = step[1:]
  return step


def privatize(summed, denominator, *, key, step, stddev=None, noise_multiplier=None,
              sensitivity=None, clipped_count_stddev=None, user_seeded=False,
              local_denominator=False) -> list:
  """``(summed + N(0, s^2 I)) / D`` per variable: the Gaussian mechanism of one step.

  Under a ``tf.distribute`` strategy with several replicas, the per-replica
  sums are all-reduced first and every replica adds the SAME draw (same key
  and step), so the noise enters once per logical batch.

  Args:
    summed: per-variable ``sum_i h_i g_i`` (each unit's contribution bounded by the
      transform's sensitivity ``S``).
    denominator: ``D``, the number of units (batch size, number of microbatches, or
      the expected batch size ``qN`` under Poisson sampling).
    key: :func:`noise_key`.
    step: the ledger's ``[lineage, generation, step]`` (or a scalar step).
    stddev: ``s``, the std of the noise on the sum (``sigma S`` with a fixed clip), or
      None for adaptive clipping: then ``s = sigma_grad S`` of this step's global ``D``
      (:func:`sum_noise_stddev` of ``noise_multiplier``, ``sensitivity`` and
      ``clipped_count_stddev``), drawn after the check that ``sigma_grad`` exists.
    user_seeded: the key's seed was fixed by the user (see :func:`stream`).
    local_denominator: ``D`` counts this replica's units only (summed over replicas).

  Returns:
    The privatized mean gradient, one tensor per variable.
  """
  ctx, replicas = _replicas()
  if replicas > 1:
    summed = ctx.all_reduce(tf.distribute.ReduceOp.SUM, list(summed))
  denominator = global_denominator(denominator, local_denominator)
  seed = step_seed(tf.constant(key, tf.int64), stream(step, user_seeded))
  checks = []
  if stddev is None:
    stddev, checks = sum_noise_stddev(noise_multiplier, sensitivity, denominator, adaptive=True,
                                      clipped_count_stddev=clipped_count_stddev)
  with tf.control_dependencies(checks):
    noisy = add_gaussian_noise(summed, stddev, seed)
  if replicas > 1:
    # Keras sums the replicas' gradients in apply_gradients; every replica
    # holds the same privatized mean, so each passes 1/R of it.
    denominator = denominator * replicas
  return [g / tf.cast(denominator, g.dtype) for g in noisy]


def privatize_count(centered_count, denominator, *, key, step, noise_multiplier,
                    clipped_count_stddev=None, user_seeded=False,
                    local_denominator=False) -> tuple:
  """Adaptive clipping's count query: ``(b_t, sigma_b)``, ``b_t`` the noised fraction of
  unclipped units (:func:`noised_unclipped_fraction`).

  Args:
    centered_count: :func:`tf_dpnsgd.transforms.centered_unclipped_count` of this
      replica's units at the step's clip (sensitivity 1/2); all-reduced here.
    denominator, key, step, user_seeded, local_denominator: as :func:`privatize` (the
      same public denominator); the draw is keyed like the gradient's but from an
      independent stream.
    noise_multiplier, clipped_count_stddev: ``sigma`` and the given ``sigma_b`` (None:
      the default, :func:`count_stddev`).
  """
  ctx, replicas = _replicas()
  centered_count = tf.cast(centered_count, tf.float32)
  if replicas > 1:
    centered_count = ctx.all_reduce(tf.distribute.ReduceOp.SUM, centered_count)
  denominator = global_denominator(denominator, local_denominator)
  seed = step_seed(tf.constant((key[0], COUNT_TAG), tf.int64), stream(step, user_seeded))
  sigma_b = count_stddev(clipped_count_stddev, noise_multiplier, denominator)
  return noised_unclipped_fraction(centered_count, sigma_b, denominator, seed), sigma_b


def step_checks(noise_multiplier, clipped_count_stddev, denominator,
                local_denominator=False) -> list:
  """Assertions an adaptive-clipping step must pass before it changes anything
  (``2 sigma_b > sigma`` for the default ``sigma_b = m / 20`` of this step's ``m``);
  ``[]`` for an explicit ``sigma_b`` (checked at construction) or ``sigma = 0``."""
  if noise_multiplier == 0 or clipped_count_stddev is not None:
    return []
  sigma_b = count_stddev(None, noise_multiplier,
                         global_denominator(denominator, local_denominator))
  return step_gradient_noise_multiplier(noise_multiplier, sigma_b)[1]
