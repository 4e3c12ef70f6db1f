"""DP optimizers: any Keras optimizer made private, and the paper's four by name.

This module is long (about 470 lines): the wrapper and the four named optimizers share one
``__init__``/``get_config`` contract, which is easier to keep in step in one file.

:func:`make_private_optimizer` wraps ANY Keras 3 optimizer (SGD with momentum,
Adam, AdamW, Nadam, Lion, Adafactor, ...) in a :class:`PrivateOptimizer`,
which owns

(a) the per-example transform (:class:`~tf_dpnsgd.transforms.Normalize` for
    DP-NSGD-style normalization, :class:`~tf_dpnsgd.transforms.Clip` for
    DP-SGD-style clipping), which reports the sensitivity ``S``;
(b) the noise multiplier ``sigma``;
(c) the noise key: the user's ``seed`` (reproducibility experiments only; the
    privacy report says so) or, by default, a key drawn from the OS when the
    optimizer is built. The key is never a variable, so no checkpoint,
    ``.keras`` file or export holds it. The draw of each step is keyed by
    (key, the model's privacy-ledger step), not by an optimizer counter, so a
    recompile, a new optimizer or a resume continues the noise stream and
    never repeats a draw (:mod:`tf_dpnsgd.ledger`).

and hands the privatized mean gradient to the wrapped optimizer, whose update
rule (and state: momentum, moments, its step counter) is used unchanged. The
wrapper is a composition, like Keras' own ``LossScaleOptimizer``: no class is
generated and nothing in Keras is patched.

:class:`DPNSGD`, :class:`DPSGD`, :class:`DPAdam` and :class:`DPNAdam` are thin
names over the same mechanism with the paper's signatures.

The per-example contributions come from the model's train step
(:class:`tf_dpnsgd.DPModel` / :func:`tf_dpnsgd.make_private`), which calls
:meth:`PrivateOptimizer.apply_private_gradients` with the SUM of the
transformed contributions. Calling ``apply``/``apply_gradients`` with ordinary
gradients raises: it would silently train without privacy.

Noise semantics (as tensorflow-privacy and Opacus): ``N(0, (sigma * S)^2)`` is
added to the sum of contributions, then the result is divided by the
(expected) number of units in the batch.
"""

from __future__ import annotations

import warnings

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


def _validate_seed(seed):
  if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
    raise ValueError(f"`seed` must be a non-negative integer or None; got {seed!r}.")
  return seed


def make_transform(regularizer=None, l2_norm_clip=None) -> transforms.Transform:
  """``Normalize(regularizer)`` or ``Clip(l2_norm_clip)``: exactly one must be given."""
  if (regularizer is None) == (l2_norm_clip is None):
    raise ValueError("Give exactly one of `regularizer` (per-example normalization, "
                     "DP-NSGD) and `l2_norm_clip` (per-example clipping, DP-SGD).")
  if regularizer is not None:
    return transforms.Normalize(regularizer)
  return transforms.Clip(l2_norm_clip)


def _check_inner(inner) -> keras.optimizers.Optimizer:
  if isinstance(inner, str) or isinstance(inner, dict):
    inner = keras.optimizers.get(inner)
  if isinstance(inner, PrivateOptimizer):
    raise ValueError(f"{inner.name} is already private; wrap the plain optimizer once.")
  if isinstance(inner, keras.optimizers.LossScaleOptimizer):
    raise ValueError("Wrap the plain optimizer; loss scaling is not supported by the DP "
                     "train step (per-example contributions are computed in float32).")
  if not isinstance(inner, keras.optimizers.Optimizer):
    raise TypeError(f"Expected a Keras 3 optimizer; got {inner!r}.")
  if getattr(inner, "gradient_accumulation_steps", None):
    raise ValueError(
        "`gradient_accumulation_steps` is not supported by DP optimizers: noise would be "
        "added per accumulation step. Use `physical_batch_size` on DPModel/make_private to "
        "process a large logical batch in chunks with noise added once.")
  if getattr(inner, "loss_scale_factor", None) is not None:
    raise ValueError("`loss_scale_factor` is not supported by DP optimizers.")
  return inner


@keras.saving.register_keras_serializable(package="tf_dpnsgd")
class PrivateOptimizer(keras.optimizers.Optimizer):
  """A Keras optimizer that privatizes summed per-example contributions, then steps.

  Build it with :func:`make_private_optimizer` (or one of the named
  subclasses). Attributes the wrapper does not define (``momentum``,
  ``beta_1``, ...) are read from the wrapped optimizer.

  Args:
    inner_optimizer: any Keras 3 optimizer (instance, name or config).
    noise_multiplier: ``sigma >= 0``; the noise std on the sum is ``sigma * S``.
    regularizer / l2_norm_clip: exactly one (see :func:`make_transform`).
    seed: a fixed noise seed, for reproducibility experiments only (the privacy
      report says so); ``None`` (default) draws the key from the OS.
    num_microbatches: deprecated here; give it to ``DPModel`` / ``make_private``.
    name: the optimizer's name.

  Formal guarantee: :meth:`privatize` returns ``(sum + N(0, (sigma S)^2 I)) / D``
  with one draw per call, keyed by ``(key, step)``; given contributions of
  norm at most ``S = transform.sensitivity`` this is the Gaussian mechanism
  with noise multiplier ``sigma`` that :mod:`tf_dpnsgd.accounting` accounts.
  """

  def __init__(self, inner_optimizer, noise_multiplier=None, regularizer=None,
               l2_norm_clip=None, seed=None, num_microbatches=None, name=None, **kwargs):
    if kwargs:
      raise ValueError(f"{type(self).__name__} does not take {sorted(kwargs)}; set optimizer "
                       "options on the wrapped optimizer.")
    if noise_multiplier is None:
      raise ValueError("A private optimizer needs `noise_multiplier` (>= 0).")
    transform = make_transform(regularizer, l2_norm_clip)
    inner = _check_inner(inner_optimizer)
    super().__init__(learning_rate=0.0, name=name or f"private_{inner.name}")
    self.inner_optimizer = inner
    self.transform = transform
    self.noise_multiplier = noise_lib.validate_noise_multiplier(noise_multiplier)
    self.seed = _validate_seed(seed)
    self.num_microbatches = _validate_num_microbatches(num_microbatches)
    if self.num_microbatches is not None:
      warnings.warn("`num_microbatches` on the optimizer is deprecated: pass it to "
                    "tf_dpnsgd.DPModel(...) / make_private(...), beside physical_batch_size.",
                    DeprecationWarning, stacklevel=2)
    self._dp_applying = False
    self._noise_key = None

  # --- the transform's parameters ----------------------------------------------
  @property
  def regularizer(self):
    return getattr(self.transform, "regularizer", None)

  @property
  def l2_norm_clip(self):
    return getattr(self.transform, "l2_norm_clip", None)

  @property
  def noise_stddev(self) -> float:
    """Std of the noise added to the SUM of contributions: sigma x sensitivity."""
    if self.noise_multiplier == 0:  # also for an infinite clip (0 * inf would be NaN)
      return 0.0
    return self.noise_multiplier * self.transform.sensitivity

  # --- the wrapped optimizer's state and schedule -------------------------------
  def __getattr__(self, name):
    # Only reached when normal lookup fails: forward public attributes (momentum,
    # beta_1, ...) to the wrapped optimizer.
    if name.startswith("_") or "inner_optimizer" not in self.__dict__:
      raise AttributeError(name)
    return getattr(self.__dict__["inner_optimizer"], name)

  @property
  def learning_rate(self):
    return self.inner_optimizer.learning_rate

  @learning_rate.setter
  def learning_rate(self, learning_rate):
    self.inner_optimizer.learning_rate = learning_rate

  @property
  def iterations(self):
    return self.inner_optimizer.iterations

  @property
  def variables(self):
    return self._variables + self.inner_optimizer.variables

  def build(self, var_list):
    if self.built:
      return
    self.inner_optimizer.build(var_list)
    super().build(var_list)
    # A Python value, never a variable: no checkpoint, .keras file or export holds it.
    self._noise_key = (self.seed if self.seed is not None else noise_lib.random_seed(),
                       _NOISE_TAG)

  def finalize_variable_values(self, var_list):
    self.inner_optimizer.finalize_variable_values(var_list)

  # --- the private step ----------------------------------------------------------
  def privatize(self, summed, denominator, local_denominator=False, step=None):
    """Adds calibrated noise to the summed contributions and divides by ``denominator``.

    Under a ``tf.distribute`` strategy with several replicas, the per-replica
    sums are all-reduced first and every replica adds the SAME noise draw (same
    key and step), so the noise enters once per logical batch.

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
    if step is None:
      raise ValueError("privatize() needs `step`, the model's privacy-ledger step that keys "
                       "the noise draw (the DP train step passes it).")
    if self._noise_key is None:
      raise RuntimeError("Build the optimizer before privatize() (its noise key is drawn "
                         "at build time).")
    ctx = tf.distribute.get_replica_context()
    replicas = ctx.num_replicas_in_sync if ctx is not None else 1
    if replicas > 1:
      summed = ctx.all_reduce(tf.distribute.ReduceOp.SUM, list(summed))
      if local_denominator:
        denominator = ctx.all_reduce(tf.distribute.ReduceOp.SUM,
                                     tf.cast(denominator, tf.float32))
    seed = noise_lib.step_seed(tf.constant(self._noise_key, tf.int64), step)
    noisy = noise_lib.add_gaussian_noise(summed, self.noise_stddev, seed)
    denominator = tf.cast(denominator, tf.float32)
    if replicas > 1:
      # Keras sums the replicas' gradients in apply_gradients; every replica
      # holds the same privatized mean, so each passes 1/R of it.
      denominator = denominator * replicas
    return [g / tf.cast(denominator, g.dtype) for g in noisy]

  def apply_private_gradients(self, summed, denominator, variables, public_grads=None,
                              local_denominator=False, step=None):
    """Privatizes ``summed`` and applies the wrapped optimizer's update to ``variables``.

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
      self.inner_optimizer.apply_gradients(zip(grads, variables))
    finally:
      self._dp_applying = False

  def apply(self, grads, trainable_variables=None):
    raise RuntimeError(_RAW_APPLY_ERROR.format(name=type(self).__name__))

  def apply_gradients(self, grads_and_vars):
    raise RuntimeError(_RAW_APPLY_ERROR.format(name=type(self).__name__))

  def stateless_apply(self, optimizer_variables, grads, trainable_variables):
    raise RuntimeError(_RAW_APPLY_ERROR.format(name=type(self).__name__))

  # --- serialization ---------------------------------------------------------------
  def _dp_config(self) -> dict:
    return {"name": self.name, "noise_multiplier": self.noise_multiplier, "seed": self.seed,
            "num_microbatches": self.num_microbatches, "regularizer": self.regularizer,
            "l2_norm_clip": self.l2_norm_clip}

  def get_config(self):
    config = self._dp_config()
    config["inner_optimizer"] = keras.saving.serialize_keras_object(self.inner_optimizer)
    return config

  @classmethod
  def from_config(cls, config, custom_objects=None):
    config = dict(config)
    config["inner_optimizer"] = keras.saving.deserialize_keras_object(
        config["inner_optimizer"], custom_objects=custom_objects)
    with warnings.catch_warnings():
      warnings.simplefilter("ignore", DeprecationWarning)
      return cls(**config)


def make_private_optimizer(optimizer, *, noise_multiplier, regularizer=None, l2_norm_clip=None,
                           seed=None) -> PrivateOptimizer:
  """Returns ``optimizer`` made private: per-example normalization or clipping, then noise.

  Args:
    optimizer: any Keras 3 optimizer (instance, or a name like ``"adamw"``); its
      update rule is applied to the privatized mean gradient unchanged.
    noise_multiplier: ``sigma >= 0`` (noise std on the sum: ``sigma * S``).
    regularizer: ``r > 0``: normalize each example, ``h_i = 1/(r + ||g_i||)``
      (DP-NSGD; sensitivity 1).
    l2_norm_clip: ``c > 0``: clip each example to norm ``c`` (DP-SGD;
      sensitivity ``c``). Exactly one of ``regularizer`` and ``l2_norm_clip``.
    seed: fixed noise seed for reproducibility experiments only; ``None`` (the
      default) draws an OS key.

  >>> opt = make_private_optimizer(keras.optimizers.AdamW(1e-3), noise_multiplier=1.0,
  ...                              l2_norm_clip=1.0)
  >>> opt.transform.sensitivity, opt.noise_stddev
  (1.0, 1.0)
  """
  return PrivateOptimizer(optimizer, noise_multiplier=noise_multiplier, regularizer=regularizer,
                          l2_norm_clip=l2_norm_clip, seed=seed)


# Kept for code that checks ``isinstance(opt, DPOptimizerMixin)``.
DPOptimizerMixin = PrivateOptimizer


class _Named(PrivateOptimizer):
  """A named private optimizer: ``get_config`` mirrors ``__init__`` (Keras style)."""

  _inner_cls = None
  _inner_keys = ()  # the inner optimizer's arguments that appear in the signature

  def __init__(self, learning_rate, regularizer, l2_norm_clip, noise_multiplier, seed,
               num_microbatches, name, inner_kwargs, base_kwargs):
    unknown = set(base_kwargs) - _BASE_KEYS
    if unknown:
      raise ValueError(f"{type(self).__name__} got unknown arguments {sorted(unknown)}.")
    if noise_multiplier is None or (regularizer is None and l2_norm_clip is None):
      raise ValueError(f"{type(self).__name__} needs `{self._signature[0]}` (> 0) and "
                       "`noise_multiplier` (>= 0).")
    inner = self._inner_cls(learning_rate=learning_rate, **inner_kwargs, **base_kwargs)
    super().__init__(inner, noise_multiplier=noise_multiplier, regularizer=regularizer,
                     l2_norm_clip=l2_norm_clip, seed=seed, num_microbatches=num_microbatches,
                     name=name or type(self).__name__.lower())

  _signature = ()

  def get_config(self):
    inner = self.inner_optimizer.get_config()
    config = {k: inner[k] for k in ("learning_rate",) + self._inner_keys}
    config.update({k: inner[k] for k in _BASE_KEYS if k in inner})
    dp = self._dp_config()
    for key in ("name", "noise_multiplier", "seed", "num_microbatches") + self._signature:
      config[key] = dp[key]
    return config

  @classmethod
  def from_config(cls, config, custom_objects=None):
    config = dict(config)
    if isinstance(config.get("learning_rate"), dict):
      config["learning_rate"] = keras.saving.deserialize_keras_object(
          config["learning_rate"], custom_objects=custom_objects)
    with warnings.catch_warnings():
      warnings.simplefilter("ignore", DeprecationWarning)
      return cls(**config)


# Options of keras.optimizers.Optimizer that the named optimizers pass through.
_BASE_KEYS = frozenset({"weight_decay", "clipnorm", "clipvalue", "global_clipnorm", "use_ema",
                        "ema_momentum", "ema_overwrite_frequency", "loss_scale_factor",
                        "gradient_accumulation_steps"})


@keras.saving.register_keras_serializable(package="tf_dpnsgd")
class DPNSGD(_Named):
  """DP-NSGD: SGD on the noised mean of normalized per-example gradients.

  Update: ``w <- w - lr * (sum_i g_i / (r + ||g_i||) + N(0, sigma^2 I)) / B``
  (with optional momentum). Sensitivity 1.

  Args:
    learning_rate: float or schedule.
    regularizer: ``r > 0`` in ``h_i = 1/(r + ||g_i||)``.
    noise_multiplier: ``sigma >= 0``; noise std on the sum is ``sigma * 1``.
    seed: fixed noise seed (reproducibility experiments only); ``None`` draws an OS key.
    num_microbatches: deprecated here (give it to ``DPModel``/``make_private``).
    momentum, nesterov, **kwargs: as ``keras.optimizers.SGD``.

  References: Yang et al. (2022), Algorithm 1.
  """

  _inner_cls = keras.optimizers.SGD
  _inner_keys = ("momentum", "nesterov")
  _signature = ("regularizer",)

  def __init__(self, learning_rate=0.01, regularizer=None, noise_multiplier=None, seed=None,
               num_microbatches=None, momentum=0.0, nesterov=False, name=None, **kwargs):
    super().__init__(learning_rate, regularizer, None, noise_multiplier, seed, num_microbatches,
                     name, {"momentum": float(momentum), "nesterov": nesterov}, kwargs)


@keras.saving.register_keras_serializable(package="tf_dpnsgd")
class DPSGD(_Named):
  """DP-SGD: SGD on the noised mean of clipped per-example gradients.

  Update: ``w <- w - lr * (sum_i min(1, c/||g_i||) g_i + N(0, (sigma c)^2 I)) / B``.
  Sensitivity ``c``.

  Args:
    learning_rate: float or schedule.
    l2_norm_clip: ``c > 0`` (``inf`` only for testing).
    noise_multiplier: ``sigma >= 0``; noise std on the sum is ``sigma * c``.
    seed, num_microbatches, momentum, nesterov, **kwargs: as :class:`DPNSGD`.
  """

  _inner_cls = keras.optimizers.SGD
  _inner_keys = ("momentum", "nesterov")
  _signature = ("l2_norm_clip",)

  def __init__(self, learning_rate=0.01, l2_norm_clip=None, noise_multiplier=None, seed=None,
               num_microbatches=None, momentum=0.0, nesterov=False, name=None, **kwargs):
    super().__init__(learning_rate, None, l2_norm_clip, noise_multiplier, seed, num_microbatches,
                     name, {"momentum": float(momentum), "nesterov": nesterov}, kwargs)


@keras.saving.register_keras_serializable(package="tf_dpnsgd")
class DPAdam(_Named):
  """DP-Adam: Adam on the noised mean of clipped per-example gradients (sensitivity ``c``).

  Args:
    learning_rate, beta_1, beta_2, epsilon, amsgrad: as ``keras.optimizers.Adam``.
    l2_norm_clip, noise_multiplier, seed, num_microbatches: as :class:`DPSGD`.
  """

  _inner_cls = keras.optimizers.Adam
  _inner_keys = ("beta_1", "beta_2", "epsilon", "amsgrad")
  _signature = ("l2_norm_clip",)

  def __init__(self, learning_rate=0.001, l2_norm_clip=None, noise_multiplier=None, seed=None,
               num_microbatches=None, beta_1=0.9, beta_2=0.999, epsilon=1e-7, amsgrad=False,
               name=None, **kwargs):
    super().__init__(learning_rate, None, l2_norm_clip, noise_multiplier, seed, num_microbatches,
                     name, {"beta_1": beta_1, "beta_2": beta_2, "epsilon": epsilon,
                            "amsgrad": amsgrad}, kwargs)


@keras.saving.register_keras_serializable(package="tf_dpnsgd")
class DPNAdam(_Named):
  """DP-NAdam: Adam on the noised mean of normalized per-example gradients (sensitivity 1).

  "NAdam" here is the paper's *normalized* Adam, not Nesterov-Adam.

  Args:
    learning_rate, beta_1, beta_2, epsilon, amsgrad: as ``keras.optimizers.Adam``.
    regularizer, noise_multiplier, seed, num_microbatches: as :class:`DPNSGD`.
  """

  _inner_cls = keras.optimizers.Adam
  _inner_keys = ("beta_1", "beta_2", "epsilon", "amsgrad")
  _signature = ("regularizer",)

  def __init__(self, learning_rate=0.001, regularizer=None, noise_multiplier=None, seed=None,
               num_microbatches=None, beta_1=0.9, beta_2=0.999, epsilon=1e-7, amsgrad=False,
               name=None, **kwargs):
    super().__init__(learning_rate, regularizer, None, noise_multiplier, seed, num_microbatches,
                     name, {"beta_1": beta_1, "beta_2": beta_2, "epsilon": epsilon,
                            "amsgrad": amsgrad}, kwargs)


__all__ = ["DPAdam", "DPNAdam", "DPNSGD", "DPOptimizerMixin", "DPSGD", "PrivateOptimizer",
           "make_private_optimizer", "make_transform"]
