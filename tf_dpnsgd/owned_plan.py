"""The plan a private model owns: ``make_private(model, target_epsilon=...)``, then plain ``fit``.

With privacy keywords, :func:`tf_dpnsgd.make_private` returns a model that
owns its :class:`~tf_dpnsgd.plan.PrivacyPlan`, so the four links of the
explicit path (optimizer noise, sampler, callbacks, fit arguments) are made
by the package, not by hand:

* ``compile(optimizer=tf_dpnsgd.DPNSGD(learning_rate=..., regularizer=...))``
  takes the plan's noise multiplier when the optimizer has none; one that
  disagrees with the plan is an error;
* ``fit(x, y, validation_data=...)`` on in-memory arrays (or dicts of them)
  or on an UNBATCHED ``tf.data.Dataset`` of examples draws the plan's batches
  itself (Poisson by default, tagged for the privacy ledger), runs the plan's
  number of steps, shows ``epsilon`` in the progress bar and history and
  stops at the budget. A ``batch_size``/``epochs``/``steps_per_epoch`` that
  disagrees with the plan is an error; a batched dataset is refused unless it
  came from ``plan.dataset`` (the explicit path, passed through unchanged);
* ``model.privacy_report()`` is the report of what the ledger executed;
* ``model.extend_privacy_plan(target_epsilon=... or epochs=...)`` (totals,
  counted from the first step) lets a model whose plan has run train on at
  the same noise multiplier (:func:`extend`), also after ``load_model``.

``epochs`` are Keras epochs: ``epochs=3`` runs three epochs of
``plan.steps_per_epoch`` steps, and the epsilon is that of exactly those steps.

A :class:`~tf_dpnsgd.callbacks.PrivacyCallback` of the model's plan among
``fit``'s callbacks (``model.privacy_plan.callbacks(log_dir=..., state_path=...)``)
replaces the default one, if it stops at the budget too.

``N`` (the dataset size) is taken from the first ``fit`` unless given; the
noise multiplier is calibrated then (for ``target_epsilon``), and a later
``fit`` on a different number of examples is refused (the plan is for one
data set).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Optional

import numpy as np
import tensorflow as tf

from tf_dpnsgd import callbacks as callbacks_lib
from tf_dpnsgd import ledger as ledger_lib
from tf_dpnsgd import noise_choice
from tf_dpnsgd import plan as plan_lib
from tf_dpnsgd import users as users_lib
from tf_dpnsgd.correlated import blt as blt_lib


@dataclasses.dataclass(frozen=True)
class PlanRequest:
  """The privacy keywords of ``make_private`` before ``N`` is known (frozen, validated)."""

  delta: float
  batch_size: int
  target_epsilon: Optional[float] = None
  noise_multiplier: Optional[float] = None
  epochs: Optional[float] = None
  steps: Optional[int] = None
  sampling: str = "poisson"
  accountant: str = "rdp"
  dataset_size: Optional[int] = None
  bands: int = 1  # > 1: correlated noise (BandMF) with cyclic Poisson sampling
  blt_buffers: int = 0  # > 0: BLT noise with this many buffers, separation `bands`
  auto_bands: int = 0  # > 0: noise="auto", independent or BandMF with at most this many bands
  user_key: Optional[str] = None  # sampling="user_poisson": the user id column of x
  max_examples_per_user: Optional[int] = None  # sampling="user_poisson": k

  def __post_init__(self):
    users_lib.validate_plan(self.sampling, self.max_examples_per_user, self.user_key)
    if (self.target_epsilon is None) == (self.noise_multiplier is None):
      raise ValueError("make_private: give exactly one of `target_epsilon` and "
                       "`noise_multiplier`.")
    if (self.epochs is None) == (self.steps is None):
      raise ValueError("make_private: give exactly one of `epochs` and `steps`.")
    if self.auto_bands and (self.target_epsilon is None or self.sampling != "poisson"
                            or self.bands != 1 or self.blt_buffers):
      raise ValueError("make_private(noise='auto') chooses the sampling and the bands itself "
                       "and compares the mechanisms at one epsilon: give `target_epsilon`, "
                       "and no `noise_multiplier`, `sampling` or `blt_buffers`.")
    if self.dataset_size is not None:
      self.resolve(self.dataset_size)  # validates everything now

  def resolve(self, dataset_size: int, seed: Optional[int] = None,
              momentum: float = 0.0) -> plan_lib.PrivacyPlan:
    """The plan for ``dataset_size`` examples. BLT noise: the plan's BLT is optimized for its
    steps, its separation and ``momentum`` (the optimizer's; the strategy decides accuracy,
    the plan's accounting covers whichever it is)."""
    fields = dict(dataset_size=int(dataset_size), batch_size=self.batch_size,
                  sampling=self.sampling, delta=self.delta, steps=self.steps,
                  epochs=self.epochs, accountant=self.accountant, bands=self.bands, seed=seed,
                  user_key=self.user_key, max_examples_per_user=self.max_examples_per_user)
    if self.auto_bands:  # public settings only: a rerun (or a reload) chooses the same
      choice = noise_choice.choose_bands(
          dataset_size=int(dataset_size), batch_size=self.batch_size, delta=self.delta,
          target_epsilon=self.target_epsilon, epochs=self.epochs, steps=self.steps,
          accountant=self.accountant, momentum=float(momentum or 0.0),
          max_bands=int(self.auto_bands))
      logging.getLogger(__name__).info("%s", choice.describe())
      fields.update(sampling=choice.sampling, bands=choice.bands)
    blt = ()
    if self.blt_buffers:
      steps = plan_lib.PrivacyPlan(noise_multiplier=1.0, **fields).num_steps
      if steps < 2:
        raise ValueError(f"noise='blt' needs a plan of at least 2 steps; this one has {steps}.")
      blt = blt_lib.optimize_blt(steps, self.blt_buffers, self.bands, momentum).parameters()
    return plan_lib.PrivacyPlan(noise_multiplier=self.noise_multiplier,
                                target_epsilon=self.target_epsilon, blt=blt, **fields)

  def to_config(self) -> dict:
    return dataclasses.asdict(self)


NOISE_MECHANISMS = ("independent", "bandmf", "blt")


def auto_max_bands(noise, bands, sampling=None) -> int:
  """0 unless ``noise="auto"``; then the most bands it may choose (``bands``, default 32).

  >>> auto_max_bands("auto", None), auto_max_bands("auto", 8), auto_max_bands("bandmf", 8)
  (32, 8, 0)
  """
  if noise != "auto":
    return 0
  if sampling is not None:
    raise ValueError(f"make_private(noise='auto') chooses the sampling with the noise (Poisson "
                     f"for independent noise, cyclic Poisson for BandMF): drop "
                     f"`sampling={sampling!r}`.")
  if bands is None:
    return noise_choice.DEFAULT_MAX_BANDS
  if isinstance(bands, bool) or not isinstance(bands, int) or bands < 1:
    raise ValueError(f"noise='auto' takes `bands` as the most bands it may choose, an int "
                     f">= 1; got {bands!r}.")
  return bands


def noise_mechanism(noise, bands, sampling, blt_buffers=None):
  """``(sampling, bands, blt_buffers)`` of ``make_private``'s ``noise=``/``bands=``/
  ``blt_buffers=`` (None: unchanged).

  >>> noise_mechanism("bandmf", 4, None)
  ('cyclic_poisson', 4, None)
  >>> noise_mechanism("blt", 4, None)
  ('cyclic_poisson', 4, 2)
  >>> noise_mechanism(None, None, "poisson")
  ('poisson', None, None)
  """
  if noise is None or noise == "independent":
    if bands not in (None, 1):
      raise ValueError(f"`bands={bands!r}` needs noise='bandmf' or 'blt' (correlated noise).")
    if blt_buffers is not None:
      raise ValueError(f"`blt_buffers={blt_buffers!r}` needs noise='blt'.")
    return sampling, None, None
  if noise not in NOISE_MECHANISMS:
    raise ValueError(f"`noise` must be one of {NOISE_MECHANISMS}; got {noise!r}.")
  if noise == "bandmf" and blt_buffers is not None:
    raise ValueError(f"`blt_buffers={blt_buffers!r}` needs noise='blt', not 'bandmf'.")
  least = 2 if noise == "bandmf" else 1
  if isinstance(bands, bool) or not isinstance(bands, int) or bands < least:
    raise ValueError(
        f"noise={noise!r} needs an int `bands` >= {least} ("
        + ("bands=1 is independent noise" if noise == "bandmf" else
           "the separation b of an example's steps: cyclic Poisson sampling over b parts")
        + f"); got {bands!r}.")
  if sampling not in (None, "cyclic_poisson"):
    raise ValueError(f"noise={noise!r} is analysed under cyclic Poisson sampling (each example "
                     f"at most once every `bands` steps); got sampling={sampling!r}.")
  if noise == "bandmf":
    return "cyclic_poisson", bands, None
  buffers = 2 if blt_buffers is None else blt_buffers
  if isinstance(buffers, bool) or not isinstance(buffers, int) or buffers < 1:
    raise ValueError(f"noise='blt' needs an int `blt_buffers` >= 1; got {blt_buffers!r}.")
  return "cyclic_poisson", bands, buffers


def unit_keywords(privacy_unit, user_key, max_examples_per_user, sampling, per_example="auto"):
  """``(sampling, request keywords)`` of ``make_private``'s ``privacy_unit=``/``user_key=``/
  ``max_examples_per_user=`` (:mod:`tf_dpnsgd.users`).

  >>> unit_keywords(None, None, None, "uniform")
  ('uniform', {})
  >>> unit_keywords("user", "uid", 8, None)
  ('user_poisson', {'user_key': 'uid', 'max_examples_per_user': 8})
  """
  if privacy_unit in (None, "example"):
    if user_key is not None or max_examples_per_user is not None:
      raise ValueError("`user_key` and `max_examples_per_user` are user-level settings: add "
                       "privacy_unit='user'.")
    return sampling, {}
  if privacy_unit != "user":
    raise ValueError(f"`privacy_unit` must be one of {users_lib.PRIVACY_UNITS}; got "
                     f"{privacy_unit!r}.")
  if sampling not in (None, "poisson", users_lib.SAMPLING):
    raise ValueError(f"privacy_unit='user' samples users by Poisson sampling (q = "
                     f"batch_size / users); got sampling={sampling!r}. Drop `sampling`.")
  if user_key is None or max_examples_per_user is None:
    raise ValueError("privacy_unit='user' needs user_key=<the user id column of x> and "
                     "max_examples_per_user=k (the most rows of one user a step uses).")
  if per_example not in users_lib.UNIT_ENGINES:
    raise ValueError(f"privacy_unit='user' computes each user's gradient on the layer-wise "
                     f"engine (where every layer has a rule), the vectorized engine or the "
                     f"per-user loop; per_example={per_example!r} has no user-level form: "
                     f"use one of "
                     f"{users_lib.UNIT_ENGINES} ('auto' picks).")
  return users_lib.SAMPLING, {"user_key": user_key,
                              "max_examples_per_user": max_examples_per_user}


def rows_per_user(owned) -> Optional[int]:
  """``k`` of a user-level plan or request (None: example-level)."""
  if getattr(owned, "sampling", None) != users_lib.SAMPLING:
    return None
  return int(owned.max_examples_per_user)


def request_of(plan=None, **keywords):
  """``None`` (no privacy keywords), a :class:`PlanRequest` or the given ``PrivacyPlan``."""
  given = {k: v for k, v in keywords.items() if v is not None}
  if plan is not None:
    if given:
      raise ValueError(f"make_private: give `plan=` or the privacy keywords, not both "
                       f"(got plan and {sorted(given)}).")
    if not isinstance(plan, plan_lib.PrivacyPlan):
      raise TypeError(f"`plan` must be a tf_dpnsgd.PrivacyPlan; got {plan!r}.")
    return plan
  privacy = {k: v for k, v in given.items()
             if k not in ("sampling", "accountant", "bands", "blt_buffers", "auto_bands")}
  if not privacy:
    return None
  missing = [k for k in ("delta", "batch_size") if k not in given]
  if missing:
    raise ValueError(f"make_private: a private model's plan needs {missing} too (with "
                     f"{sorted(privacy)}).")
  return PlanRequest(**given)


def plan_from_config(config):
  if config is None:
    return None
  if "training_noise_multiplier" in config or "calibration_tolerance" in config:
    fields = {f.name for f in dataclasses.fields(plan_lib.PrivacyPlan)}
    return plan_lib.PrivacyPlan(**{k: v for k, v in config.items() if k in fields})
  return PlanRequest(**config)


def plan_config(owned) -> Optional[dict]:
  """What a saved model keeps of its plan: the public fields (never the sampler seed)."""
  if owned is None:
    return None
  if isinstance(owned, plan_lib.PrivacyPlan):
    return owned.public_dict()
  return owned.to_config()


# --- fit -----------------------------------------------------------------------------
def is_tagged_dataset(x) -> bool:
  """Whether ``x`` is a dataset of sampler batches (``plan.dataset``: the explicit path)."""
  if not isinstance(x, tf.data.Dataset):
    return False
  spec = x.element_spec
  return (isinstance(spec, tuple) and len(spec) == 3 and isinstance(spec[2], dict)
          and ledger_lib.DP_KIND_KEY in spec[2])


def _leading(structure) -> int:
  sizes = {int(np.shape(a)[0]) for a in tf.nest.flatten(structure)}
  if len(sizes) != 1:
    raise ValueError(f"All arrays must have the same number of examples; got {sorted(sizes)}.")
  return sizes.pop()


def examples_of(dataset: tf.data.Dataset):
  """``(x, y)`` NumPy structures of an UNBATCHED dataset of ``(x, y)`` examples.

  Raises:
    ValueError: a batched dataset (its leading dimension is unknown), or
      elements that are not ``(x, y)`` pairs.
  """
  spec = dataset.element_spec
  if not (isinstance(spec, tuple) and len(spec) == 2):
    raise ValueError("A private model's fit takes a dataset of (x, y) EXAMPLES; got elements "
                     f"{spec}.")
  if any(s.shape.rank and s.shape[0] is None for s in tf.nest.flatten(spec)):
    raise ValueError(
        "This dataset looks batched (its leading dimension is unknown): a private model draws "
        "its own batches (so that they are the ones the plan accounts for). Pass unbatched "
        "examples (dataset.unbatch()), the arrays, or batches from "
        "model.privacy_plan.dataset(x, y, model=model).")
  xs, ys = [], []
  for xb, yb in dataset.batch(8192).as_numpy_iterator():
    xs.append(xb)
    ys.append(yb)
  if not xs:
    raise ValueError("The dataset is empty.")
  join = lambda parts: tf.nest.map_structure(lambda *a: np.concatenate(a), *parts)  # noqa: E731
  return join(xs), join(ys)


def _split(structure, n_train):
  return (tf.nest.map_structure(lambda a: np.asarray(a)[:n_train], structure),
          tf.nest.map_structure(lambda a: np.asarray(a)[n_train:], structure))


def preprocessed(model, x, chunk: int = 1024):
  """``x`` through the private model's task preprocessor (a keras-hub task's
  ``preprocessor``, kept by ``make_private``), on the host, ``chunk`` rows at a time, BEFORE
  the sampler: the sampler's rows, tags and identities are then the model's inputs, one
  example per row. A keras-hub text preprocessor tokenizes each string alone and packs it
  to a fixed ``sequence_length``, so a row's output depends on that row only. Inputs that
  already hold the model's input names pass unchanged, as does everything when the model
  has no preprocessor."""
  preprocessor = getattr(model, "_dp_preprocessor", None)
  if preprocessor is None or x is None:
    return x
  try:
    inputs = model.input
  except (AttributeError, ValueError):  # a subclassed model
    inputs = None
  if isinstance(x, dict) and (not isinstance(inputs, dict) or set(inputs) <= set(x)):
    return x  # already the model's inputs
  rows = _leading(x)
  parts = []
  for start in range(0, rows, chunk):
    piece = tf.nest.map_structure(lambda a: np.asarray(a)[start:start + chunk], x)
    parts.append(tf.nest.map_structure(np.asarray, preprocessor(piece)))
  return tf.nest.map_structure(lambda *a: np.concatenate(a), *parts)


def fit_arguments(model, arguments: dict) -> dict:
  """The arguments of ``keras.Model.fit`` for a plain ``fit`` call of a plan-owning model.

  Args:
    model: a DP model that owns a plan (``model._dp_owned_plan``).
    arguments: the bound arguments of the user's ``fit`` call.

  Returns:
    The arguments to pass on (data from the plan's sampler, its callbacks and
    step counts), or ``arguments`` unchanged for batches from ``plan.dataset``.
  """
  args = dict(arguments)
  x, y = args.pop("x", None), args.pop("y", None)
  if is_tagged_dataset(x):
    return dict(arguments)
  if isinstance(x, tf.data.Dataset):
    if y is not None:
      raise ValueError("`y` must be None when `x` is a dataset of (x, y) examples.")
    x, y = examples_of(x)
  elif y is None:
    raise ValueError("A private model's fit needs the labels `y` (or a dataset of (x, y) "
                     "examples).")
  for name in ("sample_weight", "class_weight"):
    if args.get(name) is not None:
      raise ValueError(f"DP training does not take `{name}`: weights change each example's "
                       "contribution and hence the sensitivity. For a per-token padding mask "
                       "(a causal LM's `sample_weight`), mark the padded labels instead: "
                       "`y = np.where(sample_weight > 0, y, -1)` and compile with "
                       "`keras.losses.SparseCategoricalCrossentropy(from_logits=True, "
                       "ignore_class=-1)`; each sequence's loss is then the mean over its own "
                       "unpadded tokens (docs/text_library_path.md, 'Causal language models').")
  x = preprocessed(model, x)
  if args.get("validation_data") is not None:
    x_val, *rest = args["validation_data"]
    args["validation_data"] = (preprocessed(model, x_val), *rest)
  split = float(args.pop("validation_split", 0.0) or 0.0)
  user_key = getattr(model._dp_owned_plan, "user_key", None)
  if split and user_key is not None:
    raise ValueError("validation_split cuts rows, so one user's rows would land on both sides "
                     "(and the validation metrics would not be held out): give "
                     "validation_data=(x_val, y_val) of other users, without the user column.")
  if split:
    if args.get("validation_data") is not None:
      raise ValueError("Give `validation_split` or `validation_data`, not both.")
    n_train = int(_leading(x) * (1.0 - split))
    (x, x_val), (y, y_val) = _split(x, n_train), _split(y, n_train)
    args["validation_data"] = (x_val, y_val)
  if user_key is not None:  # user-level: the plan's N is the number of users
    units = users_lib.num_users(users_lib.split_user_column(x, user_key)[1])
  else:
    units = _leading(x)
  plan = model._dp_resolve_plan(units)
  _check_against_plan(plan, args, model)
  fit_kwargs = plan.fit_kwargs(model)
  user_callbacks = list(args.pop("callbacks", None) or [])
  for key in ("batch_size", "epochs", "steps_per_epoch", "initial_epoch", "shuffle"):
    args.pop(key, None)
  args.update(fit_kwargs)
  args["x"] = plan.dataset(x, y, model=model)
  args["shuffle"] = False  # the sampler draws the batches
  args["callbacks"] = callbacks_lib.with_progress_bar(
      ([] if _has_privacy_callback(user_callbacks, plan) else plan.callbacks()) + user_callbacks,
      total_steps=plan.num_steps)
  return args


def extend(model, *, target_epsilon=None, epochs=None, steps=None):
  """Replaces ``model``'s owned plan by :meth:`~tf_dpnsgd.plan.PrivacyPlan.extended`
  (same noise multiplier, more steps); returns the new plan.

  Raises:
    ValueError: the model owns no plan, or owns one whose data set size is not
      known yet (no ``fit`` ran: give ``make_private`` the budget you want).
  """
  if getattr(model, "_dp_owned_plan", None) is None:
    raise ValueError("This model owns no privacy plan to extend (made without privacy "
                     "keywords): on the explicit path use plan = plan.extended(...).")
  plan = model._dp_plan
  if plan is None:
    raise ValueError("The model's privacy plan has not run a step yet (its data set size is "
                     "fixed by the first fit): give make_private the budget you want instead.")
  new = plan.extended(target_epsilon=target_epsilon, epochs=epochs, steps=steps)
  model._dp_owned_plan = model._dp_plan = new
  return new


def _has_privacy_callback(callbacks, plan) -> bool:
  """Whether ``callbacks`` hold a budget-stopping PrivacyCallback of ``plan`` (e.g.
  ``plan.callbacks(log_dir=..., state_path=...)``): it replaces the default one."""
  return any(isinstance(c, callbacks_lib.PrivacyCallback) and c.plan == plan
             and c.epsilon_budget is not None for c in callbacks)


def _check_against_plan(plan, args, model) -> None:
  batch_size = args.get("batch_size")
  if batch_size is not None and int(batch_size) != plan.batch_size:
    raise ValueError(
        f"fit(batch_size={batch_size}) but the model's privacy plan draws batches of "
        f"{plan.batch_size} (expected size under Poisson sampling): omit batch_size, or "
        f"make_private(..., batch_size={batch_size}) (the epsilon depends on it).")
  epochs = args.get("epochs")  # only the arguments the user passed are bound
  if epochs is not None:
    planned = plan.epochs
    if planned is None:
      raise ValueError(f"fit(epochs={epochs}) but the model's privacy plan fixes the number "
                       f"of steps ({plan.num_steps}): omit epochs (to train longer: "
                       "model.extend_privacy_plan(steps=...) or (target_epsilon=...)).")
    if not math.isclose(float(epochs), float(planned)):
      raise ValueError(
          f"fit(epochs={epochs}) but the model's privacy plan runs {planned:g} epochs (its "
          f"epsilon is for {plan.num_steps} steps): omit epochs. To train longer, extend the "
          "plan first: model.extend_privacy_plan(epochs=<total, counted from the first "
          "step>) or (target_epsilon=...).")
  steps = args.get("steps_per_epoch")
  if steps is not None and int(steps) != plan.steps_per_epoch:
    raise ValueError(f"fit(steps_per_epoch={steps}) disagrees with the privacy plan "
                     f"({plan.steps_per_epoch} steps per epoch): omit it.")
  initial = args.get("initial_epoch")
  if initial not in (None, 0) and initial != plan.fit_kwargs(model)["initial_epoch"]:
    raise ValueError("fit(initial_epoch=...) is set by the privacy ledger: omit it.")


__all__ = ["PlanRequest", "examples_of", "extend", "fit_arguments", "is_tagged_dataset", "plan_config",
           "plan_from_config", "request_of"]
