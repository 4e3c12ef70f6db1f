"""What the Gaussian mechanism does not cover: the report's ``not_covered`` field.

This module is long (about 500 lines, half of it docstrings): each rule of what counts
as uncovered (layer state, callbacks, ledger flags) is stated beside its code.

An epsilon is a statement about the noised gradient sums and nothing else. A
released model can also depend on the training data through other paths: a
``Normalization`` layer adapted on the training set, a vocabulary, a learning
rate lowered when the (unprivatized) training loss stalled, batches whose
composition the package took on trust. This module finds those paths, so that
:meth:`tf_dpnsgd.plan.PrivacyPlan.report`, ``privacy_report.json`` and export
metadata can list them in a field of their own (``not_covered``), or so that
the run is refused. Everything here is a pure function of a model, a ledger
or a list of callbacks; nothing changes state.

=================================  ==================================================
function                           answers
=================================  ==================================================
:func:`data_derived_state`         which layers hold non-trainable state computed from
                                   data (adapted normalizers, vocabularies, bins, and
                                   any non-trainable variable of unknown origin)
:func:`check_data_derived_state`   refuses such layers unless declared public
:func:`steering_callbacks`         which callbacks read the unprivatized training
                                   loss/metrics and change training with it
:func:`flag_notes`                 the sentences of the ledger's coverage flags
:func:`not_covered`                everything above, for one model: the report field
=================================  ==================================================

Coverage flags (bits the privacy ledger persists, ``ledger.flags``):

========================== ==== ====================================================
flag                       bit  meaning
========================== ==== ====================================================
UNVERIFIED_BATCHES           1  the user opted in to untagged batches: the package
                                assumed each example at most once per batch and once
                                per epoch, and did not verify it
TRAINING_METRIC_CALLBACKS    2  a callback read the unprivatized training loss or
                                metrics and steered training (:func:`steering_callbacks`)
PUBLIC_STATE_DECLARED        4  reserved: the user declared data-dependent layer state
                                public (``make_private(..., public_state=[...])``)
WARM_START                   8  weights were loaded from a file without a privacy
                                ledger (``ledger.warm_start_source`` names it): assumed
                                public, not covered
========================== ==== ====================================================

Notes vs. not covered: a report's ``notes`` explain how the number was
computed (shuffling without amplification, a user-fixed noise seed, adaptive
clipping's split); ``not_covered`` lists what the released model depends on
OUTSIDE the mechanism (data-derived state, steering by training metrics) or
assumptions the package took on trust without verifying them. An empty
``not_covered`` means "nothing known", not "nothing": the package cannot see
weights copied by hand into the model, nor data used before ``make_private``
other than through the layer state checked here.
"""

from __future__ import annotations

from typing import Iterable, Optional, Sequence

import keras
import numpy as np

from tf_dpnsgd import ledger as ledger_lib

# --- ledger flags ----------------------------------------------------------------
UNVERIFIED_BATCHES = 1
TRAINING_METRIC_CALLBACKS = 2
PUBLIC_STATE_DECLARED = 4
WARM_START = 8

FLAG_NOTES = {
    UNVERIFIED_BATCHES: (
        "Unverified batches: the user opted in to batches without sampler tags; the "
        "package ASSUMED that each example appears at most once per batch and at most once "
        "per epoch and did not verify it. The epsilon holds only if that assumption does."),
    TRAINING_METRIC_CALLBACKS: (
        "Training steered by unprivatized metrics: a callback (e.g. ReduceLROnPlateau, "
        "EarlyStopping or ModelCheckpoint(save_best_only=True) monitoring the training loss "
        "or accuracy) read exact training-set metrics and changed the learning rate, the "
        "stopping step or the model kept; those decisions depend on the training data "
        "outside the Gaussian mechanism."),
    PUBLIC_STATE_DECLARED: (
        "Declared-public layer state: the user declared data-dependent layer state public "
        "(make_private(..., public_state=[...])); the package did not verify that it was "
        "computed from public data."),
    WARM_START: (
        "Warm start: weights were loaded from a file without a privacy ledger "
        "(load_weights of a plain model's checkpoint); the epsilon assumes those weights are "
        "public (e.g. pretrained on public data) and does not cover them. Weights trained on "
        "the private data without DP are NOT public."),
}
KNOWN_FLAGS = UNVERIFIED_BATCHES | TRAINING_METRIC_CALLBACKS | PUBLIC_STATE_DECLARED | WARM_START


def flag_notes(flags) -> list:
  """The sentences of the coverage flags set in ``flags`` (bit order).

  Args:
    flags: the ledger's ``flags`` (a non-negative int; numpy ints accepted).

  Returns:
    One sentence per set bit; bits this version does not know produce one
    sentence that names them (a newer package wrote them: the run must be treated
    as not covered until they are explained, never silently dropped).

  Raises:
    TypeError / ValueError: ``flags`` is not a non-negative integer.

  >>> flag_notes(0)
  []
  >>> [n.split(":")[0] for n in flag_notes(UNVERIFIED_BATCHES | 1024)]
  ['Unverified batches', 'Unknown coverage flags 0x400']
  """
  if isinstance(flags, bool) or not isinstance(flags, (int, np.integer)):
    raise TypeError(f"`flags` must be an int; got {flags!r}.")
  flags = int(flags)
  if flags < 0:
    raise ValueError(f"`flags` must be >= 0; got {flags}.")
  notes = [FLAG_NOTES[bit] for bit in sorted(FLAG_NOTES) if flags & bit]
  unknown = flags & ~KNOWN_FLAGS
  if unknown:
    notes.append(f"Unknown coverage flags {unknown:#x}: written by another version of "
                 "tf_dpnsgd; treat the run as not covered by the epsilon until they are "
                 "explained.")
  return notes


# --- callbacks that steer training with unprivatized metrics --------------------
# Logs keys that are public (computed from the ledger, the schedule or the privatized
# clip), so monitoring them does not read the training data.
PUBLIC_LOG_KEYS = ("epsilon", "learning_rate", "lr", "steps", "l2_norm_clip")
# Hooks that receive the TRAINING logs (loss and metrics on the training batches).
TRAINING_LOG_HOOKS = ("on_epoch_end", "on_train_batch_end", "on_batch_end", "on_train_end")
# A callback class (or instance) with this attribute set to True declares that it never
# changes training (learning rate, stopping, weights, which checkpoint is kept).
OBSERVES_ONLY_ATTRIBUTE = "dp_observes_only"


def is_training_metric(name: str) -> bool:
  """Whether a logs key is an unprivatized training-set quantity.

  ``val_*`` keys are computed on validation data, assumed outside the protected
  training set; :data:`PUBLIC_LOG_KEYS` are public. Everything else (``loss``,
  ``accuracy``, ``grad_norm``, ``clipped_fraction``, a custom metric) is a
  training metric.

  >>> [is_training_metric(k) for k in ("loss", "val_loss", "epsilon", "grad_norm")]
  [True, False, False, True]
  """
  name = str(name)
  return not (name.startswith("val_") or name in PUBLIC_LOG_KEYS)


def _observer_classes() -> tuple:
  """Callbacks that only record or display (they never change training)."""
  from tf_dpnsgd import callbacks as callbacks_lib  # function level: no import edge
  cb = keras.callbacks
  return (cb.History, cb.ProgbarLogger, cb.TensorBoard, cb.CSVLogger, cb.RemoteMonitor,
          cb.BackupAndRestore, cb.LearningRateScheduler, cb.SwapEMAWeights,
          callbacks_lib.PrivacyCallback)


def _overridden_hooks(callback, base) -> list:
  """The training-log hooks whose implementation on ``callback`` is not ``base``'s
  (subclass methods and instance attributes, e.g. ``LambdaCallback(on_epoch_end=f)``)."""
  out = []
  for hook in TRAINING_LOG_HOOKS:
    impl = getattr(callback, hook, None)
    func = getattr(impl, "__func__", impl)
    if func is not getattr(base, hook, None):
      out.append(hook)
  return out


def _flatten_callbacks(callbacks) -> list:
  if callbacks is None:
    return []
  if isinstance(callbacks, keras.callbacks.CallbackList):
    callbacks = callbacks.callbacks
  elif isinstance(callbacks, keras.callbacks.Callback):
    callbacks = [callbacks]
  out = []
  for cb in callbacks:
    out.extend(_flatten_callbacks(cb) if isinstance(cb, keras.callbacks.CallbackList) else [cb])
  return out


def steering_callbacks(callbacks) -> list:
  """Names of the callbacks that read unprivatized training metrics to steer the run.

  A callback steers the released model when its decision (learning rate,
  stopping step, which checkpoint is kept) depends on a training-set quantity
  that the Gaussian mechanism did not noise. The rule, in order:

  1. Marked ``dp_observes_only = True`` (class or instance): not steering (the
     owner vouches for it; the package's launchers mark their recorders).
  2. ``keras.callbacks.ModelCheckpoint`` / ``OrbaxCheckpoint``: steering only
     with ``save_best_only=True`` and a training-metric ``monitor``.
  3. Any other callback with a ``monitor`` (``EarlyStopping``,
     ``ReduceLROnPlateau``, Keras' ``MonitorCallback`` subclasses, a user class
     with a ``monitor`` string): steering when ``monitor`` is a training metric
     (:func:`is_training_metric`: not ``val_*``, not epsilon/learning rate).
  4. ``TerminateOnNaN``: steering (it stops on a NaN training loss).
  5. Known observers (``History``, ``ProgbarLogger``, ``TensorBoard``,
     ``CSVLogger``, ``RemoteMonitor``, ``BackupAndRestore``,
     ``LearningRateScheduler``, ``SwapEMAWeights``,
     :class:`~tf_dpnsgd.callbacks.PrivacyCallback`): not steering, unless a
     subclass overrides a hook that receives the training logs.
  6. Any other callback that implements a hook receiving the training logs
     (``on_epoch_end``, ``on_train_batch_end``, ``on_batch_end``,
     ``on_train_end``; ``LambdaCallback`` included): listed as unknown. The
     package cannot tell whether it only reads ``val_*`` keys, so it fails closed.

  Observers do not steer the released model, but what they write does leak:
  ``History``, ``CSVLogger``, ``TensorBoard``, ``RemoteMonitor``, the
  progress bar and the launchers' ``history.json`` hold the EXACT training loss
  and accuracy of every epoch. Those values are not covered by the epsilon;
  keep such logs private, or publish only validation/test metrics and epsilon.
  Not detected: a callback that reads ``model.metrics`` from another hook, and
  ``val_*`` metrics computed on training data (validation data is assumed to be
  outside the protected training set).

  Args:
    callbacks: a list of Keras callbacks (or a ``CallbackList``, or ``None``).

  Returns:
    One string per steering callback, e.g. ``"ReduceLROnPlateau(monitor='loss')"``.

  >>> steering_callbacks([keras.callbacks.EarlyStopping(monitor="loss"),
  ...                     keras.callbacks.EarlyStopping(monitor="val_loss")])
  ["EarlyStopping(monitor='loss')"]
  """
  observers = _observer_classes()
  out = []
  for cb in _flatten_callbacks(callbacks):
    if not isinstance(cb, keras.callbacks.Callback):
      raise TypeError(f"Expected Keras callbacks; got {cb!r}.")
    name = type(cb).__name__
    if getattr(cb, OBSERVES_ONLY_ATTRIBUTE, False) is True:
      continue
    monitor = getattr(cb, "monitor", None)
    if isinstance(monitor, str):  # EarlyStopping, ReduceLROnPlateau, ModelCheckpoint, ...
      checkpoint = isinstance(cb, (keras.callbacks.ModelCheckpoint,
                                   getattr(keras.callbacks, "OrbaxCheckpoint", ())))
      if checkpoint and not getattr(cb, "save_best_only", False):
        continue
      if is_training_metric(monitor):
        extra = "save_best_only=True, " if checkpoint else ""
        out.append(f"{name}({extra}monitor={monitor!r})")
      continue
    if isinstance(cb, keras.callbacks.TerminateOnNaN):
      out.append(f"{name} (stops training on a NaN training loss)")
      continue
    base = next((c for c in type(cb).__mro__ if c in observers), keras.callbacks.Callback)
    hooks = _overridden_hooks(cb, base)
    if hooks:
      out.append(f"{name} (a callback the package does not know, implementing "
                 f"{', '.join(hooks)}: it receives the unprivatized training logs; mark it "
                 f"`{OBSERVES_ONLY_ATTRIBUTE} = True` if it never changes training)")
  return out


# --- layer state derived from data ---------------------------------------------------
def _iter_layers(model) -> list:
  return list(model._flatten_layers(include_self=True, recursive=True))


def _own_state_variables(layer) -> list:
  """``layer``'s own non-trainable state: variables created with ``trainable=False``
  (not frozen weights, not sublayers', not Keras seed-generator state)."""
  seeds = {id(getattr(g, "state", None)) for g in getattr(layer, "_seed_generators", ()) or ()}
  weights = {id(v) for v in getattr(layer, "_trainable_variables", ())}
  return [v for v in getattr(layer, "_non_trainable_variables", ())
          if id(v) not in seeds and id(v) not in weights and "seed_generator" not in v.path]


def _normalization_reason(layer) -> Optional[str]:
  if getattr(layer, "input_mean", None) is not None:
    return None  # mean/variance given in the constructor: public constants
  if not layer.built:
    return None  # no state yet (adapt() builds it)
  mean = np.asarray(layer.adapt_mean.numpy())
  variance = np.asarray(layer.adapt_variance.numpy())
  if np.all(mean == 0) and np.all(variance == 1):
    return None  # the initial identity: data independent
  return ("keras.layers.Normalization whose mean/variance were not given in its "
          "constructor: they come from adapt() (or were loaded or assigned as weights), "
          "statistics of the data released unnoised in the model")


def _discretization_reason(layer) -> Optional[str]:
  if getattr(layer, "num_bins", None) is None or getattr(layer, "bin_boundaries", None) is None:
    return None  # boundaries from the constructor, or not adapted yet
  return (f"keras.layers.Discretization with {len(layer.bin_boundaries)} bin boundaries from "
          "adapt() (num_bins given, not bin_boundaries): quantiles of the data")


def _vocabulary_reason(layer, lookup) -> Optional[str]:
  """``lookup``: the IndexLookup holding the table (``layer`` itself, or a
  TextVectorization's inner lookup layer)."""
  if getattr(layer, "_has_input_vocabulary", False):
    return None  # vocabulary given in the constructor
  size = int(layer.vocabulary_size())
  start = getattr(lookup, "_token_start_index", None)
  special = int(start()) if callable(start) else 0
  if size <= special:
    return None  # only mask / OOV tokens: not adapted
  return (f"keras.layers.{type(layer).__name__} whose vocabulary ({size - special} tokens) "
          "came from adapt() or set_vocabulary(), not from its constructor: which tokens "
          "(and, with TF-IDF, how often) occur in the data")


def _known_state_reason(layer):
  """``(handled, reason)`` for the preprocessing layers whose state has known meaning."""
  layers = keras.layers
  if isinstance(layer, ledger_lib.PrivacyLedger):
    return True, None
  if isinstance(layer, layers.Normalization):
    return True, _normalization_reason(layer)
  if isinstance(layer, layers.Discretization):
    return True, _discretization_reason(layer)
  if isinstance(layer, layers.TextVectorization):
    return True, _vocabulary_reason(layer, getattr(layer, "_lookup_layer", None))
  if isinstance(layer, (layers.StringLookup, layers.IntegerLookup)):
    return True, _vocabulary_reason(layer, layer)
  return False, None


def data_derived_state(model) -> list:
  """Layers whose non-trainable state was (or may have been) derived from data.

  Rules (each layer of ``model``, nested ones included):

  =======================================  ==================================================
  layer                                    data-derived when
  =======================================  ==================================================
  ``Normalization``                        mean/variance not given in the constructor and
                                           not the initial (0, 1) (adapted, loaded, assigned)
  ``Discretization``                       ``num_bins`` given and boundaries present (adapt)
  ``StringLookup`` / ``IntegerLookup`` /   vocabulary not given in the constructor and
  ``TextVectorization``                    more than the mask/OOV tokens (adapt,
                                           ``set_vocabulary``)
  ``Hashing``, ``Rescaling``, ...          never (no state)
  the privacy ledger                       never (the package's own record)
  any other layer                          it owns a variable created with
                                           ``trainable=False`` (a running statistic, a
                                           counter, a buffer): origin unknown, so listed
  =======================================  ==================================================

  Not listed: Keras seed-generator state (random layers' RNG, never data), and
  frozen weights (``layer.trainable = False``: weights, not statistics; see
  :func:`frozen_layers`). The package cannot tell a constant a user assigned by
  hand from a statistic of the training set; it lists both (fail closed) and
  the user declares the public ones (:func:`check_data_derived_state`).

  Args:
    model: a Keras model or layer.

  Returns:
    ``[(layer_name, reason), ...]`` in layer order (a TextVectorization's inner
    lookup layer is reported as the TextVectorization).
  """
  if not isinstance(model, keras.layers.Layer):
    raise TypeError(f"`model` must be a Keras model or layer; got {model!r}.")
  out, skip = [], set()
  for layer in _iter_layers(model):
    if id(layer) in skip:
      continue
    if isinstance(layer, keras.layers.TextVectorization):
      skip.update(id(sub) for sub in layer._flatten_layers(include_self=False, recursive=True))
    handled, reason = _known_state_reason(layer)
    if not handled:
      state = _own_state_variables(layer)
      if state:
        reason = (f"{type(layer).__name__} owns non-trainable state "
                  f"{sorted(v.path for v in state)} that the optimizer does not train: "
                  "the package cannot tell whether it was computed from the training data")
    if reason:
      out.append((layer.name, reason))
  return out


def frozen_layers(model) -> list:
  """Full paths of the top-most layers holding frozen weights (``trainable=False``).

  A frozen layer's weights are not changed by the DP step; the epsilon assumes
  they are public (initialisation, or pretraining on public data). A frozen
  nested model is named once, not layer by layer. A layer whose own weights were
  frozen one by one (a LoRA-enabled ``Dense``: its base kernel) is named with them,
  and with those that still train: ``"path (frozen: kernel; trained: lora_kernel_a,
  lora_kernel_b)"``. What the step trains comes from ``model.trainable_variables``
  (the variables the DP step updates), not from ``layer.trainable``: keras-hub's
  ``backbone.enable_lora(rank)`` sets every layer ``trainable = False`` and leaves the
  LoRA factors trainable, so ``layer.trainable = False`` afterwards freezes nothing
  (freeze a layer's LoRA factors with ``for v in layer.weights: v.trainable = False``);
  such a layer is named with what still trains.
  """
  out = []
  trained = {id(v) for v in model.trainable_variables}

  def has_weights(layer):  # weights created trainable (frozen or not), here or below
    return any(getattr(sub, "_trainable_variables", ())
               for sub in layer._flatten_layers(include_self=True, recursive=True))

  def trains_below(layer):
    return any(id(v) in trained for v in layer.weights)

  def walk(layer):
    if not layer.trainable and has_weights(layer) and not trains_below(layer):
      out.append(layer.path)  # the whole layer (and everything below) is frozen
      return
    own = list(getattr(layer, "_trainable_variables", ()))
    frozen = [v.name for v in own if id(v) not in trained]
    if frozen and len(frozen) < len(own):  # some of its own weights were frozen one by one
      out.append(f"{layer.path} (frozen: {', '.join(frozen)}; trained: "
                 f"{', '.join(v.name for v in own if id(v) in trained)})")
    elif frozen:
      out.append(layer.path)
    for sub in layer._flatten_layers(include_self=False, recursive=False):
      walk(sub)

  for sub in model._flatten_layers(include_self=False, recursive=False):
    walk(sub)
  return out


#: A model (or a layer in it) may carry the source of its starting weights under this attribute
#: (``tf_dpnsgd.models.text_classifier`` sets the preset); ``make_private`` records it.
PRETRAINED_ATTRIBUTE = "dp_pretrained_source"


def pretrained_backbones(model) -> list:
  """``["KerasHubClass 'name'", ...]``: the keras-hub backbones inside ``model``, or, for a
  model built on a backbone's inputs and outputs (its layers inlined), its keras-hub layers
  with weights (their weights usually come from ``from_preset``, a file without a privacy
  ledger)."""
  layers = list(model._flatten_layers(include_self=True, recursive=True))
  hub = [layer for layer in layers if type(layer).__module__.startswith("keras_hub")]
  backbones = [f"{type(layer).__name__} '{layer.name}'" for layer in hub
               if type(layer).__name__.endswith("Backbone")]
  if backbones:
    return backbones
  weighted = [layer for layer in hub if layer.weights]
  if not weighted:
    return []
  return [f"{len(weighted)} keras-hub layers (e.g. {type(weighted[0]).__name__} "
          f"'{weighted[0].name}')"]


def record_initial_weights(model, ledger, pretrained=None) -> None:
  """Names, in the ledger, where the weights ``make_private`` starts from came from when
  the ledger did not see them (it has taken no step and names no file yet).

  Args:
    model: the Keras model being made private.
    ledger: its :class:`~tf_dpnsgd.ledger.PrivacyLedger`.
    pretrained: a string naming the source (a keras-hub preset, a local preset folder, a
      checkpoint): recorded as a warm start the report lists as not covered; ``False``: the
      user declares a random initialisation (nothing recorded); ``None`` (default): a model
      holding a keras-hub backbone is recorded as a warm start of undeclared source (its
      weights usually come from ``from_preset``), any other model as nothing.
  """
  if pretrained is not None and not isinstance(pretrained, (bool, str)) or pretrained is True:
    raise TypeError("`pretrained` must be a string naming the weights' source (a preset, a "
                    f"folder, a file), False (random initialisation) or None; got {pretrained!r}.")
  if ledger.steps or ledger.flags & WARM_START or pretrained is False:
    return
  if pretrained is None:  # a source the model declares (e.g. models.text_classifier's preset)
    declared = [getattr(layer, PRETRAINED_ATTRIBUTE) for layer
                in model._flatten_layers(include_self=True, recursive=True)
                if isinstance(getattr(layer, PRETRAINED_ATTRIBUTE, None), str)]
    pretrained = declared[0] if declared else None
  if isinstance(pretrained, str):
    ledger.record_warm_start(f"pretrained weights {pretrained!r} (declared at make_private)")
    return
  backbones = pretrained_backbones(model)
  if backbones:
    # The ledger keeps at most 256 bytes of the source: the backbone and what to do.
    ledger.record_warm_start(
        f"the initial weights of {', '.join(backbones)[:120]} (from_preset? undeclared: "
        "make_private(pretrained=...))")


def _validate_names(public_state) -> tuple:
  if public_state is None:
    return ()
  if isinstance(public_state, (str, bytes)) or not isinstance(public_state, Iterable):
    raise TypeError(f"`public_state` must be a list of layer names; got {public_state!r}.")
  names = tuple(dict.fromkeys(public_state))
  bad = [n for n in names if not isinstance(n, str) or not n]
  if bad:
    raise TypeError(f"`public_state` must hold layer names (strings); got {bad!r}.")
  return names


def check_data_derived_state(model, public_state: Sequence[str] = ()) -> tuple:
  """Refuses a model whose data-derived layer state is not declared public.

  Call at ``make_private`` / ``compile`` (and before each ``fit``): the state
  found by :func:`data_derived_state` is released unnoised in the model, so one
  example can move it arbitrarily (a crafted outlier moves an adapted mean by
  ``(outlier - x) / N``) whatever the reported epsilon.

  Args:
    model: the model to be trained privately.
    public_state: names of layers whose state the user declares computed from
      public data (``make_private(..., public_state=[...])``). The report lists
      them as declared public and unverified.

  Returns:
    The declared names (deduplicated, in order).

  Raises:
    ValueError: a data-derived layer that is not declared (the message names each
      one and what to do), or a declared name that is no layer of ``model``.
    TypeError: ``public_state`` is not a list of names (a bare string is refused).
  """
  declared = _validate_names(public_state)
  names = {layer.name for layer in _iter_layers(model)}
  unknown = [n for n in declared if n not in names]
  if unknown:
    raise ValueError(f"public_state names {unknown}, which are not layers of model "
                     f"'{model.name}'.")
  undeclared = [(n, r) for n, r in data_derived_state(model) if n not in declared]
  if undeclared:
    lines = "\n".join(f"  * layer '{n}': {r}" for n, r in undeclared)
    names_list = [n for n, _ in undeclared]
    raise ValueError(
        f"Model '{model.name}' holds layer state derived from data, which the Gaussian "
        "mechanism does not cover (one example can move it by any amount, whatever "
        f"the epsilon):\n{lines}\nEither build these layers from public data in their "
        "constructor (Normalization(mean=..., variance=...), StringLookup(vocabulary=...), "
        "TextVectorization(vocabulary=...), Discretization(bin_boundaries=...)), or, if "
        "their state WAS computed from public data, declare it: make_private(model, "
        f"public_state={names_list!r}); the privacy report then lists them as declared "
        "public and unverified.")
  return declared


# --- the report field ------------------------------------------------------------------
def not_covered(model) -> tuple:
  """Everything the released model depends on that the Gaussian mechanism does not cover.

  Lists, in this order: layers declared public (``model.public_state``; named,
  with their state's kind, "declared public, not verified"), data-derived
  layer state that was NOT declared (:func:`data_derived_state`; normally
  refused before training, listed here if it appeared later), frozen weights
  assumed public (:func:`frozen_layers`), and the ledger's coverage flags
  (:func:`flag_notes`). A user-fixed noise seed is a report note, not listed here.

  Args:
    model: a DP model, or its :class:`~tf_dpnsgd.ledger.PrivacyLedger` (then only
      the flags are known).

  Returns:
    A tuple of sentences; empty when nothing is known to be uncovered.
  """
  ledger = model if isinstance(model, ledger_lib.PrivacyLedger) else getattr(
      model, "privacy_ledger", None)
  flags = int(getattr(ledger, "flags", 0) or 0)
  items = []
  if flags & WARM_START:
    source = getattr(ledger, "warm_start_source", None) or "an unnamed file"
    items.append(FLAG_NOTES[WARM_START].replace(
        "were loaded from a file without", f"came from {source}, without", 1))
    flags &= ~WARM_START
  if isinstance(model, keras.layers.Layer):
    declared = _validate_names(getattr(model, "public_state", ()) or ())
    derived = dict(data_derived_state(model))
    for name in declared:
      kind = derived.get(name, "state the package does not recognise as data-derived")
      items.append(f"Layer '{name}': declared public by the user (public_state), not "
                   f"verified; the epsilon does not cover it ({kind}).")
    for name, reason in derived.items():
      if name not in declared:
        items.append(f"Layer '{name}': {reason}. Not declared public and not covered by "
                     "the epsilon: do not release this model as private.")
    frozen = frozen_layers(model)
    if frozen:
      variables = model.trainable_variables
      items.append(f"Frozen weights of layers {frozen}: not trained by the DP step (it "
                   f"trains {len(variables)} variables, "
                   f"{sum(int(np.prod(v.shape)) for v in variables):,} weights); the "
                   "epsilon assumes they are public (initialisation or pretraining on public "
                   "data), which the package cannot verify.")
    if declared:
      flags &= ~PUBLIC_STATE_DECLARED  # the layers are named above
  items.extend(flag_notes(flags))
  return tuple(items)


__all__ = ["FLAG_NOTES", "OBSERVES_ONLY_ATTRIBUTE", "PRETRAINED_ATTRIBUTE", "PUBLIC_LOG_KEYS",
           "PUBLIC_STATE_DECLARED",
           "TRAINING_LOG_HOOKS", "TRAINING_METRIC_CALLBACKS", "UNVERIFIED_BATCHES", "WARM_START",
           "check_data_derived_state", "data_derived_state", "flag_notes", "frozen_layers",
           "pretrained_backbones", "record_initial_weights",
           "is_training_metric", "not_covered", "steering_callbacks"]
