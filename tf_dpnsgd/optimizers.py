"""DP optimizers: the Keras face of the DP step (config, build, the paper's four by name).

This module is long (about 640 lines): the wrapper and the four named optimizers share
one ``__init__``/``get_config`` contract (a named optimizer's ``get_config`` mirrors its
``__init__`` and the wrapper's config), which must be read and changed together; the
mechanism itself is :mod:`tf_dpnsgd.noise`.

:func:`make_private_optimizer` wraps ANY Keras 3 optimizer (SGD with momentum,
Adam, AdamW, Nadam, Lion, Adafactor, ...) in a :class:`PrivateOptimizer`, which
holds the mechanism's configuration and state: (a) the per-example transform
(``Normalize``, DP-NSGD, or ``Clip``, DP-SGD; it reports the sensitivity ``S``),
(b) the noise multiplier ``sigma``, (c) the noise key (the user's ``seed``, for
reproducibility experiments only, or by default a key drawn from the OS at
``build``; never a variable, so no checkpoint, ``.keras`` file or export holds
it), (d) under quantile-adaptive clipping the clip variable. The mechanism
itself, ``(sum + N(0, (sigma S)^2 I)) / D`` with each draw keyed by (key, the
model's privacy-ledger step), is :func:`tf_dpnsgd.noise.privatize`; the wrapped
optimizer's update rule (and state: momentum, moments, step counter) is applied
to its result unchanged. The wrapper is a composition, like Keras' own
``LossScaleOptimizer``: no class is generated and nothing in Keras is patched.

:class:`DPNSGD`, :class:`DPSGD`, :class:`DPAdam` and :class:`DPNAdam` are thin
names over the same mechanism with the paper's signatures; their
``get_config`` mirrors ``__init__``.

The per-example contributions come from the model's train step
(:func:`tf_dpnsgd.step.dp_step`), which calls
:meth:`PrivateOptimizer.apply_private_gradients` with the SUM of the
transformed contributions. Calling ``apply``/``apply_gradients`` with ordinary
gradients raises: it would silently train without privacy.
"""

from __future__ import annotations

import math
import warnings

import keras
import tensorflow as tf

from tf_dpnsgd import noise as noise_lib
from tf_dpnsgd.correlated import blt as _blt
from tf_dpnsgd.correlated import noise as _correlated
from tf_dpnsgd import transforms

_RAW_APPLY_ERROR = (
    "{name} received ordinary (non-private) gradients. DP optimizers must be fed "
    "per-example contributions by a DP train step: build the model with "
    "`tf_dpnsgd.DPModel(inputs, outputs)` or wrap it with `tf_dpnsgd.make_private(model)` "
    "before `compile`/`fit`; in a custom loop use `optimizer.apply_private_gradients(...)`."
)

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
    regularizer / l2_norm_clip: exactly one (see :func:`tf_dpnsgd.noise.make_transform`).
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

  Formal guarantee and adaptive clipping's split of ``sigma`` (the EFFECTIVE
  multiplier of the gradient and count queries): :mod:`tf_dpnsgd.noise`.
  """

  def __init__(self, inner_optimizer, noise_multiplier=None, regularizer=None,
               l2_norm_clip=None, seed=None, num_microbatches=None,
               target_unclipped_quantile=None, clip_learning_rate=None,
               clipped_count_stddev=None, name=None, band_coefficients=None,
               blt_parameters=None, **kwargs):
    if kwargs:
      raise ValueError(f"{type(self).__name__} does not take {sorted(kwargs)}; set optimizer "
                       "options on the wrapped optimizer.")
    transform = noise_lib.make_transform(regularizer, l2_norm_clip)
    if noise_multiplier is not None:
      noise_multiplier = noise_lib.validate_noise_multiplier(noise_multiplier)
    adaptive, count_stddev = noise_lib.make_adaptive_clip(
        noise_multiplier or 0.0, regularizer, l2_norm_clip, target_unclipped_quantile,
        clip_learning_rate, clipped_count_stddev)
    if band_coefficients is not None and blt_parameters is not None:
      raise ValueError("Give band_coefficients (BandMF) or blt_parameters (BLT), not both.")
    band_noise = (_correlated.blt_noise(blt_parameters, adaptive) if blt_parameters is not None
                  else _correlated.banded_noise(band_coefficients, adaptive))
    inner = _check_inner(inner_optimizer)
    super().__init__(learning_rate=0.0, name=name or f"private_{inner.name}")
    self.band_noise = band_noise  # None: independent noise (tf_dpnsgd.correlated.noise)
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
    self.adopted_noise = False  # set when a built, un-stepped optimizer took correlated noise

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

  def take_band_coefficients(self, coefficients) -> None:
    """Sets the banded strategy from the model's privacy plan (correlated noise,
    ``make_private(..., noise="bandmf", bands=b)``); one already given must agree.

    Raises:
      ValueError: other coefficients were given (or saved with the optimizer: e.g. a plan
        extended to more steps, whose optimized strategy differs), or the optimizer was
        already built with independent noise.
    """
    coefficients = _correlated.validate_coefficients(coefficients)
    if self.band_noise is not None:
      if not isinstance(self.band_noise, _correlated.BandedNoise) or len(
          self.band_noise.coefficients) != len(coefficients) or not all(
          math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-9)
          for a, b in zip(self.band_noise.coefficients, coefficients)):
        raise ValueError(
            "The optimizer's band_coefficients differ from the model's privacy plan's banded "
            "strategy (computed for the plan's steps and bands): the correlated stream would "
            "not be the planned mechanism. Leave band_coefficients unset; a plan extended to "
            "more steps cannot continue a correlated-noise run.")
      return
    self._adopt_correlated(_correlated.banded_noise(coefficients, self.adaptive_clip))

  def take_blt_parameters(self, blt) -> None:
    """Sets the BLT from the model's privacy plan (``make_private(..., noise="blt")``); one
    already given (or saved with the optimizer) must be exactly the plan's.

    Raises:
      ValueError: another BLT (or banded noise) was given, or the optimizer was already
        built with independent noise.
    """
    strategy = _blt.BLTStrategy(*blt)
    if self.band_noise is not None:
      if getattr(self.band_noise, "bands", None) != strategy.ledger_code:
        raise ValueError(
            "The optimizer's noise differs from the model's privacy plan's BLT (optimized "
            "for the plan's steps and separation): the correlated stream would not be the "
            "accounted mechanism. Leave blt_parameters (and band_coefficients) unset.")
      return
    self._adopt_correlated(_correlated.blt_noise(strategy.parameters(), self.adaptive_clip))

  def _adopt_correlated(self, band_noise) -> None:
    """Takes correlated noise in place of independent noise. Before :meth:`build` the buffers
    come with the rest of the state. A built optimizer (``load_model`` builds the one saved
    with a model) may take it only while it has taken no step: its buffers then start fresh,
    as they would have at build, and the step function is retraced (:attr:`adopted_noise`).

    Raises:
      ValueError: the optimizer has taken a step with independent noise (or is being traced).
    """
    if not self.built:
      self.band_noise = band_noise
      return
    if not tf.executing_eagerly() or int(self.iterations.numpy()) != 0:
      raise ValueError("The optimizer has taken steps with independent noise; compile the "
                       "model with a new optimizer to take the plan's correlated noise.")
    self.band_noise = band_noise
    self.band_noise.build(self, self._trainable_variables)
    self.adopted_noise = True  # the model drops a step function traced before (training.py)

  def take_plan_bands(self, num_steps: int, bands: int) -> None:
    """:meth:`take_band_coefficients` of the strategy optimized for a plan's ``num_steps``
    and ``bands`` and this optimizer's momentum (0 where it has none: the strategy is then
    optimized for plain prefix sums; any normalized strategy is equally private)."""
    self.take_band_coefficients(_correlated.bandmf(int(num_steps), int(bands),
                                                   self.workload_momentum))

  @property
  def workload_momentum(self) -> float:
    """The momentum the updates are applied with (0 without one, or for a schedule): the
    workload a correlated-noise strategy (banded, BLT) is optimized for."""
    momentum = getattr(self.inner_optimizer, "momentum", 0.0)
    return float(momentum) if isinstance(momentum, (int, float)) else 0.0

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
    return noise_lib.count_stddev(self._clipped_count_stddev, self.noise_multiplier,
                                  denominator)

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
    if self.band_noise is not None:  # its buffers: optimizer state, saved with the rest
      self.band_noise.build(self, var_list)
    # A Python value, never a variable: no checkpoint, .keras file or export holds it.
    self._noise_key = noise_lib.noise_key(self.seed)

  def finalize_variable_values(self, var_list):
    self.inner_optimizer.finalize_variable_values(var_list)

  # --- the private step (the mechanism itself: tf_dpnsgd.noise) ------------------------
  def privatize(self, summed, denominator, local_denominator=False, step=None, transform=None):
    """``(summed + N(0, (sigma S)^2 I)) / denominator``: :func:`tf_dpnsgd.noise.privatize`
    with this optimizer's key and noise.

    ``step`` is the model's privacy-ledger ``[lineage, generation, step]``
    (:meth:`tf_dpnsgd.ledger.PrivacyLedger.noise_stream`), required: it keys the draw.
    ``transform`` (default :attr:`transform`) produced ``summed``: under adaptive
    clipping the train step passes ``Clip(C_t)`` read once before the step, whose
    sensitivity scales the noise; with a fixed clip the std is :attr:`noise_stddev`.
    ``local_denominator``: ``denominator`` counts this replica's units only.
    """
    if step is None:
      raise ValueError("privatize() needs `step`, the model's privacy-ledger step that keys "
                       "the noise draw (the DP train step passes it).")
    self._require_noise_multiplier()
    if self._noise_key is None:
      raise RuntimeError("Build the optimizer before privatize() (its noise key is drawn "
                         "at build time).")
    transform = self.transform if transform is None else transform
    if self.adaptive_clip is None:
      stddev = self.noise_stddev
    elif self.noise_multiplier == 0:
      stddev = 0.0
    else:
      stddev = None  # sigma_grad of the step's global denominator, times the clip C_t
    if self.band_noise is not None:  # w = C^-1 z, the same draws z (tf_dpnsgd.correlated)
      return self.band_noise.privatize(summed, denominator, key=self._noise_key, step=step,
                                       stddev=stddev, user_seeded=self.seed is not None)
    return noise_lib.privatize(
        summed, denominator, key=self._noise_key, step=step, stddev=stddev,
        noise_multiplier=self.noise_multiplier, sensitivity=transform.sensitivity,
        clipped_count_stddev=self._clipped_count_stddev, user_seeded=self.seed is not None,
        local_denominator=local_denominator)

  def step_checks(self, denominator, local_denominator=False) -> list:
    """Adaptive clipping's assertions (:func:`tf_dpnsgd.noise.step_checks`): the train step
    creates its ops under them, so a refused step changes nothing. XLA drops assertions,
    so the host runs the same check first (:mod:`tf_dpnsgd.guard`)."""
    if self.adaptive_clip is None:
      return []
    return noise_lib.step_checks(self.noise_multiplier, self._clipped_count_stddev,
                                 denominator, local_denominator)

  def privatize_count(self, centered_count, denominator, local_denominator=False, step=None):
    """Adaptive clipping's count query: the noised fraction of unclipped units
    (:func:`tf_dpnsgd.noise.privatize_count`, keyed like the gradient's noise but from an
    independent stream); ``centered_count`` is
    :func:`tf_dpnsgd.transforms.centered_unclipped_count` at the step's clip."""
    return self._privatize_count(centered_count, denominator, local_denominator, step)[0]

  def _privatize_count(self, centered_count, denominator, local_denominator, step):
    if step is None or self._noise_key is None:
      raise ValueError("privatize_count() needs a built optimizer and `step`.")
    return noise_lib.privatize_count(
        centered_count, denominator, key=self._noise_key, step=step,
        noise_multiplier=self.noise_multiplier, clipped_count_stddev=self._clipped_count_stddev,
        user_seeded=self.seed is not None, local_denominator=local_denominator)

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

    Returns:
      None with a fixed clip; under adaptive clipping what the step released, for
      the privacy ledger (:meth:`tf_dpnsgd.ledger.PrivacyLedger.record`): the count
      noise ``clipped_count_stddev`` of this step, the clip ``C_{t+1}`` it moved to, and
      its settings (``initial_l2_norm_clip``, ``target_unclipped_quantile``,
      ``clip_learning_rate``).
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
    released = None
    if self.adaptive_clip is not None:
      fraction, sigma_b = self._privatize_count(centered_unclipped_count, denominator,
                                                local_denominator, step)
      clip = self.adaptive_clip.update(transform.l2_norm_clip, fraction)
      self._clip_variable.assign(clip)
      released = {"clipped_count_stddev": sigma_b, "l2_norm_clip": clip,
                  "initial_l2_norm_clip": self.l2_norm_clip,
                  "target_unclipped_quantile": self.target_unclipped_quantile,
                  "clip_learning_rate": self.clip_learning_rate}
    if public_grads is not None:
      grads = [g if p is None else g + tf.cast(p, g.dtype) for g, p in zip(grads, public_grads)]
    self._dp_applying = True
    try:
      self.inner_optimizer.apply_gradients(zip(grads, variables))
    finally:
      self._dp_applying = False
    return released

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
            "clipped_count_stddev": self.clipped_count_stddev,
            "band_coefficients": self.band_coefficients, "blt_parameters": self.blt_parameters}

  @property
  def band_coefficients(self):
    """The banded strategy's ``(c_0, ..., c_{b-1})``, or None (independent or BLT noise)."""
    if not isinstance(self.band_noise, _correlated.BandedNoise):
      return None
    return list(self.band_noise.coefficients)

  @property
  def blt_parameters(self):
    """The BLT's ``[theta, omega]`` (:mod:`tf_dpnsgd.correlated.blt`), or None."""
    if not isinstance(self.band_noise, _correlated.BLTNoise):
      return None
    return [list(self.band_noise.strategy.theta), list(self.band_noise.strategy.omega)]

  @property
  def bands(self) -> int:
    """``b`` of the correlated noise (1: independent noise; a code ``<= -2`` naming the BLT
    for BLT noise), what the ledger records."""
    return 1 if self.band_noise is None else self.band_noise.bands

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


def make_private_optimizer(optimizer, *, noise_multiplier=None, regularizer=None, l2_norm_clip=None,
                           seed=None, target_unclipped_quantile=None, clip_learning_rate=None,
                           clipped_count_stddev=None) -> PrivateOptimizer:
  """Returns ``optimizer`` made private: per-example normalization or clipping, then noise.

  Args:
    optimizer: any Keras 3 optimizer (instance, or a name like ``"adamw"``); its
      update rule is applied to the privatized mean gradient unchanged.
    noise_multiplier: ``sigma >= 0`` (noise std on the sum: ``sigma * S``); ``None``
      (default): the privacy plan of the model it is compiled with sets it
      (``make_private(model, target_epsilon=...)``); ``compile`` raises when no
      plan does.
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
    adaptive_given = sorted(k for k in noise_lib.ADAPTIVE_KEYS
                            if base_kwargs.get(k) is not None)
    if adaptive_given:
      raise ValueError(
          f"{type(self).__name__} normalizes per-example gradients (sensitivity 1, no clip), "
          f"so {adaptive_given} (quantile-adaptive clipping) does not apply. Use DPSGD or "
          "DPAdam (l2_norm_clip=..., target_unclipped_quantile=...) for adaptive clipping.")
    base_kwargs = {k: v for k, v in base_kwargs.items() if k not in noise_lib.ADAPTIVE_KEYS}
    unknown = set(base_kwargs) - _BASE_KEYS - {"band_coefficients", "blt_parameters"}
    if unknown:
      raise ValueError(f"{type(self).__name__} got unknown arguments {sorted(unknown)}.")
    if regularizer is None and l2_norm_clip is None:
      raise ValueError(f"{type(self).__name__} needs `{self._signature[0]}` (> 0); "
                       "`noise_multiplier` (>= 0) too, unless the model's privacy plan sets it.")
    band_coefficients = base_kwargs.pop("band_coefficients", None)
    blt_parameters = base_kwargs.pop("blt_parameters", None)
    inner = self._inner_cls(learning_rate=learning_rate, **inner_kwargs, **base_kwargs)
    super().__init__(inner, noise_multiplier=noise_multiplier, regularizer=regularizer,
                     l2_norm_clip=l2_norm_clip, seed=seed, num_microbatches=num_microbatches,
                     band_coefficients=band_coefficients, blt_parameters=blt_parameters,
                     name=name or type(self).__name__.lower(), **(adaptive_kwargs or {}))

  _signature = ()

  def get_config(self):
    inner = self.inner_optimizer.get_config()
    config = {k: inner[k] for k in ("learning_rate",) + self._inner_keys}
    config.update({k: inner[k] for k in _BASE_KEYS if k in inner})
    dp = self._dp_config()
    for key in ("name", "noise_multiplier", "seed", "num_microbatches",
                "band_coefficients", "blt_parameters") + self._signature:
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
  return dict(zip(noise_lib.ADAPTIVE_KEYS, (target_unclipped_quantile, clip_learning_rate,
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
  _signature = ("l2_norm_clip",) + noise_lib.ADAPTIVE_KEYS

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
  _signature = ("l2_norm_clip",) + noise_lib.ADAPTIVE_KEYS

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


__all__ = ["DPAdam", "DPNAdam", "DPNSGD", "DPSGD", "PrivateOptimizer", "make_private_optimizer"]
