"""Canaries: training rows whose presence an auditor tries to detect.

Both kinds are ordinary rows of the training set: they are Poisson-sampled
like every other row and go through the compiled loss, the per-example
engine, the transform (clip / normalize) and the noise of the normal DP
train step. Nothing bypasses the mechanism under audit.

Coins. Each of the ``m`` canaries is included independently with
probability 1/2 (:func:`draw_inclusion`), the randomisation the one-run
theorem needs. Included canaries are appended to the real rows; the others
are never seen by training. The plan is built for the resulting ``N``
(real rows plus included canaries), so the sampling rate ``B / N`` differs
between neighbouring coin vectors by a relative ``1/N``; the claim audited is
the plan's (add/remove one row at rate ``B/N``).

Input-space canaries (black-box, :func:`mislabeled_canaries`): real-looking
examples (held-out real inputs) with a flipped label. The auditor scores the
final model's loss or logit margin on them (:mod:`tf_dpnsgd.audit.scoring`).

Gradient-space canaries (white-box, "Dirac" canaries,
:func:`with_dirac_canaries`): the audited model is the user's model plus a
canary head: an ``Embedding(m, 1)`` table ``E`` (zeros at start) and
:class:`DiracCanaryLogits`. Canary ``j`` is a row with inputs ``{features:
0, canary_id: j, canary_scale: A}`` and label ``target_class``; real rows
carry ``canary_scale = 0``. For a canary row the layer outputs the logits
``0 + e_t (s - stop_gradient(s))`` with ``s = A E[j]``: forward value 0
(uniform softmax over ``K`` classes, whatever the training did), gradient
``A (1/K - 1)`` with respect to ``E[j]`` and **exactly zero for every other
parameter**. Its per-example gradient is therefore a fixed direction
(``-e_j`` in the table) of known norm ``A (1 - 1/K)``, chosen far above the
sensitivity, so the transform maps it to exactly ``c`` (DP-SGD) or
``||g|| / (r + ||g||) ~ 1`` (DP-NSGD) along ``+e_j`` after the update: the
accountant's worst case, one coordinate per canary. Real rows have
``canary_scale = 0``: their gradient with respect to ``E`` is exactly 0 and
their logits are the user model's. The white-box score of canary ``j`` is
``E[j]`` after training minus before (the parameter change along the
canary's direction).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import keras
import numpy as np
from keras import ops

from tf_dpnsgd import noise as noise_lib

KINDS = ("input", "gradient")
FEATURES_KEY = "features"
CANARY_ID_KEY = "canary_id"
CANARY_SCALE_KEY = "canary_scale"
DIRAC_TABLE_NAME = "dirac_canaries"
# A canary's gradient norm, in units of the transform's sensitivity (far above 1, so
# DP-SGD clips it to exactly c and DP-NSGD's factor ||g|| / (r + ||g||) is ~1).
DEFAULT_GRADIENT_NORM_OVER_SENSITIVITY = 100.0


def draw_inclusion(num_canaries: int, seed: Optional[int] = None) -> np.ndarray:
  """``[m]`` booleans, each True independently with probability 1/2.

  ``seed=None`` draws the seed from the OS (real audits); tests pass a fixed seed.
  """
  if isinstance(num_canaries, bool) or not isinstance(num_canaries, (int, np.integer)) \
      or num_canaries < 1:
    raise ValueError(f"`num_canaries` must be a positive integer; got {num_canaries!r}.")
  seed = noise_lib.random_seed() if seed is None else int(seed)
  return np.random.default_rng([seed, 0xCA4A]).random(int(num_canaries)) < 0.5


@dataclasses.dataclass(frozen=True)
class Canaries:
  """``m`` canary rows and their coins.

  Attributes:
    kind: ``"input"`` or ``"gradient"``.
    x: the rows' inputs (an array, or a dict of arrays for gradient canaries).
    y: ``[m]`` int32 labels.
    included: ``[m]`` booleans (True: in the training set).
  """

  kind: str
  x: object
  y: np.ndarray
  included: np.ndarray

  def __post_init__(self):
    if self.kind not in KINDS:
      raise ValueError(f"`kind` must be one of {KINDS}; got {self.kind!r}.")
    m = len(self.y)
    if np.shape(self.included) != (m,):
      raise ValueError(f"`included` must have one coin per canary ({m}).")

  @property
  def num_canaries(self) -> int:
    return len(self.y)

  def rows(self, which=None):
    """``(x, y)`` of the canaries selected by the boolean ``which`` (default: the included)."""
    which = self.included if which is None else np.asarray(which, bool)
    return take_rows(self.x, which), self.y[which]


def take_rows(x, rows):
  """``x[rows]`` for an array or a dict of arrays (e.g. a text model's token ids and mask)."""
  if isinstance(x, dict):
    return {k: np.asarray(v)[rows] for k, v in x.items()}
  return np.asarray(x)[rows]


def _concat(a, b):
  if isinstance(a, dict):
    return {k: np.concatenate([np.asarray(a[k]), np.asarray(b[k])]) for k in a}
  return np.concatenate([np.asarray(a), np.asarray(b)])


def mislabeled_canaries(x_pool, y_pool, num_canaries: int, num_classes: int, included,
                        seed: Optional[int] = None) -> Canaries:
  """Input-space canaries: ``m`` distinct pool examples, each with a wrong label.

  Args:
    x_pool, y_pool: real examples not otherwise in the training set (``x_pool`` an
      array or a dict of arrays).
    num_canaries: ``m <= len(y_pool)``.
    num_classes: ``K``; the new label is uniform over the ``K - 1`` wrong ones.
    included: the coins (:func:`draw_inclusion`).
    seed: selection and label seed (``None``: from the OS).
  """
  y_pool = np.asarray(y_pool)
  if num_canaries > len(y_pool):
    raise ValueError(f"{num_canaries} canaries need as many pool examples; the pool has "
                     f"{len(y_pool)}.")
  seed = noise_lib.random_seed() if seed is None else int(seed)
  rng = np.random.default_rng([seed, 0x1AB])
  idx = np.sort(rng.choice(len(y_pool), num_canaries, replace=False))
  true = y_pool[idx].astype(np.int64)
  shift = rng.integers(1, num_classes, size=num_canaries)
  labels = ((true + shift) % num_classes).astype(np.int32)
  return Canaries("input", take_rows(x_pool, idx), labels, np.asarray(included, bool))


# --- gradient-space (Dirac) canaries ------------------------------------------------------
@keras.saving.register_keras_serializable(package="tf_dpnsgd")
class DiracCanaryLogits(keras.layers.Layer):
  """The canary head's output (variable-free; see the module docstring).

  ``call(logits, table_rows, scale)`` with ``logits [B, K]`` the user model's,
  ``table_rows [B, 1]`` the looked-up ``E[canary_id]`` and ``scale [B]``:

  * real rows (``scale == 0``): ``logits`` (the canary term is 0 and so is its gradient);
  * canary rows (``scale > 0``): ``e_t * (s - stop_gradient(s))``, ``s = scale * E[id]``:
    value 0, gradient ``dL/ds = p_t - 1 = 1/K - 1`` (softmax of zeros), and no
    gradient to the user model (its logits are replaced, not added to).
  """

  def __init__(self, target_class: int = 0, **kwargs):
    super().__init__(**kwargs)
    self.target_class = int(target_class)

  def call(self, logits, table_rows, scale):
    scale = ops.cast(scale, logits.dtype)
    is_canary = ops.expand_dims(scale > 0, -1)
    base = ops.where(is_canary, ops.zeros_like(logits), logits)
    s = ops.cast(table_rows[:, 0], logits.dtype) * scale
    bump = s - ops.stop_gradient(s)              # forward 0, derivative 1
    target = ops.one_hot(self.target_class, ops.shape(logits)[-1], dtype=logits.dtype)
    return base + ops.expand_dims(bump, -1) * target

  def compute_output_shape(self, logits_shape, table_rows_shape=None, scale_shape=None):
    return logits_shape

  def get_config(self):
    return {**super().get_config(), "target_class": self.target_class}


def with_dirac_canaries(model: keras.Model, num_canaries: int, target_class: int = 0,
                        name: Optional[str] = None) -> keras.Model:
  """The functional model ``{features, canary_id, canary_scale} -> logits`` auditing ``model``.

  ``model`` maps one input (``features``) to ``K`` logits. The result shares its
  layers and adds the canary table (:data:`DIRAC_TABLE_NAME`, ``Embedding(m, 1)``,
  zeros) and :class:`DiracCanaryLogits`. Use :func:`dirac_canaries` for the canary
  rows and :func:`as_dirac_inputs` for the real rows.
  """
  shape = tuple(model.inputs[0].shape[1:]) if getattr(model, "inputs", None) else None
  if shape is None:
    raise ValueError("with_dirac_canaries needs a built model with one input.")
  features = keras.Input(shape, name=FEATURES_KEY)
  canary_id = keras.Input((), dtype="int32", name=CANARY_ID_KEY)
  scale = keras.Input((), dtype="float32", name=CANARY_SCALE_KEY)
  logits = model(features)
  rows = keras.layers.Embedding(num_canaries, 1, embeddings_initializer="zeros",
                                name=DIRAC_TABLE_NAME)(canary_id)
  out = DiracCanaryLogits(target_class, name="dirac_canary_logits")(logits, rows, scale)
  return keras.Model({FEATURES_KEY: features, CANARY_ID_KEY: canary_id,
                      CANARY_SCALE_KEY: scale}, out, name=name or f"{model.name}_audited")


def dirac_scale(gradient_norm: float, num_classes: int) -> float:
  """The input ``A`` giving a canary gradient of norm ``A (1 - 1/K) = gradient_norm``."""
  if not gradient_norm > 0 or num_classes < 2:
    raise ValueError("Need gradient_norm > 0 and at least 2 classes.")
  return float(gradient_norm) / (1.0 - 1.0 / num_classes)


def as_dirac_inputs(x) -> dict:
  """Real rows for the audited model: ``canary_id = 0``, ``canary_scale = 0`` (no canary term)."""
  n = len(x)
  return {FEATURES_KEY: np.asarray(x, np.float32), CANARY_ID_KEY: np.zeros(n, np.int32),
          CANARY_SCALE_KEY: np.zeros(n, np.float32)}


def dirac_canaries(feature_shape, num_canaries: int, num_classes: int, included,
                   gradient_norm: float, target_class: int = 0) -> Canaries:
  """The ``m`` Dirac canary rows: zero features, id ``j``, scale ``A``, label ``target_class``.

  Args:
    feature_shape: the shape of one ``features`` row (the user model's input).
    num_canaries: ``m`` (the table size of :func:`with_dirac_canaries`).
    num_classes: ``K``.
    included: the coins.
    gradient_norm: each canary's per-example gradient norm (choose it far above the
      sensitivity, e.g. :data:`DEFAULT_GRADIENT_NORM_OVER_SENSITIVITY` times it).
    target_class: the label of every canary.
  """
  m = int(num_canaries)
  x = {FEATURES_KEY: np.zeros((m,) + tuple(feature_shape), np.float32),
       CANARY_ID_KEY: np.arange(m, dtype=np.int32),
       CANARY_SCALE_KEY: np.full(m, dirac_scale(gradient_norm, num_classes), np.float32)}
  return Canaries("gradient", x, np.full(m, target_class, np.int32), np.asarray(included, bool))


def dirac_table(model) -> np.ndarray:
  """``[m]`` the canary table ``E`` of a model built by :func:`with_dirac_canaries`."""
  for layer in model._flatten_layers(include_self=False, recursive=True):
    if layer.name == DIRAC_TABLE_NAME:
      return np.asarray(layer.embeddings.numpy()).reshape(-1)
  raise ValueError(f"{model.name} has no '{DIRAC_TABLE_NAME}' layer (build it with "
                   "with_dirac_canaries).")


def training_set(x_real, y_real, canaries: Canaries):
  """``(x, y)``: the real rows followed by the included canaries (``N = n + #included``)."""
  xc, yc = canaries.rows()
  if canaries.kind == "gradient" and not isinstance(x_real, dict):
    x_real = as_dirac_inputs(x_real)
  return _concat(x_real, xc), np.concatenate([np.asarray(y_real, np.int32), yc])


__all__ = ["CANARY_ID_KEY", "CANARY_SCALE_KEY", "Canaries",
           "DEFAULT_GRADIENT_NORM_OVER_SENSITIVITY", "DIRAC_TABLE_NAME", "DiracCanaryLogits",
           "FEATURES_KEY", "KINDS", "as_dirac_inputs", "dirac_canaries", "dirac_scale",
           "dirac_table", "draw_inclusion", "mislabeled_canaries", "take_rows", "training_set",
           "with_dirac_canaries"]
