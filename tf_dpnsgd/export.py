"""Export trained classifiers as TF SavedModels for serving, and write privacy reports.

The exports take what a user has (raw pixels, raw sentences): normalization
or tokenization happens inside. Signature ``serving_default`` returns
``logits``, ``probabilities`` (softmax) and ``class_ids`` (argmax, int64).

Formal guarantee: an export holds only the model's weights, never the
optimizer state nor any RNG state. (The DP noise key itself is never a
variable anywhere, see :mod:`tf_dpnsgd.noise`; the check below also refuses the
variable names ``dp_noise_seed``/``dp_noise_draws`` that older versions kept in
the optimizer.) Nor are the Keras ``SeedGenerator`` states
of Dropout / RandomFlip / ... layers (derived from the run's seed; serving
runs with ``training=False`` and never reads them). Each export is checked
after writing (:func:`check_no_optimizer_state`, :func:`check_no_rng_state`)
and deleted if a check fails. (The models are exported through ``keras.export.ExportArchive``,
which saves the variables the endpoints use; Keras checkpoints
``model.save(...)``, in contrast, do include the optimizer.)

Loading a text export needs the tokenizer ops of tensorflow-text:
``import tensorflow_text`` before ``tf.saved_model.load`` (or use
:func:`load_serving_fn`).
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import re
import shutil

import keras
import numpy as np
import tensorflow as tf

from tf_dpnsgd import records
from tf_dpnsgd import training
from tf_dpnsgd.data import cifar10

SIGNATURE = "serving_default"
SECRET_VARIABLE = re.compile(r"(^|/)dp_noise_(seed|draws)(:\d+)?$")
RNG_STATE_VARIABLE = re.compile(r"seed_generator")  # Keras SeedGenerator state paths
SECRET_FIELD = re.compile(r"(^|_)seed$")
PUBLIC_SEED_FIELDS = ("data_seed", "shuffle_seed", "init_seed", "split_seed", "augment_seed")
REPORT_FILE = "privacy_report.json"


# --- serving outputs -------------------------------------------------------
def classification_outputs(logits):
  """``{"logits", "probabilities", "class_ids"}`` from float logits ``[batch, classes]``."""
  logits = tf.cast(logits, tf.float32)
  return {"logits": logits, "probabilities": tf.nn.softmax(logits, axis=-1),
          "class_ids": tf.argmax(logits, axis=-1, output_type=tf.int64)}


def export_image_classifier(model, export_dir, mean, std, scale=255.0):
  """Exports ``model`` behind pixel normalization, as a SavedModel on raw pixels.

  Signatures: ``serving_default`` takes ``images`` float32 ``[None, H, W, C]``
  with raw values 0..``scale``; ``serving_uint8`` takes uint8 images.

  Args:
    model: a built Keras model (e.g. a trained ``DPModel``) mapping images
      normalized by :func:`tf_dpnsgd.data.cifar10.normalize` to logits.
    export_dir: SavedModel directory to create (must not exist).
    mean, std: the per-channel normalization used in training, in units of
      ``pixels / scale`` (e.g. ``cifar10.CIFAR10_MEAN``, ``cifar10.CIFAR10_STD``);
      both ``None`` if ``model`` already takes raw pixels (e.g. built with
      :func:`tf_dpnsgd.data.cifar10.with_normalization`).
    scale: raw value that maps to 1.0 (255 for 8-bit images).

  Returns:
    ``export_dir``.

  Raises:
    ValueError: ``model`` does not take images, or it already contains a
      ``PixelNormalization`` layer and ``mean``/``std`` are given (the pixels
      would be normalized twice).
  """
  training.ensure_called(model)  # a wrapped model just loaded from .keras
  spec = training.saved_input_spec(model)
  shape = tuple((spec.shape if isinstance(spec, keras.KerasTensor) else model.input_shape)[1:])
  if len(shape) != 3:
    raise ValueError(f"Model '{model.name}' takes {shape}; expected images [H, W, C].")
  if (mean is None) != (std is None):
    raise ValueError("Pass both `mean` and `std`, or neither (model takes raw pixels).")
  inner = [layer.name for layer in training.iter_layers(model)
           if isinstance(layer, cifar10.PixelNormalization)]
  if mean is not None and inner:
    raise ValueError(f"Model '{model.name}' already normalizes pixels (layer {inner[0]}); "
                     "pass mean=None, std=None.")
  normalization = None if mean is None else cifar10.PixelNormalization(
      mean, std, scale, name="pixel_normalization")

  def serve(images):
    x = images if normalization is None else normalization(images)
    return classification_outputs(model(x, training=False))

  def serve_uint8(images):
    return serve(tf.cast(images, tf.float32))

  _write(export_dir, model, [model], {
      SIGNATURE: (serve, tf.TensorSpec((None,) + shape, tf.float32, name="images")),
      "serving_uint8": (serve_uint8, tf.TensorSpec((None,) + shape, tf.uint8, name="images")),
  })
  return export_dir


def export_text_classifier(model, preprocessor, export_dir):
  """Exports ``preprocessor`` + ``model`` as one SavedModel on raw sentences.

  Signature ``serving_default`` takes ``sentences`` tf.string ``[None]``. The tokenizer
  runs TensorFlow Text ops: a fresh process must ``import tensorflow_text`` before
  ``tf.saved_model.load(export_dir)``.

  Args:
    model: the classifier on token dicts (from
      :func:`tf_dpnsgd.models.text.text_classifier`, possibly trained through
      ``make_private``).
    preprocessor: the matching keras-hub ``TextClassifierPreprocessor``.
    export_dir: SavedModel directory to create (must not exist).

  Returns:
    ``export_dir``.
  """
  preprocessor(tf.constant(["build"]))  # builds the tokenizer layers before tracking
  training.ensure_called(model)

  def serve(sentences):
    return classification_outputs(model(preprocessor(sentences), training=False))

  _write(export_dir, model, [model, preprocessor],
         {SIGNATURE: (serve, tf.TensorSpec([None], tf.string, name="sentences"))})
  return export_dir


def export_private(model, export_dir, *, plan=None, **report_fields):
  """Exports a ``make_private`` model for serving, with its ``privacy_report.json``.

  The library path's counterpart of the launchers' exports. What the serving signature
  ``serving_default`` takes:

  * a keras-hub task whose preprocessor ``make_private`` kept (a ``.keras`` round trip keeps
    it too): **raw strings** ``sentences`` tf.string ``[None]``, tokenized in the SavedModel
    (a fresh process must ``import tensorflow_text`` before ``tf.saved_model.load``);
  * any other functional model: its own inputs (a tensor or a dict of tensors, as
    ``model.inputs``).

  Outputs: ``{"logits", "probabilities", "class_ids"}`` for a classifier (outputs
  ``[batch, classes]``), else ``{"outputs"}`` (e.g. a causal LM's per-token logits).
  The file ``<export_dir>/privacy_report.json`` holds the claim of the steps the model's
  ledger executed, what the epsilon does not cover and ``report_fields`` (e.g.
  ``final_metrics={...}``, ``hyperparameters={...}``); the secret noise seed is neither in
  the SavedModel (checked) nor in the report.

  Args:
    model: a private model (:func:`tf_dpnsgd.make_private`), trained or not.
    export_dir: SavedModel directory to create (must not exist).
    plan: the :class:`~tf_dpnsgd.plan.PrivacyPlan` of the explicit path; default the plan
      the model owns.
    **report_fields: :class:`~tf_dpnsgd.records.RunRecord` fields for the report.

  Returns:
    ``export_dir``.
  """
  if not isinstance(model, training._DPTrainer):
    raise TypeError(f"export_private exports a private model (tf_dpnsgd.make_private); got "
                    f"{type(model).__name__}. For a model trained without privacy use "
                    "model.export(dir): it has no privacy report.")
  report = plan.report(model) if plan is not None else model.privacy_report()
  record = records.RunRecord.from_privacy_report(report, **report_fields)
  training.ensure_called(model)
  try:
    outputs = model.outputs
  except (AttributeError, ValueError):
    outputs = None
  if not outputs:
    raise ValueError(f"Model {model.name!r} has no symbolic inputs and outputs (a subclassed "
                     "model): export the model it wraps with export_image_classifier, "
                     "export_text_classifier or keras' model.export, then write the report "
                     "with write_privacy_report(dir, **RunRecord.from_privacy_report("
                     "model.privacy_report()).to_dict()).")
  classifier = len(outputs) == 1 and len(outputs[0].shape) == 2
  preprocessor = getattr(model, "_dp_preprocessor", None)

  def served(inputs):
    out = model(inputs, training=False)
    return classification_outputs(out) if classifier else {"outputs": out}

  if preprocessor is not None:
    preprocessor(tf.constant(["build"]))  # builds the tokenizer layers before tracking
    fn = lambda sentences: served(preprocessor(sentences))  # noqa: E731
    spec = tf.TensorSpec([None], tf.string, name="sentences")
    tracked = [model, preprocessor]
  else:
    fn = served
    spec = tf.nest.map_structure(lambda t: tf.TensorSpec(t.shape, t.dtype, name=t.name),
                                 model.input)
    tracked = [model]
  _write(export_dir, model, tracked, {SIGNATURE: (fn, spec)})
  write_privacy_report(export_dir, **record.to_dict())
  return export_dir


def _write(export_dir, model, tracked, endpoints):
  export_dir = os.fspath(export_dir)
  if os.path.exists(export_dir):
    raise FileExistsError(f"Export directory '{export_dir}' exists; choose a new one (an export "
                          "is never written over another).")
  archive = keras.export.ExportArchive()
  for resource in tracked:
    archive.track(resource)
  rng_state = rng_state_variables(*tracked)
  _untrack(archive, rng_state)
  for name, (fn, spec) in endpoints.items():
    archive.add_endpoint(name, fn, input_signature=[spec])
  archive.write_out(export_dir, verbose=False)
  try:
    check_no_optimizer_state(export_dir, getattr(model, "optimizer", None))
    check_no_rng_state(export_dir, rng_state)
  except Exception:
    shutil.rmtree(export_dir, ignore_errors=True)
    raise


# --- the RNG-state guarantee --------------------------------------------------
def rng_state_variables(*resources) -> list:
  """The Keras ``SeedGenerator`` state variables of ``resources`` and their sublayers
  (Dropout, RandomFlip, GaussianNoise, ...)."""
  out = []
  for resource in resources:
    if not isinstance(resource, keras.layers.Layer):
      continue
    for layer in resource._flatten_layers(include_self=True, recursive=True):
      for generator in getattr(layer, "_seed_generators", ()) or ():
        state = getattr(generator, "state", None)
        if state is not None and all(state is not v for v in out):
          out.append(state)
    for v in resource.variables:  # generators not registered with a layer
      if RNG_STATE_VARIABLE.search(v.path) and all(v is not w for w in out):
        out.append(v)
  return out


def _untrack(archive, variables) -> None:
  """Removes ``variables`` from the lists ``ExportArchive.track`` fills (they are
  saved only if an endpoint reads them, which :func:`check_no_rng_state` refuses)."""
  root = getattr(archive, "_tf_trackable", None)
  if root is None or not variables:
    return
  for attr in ("variables", "trainable_variables", "non_trainable_variables"):
    kept = [v for v in getattr(root, attr, []) if all(v is not w for w in variables)]
    setattr(root, attr, kept)


def check_no_rng_state(export_dir, rng_variables=()) -> None:
  """Raises ``RuntimeError`` if the SavedModel holds RNG state: a Keras
  ``SeedGenerator`` state (by name, or one of the paths of ``rng_variables``)."""
  paths = {v.path for v in rng_variables}
  leaked = sorted({name for name in exported_variable_names(export_dir)
                   if RNG_STATE_VARIABLE.search(name) or name.split(":")[0] in paths})
  if leaked:
    raise RuntimeError(
        f"The export '{export_dir}' contains RNG state {leaked} (seed-generator state of "
        "random layers, derived from the run's seed); an export holds weights only. Does a "
        "serving function call a random layer with training=True?")


# --- the optimizer-state guarantee --------------------------------------------
def exported_variable_names(export_dir) -> list[str]:
  """Names of all variables stored in a SavedModel (read from ``saved_model.pb``).

  Needs no custom ops (unlike ``tf.saved_model.load`` of a text export).
  """
  from tensorflow.core.protobuf import saved_model_pb2

  proto = saved_model_pb2.SavedModel()
  with open(os.path.join(os.fspath(export_dir), "saved_model.pb"), "rb") as f:
    proto.ParseFromString(f.read())
  return [node.variable.name for graph in proto.meta_graphs
          for node in graph.object_graph_def.nodes if node.HasField("variable")]


def check_no_optimizer_state(export_dir, optimizer=None):
  """Raises ``RuntimeError`` if the SavedModel holds optimizer state.

  Checks every stored variable name against the DP noise state
  (``dp_noise_seed``, ``dp_noise_draws``) and, if ``optimizer`` is given,
  against the paths of all its variables.

  Args:
    export_dir: a SavedModel directory.
    optimizer: the training optimizer, or ``None``.
  """
  forbidden = set()
  if optimizer is not None:
    forbidden = {v.path for v in optimizer.variables}
  leaked = sorted({name for name in exported_variable_names(export_dir)
                   if SECRET_VARIABLE.search(name) or name.split(":")[0] in forbidden})
  if leaked:
    raise RuntimeError(
        f"The export '{export_dir}' contains optimizer state {leaked}; it must never be "
        "released (the DP noise seed lets anyone remove the noise). Export with "
        "tf_dpnsgd.export.export_*_classifier, not model.save().")


def serving_accuracy(export_dir, inputs, labels, *, input_name, signature=SIGNATURE,
                     dtype=None, batch_size=250) -> float:
  """Accuracy of an export's ``class_ids`` on raw ``inputs`` (images or sentences), in batches.

  Args:
    export_dir: the SavedModel.
    inputs: an array of raw images or a list of sentences.
    labels: the true classes.
    input_name: the signature's argument (``"images"``, ``"sentences"``).
    signature: which signature to call (e.g. ``"serving_uint8"``).
    dtype: the input tensors' dtype (``None``: inferred).
    batch_size: rows per call.
  """
  serve = load_serving_fn(export_dir, signature)
  labels = np.asarray(labels)
  correct = 0
  for i in range(0, len(labels), batch_size):
    batch = tf.constant(inputs[i:i + batch_size], dtype)
    ids = np.asarray(serve(**{input_name: batch})["class_ids"]).reshape(-1)
    correct += int(np.sum(ids == labels[i:i + batch_size]))
  return correct / len(labels)


def load_serving_fn(export_dir, signature=SIGNATURE):
  """Loads a SavedModel signature, importing tensorflow-text first if installed.

  Returns:
    The concrete function; call it with keyword arguments (``images=...`` or
    ``sentences=...``).
  """
  try:
    import tensorflow_text  # noqa: F401  registers the tokenizer ops
  except ImportError:
    pass
  return tf.saved_model.load(os.fspath(export_dir)).signatures[signature]


# --- privacy report ---------------------------------------------------------------
def package_versions() -> dict:
  """Versions of python, tf_dpnsgd and the packages a result depends on (if installed)."""
  import tf_dpnsgd

  versions = {"python": platform.python_version(), "tf_dpnsgd": tf_dpnsgd.__version__,
              "tensorflow": tf.__version__, "keras": keras.__version__}
  for key, dist in (("dp_accounting", "dp-accounting"), ("keras_hub", "keras-hub"),
                    ("tensorflow_datasets", "tensorflow-datasets")):
    try:
      versions[key] = importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
      pass
  return versions


def _reject_secret(key, where):
  if SECRET_FIELD.search(key.lower()) and key.lower() not in PUBLIC_SEED_FIELDS:
    raise ValueError(
        f"Report field {where} looks like a seed. The DP noise seed must never be released; "
        f"name a public seed as one of {PUBLIC_SEED_FIELDS} if you mean one of those.")


def write_privacy_report(path, **fields):
  """Writes ``privacy_report.json``: the given fields plus package versions.

  Args:
    path: the JSON file, or an existing directory (the file is then
      ``<path>/privacy_report.json``).
    **fields: JSON-able values (numpy and tf scalars/arrays are converted;
      inf/nan are written as strings), e.g. ``epsilon=``, ``delta=``,
      ``noise_multiplier=``, ``sampling=``, ``steps=``, ``accountant=``.
      A field (or nested key) named ``seed`` or ``*_seed`` other than
      :data:`PUBLIC_SEED_FIELDS` is refused: the noise seed is secret. A report
      with an ``epsilon`` must carry ``not_covered`` (a list; empty when nothing
      is known, see :mod:`tf_dpnsgd.coverage`): an epsilon published without
      what it does not cover is refused.

  Returns:
    The path written.
  """
  path = os.fspath(path)
  if os.path.isdir(path):
    path = os.path.join(path, REPORT_FILE)
  if "versions" in fields:
    raise ValueError("`versions` is filled in by write_privacy_report; do not pass it.")
  if fields.get("epsilon") is not None and "not_covered" not in fields:
    raise ValueError(
        "A privacy report with an epsilon must say what the epsilon does not cover: pass "
        "not_covered=... (PrivacyReport.not_covered or RunRecord.not_covered, from "
        "plan.report(model); an empty list says nothing is known). Writing "
        "RunRecord.to_dict() does this.")
  if isinstance(fields.get("not_covered"), str):
    raise TypeError("`not_covered` must be a list of sentences, not one string.")
  report = records.json_ready(dict(fields), "report", check_key=_reject_secret)
  report["versions"] = package_versions()
  parent = os.path.dirname(path)
  if parent:
    os.makedirs(parent, exist_ok=True)
  with open(path, "w", encoding="utf-8") as f:
    json.dump(report, f, indent=2, sort_keys=True)
    f.write("\n")
  return path


__all__ = ["check_no_optimizer_state", "check_no_rng_state", "classification_outputs",
           "export_image_classifier", "export_private", "rng_state_variables",
           "export_text_classifier", "exported_variable_names", "load_serving_fn",
           "package_versions", "serving_accuracy", "write_privacy_report"]
