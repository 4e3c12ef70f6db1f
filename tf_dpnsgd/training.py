"""``DPModel`` and ``make_private``: the train step that feeds DP optimizers.

This module is long (about 1050 lines): the Keras glue of the DP step (options, the owned
plan, compile, fit under the guard, metrics, saving) and the two model classes share one
mixin's state and are easier to check together; the step itself is :mod:`tf_dpnsgd.step`.

Keras 3's default ``train_step`` differentiates a reduced loss, so an optimizer
never sees per-example gradients. ``DPModel`` replaces the train step with the
DP one, in named phases:

1. ``per-example losses`` from the compiled loss (any reduction),
2. ``contributions``: an engine (see :mod:`tf_dpnsgd.per_example`) returns the
   sum of transformed per-unit gradients, in physical chunks if asked,
3. ``privatize``: the optimizer adds noise once to the sum and divides by the
   (expected) number of units,
4. ``apply``: Keras' SGD/Adam update; data-independent gradients (weight
   regularizers) are added after the noise.

Batches: ``(x, y)`` or, from :mod:`tf_dpnsgd.sampling`'s Poisson sampler,
``(x, y, {"dp_mask": bool[B], "dp_denominator": float})``: padded rows
(mask False) contribute exactly zero and the sum is divided by the expected
batch size. Any other ``sample_weight`` is rejected: weights change the
per-example sensitivity.
"""

from __future__ import annotations

import inspect
import logging
import warnings
import weakref

import keras
import numpy as np
import tensorflow as tf

from tf_dpnsgd import callbacks as callbacks_lib
from tf_dpnsgd import coverage
from tf_dpnsgd import distribution
from tf_dpnsgd import guard as guard_lib
from tf_dpnsgd import ledger as ledger_lib
from tf_dpnsgd import lineage as lineage_lib
from tf_dpnsgd import losses as losses_lib
from tf_dpnsgd import owned_plan as owned_plan_lib
from tf_dpnsgd import plan as plan_lib
from tf_dpnsgd import transforms
from tf_dpnsgd.optimizers import PrivateOptimizer
from tf_dpnsgd import per_example as per_example_lib
from tf_dpnsgd import step as step_lib
from tf_dpnsgd.per_example import loss_scale as loss_scale_lib


_MIXING_LAYERS = (keras.layers.BatchNormalization,)


def iter_layers(model):
  """All layers below ``model`` (nested models and layers included)."""
  return list(model._flatten_layers(include_self=False, recursive=True))


def validate_layers(model) -> None:
  """Raises ``ValueError`` for layers that break per-example privacy.

  * BatchNormalization mixes statistics across the examples of a batch, so one
    example's gradient depends on the others and its contribution is no longer
    bounded by the clip/normalization.
  * Activity regularizers add a data-dependent loss outside the per-example
    losses.
  """
  for layer in iter_layers(model):
    if isinstance(layer, _MIXING_LAYERS):
      raise ValueError(
          f"Layer '{layer.name}' ({type(layer).__name__}) mixes examples within a batch "
          "(batch statistics), which breaks per-example differential privacy. Replace it "
          "with keras.layers.GroupNormalization (e.g. groups=16) or LayerNormalization: "
          "tf_dpnsgd.fix_layers(model) returns a copy with every BatchNormalization "
          "replaced and lists the changes; tf_dpnsgd.models.resnet20() is a ResNet20 "
          "with GroupNorm.")
    if getattr(layer, "activity_regularizer", None) is not None:
      raise ValueError(
          f"Layer '{layer.name}' has an activity_regularizer: its data-dependent loss "
          "would bypass per-example clipping. Remove it or fold it into the loss.")


def _share_noise_key(optimizer, strategy) -> None:
  """Gives every worker worker 0's noise key (never stored; see :mod:`tf_dpnsgd.distribution`).

  Each replica adds the same draw to the all-reduced sum; with independent
  per-worker keys the applied noise would be the mean of several draws, its
  standard deviation ``sqrt(workers)`` times too small.
  """
  key = getattr(optimizer, "_noise_key", None)
  if key is None:
    raise RuntimeError("Under a multi-worker strategy the model must be built before fit "
                       "(call it on a batch or model.build(input_shape) inside "
                       "strategy.scope()), so the optimizer's noise key can be shared.")
  optimizer._noise_key = (distribution.broadcast_int(strategy, key[0]),) + tuple(key[1:])


def _attach_ledger(model, ledger) -> None:
  """Makes ``ledger`` the model's ``privacy_ledger`` without adding it to ``model.weights``.

  Keras' saving walks the model's attributes (so ``save``, ``.keras``,
  ``save_weights``/``load_weights``, ``ModelCheckpoint`` and ``BackupAndRestore``
  carry it); Keras' layer tracking, which builds the weight list, does not see
  an attribute set this way.
  """
  if not isinstance(ledger, ledger_lib.PrivacyLedger):
    raise TypeError(f"`privacy_ledger` must be a tf_dpnsgd PrivacyLedger; got {ledger!r}.")
  object.__setattr__(model, "privacy_ledger", ledger)


def _is_in_memory(x) -> bool:
  """Whether ``fit`` batches ``x`` itself from in-memory arrays (NumPy, tensors, pandas)."""
  if x is None or isinstance(x, (tf.data.Dataset, tf.distribute.DistributedDataset)):
    return False
  try:
    from keras.src.trainers.data_adapters import array_data_adapter  # pylint: disable=g-import-not-at-top
    return bool(array_data_adapter.can_convert_arrays((x,)))
  except Exception:  # pylint: disable=broad-except
    return False


# The ledger make_private continues for a plain Keras model, kept OFF the model (a weak map,
# not an attribute): Keras' saving walks a model's attributes, and a ledger attribute on the
# inner model of a wrapper was saved under the inner model's path, which a loaded wrapper
# never reads (its fresh inner model has no such attribute): the loaded model started at 0.
_BASE_LEDGERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _nested_ledgers(model) -> list:
  """The distinct ledgers already bound to ``model`` or to a model nested in it (a head with
  released statistics inside a multi-view model; a private model used as a layer)."""
  found = []
  for layer in [model] + iter_layers(model):
    for ledger in (_BASE_LEDGERS.get(layer), layer.__dict__.get("privacy_ledger")):
      if isinstance(ledger, ledger_lib.PrivacyLedger) and all(ledger is not f for f in found):
        found.append(ledger)
  return found


def _has_history(ledger) -> bool:
  state = ledger.state()
  return bool(state["steps"] or state["releases"] or state["flags"])


def _ledger_for(model) -> ledger_lib.PrivacyLedger:
  """The privacy ledger that ``make_private(model)`` continues.

  The one a previous ``make_private`` or :func:`base_ledger` bound to this Keras
  model or to a model nested in it (two-phase fine-tuning; a head whose input
  statistics were released, then put inside a multi-view model); else, if
  this machine recorded these exact weights with a ledger
  (:mod:`tf_dpnsgd.lineage`: e.g. ``base.save`` + ``load_model`` in a new
  process), a ledger restored to that state; else a new one.

  Raises:
    ValueError: two different ledgers with history are bound to parts of ``model`` (two
      privately trained or released models combined): one epsilon cannot be reported for
      the combination by continuing either.
  """
  found = [ledger for ledger in _nested_ledgers(model) if _has_history(ledger)]
  if len(found) > 1:
    raise ValueError(
        f"Model '{model.name}' combines parts with {len(found)} different privacy ledgers "
        "(each privately trained or with released statistics). Their epsilons compose, but "
        "make_private continues one ledger: build the combined model from the private "
        "parts' common base, or account for the parts separately.")
  if found:
    return found[0]
  existing = _BASE_LEDGERS.get(model)
  if existing is not None:
    return existing
  ledger = ledger_lib.PrivacyLedger()
  weights = model.get_weights() if model.built else []
  state = lineage_lib.lookup_weights(lineage_lib.fingerprint(weights)) if weights else None
  if state:
    ledger.load_own_variables({k: np.asarray(v) for k, v in state.items()})
    logging.getLogger(__name__).warning(
        "make_private: model '%s' holds weights recorded with a privacy ledger on this "
        "machine (%d steps, %d releases); the ledger is restored, so the report counts them.",
        model.name, ledger.steps, ledger.releases)
  return ledger


def _bind_ledger(model, ledger) -> None:
  _BASE_LEDGERS[model] = ledger
  ledger_lib.bind_weights_owner(ledger, model)


def base_ledger(model: keras.Model) -> ledger_lib.PrivacyLedger:
  """The privacy ledger that ``make_private(model)`` will continue (created now if needed).

  For what is spent on ``model``'s training data before it is made private,
  e.g. :func:`tf_dpnsgd.private_stats.release_channel_moments` of its input
  features: recorded here, it is in every later report of the private model
  (and of a model built around ``model``, e.g. :func:`tf_dpnsgd.models.views.multi_view`).
  """
  ledger = _ledger_for(model)
  _bind_ledger(model, ledger)
  return ledger


def _release_iterators(epoch_iterators) -> None:
  """Drops the data iterators of Keras' epoch iterators now.

  Keras keeps an epoch's generator and the ``tf.data`` iterator it holds in a
  reference cycle after ``fit``; freed at interpreter exit, the sampler's
  generator-backed iterator logs "Error occurred when finalizing
  GeneratorDataset iterator". ``reset()`` breaks the cycle, so they are freed
  here, while Python runs.
  """
  for iterator in epoch_iterators:
    reset = getattr(iterator, "reset", None)
    if callable(reset):
      reset()


def build_compiled_metrics(model, data) -> None:
  """Builds ``model``'s compiled metrics (Keras' ``metrics=``) from one batch's shapes.

  Without a ``tf.distribute`` strategy Keras builds them, creating their variables, while it
  traces the first train step, and a ``tf.function`` whose first trace creates variables is
  traced a second time: the whole DP step twice in every first ``fit`` (under a strategy
  Keras builds them before, from the first batch). Built here from the shapes and dtypes of
  ``(x, y)`` as symbolic tensors and the model's symbolic output: no value is read, nothing
  runs on the data. Anything unexpected (no labels, distributed values, a warning or an
  error from the symbolic pass) leaves them to Keras' build while tracing, as before.
  """
  compiled = getattr(model, "_compile_metrics", None)
  if compiled is None or compiled.built:
    return
  x, y, _ = keras.utils.unpack_x_y_sample_weight(data)
  if y is None:
    return

  def spec(t):
    if not (tf.is_tensor(t) or isinstance(t, np.ndarray)) or isinstance(t, tf.RaggedTensor):
      raise TypeError(f"not a dense tensor: {type(t).__name__}")
    return keras.KerasTensor((None,) + tuple(t.shape)[1:], dtype=tf.as_dtype(t.dtype).name)

  try:
    with warnings.catch_warnings():
      warnings.simplefilter("error")
      y_pred = model.compute_output_spec(tf.nest.map_structure(spec, x), training=False)
      compiled.build(tf.nest.map_structure(spec, y), y_pred)
  except Exception:  # pylint: disable=broad-except
    return  # Keras builds them while tracing (the step is then traced twice)


def _metrics_built_first(model, main):
  """Keras' train function ``main`` (called by the guard with the call's batches), building
  the compiled metrics before its first call traces the step (:func:`build_compiled_metrics`)."""
  def function(batches):
    build_compiled_metrics(model, batches[0])
    return main(batches)

  return function


def ensure_called(model) -> None:
  """Calls a built model that was never called (a wrapped model loaded from a ``.keras``
  file) once on symbolic inputs shaped as its saved ones.

  Keras' export (``model.export``, ``keras.export.ExportArchive``) and
  ``model.input_shape`` need a subclassed model that has been called. The input
  spec comes from the model's build shapes, else from the model it wraps (its
  ``inputs`` or build shapes). The call is symbolic: no data, no state change.
  """
  if getattr(model, "_called", True) or not model.built or _graph_inputs(model):
    return  # called, or not built, or a functional/Sequential model (its inputs are known)
  spec = saved_input_spec(model)
  if spec is not None:  # else Keras' own "never called" error follows
    model(spec, training=False)


def _graph_inputs(model):
  """A functional or Sequential model's input tensors (None for a subclassed model)."""
  try:
    return model.inputs
  except (AttributeError, ValueError):
    return None


def saved_input_spec(model):
  """Fresh Keras tensors shaped as the inputs ``model`` (or the model it wraps) was
  built for; None if neither recorded them."""
  def from_shape(shape, dtype):
    if isinstance(shape, dict):
      return {k: from_shape(v, dtype) for k, v in shape.items()}
    if isinstance(shape, (list, tuple)) and shape and not all(
        d is None or isinstance(d, int) for d in shape):
      return type(shape)(from_shape(v, dtype) for v in shape)
    return keras.KerasTensor((None,) + tuple(shape)[1:], dtype=dtype)

  for candidate in (model, getattr(model, "model", None)):
    if not isinstance(candidate, keras.Model):
      continue
    shapes = getattr(candidate, "_build_shapes_dict", None) or {}
    if len(shapes) == 1 and next(iter(shapes.values())) is not None:
      return from_shape(next(iter(shapes.values())), candidate.input_dtype)
    inputs = _graph_inputs(candidate)
    if inputs:
      struct = getattr(candidate, "_inputs_struct", None)
      struct = struct if struct is not None else (inputs[0] if len(inputs) == 1 else inputs)
      return tf.nest.map_structure(lambda t: keras.KerasTensor(t.shape, dtype=t.dtype), struct)
  return None


class LastValue(keras.metrics.Metric):
  """A metric that reports the last value it was given (e.g. the current clip).

  Every replica reports the same value, so replicas are averaged.
  """

  def __init__(self, name="last_value", dtype="float32"):
    super().__init__(name=name, dtype=dtype)
    self._last = self.add_variable(shape=(), initializer="zeros", name="value",
                                   aggregation="mean")

  def update_state(self, value):
    self._last.assign(tf.cast(value, self.dtype))

  def result(self):
    return tf.identity(self._last)


class _DPTrainer:
  """Mixin holding the DP train step; used by :class:`DPModel` and the wrapper."""

  _dp_keys = ("per_example", "physical_batch_size", "num_microbatches",
              "trust_untagged_batches", "public_state", "privacy_plan", "keep_per_example_mib",
              "length_key")

  def _set_dp_options(self, per_example="auto", physical_batch_size=None, num_microbatches=None,
                      trust_untagged_batches=False, public_state=(), privacy_ledger=None,
                      privacy_plan=None, keep_per_example_mib=None, length_key=None):
    if length_key is not None and (not isinstance(length_key, str) or physical_batch_size is None):
      raise ValueError(
          f"`length_key` ({length_key!r}) names the padding mask in dict inputs (e.g. "
          "'padding_mask') and needs physical_batch_size: each physical chunk is cut to its "
          "own longest row (tf_dpnsgd.step.contributions).")
    self._dp_length_key = length_key
    if num_microbatches is not None and (
        isinstance(num_microbatches, bool) or not isinstance(num_microbatches, int)
        or num_microbatches < 1):
      raise ValueError(f"`num_microbatches` must be a positive integer or None; "
                       f"got {num_microbatches!r}.")
    if num_microbatches is not None and physical_batch_size is not None:
      raise ValueError("physical_batch_size cannot be combined with num_microbatches; "
                       "the microbatch is already the unit of computation.")
    self._dp_num_microbatches = num_microbatches
    if physical_batch_size is not None and (
        isinstance(physical_batch_size, bool) or not isinstance(physical_batch_size, int)
        or physical_batch_size < 1):
      raise ValueError(f"`physical_batch_size` must be a positive integer or None; "
                       f"got {physical_batch_size!r}.")
    self._dp_per_example = per_example_lib.validate_engine_name(per_example)
    self._dp_keep_mib = per_example_lib.validate_keep_mib(keep_per_example_mib)
    self._dp_physical_batch_size = physical_batch_size
    if not isinstance(trust_untagged_batches, bool):
      raise ValueError(f"`trust_untagged_batches` must be a bool; got "
                       f"{trust_untagged_batches!r}.")
    if isinstance(public_state, str) or not all(isinstance(n, str) for n in public_state):
      raise ValueError(f"`public_state` must be a list of layer names; got {public_state!r}.")
    self._dp_trust_untagged = trust_untagged_batches
    self._dp_public_state = tuple(public_state)
    if isinstance(privacy_plan, dict):
      privacy_plan = owned_plan_lib.plan_from_config(privacy_plan)
    self._dp_owned_plan = privacy_plan  # None, a PlanRequest (N from the first fit) or a plan
    self._dp_plan = privacy_plan if isinstance(privacy_plan, plan_lib.PrivacyPlan) else None
    self._dp_loss_fn = None
    self._dp_engine = None
    if privacy_ledger is not None:
      _attach_ledger(self, privacy_ledger)
    elif not isinstance(getattr(self, "privacy_ledger", None), ledger_lib.PrivacyLedger):
      # Saved with the weights by Keras' saving (an attribute it walks), NOT in
      # self.weights: get_weights/set_weights with a plain twin keep working.
      _attach_ledger(self, ledger_lib.PrivacyLedger())
    if ledger_lib.weights_owner(self.privacy_ledger) is None:
      ledger_lib.bind_weights_owner(self.privacy_ledger, self)
    if not hasattr(self, "_dp_guard"):
      object.__setattr__(self, "_dp_guard", guard_lib.GuardState())

  # --- the plan the model owns (make_private(model, target_epsilon=...)) ---------
  @property
  def privacy_plan(self):
    """The :class:`~tf_dpnsgd.plan.PrivacyPlan` this model trains under (None before the
    first ``fit`` fixed ``N``, or for a model without privacy keywords)."""
    return self._dp_plan

  def privacy_report(self):
    """The privacy report of the steps this model's ledger executed (its own plan)."""
    if self._dp_plan is None:
      raise ValueError("This model owns no resolved privacy plan: build it with "
                       "tf_dpnsgd.make_private(model, target_epsilon=..., delta=..., "
                       "batch_size=..., epochs=...) and fit it, or use plan.report(model).")
    return self._dp_plan.report(self)

  def extend_privacy_plan(self, *, target_epsilon=None, epochs=None, steps=None):
    """Lets a model whose plan has run train on: more steps at the same noise multiplier.

    The one way to go on after the budget stop (``PrivacyBudgetExceededError``):
    ``model.extend_privacy_plan(target_epsilon=6.0)`` (as many steps, whole epochs
    for a plan of epochs, as fit in epsilon 6) or ``(epochs=5)`` / ``(steps=...)``
    (the new total), then ``fit`` again. Totals count every step from the first;
    the steps taken and the new ones share the plan's noise multiplier, so
    ``privacy_report()`` stays exact. Saved with the model (``.keras``).

    Returns:
      The new :class:`~tf_dpnsgd.plan.PrivacyPlan` (see
      :meth:`~tf_dpnsgd.plan.PrivacyPlan.extended`).
    """
    return owned_plan_lib.extend(self, target_epsilon=target_epsilon, epochs=epochs,
                                 steps=steps)

  def _dp_resolve_plan(self, dataset_size: int):
    """The owned plan for ``dataset_size`` examples; gives its noise to the optimizer."""
    owned = self._dp_owned_plan
    if self._dp_plan is None:
      if owned.dataset_size not in (None, dataset_size):
        raise ValueError(f"The model's privacy plan is for N = {owned.dataset_size} examples, "
                         f"but fit got {dataset_size}.")
      self._dp_plan = owned.resolve(dataset_size, momentum=self._dp_workload_momentum())
    if self._dp_plan.dataset_size != dataset_size:
      raise ValueError(
          f"The model's privacy plan is for N = {self._dp_plan.dataset_size} examples, but "
          f"fit got {dataset_size}: one plan accounts for one data set (epsilon depends on N).")
    self._dp_give_plan_noise()
    return self._dp_plan

  def _dp_workload_momentum(self) -> float:
    """The compiled optimizer's :attr:`~tf_dpnsgd.PrivateOptimizer.workload_momentum`."""
    return getattr(getattr(self, "optimizer", None), "workload_momentum", 0.0)

  def _dp_give_plan_noise(self):
    if self._dp_plan is None or getattr(self, "optimizer", None) is None:
      return
    self.optimizer.take_noise_multiplier(self._dp_plan.training_noise_multiplier)
    if self._dp_plan.blt:  # correlated noise: the plan's BLT
      self.optimizer.take_blt_parameters(self._dp_plan.blt)
    elif self._dp_plan.bands > 1:  # correlated noise: the plan's banded strategy
      self.optimizer.take_plan_bands(self._dp_plan.num_steps, self._dp_plan.bands)
    if getattr(self.optimizer, "adopted_noise", False):  # a step traced before has none of it
      self.train_function = None
      self.optimizer.adopted_noise = False
    self._dp_plan.check_optimizer(self.optimizer)

  @property
  def _dp_rows_per_user(self):
    """``k`` when each unit is one user's rows (``privacy_unit='user'``), else None."""
    return owned_plan_lib.rows_per_user(getattr(self, "_dp_owned_plan", None))

  @property
  def trust_untagged_batches(self) -> bool:
    """Whether untagged batches from a user pipeline are accepted (an unverified assumption
    that the report lists); False: only sampler batches and in-memory arrays."""
    return self._dp_trust_untagged

  @property
  def public_state(self) -> tuple:
    """Layers whose data-derived state the user declared public (listed by the report)."""
    return self._dp_public_state

  def load_weights(self, filepath, *args, **kwargs):
    """As ``keras.Model.load_weights``. A file that holds this model's privacy ledger moves it
    (never below what its lineage executed); a file without one (a plain model's weights)
    is a warm start: the ledger keeps its history and names the file in ``not_covered``."""
    if not self.built:
      raise ValueError(
          f"Model '{self.name}' is not built yet, so there is nothing to load the weights "
          "into: call it on a batch first (model(x[:1])) or model.build(input_shape).")
    ledger = self.privacy_ledger
    object.__setattr__(ledger, "_loading_source", str(filepath))
    _build_correlated_optimizer(self)
    try:
      return super().load_weights(filepath, *args, **kwargs)
    finally:
      object.__setattr__(ledger, "_loading_source", None)

  def _trackable_children(self, save_type="checkpoint", **kwargs):
    children = super()._trackable_children(save_type, **kwargs)
    if save_type == "checkpoint":  # tf.train.Checkpoint carries the ledger too
      children = dict(children)
      children["privacy_ledger"] = self.privacy_ledger
    return children

  def _lookup_dependency(self, name, cached_dependencies=None):
    if name == "privacy_ledger":  # tf.train.Checkpoint restores into this model's ledger
      return self.privacy_ledger
    return super()._lookup_dependency(name, cached_dependencies)

  @property
  def physical_batch_size(self):
    return self._dp_physical_batch_size

  @property
  def per_example(self):
    return self._dp_per_example

  @property
  def num_microbatches(self):
    return self._dp_num_microbatches

  def _dp_config(self):
    return {"per_example": self._dp_per_example,
            "physical_batch_size": self._dp_physical_batch_size,
            "num_microbatches": self._dp_num_microbatches,
            "trust_untagged_batches": self._dp_trust_untagged,
            "public_state": list(self._dp_public_state),
            "privacy_plan": owned_plan_lib.plan_config(self._dp_plan or self._dp_owned_plan),
            "keep_per_example_mib": self._dp_keep_mib,
            "length_key": self._dp_length_key,
            # A keras-hub task's preprocessor (make_private keeps it): saved in the config, its
            # assets (a tokenizer's vocabulary) by Keras' attribute walk, so a reloaded model
            # trains on raw strings again.
            "preprocessor": _preprocessor_config(getattr(self, "_dp_preprocessor", None))}

  def _microbatches(self):
    """The model's ``num_microbatches``, else the optimizer's (deprecated keyword)."""
    if self._dp_num_microbatches is not None:
      return self._dp_num_microbatches
    return getattr(self.optimizer, "num_microbatches", None)

  # --- compile -------------------------------------------------------------
  def compile(self, optimizer=None, loss=None, loss_weights=None, metrics=None,
              jit_compile=False, loss_scale=None, **kwargs):
    """As ``keras.Model.compile``, but requires a DP optimizer and checks the model.

    ``jit_compile`` defaults to False (XLA's gain on the vectorized DP step is
    model dependent; pass True to try it).

    Mixed precision: Keras' dynamic loss scaling (``LossScaleOptimizer``,
    ``auto_scale_loss``) decides its scale and skips steps from the data, so it
    is refused; the engines use a FIXED ``loss_scale`` (a power of two; default
    ``2**7`` when a layer computes in float16, else 1) and unscale before the
    transform (:mod:`tf_dpnsgd.per_example.loss_scale`, ``docs/mixed_precision.md``).
    """
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
      raise ValueError(
          "DP training does not take a keras.optimizers.LossScaleOptimizer: its dynamic "
          "scale and skipped steps depend on the data (a privacy leak). Pass the DP "
          "optimizer itself; a fixed loss scale is applied under mixed_float16 "
          "(compile(loss_scale=...) to change it).")
    if kwargs.pop("auto_scale_loss", False):
      raise ValueError("`auto_scale_loss=True` (Keras' dynamic loss scaling) is not supported "
                       "by DP training; use the fixed `loss_scale` argument instead.")
    self._dp_loss_scale = (loss_scale_lib.default_loss_scale(self) if loss_scale is None
                           else loss_scale_lib.validate_loss_scale(loss_scale))
    optimizer = keras.optimizers.get(optimizer) if optimizer is not None else None
    if not isinstance(optimizer, PrivateOptimizer):
      raise TypeError(
          f"{type(self).__name__} needs a DP optimizer (tf_dpnsgd.DPNSGD, DPSGD, DPAdam or "
          f"DPNAdam); got {optimizer!r}. For non-private training use a plain keras.Model.")
    if kwargs.get("weighted_metrics"):
      raise ValueError("`weighted_metrics` is not supported: DP training takes no sample weights.")
    validate_layers(self)
    coverage.check_data_derived_state(self, self._dp_public_state)
    output_names = getattr(self, "output_names", None)
    self._dp_loss_fn = losses_lib.per_example_loss_fn(loss, loss_weights, output_names)
    if not hasattr(self, "_dp_norm_tracker"):
      self._dp_norm_tracker = keras.metrics.Mean(name="grad_norm")
      self._dp_clipped_tracker = keras.metrics.Mean(name="clipped_fraction")
      self._dp_nonfinite_tracker = keras.metrics.Sum(name="nonfinite_examples")
    if not hasattr(self, "_dp_clip_tracker"):
      self._dp_clip_tracker = LastValue(name="l2_norm_clip")
    super().compile(optimizer=optimizer, loss=loss, loss_weights=loss_weights, metrics=metrics,
                    jit_compile=jit_compile, auto_scale_loss=False, **kwargs)
    if loss_scale is not None:  # restored by compile_from_config
      self._compile_config.config["loss_scale"] = self._dp_loss_scale
    self._dp_engine = None  # chosen from the built layers (a subclassed model: at fit)
    self._dp_resolve_engine()
    self._dp_guard.probe_pending = True  # probe the next batch
    self._dp_guard.padding_probe_pending = True  # length_key: rows vs padding
    self._dp_guard.restored_compile = False  # the user's compile accepts what trains
    if self._dp_owned_plan is not None and self._dp_plan is None \
        and self._dp_owned_plan.dataset_size is not None:
      self._dp_plan = self._dp_owned_plan.resolve(self._dp_owned_plan.dataset_size,
                                                   momentum=self._dp_workload_momentum())
    self._dp_give_plan_noise()
    if self.optimizer.noise_multiplier is None and self._dp_owned_plan is None:
      self.optimizer._require_noise_multiplier()  # raises: say where sigma comes from

  def _dp_resolve_engine(self):
    if self._dp_engine is None and self.built:
      self._dp_engine = per_example_lib.resolve_engine(self, self._dp_per_example,
                                                       keep_mib=self._dp_keep_mib)
    return self._dp_engine

  @property
  def loss_scale(self) -> float:
    """The fixed loss scale of the DP step (1 unless a layer computes in float16)."""
    return getattr(self, "_dp_loss_scale", 1.0)

  def export(self, filepath, format="tf_saved_model", verbose=None,  # noqa: A002 (Keras')
             input_signature=None, **kwargs):
    """``keras.Model.export``, also for a wrapped private model just loaded from a
    ``.keras`` file: it is called once symbolically (:func:`ensure_called`) and, unless
    given, the input signature is that of its saved inputs."""
    ensure_called(self)
    if input_signature is None and not isinstance(self, DPModel):
      spec = saved_input_spec(self)
      if spec is not None:
        input_signature = [tf.nest.map_structure(
            lambda t: tf.TensorSpec(t.shape, t.dtype), spec)]
    return super().export(filepath, format=format, verbose=verbose,
                          input_signature=input_signature, **kwargs)

  def compile_from_config(self, config):
    """Restores ``compile`` (with its DP optimizer) when a saved model is loaded."""
    config = keras.saving.deserialize_keras_object(config)
    self.compile(**config)
    self._dp_guard.restored_compile = True  # guard: what trains must continue the ledger
    if self.built:
      self.optimizer.build(self.trainable_variables)

  # --- train step ----------------------------------------------------------
  def make_train_function(self, force=False):
    """Keras' train function; its first call after ``compile`` probes the batch for
    interacting examples before the step (:mod:`tf_dpnsgd.interaction`)."""
    if self.train_function is None or force:
      self._dp_resolve_engine()
      if self.built and self.optimizer is not None and not self.optimizer.built:
        # Create the optimizer's variables now, not inside the traced (maybe XLA) step.
        with self.distribute_strategy.scope():
          self.optimizer.build(self.trainable_variables)
      if distribution.is_multi_worker(self.distribute_strategy):
        _share_noise_key(self.optimizer, self.distribute_strategy)
        # The lineage keys the noise too: every worker takes worker 0's (a collective).
        self.privacy_ledger.adopt_lineage(
            distribution.broadcast_int(self.distribute_strategy, self.privacy_ledger.lineage))
      super().make_train_function(force=True)
      self.train_function = guard_lib.wrap(self, _metrics_built_first(self, self.train_function))
    return self.train_function

  def fit(self, *args, **kwargs):
    """``keras.Model.fit`` under the DP guard (see :mod:`tf_dpnsgd.guard`).

    In-memory arrays are batched by Keras (each example at most once per
    batch): their untagged batches are accepted and accounted as such. Any
    other source must be tagged by a sampler (``plan.dataset``) unless the
    model was built with ``trust_untagged_batches=True``. At the end (also
    after an error) the weights' fingerprint is recorded with the ledger
    (:mod:`tf_dpnsgd.lineage`) and the data iterators are released.

    The progress bar is :class:`tf_dpnsgd.callbacks.ProgressBar` (loss, metrics,
    epsilon; the diagnostics stay in ``history``) unless a ``ProgbarLogger`` is
    among the callbacks. A dataset is never shuffled by Keras (``shuffle=False``
    unless given: the sampler draws the batches).
    """
    bound = inspect.signature(keras.Model.fit).bind(self, *args, **kwargs)
    arguments = {k: v for k, v in bound.arguments.items() if k != "self"}
    if self._dp_owned_plan is not None:  # the model draws its own plan's batches
      arguments = owned_plan_lib.fit_arguments(self, arguments)
    x = arguments.get("x")
    if isinstance(x, (tf.data.Dataset, tf.distribute.DistributedDataset)):
      arguments.setdefault("shuffle", False)  # Keras ignores it for datasets (and warns)
    arguments["callbacks"] = callbacks_lib.with_progress_bar(arguments.get("callbacks"))
    guard = self._dp_guard
    coverage.check_data_derived_state(self, self._dp_public_state)  # adapted after compile?
    guard.batch_source = "arrays" if _is_in_memory(x) else "other"
    guard.fit_checks_pending = True
    self._note_fit_callbacks(arguments.get("callbacks"))
    object.__setattr__(self, "_dp_fit_iterators", [])
    try:
      return super().fit(**arguments)
    finally:
      guard.batch_source = None
      _release_iterators(self.__dict__.pop("_dp_fit_iterators", None) or [])
      self._record_lineage()

  def _note_fit_callbacks(self, callbacks) -> None:
    """Callbacks that steer training with unprivatized training metrics (early stopping or
    a learning-rate cut on the training loss) make the released model depend on them: the
    ledger records it (never cleared) and the report lists it as not covered."""
    steering = coverage.steering_callbacks(callbacks or [])
    if steering:
      self.privacy_ledger.add_flags(coverage.TRAINING_METRIC_CALLBACKS)
      logging.getLogger(__name__).warning(
          "tf_dpnsgd: %s read the unprivatized training loss/metrics and steer training; "
          "the privacy report lists this as not covered by epsilon. Monitor a validation "
          "metric on public or held-out data instead.", ", ".join(steering))

  def _record_lineage(self) -> None:
    ledger = self.privacy_ledger
    state = ledger.state()
    if state["steps"] == 0 and state["releases"] == 0:
      return
    lineage_lib.record_steps(state["lineage"], state["steps"],
                             releases=ledger_lib.release_list(state))
    lineage_lib.record_weights(lineage_lib.fingerprint(self.get_weights()), state)

  def _maybe_symbolic_build(self, iterator=None, data_batch=None):
    """Keras' build from a first batch, fed one replica's shard without the DP tags.

    Under a strategy Keras MEAN-reduces the replicas' first batch (which fails
    for the boolean ``dp_mask``, for integer tags and across workers) and builds
    the compiled loss and metrics with the batch's sample weights, which the DP
    step never passes them (:func:`tf_dpnsgd.ledger.parse_batch_weights`). The
    shapes and dtypes of one replica's ``(x, y)`` are all the build needs.
    """
    if iterator is not None and isinstance(self.__dict__.get("_dp_fit_iterators"), list):
      self._dp_fit_iterators.append(iterator)  # released when fit ends (_release_iterators)
    strategy = getattr(self, "_distribute_strategy", None)
    if strategy is not None and data_batch is None and iterator is not None:
      for _, _, it in iterator:
        data_batch = tf.nest.map_structure(
            lambda v: (strategy.experimental_local_results(v)[0]
                       if isinstance(v, tf.distribute.DistributedValues) else v), next(it))
        break
    if data_batch is not None:
      x, y, _ = keras.utils.unpack_x_y_sample_weight(data_batch)
      data_batch = (x, y)
    return super()._maybe_symbolic_build(iterator=None if data_batch is not None else iterator,
                                         data_batch=data_batch)

  def _contributions(self, x, y, mask, num_microbatches, transform=None):
    """Phase 1 of the step (:func:`tf_dpnsgd.step.contributions`)."""
    transform = self.optimizer.transform if transform is None else transform
    return step_lib.contributions(self, x, y, mask, num_microbatches, transform)

  def train_step(self, data):
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    mask, denominator, tags = ledger_lib.parse_batch_weights(sample_weight)
    # Phase 0 (check) ran on the host before this step (tf_dpnsgd.guard): the batch
    # continues the ledger, or the step never started.
    logs = self._private_step(x, y, mask, denominator, tags)
    return self._multi_worker_logs(logs)

  def _multi_worker_logs(self, logs):
    """Keras reduces the logs of a multi-worker step (train or test) with
    strategy.reduce(MEAN, axis=0), which needs rank >= 1: a [1] log becomes the
    scalar mean over replicas. Elsewhere the logs pass unchanged."""
    if not distribution.is_multi_worker(self.distribute_strategy):
      return logs
    return tf.nest.map_structure(
        lambda v: tf.reshape(v, [1]) if tf.is_tensor(v) and v.shape.rank == 0 else v, logs)

  def _private_step(self, x, y, mask, denominator, tags):
    """Phases 1-4 (:func:`tf_dpnsgd.step.dp_step`), then Keras' logs and metrics."""
    num_microbatches = self._microbatches()
    out, reg_loss = step_lib.dp_step(self, x, y, mask, denominator, tags, num_microbatches)
    self._update_dp_trackers(out, mask, reg_loss, num_microbatches)
    y_pred = out.y_pred
    if mask is not None:
      # Keras' compiled `metrics` ignore sample weights: drop the padded rows instead.
      x, y, y_pred = tf.nest.map_structure(
          lambda t: step_lib.gather_rows(t, tf.where(mask)[:, 0]), (x, y, y_pred))
    return self.compute_metrics(x, y, y_pred, sample_weight=None)

  def _update_dp_trackers(self, out, mask, reg_loss, num_microbatches):
    """Logging only (not privatized, like the training loss in tf-privacy/Opacus)."""
    losses = out.losses
    valid = tf.math.is_finite(losses)
    if mask is not None:
      valid = tf.logical_and(valid, mask)
    weights = tf.cast(valid, tf.float32)
    count = tf.reduce_sum(weights)
    mean_loss = tf.reduce_sum(tf.where(valid, losses, 0.0)) / tf.maximum(count, 1.0)
    self._loss_tracker.update_state(mean_loss + reg_loss, sample_weight=count)

    unit_valid = tf.math.is_finite(out.norms)
    unit_real = tf.ones_like(unit_valid) if mask is None else mask
    if out.unit_mask is not None:  # units of several rows (user-level): the slots' mask
      unit_real = out.unit_mask
    nonfinite = tf.logical_and(unit_real, tf.logical_not(unit_valid))
    self._dp_nonfinite_tracker.update_state(tf.reduce_sum(tf.cast(nonfinite, tf.float32)))
    ok = tf.logical_and(unit_real, unit_valid)
    ok_w = tf.cast(ok, tf.float32)
    self._dp_norm_tracker.update_state(tf.where(ok, out.norms, 0.0), sample_weight=ok_w)
    if isinstance(self.optimizer.transform, transforms.Clip):
      clipped = tf.cast(out.factors < 1.0, tf.float32)
      self._dp_clipped_tracker.update_state(clipped, sample_weight=ok_w)
      clip_tracker = getattr(self, "_dp_clip_tracker", None)
      if clip_tracker is not None:  # the clip after this step (= current_l2_norm_clip)
        clip_tracker.update_state(self.optimizer.current_l2_norm_clip)

  def test_step(self, data):
    """Keras' evaluation step, without the training-only DP diagnostics."""
    logs = super().test_step(data)
    hidden = {m.name for m in self._dp_trackers()}
    return self._multi_worker_logs({k: v for k, v in logs.items() if k not in hidden})

  _DP_TRACKER_NAMES = ("_dp_norm_tracker", "_dp_clipped_tracker", "_dp_nonfinite_tracker",
                       "_dp_clip_tracker")

  def _dp_trackers(self):
    return [m for m in (getattr(self, n, None) for n in self._DP_TRACKER_NAMES)
            if m is not None]

  @property
  def metrics(self):
    metrics = list(super().metrics)
    extra = [getattr(self, n, None) for n in self._DP_TRACKER_NAMES]
    metrics += [m for m in extra if m is not None and m not in metrics]
    optimizer = getattr(self, "optimizer", None)
    if not (isinstance(optimizer, PrivateOptimizer)
            and isinstance(optimizer.transform, transforms.Clip)):
      clip_only = (extra[1], extra[3])  # clipping stats and the clip only for Clip
      metrics = [m for m in metrics if all(m is not c for c in clip_only)]
    return metrics


@keras.saving.register_keras_serializable(package="tf_dpnsgd")
class DPModel(_DPTrainer, keras.Model):
  """A Keras functional model whose ``fit`` trains with differential privacy.

  Build it like ``keras.Model(inputs, outputs)``; compile it with a DP
  optimizer; ``fit`` then runs the DP train step (per-example gradients,
  transform, noise once per logical batch, update).

  Args:
    inputs, outputs, name: as the functional ``keras.Model``.
    per_example: engine for per-example gradients: ``"auto"`` (layer-wise when
      every trainable layer has a rule, else vectorized; logged),
      ``"layerwise"``, ``"two_pass"``, ``"vectorized"`` or ``"microbatch"``; see
      :mod:`tf_dpnsgd.per_example` and ``docs/per_example.md``.
    physical_batch_size: process each logical batch in chunks of at most this
      many examples (same result and privacy, less memory); noise is still
      added once per logical batch.
    num_microbatches: if set, the mean gradient of each of this many
      consecutive microbatches is the normalized/clipped unit
      (tensorflow-privacy's option); the denominator is the number of
      microbatches. Not with Poisson batches nor ``physical_batch_size``.
    keep_per_example_mib: memory (MiB, all layers together) the layer-wise
      engine may spend on per-example tensors held between its norms and its
      weighted sum: book-keeping's output gradients, then per-example weight
      gradients (faster for sequence models); ``per_example="auto"`` runs two
      passes (aimed at a plain step's memory; not there yet) where the output
      gradients alone exceed it, 0 always; default
      :data:`~tf_dpnsgd.per_example.factored.KEEP_BYTES` (see
      ``docs/per_example.md``, "Memory").

  Example::

      model = tf_dpnsgd.DPModel(inputs, outputs)
      model.compile(optimizer=tf_dpnsgd.DPNSGD(learning_rate=0.1, regularizer=0.01,
                                               noise_multiplier=1.2),
                    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
      model.fit(x, y, batch_size=256)
  """

  def __init__(self, *args, per_example="auto", physical_batch_size=None, num_microbatches=None,
               trust_untagged_batches=False, public_state=(), privacy_ledger=None, privacy_plan=None,
               keep_per_example_mib=None, length_key=None, **kwargs):
    super().__init__(*args, **kwargs)
    self._set_dp_options(per_example, physical_batch_size, num_microbatches,
                         trust_untagged_batches, public_state, privacy_ledger,
                         privacy_plan, keep_per_example_mib, length_key)

  def get_config(self):
    config = super().get_config()
    config.update(self._dp_config())
    return config

  @classmethod
  def from_config(cls, config, custom_objects=None):
    config = dict(config)
    options = {k: config.pop(k) for k in cls._dp_keys if k in config}
    preprocessor = config.pop("preprocessor", None)
    model = super().from_config(config, custom_objects=custom_objects)
    model._set_dp_options(**options)
    _keep_preprocessor(model, preprocessor, custom_objects)
    return model


@keras.saving.register_keras_serializable(package="tf_dpnsgd")
class PrivateModelWrapper(_DPTrainer, keras.Model):
  """DP training around a subclassed Keras model (made by :func:`make_private`)."""

  def __init__(self, model, per_example="auto", physical_batch_size=None, num_microbatches=None,
               trust_untagged_batches=False, public_state=(), privacy_ledger=None, privacy_plan=None,
               keep_per_example_mib=None, length_key=None, **kwargs):
    super().__init__(**kwargs)
    self.model = model
    if model.built:  # no weights of its own: built when the model it wraps is
      self.built = True
    self._set_dp_options(per_example, physical_batch_size, num_microbatches,
                         trust_untagged_batches, public_state, privacy_ledger,
                         privacy_plan, keep_per_example_mib, length_key)

  def call(self, inputs, training=None):
    return self.model(inputs, training=training)

  def load_weights(self, filepath, *args, **kwargs):
    """As :meth:`DPModel.load_weights`; also takes the weights file of the wrapped model
    itself (``base.save_weights``: its layout has no wrapper level), as a warm start."""
    try:
      return super().load_weights(filepath, *args, **kwargs)
    except ValueError:
      if (not self.built or not str(filepath).endswith(".weights.h5")
          or _file_has_ledger(filepath)):
        raise
    self.model.load_weights(filepath, *args, **kwargs)
    self.privacy_ledger.record_warm_start(str(filepath))
    return None

  def get_config(self):
    config = {"model": keras.saving.serialize_keras_object(self.model), "name": self.name}
    config.update(self._dp_config())
    return config

  @classmethod
  def from_config(cls, config, custom_objects=None):
    config = dict(config)
    preprocessor = config.pop("preprocessor", None)
    config["model"] = keras.saving.deserialize_keras_object(config["model"],
                                                          custom_objects=custom_objects)
    model = cls(**config)
    _keep_preprocessor(model, preprocessor, custom_objects)
    return model


def _preprocessor_config(preprocessor):
  return None if preprocessor is None else keras.saving.serialize_keras_object(preprocessor)


def _keep_preprocessor(private, config, custom_objects=None) -> None:
  """Sets the private model's task preprocessor (None: none), off Keras' layer tracking: it
  is not one of the model's layers (no weights to train, none in the weights file)."""
  preprocessor = (None if config is None else
                  keras.saving.deserialize_keras_object(config, custom_objects=custom_objects))
  object.__setattr__(private, "_dp_preprocessor", preprocessor)


def _build_correlated_optimizer(model) -> None:
  """Builds a compiled, unbuilt correlated-noise optimizer before ``load_weights``.

  Keras loads an optimizer's variables only if it has as many as the file (else it warns
  and skips them): a fresh model's optimizer is unbuilt, so the banded buffers
  (:mod:`tf_dpnsgd.correlated.noise`) saved with the ledger would be dropped and the
  reloaded model refused at its next step. Built here on the variables the train step
  builds it on (:meth:`_DPTrainer.make_train_function`), they load with the ledger.
  """
  optimizer = getattr(model, "optimizer", None)
  if (getattr(optimizer, "band_noise", None) is None or optimizer.built
      or not model.trainable_variables):
    return
  with model.distribute_strategy.scope():
    optimizer.build(model.trainable_variables)


def _file_has_ledger(filepath) -> bool:
  """Whether a ``.weights.h5`` file holds a privacy ledger anywhere."""
  import h5py  # pylint: disable=g-import-not-at-top
  found = []
  with h5py.File(filepath, "r") as f:
    f.visit(lambda name: found.append(name) if name.endswith("privacy_ledger") else None)
  return bool(found)


def make_private(model: keras.Model, per_example="auto", physical_batch_size=None,
                 num_microbatches=None, trust_untagged_batches=False, public_state=(), *,
                 target_epsilon=None, noise_multiplier=None, delta=None, batch_size=None,
                 epochs=None, steps=None, sampling=None, accountant=None,
                 dataset_size=None, plan=None, keep_per_example_mib=None,
                 length_key=None, noise=None, bands=None, blt_buffers=None,
                 pretrained=None, privacy_unit=None, user_key=None,
                 max_examples_per_user=None) -> keras.Model:
  """Returns a model that shares ``model``'s layers and weights and trains with DP.

  One call (:mod:`tf_dpnsgd.owned_plan`)::

      private = tf_dpnsgd.make_private(model, target_epsilon=4.0, delta=1e-5,
                                       batch_size=256, epochs=10)
      private.compile(optimizer=tf_dpnsgd.DPNSGD(learning_rate=0.1, regularizer=0.01),
                      loss=..., metrics=[...])
      private.fit(x, y, validation_data=(x_val, y_val))   # the plan's Poisson batches
      print(private.privacy_report().statement())

  Model kinds: a functional model (nested or not) becomes a :class:`DPModel`
  over the same graph; a ``Sequential`` or subclassed model is wrapped in a
  :class:`PrivateModelWrapper` (``type(private).__name__`` says which). Both
  keep the privacy ledger through ``save``/``load_model``,
  ``save_weights``/``load_weights``, ``tf.train.Checkpoint`` and
  ``BackupAndRestore`` (``tests/test_save_paths_matrix.py``). Training the
  result updates the original model's weights too.

  The privacy ledger stays with ``model``: calling ``make_private`` again on
  the same Keras model (e.g. fine-tuning the head, then all layers), or on a
  model built around it (a head inside ``views.multi_view``), continues it,
  including statistics released for it before (:func:`base_ledger`); weights
  this machine recorded with a ledger get it back even when reloaded without
  it (:mod:`tf_dpnsgd.lineage`); weights loaded later from a file without a
  ledger are a warm start the report names (``not_covered``).

  Args:
    trust_untagged_batches: accept untagged batches from a user pipeline
      (not from ``plan.dataset`` nor in-memory arrays); the report then lists
      the unverified assumption "each example at most once per batch and per
      epoch" as not covered.
    public_state: names of layers whose data-derived state (e.g. an adapted
      ``Normalization``) the user declares public; listed by the report.
    keep_per_example_mib: the layer-wise engine's memory budget for held
      per-example tensors, which also decides ``"auto"``'s book-keeping or
      two passes (see :class:`DPModel`).
    noise, bands, blt_buffers: ``noise="bandmf", bands=b`` (b >= 2) trains with
      correlated noise (banded matrix factorization, Choquette-Choo et al. 2023) under
      cyclic Poisson sampling: the plan's strategy is optimized for its steps and the
      optimizer's momentum and handed to the optimizer at ``compile``
      (``docs/correlated_noise.md``). ``noise="blt", bands=b, blt_buffers=d`` (default 2):
      BLT noise with ``d`` buffers under the same sampling (each example at most once every
      ``b`` steps), accounted without amplification (the plan's ``blt``, optimized the same
      way). ``noise="auto"`` (needs ``target_epsilon``; ``bands``: the most it may choose,
      default 32): independent noise or BandMF, whichever the plan's accounting and the
      strategies predict leaves less noise in the model (:mod:`tf_dpnsgd.noise_choice`),
      chosen when ``N`` is known. Default: independent noise.
    privacy_unit, user_key, max_examples_per_user: ``privacy_unit="user"`` makes a
      person the privacy unit (user-level DP, :mod:`tf_dpnsgd.users`,
      ``docs/user_level.md``): ``fit`` reads each row's user id from the column
      ``user_key`` of dict inputs (removed before the model sees them), the plan samples
      USERS by Poisson sampling (``batch_size`` users per batch on average,
      ``dataset_size`` the number of users), each sampled user contributes at most
      ``max_examples_per_user`` rows (a public hash order of the rows), its mean-loss
      gradient is normalized or clipped once, and the epsilon is for adding or removing
      one user. Default ``"example"``.
    length_key: text batches at their real length: the key of the padding mask
      in dict inputs (e.g. ``"padding_mask"`` of keras-hub encoders); with
      ``physical_batch_size``, each chunk is cut to its own longest row (the
      sum, the noise and the ledger are the logical batch's; exact when the
      model masks its padding: ``docs/per_example.md``).
    pretrained: where the starting weights came from when no ledger saw them: a string
      (a keras-hub preset, a local folder, a checkpoint) the report names as not covered;
      False declares a random initialisation; None names a keras-hub backbone's weights as
      of undeclared source (:func:`tf_dpnsgd.coverage.record_initial_weights`).
    target_epsilon / noise_multiplier, delta, batch_size, epochs / steps,
      sampling, accountant, dataset_size: the privacy plan the model owns
      (:class:`~tf_dpnsgd.plan.PrivacyPlan`'s arguments; ``sampling``
      defaults to ``"poisson"``, ``accountant`` to ``"rdp"``, ``dataset_size``
      to the number of examples of the first ``fit``). Or ``plan=`` a
      ``PrivacyPlan`` (then none of these). Without them the model owns no plan (the explicit
      path: ``plan.dataset``, ``plan.callbacks()``, ``plan.fit_kwargs``).

  Raises:
    ValueError: if the model contains a layer that breaks per-example privacy
      (e.g. BatchNormalization: use GroupNormalization).
  """
  validate_layers(model)
  if isinstance(model, _DPTrainer):
    raise ValueError(f"Model '{model.name}' is already private.")
  coverage.check_data_derived_state(model, public_state)
  try:
    inputs, outputs = model.input, model.output
  except (AttributeError, ValueError):
    inputs = outputs = None
  sampling, unit = owned_plan_lib.unit_keywords(privacy_unit, user_key, max_examples_per_user,
                                                sampling, per_example)
  auto_bands = owned_plan_lib.auto_max_bands(noise, bands, sampling)  # noise="auto": chosen at resolve
  if auto_bands:
    noise = bands = None
  sampling, bands, blt_buffers = owned_plan_lib.noise_mechanism(noise, bands, sampling,
                                                                blt_buffers)
  owned = owned_plan_lib.request_of(
      plan, target_epsilon=target_epsilon, noise_multiplier=noise_multiplier, delta=delta,
      batch_size=batch_size, epochs=epochs, steps=steps, sampling=sampling,
      accountant=accountant, dataset_size=dataset_size, bands=bands, blt_buffers=blt_buffers,
      auto_bands=auto_bands or None, **unit)
  ledger = _ledger_for(model)
  _bind_ledger(model, ledger)
  coverage.record_initial_weights(model, ledger, pretrained)
  options = dict(per_example=per_example, physical_batch_size=physical_batch_size,
                 num_microbatches=num_microbatches, trust_untagged_batches=trust_untagged_batches,
                 public_state=public_state, privacy_ledger=ledger, privacy_plan=owned,
                 keep_per_example_mib=keep_per_example_mib, length_key=length_key)
  if inputs is not None and outputs is not None:
    private = DPModel(inputs=inputs, outputs=outputs, name=model.name, **options)
  else:
    logging.getLogger(__name__).info("make_private: wrapping subclassed model %s", model.name)
    private = PrivateModelWrapper(model, name=f"private_{model.name}", **options)
  # A keras-hub task's preprocessor: the owned plan's fit applies it before the sampler
  # (owned_plan.preprocessed); off Keras' layer tracking, saved in the config (.keras).
  task = any(c.__module__.startswith("keras_hub") and c.__name__ == "Task"
             for c in type(model).__mro__)
  preprocessor = getattr(model, "preprocessor", None) if task else None
  object.__setattr__(private, "_dp_preprocessor", preprocessor)
  return private
