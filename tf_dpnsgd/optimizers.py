"""DP optimizers: any Keras optimizer made private, and the paper's four by name.

This module is long (about 740 lines): the wrapper and the four named optimizers share one
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

import math
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
_COUNT_TAG = 0xC0C7  # adaptive clipping's count noise: a stream independent of the gradient's

# The keyword arguments of quantile-adaptive clipping (Andrew et al. 2021).
ADAPTIVE_KEYS = ("target_unclipped_quantile", "clip_learning_rate", "clipped_count_stddev")


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
    clipped_count_stddev = noise_lib.validate_clipped_count_stddev(clipped_count_stddev)
    noise_lib.gradient_noise_multiplier(noise_multiplier, clipped_count_stddev)  # may raise
  return adaptive, clipped_count_stddev


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
    target_unclipped_quantile: ``gamma`` in [0, 1] turns on quantile-adaptive
      clipping (Andrew et al. 2021), with ``l2_norm_clip`` as the initial clip;
      ``None`` (default) keeps the clip fixed. Clipping only.
    clip_learning_rate: ``eta_C >= 0`` of the geometric update (default 0.2).
    clipped_count_stddev: ``sigma_b``, noise std on the count of unclipped
      units (default: the step's (expected) number of units / 20).
    name: the optimizer's name.

  Formal guarantee: :meth:`privatize` returns ``(sum + N(0, (sigma S)^2 I)) / D``
  with one draw per call, keyed by ``(key, step)``; given contributions of
  norm at most ``S = transform.sensitivity`` this is the Gaussian mechanism
  with noise multiplier ``sigma`` that :mod:`tf_dpnsgd.accounting` accounts.

  Adaptive clipping: ``noise_multiplier`` is the EFFECTIVE multiplier of the
  two queries of each step (what every accountant uses): the gradient gets
  ``sigma_grad = (sigma^-2 - (2 sigma_b)^-2)^(-1/2)`` times the clip ``C_t``
  of that step (read before the step, the same value that clipped), the
  centered count of unclipped units gets ``N(0, sigma_b^2)`` from an
  independent stream, and only then is the clip moved to ``C_{t+1}``
  (:func:`tf_dpnsgd.transforms.quantile_clip_update`); see
  :mod:`tf_dpnsgd.accounting.adaptive`.
  """

  def __init__(self, inner_optimizer, noise_multiplier=None, regularizer=None,
               l2_norm_clip=None, seed=None, num_microbatches=None,
               target_unclipped_quantile=None, clip_learning_rate=None,
               clipped_count_stddev=None, name=None, **kwargs):
    if kwargs:
      raise ValueError(f"{type(self).__name__} does not take {sorted(kwargs)}; set optimizer "
                       "options on the wrapped optimizer.")
    transform = make_transform(regularizer, l2_norm_clip)
    if noise_multiplier is not None:
      noise_multiplier = noise_lib.validate_noise_multiplier(noise_multiplier)
    adaptive, count_stddev = make_adaptive_clip(
        noise_multiplier or 0.0, regularizer, l2_norm_clip, target_unclipped_quantile,
        clip_learning_rate, clipped_count_stddev)
    inner = _check_inner(inner_optimizer)
    super().__init__(learning_rate=0.0, name=name or f"private_{inner.name}")
    self.inner_optimizer = inner
    self._transform = transform
    self.adaptive_clip = adaptive
    self._clipped_count_stddev = count_stddev
    self._clip_variable = None
    self.noise_multiplier = noise_multiplier
    self.seed = _validate_seed(seed)
    self.num_microbatches = _validate_num_microbatches(num_microbatches)
    if self.num_microbatches is not None:
      warnings.warn("`num_microbatches` on the optimizer is deprecated: pass it to "
                    "tf_dpnsgd.DPModel(...) / make_private(...), beside physical_batch_size.",
                    DeprecationWarning, stacklevel=2)
    self._dp_applying = False
    self._noise_key = None

  def take_noise_multiplier(self, noise_multiplier: float) -> None:
    """Sets the noise multiplier from the model's privacy plan (``noise_multiplier=None``
    at construction); one already given must agree with it.

    Raises:
      ValueError: a different noise multiplier was given, or the train step was
        already built with another one.
    """
    sigma = noise_lib.validate_noise_multiplier(noise_multiplier)
    if self.noise_multiplier is not None:
      if not math.isclose(self.noise_multiplier, sigma, rel_tol=1e-9, abs_tol=0.0):
        raise ValueError(
            f"The optimizer's noise_multiplier ({self.noise_multiplier!r}) differs from the "
            f"model's privacy plan ({sigma!r}): the reported epsilon would not describe this "
            "training. Leave noise_multiplier unset (the plan's is taken) or make them agree.")
      return
    if self._clipped_count_stddev is not None:
      noise_lib.gradient_noise_multiplier(sigma, self._clipped_count_stddev)  # may raise
    self.noise_multiplier = sigma

  def _require_noise_multiplier(self) -> float:
    if self.noise_multiplier is None:
      raise ValueError(
          f"{self.name}: no noise_multiplier. Give one, or compile a model made with "
          "tf_dpnsgd.make_private(model, target_epsilon=... or noise_multiplier=..., delta=..., "
          "batch_size=..., epochs=...), whose privacy plan sets it.")
    return self.noise_multiplier

  # --- the transform's parameters ----------------------------------------------
  @property
  def transform(self) -> transforms.Transform:
    """The per-example transform of the current step.

    Fixed: the ``Normalize`` / ``Clip`` given. Adaptive clipping: ``Clip`` at
    the current clip ``C_t`` (a float when read eagerly; inside the train step
    a tensor read once, before the step, then used for clipping and noise).
    """
    if self._clip_variable is None:
      return self._transform
    return transforms.Clip(self.current_l2_norm_clip)

  @transform.setter
  def transform(self, transform):
    if self.adaptive_clip is not None:
      raise ValueError("The transform of an adaptive-clipping optimizer follows its clip "
                       "state; it cannot be replaced.")
    self._transform = transform

  @property
  def regularizer(self):
    return getattr(self._transform, "regularizer", None)

  @property
  def l2_norm_clip(self):
    """The given clip (the initial one under adaptive clipping)."""
    return getattr(self._transform, "l2_norm_clip", None)

  @property
  def target_unclipped_quantile(self):
    return None if self.adaptive_clip is None else self.adaptive_clip.target_unclipped_quantile

  @property
  def clip_learning_rate(self):
    return None if self.adaptive_clip is None else self.adaptive_clip.clip_learning_rate

  @property
  def clipped_count_stddev(self):
    """``sigma_b`` as given (``None``: the step's number of units / 20)."""
    return self._clipped_count_stddev

  @property
  def current_l2_norm_clip(self):
    """The clip the next step uses (``None`` for normalization).

    Under adaptive clipping it is the optimizer variable ``current_l2_norm_clip``
    (saved and restored with the optimizer's state), read as a float when
    executing eagerly and as a scalar tensor inside a traced step (the train
    step reads it once, before the step); before ``build``, the initial clip.
    """
    if self._clip_variable is None:
      return self.l2_norm_clip
    value = tf.convert_to_tensor(self._clip_variable.value)
    return float(value.numpy()) if tf.executing_eagerly() else tf.identity(value)

  def resolved_clipped_count_stddev(self, denominator):
    """``sigma_b`` for a step of ``denominator`` (expected) units (float or tensor)."""
    if self._clipped_count_stddev is not None:
      return self._clipped_count_stddev
    if self.noise_multiplier == 0:
      return 0.0
    if tf.is_tensor(denominator):
      return tf.cast(denominator, tf.float32) * noise_lib.default_clipped_count_stddev(1.0)
    return noise_lib.default_clipped_count_stddev(denominator)

  def gradient_noise_multiplier(self, expected_batch_size=None) -> float:
    """``sigma_grad``: the multiplier of the gradient's own noise (= ``noise_multiplier``
    with a fixed clip; see :mod:`tf_dpnsgd.accounting.adaptive` for adaptive clipping).

    ``expected_batch_size`` (units per step) is needed only for the default
    ``clipped_count_stddev``.
    """
    if self.adaptive_clip is None:
      return self.noise_multiplier
    if self._clipped_count_stddev is None and self.noise_multiplier != 0 \
        and expected_batch_size is None:
      raise ValueError("The default clipped_count_stddev is the expected batch size / 20: "
                       "pass expected_batch_size.")
    return noise_lib.gradient_noise_multiplier(
        self.noise_multiplier, self.resolved_clipped_count_stddev(expected_batch_size))

  @property
  def noise_stddev(self) -> float:
    """Std of the noise added to the SUM of contributions: sigma x sensitivity.

    Under adaptive clipping it changes with the clip and the batch size: see
    :meth:`gradient_noise_multiplier` and :attr:`current_l2_norm_clip`.
    """
    if self._require_noise_multiplier() == 0:  # also for an infinite clip (0 * inf is NaN)
      return 0.0
    if self.adaptive_clip is not None:
      raise ValueError("With adaptive clipping the noise std is gradient_noise_multiplier("
                       "expected_batch_size) * current_l2_norm_clip, and changes every step.")
    return self.noise_multiplier * self._transform.sensitivity

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
    if self.adaptive_clip is not None:
      # Optimizer state: saved and restored with the optimizer's variables (checkpoints,
      # save_weights, .keras files). Every replica computes the same value.
      self._clip_variable = self.add_variable(
          shape=(), dtype="float32", name="current_l2_norm_clip",
          initializer=keras.initializers.Constant(self.adaptive_clip.l2_norm_clip),
          aggregation="only_first_replica")
    # A Python value, never a variable: no checkpoint, .keras file or export holds it.
    self._noise_key = (self.seed if self.seed is not None else noise_lib.random_seed(),
                       _NOISE_TAG)

  def finalize_variable_values(self, var_list):
    self.inner_optimizer.finalize_variable_values(var_list)

  # --- the private step ----------------------------------------------------------
  def privatize(self, summed, denominator, local_denominator=False, step=None, transform=None):
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
      transform: the transform that produced ``summed`` (default
        :attr:`transform`); its ``sensitivity`` scales the noise. Under
        adaptive clipping the train step passes ``Clip(C_t)``, read once before
        the step, so the noise uses the clip that clipped.

    Returns:
      The privatized mean gradient, one tensor per variable.
    """
    if step is None:
      raise ValueError("privatize() needs `step`, the model's privacy-ledger step that keys "
                       "the noise draw (the DP train step passes it).")
    self._require_noise_multiplier()
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
    seed = noise_lib.step_seed(tf.constant(self._noise_key, tf.int64), self._stream(step))
    transform = self.transform if transform is None else transform
    checks = []
    if self.adaptive_clip is None or self.noise_multiplier == 0:
      stddev = self.noise_stddev if self.adaptive_clip is None else 0.0
    else:
      sigma_grad, checks = self._step_gradient_noise_multiplier(denominator)
      stddev = sigma_grad * tf.cast(transform.sensitivity, tf.float32)
    with tf.control_dependencies(checks):
      noisy = noise_lib.add_gaussian_noise(summed, stddev, seed)
    denominator = tf.cast(denominator, tf.float32)
    if replicas > 1:
      # Keras sums the replicas' gradients in apply_gradients; every replica
      # holds the same privatized mean, so each passes 1/R of it.
      denominator = denominator * replicas
    return [g / tf.cast(denominator, g.dtype) for g in noisy]

  def _stream(self, step):
    """The counter(s) keying this step's draw: the ledger's ``[lineage, generation, step]``
    (without the lineage for a user-fixed seed, so that a reproducibility run replays in a
    new model), or a scalar step."""
    step = tf.cast(step, tf.int64)
    if step.shape.rank == 1 and self.seed is not None:
      step = step[1:]
    return step

  def _step_gradient_noise_multiplier(self, global_denominator):
    """``(sigma_grad, checks)`` for a step of ``global_denominator`` units (adaptive)."""
    sigma_b = self.resolved_clipped_count_stddev(tf.cast(global_denominator, tf.float32))
    if tf.is_tensor(sigma_b) and tf.get_static_value(sigma_b) is not None:
      sigma_b = float(tf.get_static_value(sigma_b))
    if tf.is_tensor(sigma_b):
      return noise_lib.gradient_noise_multiplier_tensor(self.noise_multiplier, sigma_b)
    return noise_lib.gradient_noise_multiplier(self.noise_multiplier, sigma_b), []

  def step_checks(self, denominator, local_denominator=False) -> list:
    """Assertions a DP step must pass before it changes anything (adaptive clipping:
    ``2 sigma_b > sigma`` for the default ``sigma_b = m / 20`` of this step's ``m``).

    The train step creates all its ops under these control dependencies, so a
    refused step changes no weight, clip or ledger entry. A violation known
    while tracing raises ``ValueError`` at once. XLA drops assertions, so under
    ``jit_compile`` the same checks run on the host before each step
    (:mod:`tf_dpnsgd.guard`); were they bypassed, the
    gradient noise of such a step would be NaN (nothing is released).
    """
    if self.adaptive_clip is None or self.noise_multiplier == 0 \
        or self._clipped_count_stddev is not None:
      return []  # an explicit sigma_b was checked at construction
    ctx = tf.distribute.get_replica_context()
    denominator = tf.cast(denominator, tf.float32)
    if local_denominator and ctx is not None and ctx.num_replicas_in_sync > 1:
      denominator = ctx.all_reduce(tf.distribute.ReduceOp.SUM, denominator)
    return self._step_gradient_noise_multiplier(denominator)[1]

  def privatize_count(self, centered_count, denominator, local_denominator=False, step=None):
    """Adaptive clipping's count query: the noised fraction of unclipped units.

    Args:
      centered_count: :func:`tf_dpnsgd.transforms.centered_unclipped_count`
        of this replica's units at the step's clip (sensitivity 1/2).
      denominator, local_denominator, step: as :meth:`privatize` (the same
        public denominator as the gradient).

    Returns:
      ``b_t`` (:func:`tf_dpnsgd.noise.noised_unclipped_fraction`), from a noise
      stream keyed by ``(key, step)`` like the gradient's but independent of it.
    """
    if step is None or self._noise_key is None:
      raise ValueError("privatize_count() needs a built optimizer and `step`.")
    ctx = tf.distribute.get_replica_context()
    replicas = ctx.num_replicas_in_sync if ctx is not None else 1
    centered_count = tf.cast(centered_count, tf.float32)
    denominator = tf.cast(denominator, tf.float32)
    if replicas > 1:
      centered_count = ctx.all_reduce(tf.distribute.ReduceOp.SUM, centered_count)
      if local_denominator:
        denominator = ctx.all_reduce(tf.distribute.ReduceOp.SUM, denominator)
    count_key = tf.constant((self._noise_key[0], _COUNT_TAG), tf.int64)
    seed = noise_lib.step_seed(count_key, self._stream(step))
    return noise_lib.noised_unclipped_fraction(
        centered_count, self.resolved_clipped_count_stddev(denominator), denominator, seed)

  def apply_private_gradients(self, summed, denominator, variables, public_grads=None,
                              local_denominator=False, step=None, transform=None,
                              centered_unclipped_count=None):
    """Privatizes ``summed`` and applies the wrapped optimizer's update to ``variables``.

    Args:
      summed: per-variable sums of bounded per-unit contributions.
      denominator: see :meth:`privatize`.
      variables: the trainable variables, aligned with ``summed``.
      public_grads: optional data-independent gradients (e.g. of weight
        regularizers) added after the noise; ``None`` entries are skipped.
      local_denominator, step, transform: see :meth:`privatize`.
      centered_unclipped_count: required under adaptive clipping: the
        step's :func:`~tf_dpnsgd.transforms.centered_unclipped_count` at the
        clip of ``transform``. After the gradient's noise is drawn, the count is
        noised (:meth:`privatize_count`) and the clip moves to ``C_{t+1}``.
    """
    if not self.built:
      with keras.name_scope(self.name, caller=self):
        self.build(variables)
    if self.adaptive_clip is not None and (transform is None
                                           or centered_unclipped_count is None):
      raise ValueError("Adaptive clipping needs the step's `transform` (Clip at the clip read "
                       "before the step) and `centered_unclipped_count`; the DP train step "
                       "passes both.")
    grads = self.privatize(summed, denominator, local_denominator, step, transform)
    if self.adaptive_clip is not None:
      fraction = self.privatize_count(centered_unclipped_count, denominator, local_denominator,
                                      step)
      self._clip_variable.assign(self.adaptive_clip.update(transform.l2_norm_clip, fraction))
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
            "l2_norm_clip": self.l2_norm_clip,
            "target_unclipped_quantile": self.target_unclipped_quantile,
            "clip_learning_rate": self.clip_learning_rate,
            "clipped_count_stddev": self.clipped_count_stddev}

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
                           seed=None, target_unclipped_quantile=None, clip_learning_rate=None,
                           clipped_count_stddev=None) -> PrivateOptimizer:
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
    target_unclipped_quantile, clip_learning_rate, clipped_count_stddev:
      quantile-adaptive clipping (see :class:`PrivateOptimizer`); clipping only.

  >>> opt = make_private_optimizer(keras.optimizers.AdamW(1e-3), noise_multiplier=1.0,
  ...                              l2_norm_clip=1.0)
  >>> opt.transform.sensitivity, opt.noise_stddev
  (1.0, 1.0)
  """
  return PrivateOptimizer(optimizer, noise_multiplier=noise_multiplier, regularizer=regularizer,
                          l2_norm_clip=l2_norm_clip, seed=seed,
                          target_unclipped_quantile=target_unclipped_quantile,
                          clip_learning_rate=clip_learning_rate,
                          clipped_count_stddev=clipped_count_stddev)


class _Named(PrivateOptimizer):
  """A named private optimizer: ``get_config`` mirrors ``__init__`` (Keras style)."""

  _inner_cls = None
  _inner_keys = ()  # the inner optimizer's arguments that appear in the signature

  def __init__(self, learning_rate, regularizer, l2_norm_clip, noise_multiplier, seed,
               num_microbatches, name, inner_kwargs, base_kwargs, adaptive_kwargs=None):
    adaptive_given = sorted(k for k in ADAPTIVE_KEYS if base_kwargs.get(k) is not None)
    if adaptive_given:
      raise ValueError(
          f"{type(self).__name__} normalizes per-example gradients (sensitivity 1, no clip), "
          f"so {adaptive_given} (quantile-adaptive clipping) does not apply. Use DPSGD or "
          "DPAdam (l2_norm_clip=..., target_unclipped_quantile=...) for adaptive clipping.")
    base_kwargs = {k: v for k, v in base_kwargs.items() if k not in ADAPTIVE_KEYS}
    unknown = set(base_kwargs) - _BASE_KEYS
    if unknown:
      raise ValueError(f"{type(self).__name__} got unknown arguments {sorted(unknown)}.")
    if regularizer is None and l2_norm_clip is None:
      raise ValueError(f"{type(self).__name__} needs `{self._signature[0]}` (> 0); "
                       "`noise_multiplier` (>= 0) too, unless the model's privacy plan sets it.")
    inner = self._inner_cls(learning_rate=learning_rate, **inner_kwargs, **base_kwargs)
    super().__init__(inner, noise_multiplier=noise_multiplier, regularizer=regularizer,
                     l2_norm_clip=l2_norm_clip, seed=seed, num_microbatches=num_microbatches,
                     name=name or type(self).__name__.lower(), **(adaptive_kwargs or {}))

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


def _adaptive_kwargs(target_unclipped_quantile, clip_learning_rate, clipped_count_stddev):
  return dict(zip(ADAPTIVE_KEYS, (target_unclipped_quantile, clip_learning_rate,
                                  clipped_count_stddev)))


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
    noise_multiplier: ``sigma >= 0``; noise std on the sum is ``sigma * c``
      (adaptive clipping: the effective multiplier, see :class:`PrivateOptimizer`).
    seed, num_microbatches, momentum, nesterov, **kwargs: as :class:`DPNSGD`.
    target_unclipped_quantile, clip_learning_rate, clipped_count_stddev:
      quantile-adaptive clipping (Andrew et al. 2021) with ``l2_norm_clip`` as
      the initial clip; see :class:`PrivateOptimizer`.
  """

  _inner_cls = keras.optimizers.SGD
  _inner_keys = ("momentum", "nesterov")
  _signature = ("l2_norm_clip",) + ADAPTIVE_KEYS

  def __init__(self, learning_rate=0.01, l2_norm_clip=None, noise_multiplier=None, seed=None,
               num_microbatches=None, momentum=0.0, nesterov=False,
               target_unclipped_quantile=None, clip_learning_rate=None,
               clipped_count_stddev=None, name=None, **kwargs):
    super().__init__(learning_rate, None, l2_norm_clip, noise_multiplier, seed, num_microbatches,
                     name, {"momentum": float(momentum), "nesterov": nesterov}, kwargs,
                     _adaptive_kwargs(target_unclipped_quantile, clip_learning_rate,
                                      clipped_count_stddev))


@keras.saving.register_keras_serializable(package="tf_dpnsgd")
class DPAdam(_Named):
  """DP-Adam: Adam on the noised mean of clipped per-example gradients (sensitivity ``c``).

  Args:
    learning_rate, beta_1, beta_2, epsilon, amsgrad: as ``keras.optimizers.Adam``.
    l2_norm_clip, noise_multiplier, seed, num_microbatches: as :class:`DPSGD`.
    target_unclipped_quantile, clip_learning_rate, clipped_count_stddev: as :class:`DPSGD`.
  """

  _inner_cls = keras.optimizers.Adam
  _inner_keys = ("beta_1", "beta_2", "epsilon", "amsgrad")
  _signature = ("l2_norm_clip",) + ADAPTIVE_KEYS

  def __init__(self, learning_rate=0.001, l2_norm_clip=None, noise_multiplier=None, seed=None,
               num_microbatches=None, beta_1=0.9, beta_2=0.999, epsilon=1e-7, amsgrad=False,
               target_unclipped_quantile=None, clip_learning_rate=None,
               clipped_count_stddev=None, name=None, **kwargs):
    super().__init__(learning_rate, None, l2_norm_clip, noise_multiplier, seed, num_microbatches,
                     name, {"beta_1": beta_1, "beta_2": beta_2, "epsilon": epsilon,
                            "amsgrad": amsgrad}, kwargs,
                     _adaptive_kwargs(target_unclipped_quantile, clip_learning_rate,
                                      clipped_count_stddev))


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


__all__ = ["ADAPTIVE_KEYS", "DPAdam", "DPNAdam", "DPNSGD", "DPSGD", "PrivateOptimizer",
           "make_adaptive_clip", "make_private_optimizer", "make_transform"]
