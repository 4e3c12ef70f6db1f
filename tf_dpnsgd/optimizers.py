"""DP optimizers: thin Keras 3 shells over :mod:`transforms` and :mod:`noise`.

Each optimizer owns (a) its per-example transform (normalize or clip), which
reports the sensitivity, (b) the noise multiplier, and (c) the noise key: the
user's ``seed`` (reproducibility experiments only; the privacy report says so)
or, by default, a key drawn from the OS when the optimizer is built. The key is
never a variable, so no checkpoint, ``.keras`` file or export holds it. The
draw of each step is keyed by (key, the model's privacy-ledger step), not by an
optimizer counter, so a recompile, a new optimizer or a resume continues the
noise stream and never repeats a draw (:mod:`tf_dpnsgd.ledger`). The
parameter update itself is Keras' own SGD or Adam applied to the privatized
gradient.

The per-example gradients come from the model's train step
(:class:`tf_dpnsgd.DPModel` / :func:`tf_dpnsgd.make_private`), which calls
:meth:`DPOptimizerMixin.apply_private_gradients` with the SUM of the
transformed contributions. Calling ``apply_gradients`` directly with ordinary
gradients raises: it would silently train without privacy.

Noise semantics (as tensorflow-privacy and Opacus): ``N(0, (sigma * S)^2)`` is
added to the sum of contributions, with ``S`` the transform's sensitivity
(1 for normalization, ``c`` for clipping), and the result is divided by the
(expected) number of units in the batch.
"""

from __future__ import annotations

import keras
import tensorflow as tf

from tf_dpnsgd import noise as noise_lib
from tf_dpnsgd import transforms

_RAW_APPLY_ERROR = (
    "{name} received ordinary (non-private) gradients. DP optimizers must be fed "
    "per-example contributions by a DP train step: build the model with "
    "`tf_dpnsgd.DPModel(inputs, outputs)` or wrap it with `tf_dpnsgd.make_private(model)` "
    "before `compile`/`fit`; in a custom loop use `optimizer.apply_private_gradients(...)`."
)


_NOISE_TAG = 0x5EED  # separates the noise stream from other uses of the same seed


def _validate_num_microbatches(num_microbatches):
  if num_microbatches is None:
    return None
  if isinstance(num_microbatches, bool) or not isinstance(num_microbatches, int) \
      or num_microbatches < 1:
    raise ValueError(
        f"`num_microbatches` must be a positive integer or None; got {num_microbatches!r}.")
  return num_microbatches


class DPOptimizerMixin:
  """Privacy state and the private apply step shared by all DP optimizers."""

  def _init_dp(self, transform, noise_multiplier, seed, num_microbatches, kwargs):
    if kwargs.get("gradient_accumulation_steps"):
      raise ValueError(
          "`gradient_accumulation_steps` is not supported by DP optimizers: noise would be "
          "added per accumulation step. Use `physical_batch_size` on DPModel/make_private to "
          "process a large logical batch in chunks with noise added once.")
    if kwargs.get("loss_scale_factor") is not None:
      raise ValueError("`loss_scale_factor` is not supported by DP optimizers.")
    self.transform = transform
    self.noise_multiplier = noise_lib.validate_noise_multiplier(noise_multiplier)
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
      raise ValueError(f"`seed` must be a non-negative integer or None; got {seed!r}.")
    self.seed = seed
    self.num_microbatches = _validate_num_microbatches(num_microbatches)
    self._dp_applying = False

  @property
  def noise_stddev(self) -> float:
    """Std of the noise added to the SUM of contributions: sigma x sensitivity."""
    if self.noise_multiplier == 0:  # also for an infinite clip (0 * inf would be NaN)
      return 0.0
    return self.noise_multiplier * self.transform.sensitivity

  def build(self, variables):
    if self.built:
      return
    super().build(variables)
    # The noise key: the user's seed, or one drawn from the OS for this optimizer object.
    # It is a Python value, never a variable: no checkpoint, .keras file or export holds
    # it. The draw of a step is keyed by (key, the model's ledger step), so a new
    # optimizer (recompile, resume) continues the stream instead of repeating it.
    self._noise_key = (self.seed if self.seed is not None else noise_lib.random_seed(),
                       _NOISE_TAG)

  def privatize(self, summed, denominator, local_denominator=False, step=None):
    """Adds calibrated noise to the summed contributions and divides by ``denominator``.

    Under a ``tf.distribute`` strategy with several replicas, the per-replica
    sums are all-reduced first and every replica adds the SAME noise draw (same
    seed and counter), so the noise enters once per logical batch.

    Args:
      summed: per-variable ``sum_i h_i g_i`` (each unit's contribution bounded
        by ``self.transform.sensitivity``).
      denominator: number of units (batch size, number of microbatches, or the
        expected batch size ``qN`` under Poisson sampling).
      local_denominator: True if ``denominator`` counts this replica's units
        only (it is then summed over replicas too).
      step: the index of this private step in the model's privacy ledger
        (:meth:`tf_dpnsgd.ledger.PrivacyLedger.step`); the noise draw is keyed
        by it. Required: a DP train step always passes it.

    Returns:
      The privatized mean gradient, one tensor per variable.
    """
    ctx = tf.distribute.get_replica_context()
    if ctx is not None and ctx.num_replicas_in_sync > 1:
      summed = ctx.all_reduce(tf.distribute.ReduceOp.SUM, list(summed))
      if local_denominator:
        denominator = ctx.all_reduce(tf.distribute.ReduceOp.SUM,
                                     tf.cast(denominator, tf.float32))
    if step is None:
      raise ValueError("privatize() needs `step`, the model's privacy-ledger step that keys "
                       "the noise draw (the DP train step passes it).")
    seed = noise_lib.step_seed(tf.constant(self._noise_key, tf.int64), step)
    noisy = noise_lib.add_gaussian_noise(summed, self.noise_stddev, seed)
    denominator = tf.cast(denominator, tf.float32)
    if ctx is not None and ctx.num_replicas_in_sync > 1:
      # Keras sums the replicas' gradients in apply_gradients; every replica
      # holds the same privatized mean, so each passes 1/R of it.
      denominator = denominator * ctx.num_replicas_in_sync
    return [g / tf.cast(denominator, g.dtype) for g in noisy]

  def apply_private_gradients(self, summed, denominator, variables, public_grads=None,
                              local_denominator=False, step=None):
    """Privatizes ``summed`` and applies the update to ``variables``.

    Args:
      summed: per-variable sums of bounded per-unit contributions.
      denominator: see :meth:`privatize`.
      variables: the trainable variables, aligned with ``summed``.
      public_grads: optional data-independent gradients (e.g. of weight
        regularizers) added after the noise; ``None`` entries are skipped.
      local_denominator, step: see :meth:`privatize`.
    """
    if not self.built:
      with keras.name_scope(self.name, caller=self):
        self.build(variables)
    grads = self.privatize(summed, denominator, local_denominator, step)
    if public_grads is not None:
      grads = [g if p is None else g + tf.cast(p, g.dtype) for g, p in zip(grads, public_grads)]
    self._dp_applying = True
    try:
      super().apply_gradients(zip(grads, variables))
    finally:
      self._dp_applying = False

  def apply(self, grads, trainable_variables=None):
    if not self._dp_applying:
      raise RuntimeError(_RAW_APPLY_ERROR.format(name=type(self).__name__))
    return super().apply(grads, trainable_variables)

  def _dp_config(self):
    return {"noise_multiplier": self.noise_multiplier, "seed": self.seed,
            "num_microbatches": self.num_microbatches}


@keras.saving.register_keras_serializable(package="tf_dpnsgd")
class DPNSGD(DPOptimizerMixin, keras.optimizers.SGD):
  """DP-NSGD: SGD on the noised mean of normalized per-example gradients.

  Update: ``w <- w - lr * (sum_i g_i / (r + ||g_i||) + N(0, sigma^2 I)) / B``
  (with optional momentum). Sensitivity 1.

  Args:
    learning_rate: float or schedule.
    regularizer: ``r > 0`` in ``h_i = 1/(r + ||g_i||)``.
    noise_multiplier: ``sigma >= 0``; noise std on the sum is ``sigma * 1``.
    seed: int for reproducible noise; ``None`` draws an OS-random seed.
    num_microbatches: if set, the mean gradient of each of this many
      microbatches is the normalized unit (tensorflow-privacy's option).
    momentum, nesterov, **kwargs: as ``keras.optimizers.SGD``.

  References: Yang et al. (2022), Algorithm 1.
  """

  def __init__(self, learning_rate=0.01, regularizer=None, noise_multiplier=None, seed=None,
               num_microbatches=None, momentum=0.0, nesterov=False, name=None, **kwargs):
    if regularizer is None or noise_multiplier is None:
      raise ValueError("DPNSGD needs `regularizer` (> 0) and `noise_multiplier` (>= 0).")
    transform = transforms.Normalize(regularizer)
    super().__init__(learning_rate=learning_rate, momentum=float(momentum), nesterov=nesterov,
                     name=name, **kwargs)
    self._init_dp(transform, noise_multiplier, seed, num_microbatches, kwargs)
    self.regularizer = transform.regularizer

  def get_config(self):
    config = super().get_config()
    config.update(self._dp_config(), regularizer=self.regularizer)
    return config


@keras.saving.register_keras_serializable(package="tf_dpnsgd")
class DPSGD(DPOptimizerMixin, keras.optimizers.SGD):
  """DP-SGD: SGD on the noised mean of clipped per-example gradients.

  Update: ``w <- w - lr * (sum_i min(1, c/||g_i||) g_i + N(0, (sigma c)^2 I)) / B``.
  Sensitivity ``c``.

  Args:
    learning_rate: float or schedule.
    l2_norm_clip: ``c > 0`` (``inf`` only for testing).
    noise_multiplier: ``sigma >= 0``; noise std on the sum is ``sigma * c``.
    seed, num_microbatches, momentum, nesterov, **kwargs: as :class:`DPNSGD`.
  """

  def __init__(self, learning_rate=0.01, l2_norm_clip=None, noise_multiplier=None, seed=None,
               num_microbatches=None, momentum=0.0, nesterov=False, name=None, **kwargs):
    if l2_norm_clip is None or noise_multiplier is None:
      raise ValueError("DPSGD needs `l2_norm_clip` (> 0) and `noise_multiplier` (>= 0).")
    transform = transforms.Clip(l2_norm_clip)
    super().__init__(learning_rate=learning_rate, momentum=float(momentum), nesterov=nesterov,
                     name=name, **kwargs)
    self._init_dp(transform, noise_multiplier, seed, num_microbatches, kwargs)
    self.l2_norm_clip = transform.l2_norm_clip

  def get_config(self):
    config = super().get_config()
    config.update(self._dp_config(), l2_norm_clip=self.l2_norm_clip)
    return config


@keras.saving.register_keras_serializable(package="tf_dpnsgd")
class DPAdam(DPOptimizerMixin, keras.optimizers.Adam):
  """DP-Adam: Adam on the noised mean of clipped per-example gradients (sensitivity ``c``).

  Args:
    learning_rate, beta_1, beta_2, epsilon, amsgrad: as ``keras.optimizers.Adam``.
    l2_norm_clip, noise_multiplier, seed, num_microbatches: as :class:`DPSGD`.
  """

  def __init__(self, learning_rate=0.001, l2_norm_clip=None, noise_multiplier=None, seed=None,
               num_microbatches=None, beta_1=0.9, beta_2=0.999, epsilon=1e-7, amsgrad=False,
               name=None, **kwargs):
    if l2_norm_clip is None or noise_multiplier is None:
      raise ValueError("DPAdam needs `l2_norm_clip` (> 0) and `noise_multiplier` (>= 0).")
    transform = transforms.Clip(l2_norm_clip)
    super().__init__(learning_rate=learning_rate, beta_1=beta_1, beta_2=beta_2, epsilon=epsilon,
                     amsgrad=amsgrad, name=name, **kwargs)
    self._init_dp(transform, noise_multiplier, seed, num_microbatches, kwargs)
    self.l2_norm_clip = transform.l2_norm_clip

  def get_config(self):
    config = super().get_config()
    config.update(self._dp_config(), l2_norm_clip=self.l2_norm_clip)
    return config


@keras.saving.register_keras_serializable(package="tf_dpnsgd")
class DPNAdam(DPOptimizerMixin, keras.optimizers.Adam):
  """DP-NAdam: Adam on the noised mean of normalized per-example gradients (sensitivity 1).

  "NAdam" here is the paper's *normalized* Adam, not Nesterov-Adam.

  Args:
    learning_rate, beta_1, beta_2, epsilon, amsgrad: as ``keras.optimizers.Adam``.
    regularizer, noise_multiplier, seed, num_microbatches: as :class:`DPNSGD`.
  """

  def __init__(self, learning_rate=0.001, regularizer=None, noise_multiplier=None, seed=None,
               num_microbatches=None, beta_1=0.9, beta_2=0.999, epsilon=1e-7, amsgrad=False,
               name=None, **kwargs):
    if regularizer is None or noise_multiplier is None:
      raise ValueError("DPNAdam needs `regularizer` (> 0) and `noise_multiplier` (>= 0).")
    transform = transforms.Normalize(regularizer)
    super().__init__(learning_rate=learning_rate, beta_1=beta_1, beta_2=beta_2, epsilon=epsilon,
                     amsgrad=amsgrad, name=name, **kwargs)
    self._init_dp(transform, noise_multiplier, seed, num_microbatches, kwargs)
    self.regularizer = transform.regularizer

  def get_config(self):
    config = super().get_config()
    config.update(self._dp_config(), regularizer=self.regularizer)
    return config
