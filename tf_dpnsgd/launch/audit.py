r"""Empirical privacy audit: train once with canaries, print the claimed epsilon and a lower bound.

  python -m tf_dpnsgd.launch.audit --flagfile=configs/audit/digits_gradient.cfg \
      --output_dir=runs/audit/digits
  python -m tf_dpnsgd.launch.audit --flagfile=configs/audit/mnist_gradient.cfg \
      --optimizer=dpsgd --target_epsilon=4 --output_dir=runs/audit/mnist_dpsgd_eps4

Trains an MLP on ``--dataset`` (``digits``: scikit-learn's, offline;
``mnist``: ``--data_path`` to a ``keras.datasets``-format ``mnist.npz``) with
``--num_canaries`` canaries inserted as ordinary rows, under the same
:class:`~tf_dpnsgd.plan.PrivacyPlan` as a normal run (Poisson sampling by
default), then audits the model (:func:`tf_dpnsgd.audit.run_canary_audit`):

* ``--canary_kind=gradient`` (white-box): Dirac canaries, each a row whose
  per-example gradient is one coordinate of a canary table, scored by the
  parameter change along it; the audit closest to the accountant's worst case.
* ``--canary_kind=input`` (black-box): held-out real images with flipped
  labels, scored by the final model's loss (``--score=loss``) or logit
  margin (``--score=margin``).

``--output_dir`` receives ``audit_report.json`` (``epsilon_claimed``,
``epsilon_lower_bound`` (Steinke et al.), ``epsilon_lower_bound_fdp`` (f-DP), the
auditor's ``canary_audit`` (GDP estimate, AUROC, TPR at low FPR), delta, confidence, m, k+, k-, correct guesses, the
canary kind, all scores, timings) and ``audit_scores.png`` (score histograms
of in vs. out canaries, both epsilons in the title). ``--noise_multiplier=0``
trains without noise (no claim: infinite epsilon), the sanity check that the
audit detects a non-private run.

The canaries' coins and the noise and sampler seeds come from the OS;
``--audit_seed`` fixes the coins for tests only. Exit status 1 with one line
on stderr for a flag error.
"""

from __future__ import annotations

import json
import os

from absl import app
from absl import flags

import keras  # noqa: E402
import numpy as np  # noqa: E402

import tf_dpnsgd  # noqa: E402
from tf_dpnsgd import audit  # noqa: E402
from tf_dpnsgd.audit import plots as audit_plots  # noqa: E402
from tf_dpnsgd.launch import validation  # noqa: E402

DATASETS = ("digits", "mnist")
OPTIMIZERS = ("dpnsgd", "dpsgd", "dpnadam", "dpadam")
REPORT_FILE = "audit_report.json"
FIGURE_FILE = "audit_scores.png"

flags.DEFINE_enum("dataset", "digits", DATASETS, "digits (offline, scikit-learn) or mnist.")
flags.DEFINE_string("data_path", None, "keras.datasets-format mnist.npz (--dataset=mnist).")
flags.DEFINE_integer("max_train_examples", None,
                     "Use the first N real training images (mnist; the rest feed input canaries).")
flags.DEFINE_integer("max_test_examples", None, "Evaluate on the first N test images only.")
flags.DEFINE_integer("num_canaries", 1000, "m: canaries, each included with probability 1/2.")
flags.DEFINE_enum("canary_kind", "gradient", audit.canaries.KINDS,
                  "gradient: white-box Dirac canaries; input: black-box mislabeled images.")
flags.DEFINE_enum("score", "loss", audit.scoring.SCORES,
                  "Black-box score of input canaries: -loss or logit margin.")
flags.DEFINE_enum("optimizer", "dpnsgd", OPTIMIZERS, "DP optimizer under audit.")
flags.DEFINE_float("learning_rate", 1.0, "Learning rate.")
flags.DEFINE_float("regularizer", 0.01, "DP-NSGD/DP-NAdam regularizer r > 0.")
flags.DEFINE_float("l2_norm_clip", 1.0, "DP-SGD/DP-Adam clipping norm c > 0.")
flags.DEFINE_float("momentum", 0.0, "SGD momentum (dpnsgd/dpsgd).")
flags.DEFINE_float("target_unclipped_quantile", None,
                   "dpsgd/dpadam: audit quantile-adaptive clipping (Andrew et al. 2021) with "
                   "this target quantile, starting from --l2_norm_clip; the claimed epsilon "
                   "covers the gradient and the count query (docs/adaptive_clipping.md).")
flags.DEFINE_float("clip_learning_rate", None, "Adaptive clipping: clip learning rate "
                   "(default 0.2).")
flags.DEFINE_float("clipped_count_stddev", None, "Adaptive clipping: noise std of the "
                   "unclipped count (default batch/20).")
flags.DEFINE_float("noise_multiplier", None,
                   "Noise std / sensitivity (0: no noise, no claim). Exclusive with "
                   "--target_epsilon.")
flags.DEFINE_float("target_epsilon", None, "Calibrate the noise to this epsilon. Exclusive "
                   "with --noise_multiplier.")
flags.DEFINE_float("delta", 1e-5, "Claimed delta (also the audit's null hypothesis).")
flags.DEFINE_integer("batch_size", 256, "Expected batch size (Poisson) / batch size.")
flags.DEFINE_float("epochs", 10.0, "Epochs: floor(epochs * round(N / B)) steps, N incl. canaries.")
flags.DEFINE_enum("sampling", "poisson", ("poisson", "uniform", "shuffle"), "Batch sampling.")
flags.DEFINE_enum("accountant", "rdp", ("rdp", "pld"), "dp-accounting accountant.")
flags.DEFINE_enum("conversion", "modern", ("modern", "classic"), "RDP -> (eps, delta).")
flags.DEFINE_float("confidence", 0.95, "Confidence of the lower bound.")
flags.DEFINE_integer("k_plus", None, "Fixed rule: guess 'in' for the top k+ scores (with "
                     "--k_minus); default: the fixed rule grid with a Bonferroni correction.")
flags.DEFINE_integer("k_minus", None, "Fixed rule: guess 'out' for the bottom k- scores.")
flags.DEFINE_float("gradient_norm", None,
                   "Dirac canaries' gradient norm (default 100 x the sensitivity).")
flags.DEFINE_integer("width", 128, "Hidden units of the MLP.")
flags.DEFINE_enum("per_example", "auto", tuple(tf_dpnsgd.per_example.ENGINE_NAMES),
                  "Per-example gradient engine.")
flags.DEFINE_integer("physical_batch_size", None, "Process batches in chunks (memory).")
flags.DEFINE_string("output_dir", None, "Writes audit_report.json and audit_scores.png here.")
flags.DEFINE_integer("audit_seed", None, "Seed of the canaries' coins. Tests only: a real audit "
                     "draws it from the OS.")
flags.DEFINE_integer("init_seed", None, "Seed of the initialisation only (public).")
flags.DEFINE_integer("verbose", 0, "Keras fit verbosity.")


class FlagError(ValueError):
  """A flag combination that cannot run (reported as one line, exit status 1)."""


def _privacy_flags(fv):
  sigma, eps = fv.noise_multiplier, fv.target_epsilon
  if (sigma is None) == (eps is None):
    raise FlagError("Give exactly one of --noise_multiplier (0: no noise) and "
                    "--target_epsilon.")
  if sigma is not None and sigma < 0:
    raise FlagError(f"--noise_multiplier must be >= 0; got {sigma}.")
  return sigma, eps


flags.register_multi_flags_validator(
    ["noise_multiplier", "target_epsilon"],
    lambda v: (v["noise_multiplier"] is None) != (v["target_epsilon"] is None),
    "Give exactly one of --noise_multiplier (0: no noise) and --target_epsilon.")
flags.register_multi_flags_validator(
    ["k_plus", "k_minus"], lambda v: (v["k_plus"] is None) == (v["k_minus"] is None),
    "Give both --k_plus and --k_minus, or neither.")


# --- data and model --------------------------------------------------------------------------
def load_data(dataset, data_path=None, max_train_examples=None, max_test_examples=None):
  """``(x_train, y_train), (x_test, y_test)``: float32 images in [0, 1], int32 labels."""
  if dataset == "digits":
    (x_tr, y_tr), (x_te, y_te) = tf_dpnsgd.data.digits.load_digits(test_fraction=0.2, seed=0)
  else:
    if not data_path:
      raise FlagError("--dataset=mnist needs --data_path (a keras.datasets-format mnist.npz).")
    with np.load(data_path) as f:
      missing = {"x_train", "y_train", "x_test", "y_test"} - set(f.files)
      if missing:
        raise FlagError(f"{data_path} lacks {sorted(missing)}.")
      x_tr, y_tr, x_te, y_te = (f["x_train"], f["y_train"], f["x_test"], f["y_test"])
    x_tr = (x_tr.astype("float32") / 255.0)[..., None]
    x_te = (x_te.astype("float32") / 255.0)[..., None]
  x_te, y_te = x_te[:max_test_examples], y_te[:max_test_examples]
  return ((np.asarray(x_tr, np.float32), np.asarray(y_tr, np.int32)),
          (np.asarray(x_te, np.float32), np.asarray(y_te, np.int32)))


def split_canary_pool(x, y, num_canaries, canary_kind, max_train_examples=None):
  """``(train, pool)``: real training rows and, for input canaries, the pool they come from.

  Input canaries come from rows the real training set does not use: the rows
  after ``max_train_examples`` (or the last ``m`` rows when it is not given).
  """
  n = len(y)
  real = n if max_train_examples is None else min(n, max_train_examples)
  if canary_kind == "gradient":
    return (x[:real], y[:real]), None
  if max_train_examples is None or real + num_canaries > n:
    real = n - num_canaries
  if real < 1:
    raise FlagError(f"{num_canaries} input canaries need that many held-out images; the "
                    f"training split has {n}.")
  return (x[:real], y[:real]), (x[real:real + num_canaries], y[real:real + num_canaries])


def mlp(input_shape, num_classes=10, width=128):
  """Flatten, one tanh hidden layer, logits (the MLP of the MNIST launcher)."""
  inputs = keras.Input(input_shape, name="image")
  h = keras.layers.Flatten()(inputs)
  h = keras.layers.Dense(width, activation="tanh", name="hidden")(h)
  return keras.Model(inputs, keras.layers.Dense(num_classes, name="logits")(h), name="mlp")


def optimizer_factory(name, learning_rate, regularizer, l2_norm_clip, momentum=0.0,
                      **adaptive):
  """``sigma -> optimizer`` (noise seed from the OS, never fixed here).

  ``adaptive``: the quantile-adaptive clipping keywords of DPSGD/DPAdam
  (``target_unclipped_quantile``, ...); None values are left out.
  """
  adaptive = {k: v for k, v in adaptive.items() if v is not None}
  if adaptive and name not in ("dpsgd", "dpadam"):
    raise FlagError(f"--{sorted(adaptive)[0]} (quantile-adaptive clipping) needs "
                    f"--optimizer=dpsgd or dpadam; got --optimizer={name}.")
  try:  # the launchers' rule: --momentum is SGD momentum, refused for the Adam variants
    validation.check_momentum({"optimizer": name, "momentum": momentum})
  except ValueError as e:
    raise FlagError(str(e)) from None

  def make(sigma):
    if name == "dpnsgd":
      return tf_dpnsgd.DPNSGD(learning_rate=learning_rate, regularizer=regularizer,
                              noise_multiplier=sigma, momentum=momentum)
    if name == "dpsgd":
      return tf_dpnsgd.DPSGD(learning_rate=learning_rate, l2_norm_clip=l2_norm_clip,
                             noise_multiplier=sigma, momentum=momentum, **adaptive)
    if name == "dpnadam":
      return tf_dpnsgd.DPNAdam(learning_rate=learning_rate, regularizer=regularizer,
                               noise_multiplier=sigma)
    return tf_dpnsgd.DPAdam(learning_rate=learning_rate, l2_norm_clip=l2_norm_clip,
                            noise_multiplier=sigma, **adaptive)
  return make


def write_outputs(report: audit.AuditReport, output_dir: str, label: str = "") -> dict:
  """Writes ``audit_report.json`` and ``audit_scores.png``; returns the report dict."""
  os.makedirs(output_dir, exist_ok=True)
  d = report.to_dict()
  with open(os.path.join(output_dir, REPORT_FILE), "w", encoding="utf-8") as f:
    json.dump(d, f, indent=1, sort_keys=True)
    f.write("\n")
  score_name = {"dirac": "parameter change along the canary direction",
                "loss": "-loss of the canary label",
                "margin": "logit margin of the canary label"}[report.score]
  audit_plots.score_histogram(os.path.join(output_dir, FIGURE_FILE), report.scores,
                              report.included, report.epsilon_claimed,
                              report.epsilon_lower_bound, report.confidence, label=label,
                              score_name=score_name)
  return d


def main(argv):
  del argv
  fv = flags.FLAGS
  try:
    sigma, eps = _privacy_flags(fv)
    make_optimizer = optimizer_factory(
        fv.optimizer, fv.learning_rate, fv.regularizer, fv.l2_norm_clip, fv.momentum,
        target_unclipped_quantile=fv.target_unclipped_quantile,
        clip_learning_rate=fv.clip_learning_rate, clipped_count_stddev=fv.clipped_count_stddev)
    (x_train, y_train), test = load_data(fv.dataset, fv.data_path, fv.max_train_examples,
                                         fv.max_test_examples)
    train, pool = split_canary_pool(x_train, y_train, fv.num_canaries, fv.canary_kind,
                                    fv.max_train_examples)
  except FlagError as e:
    raise SystemExit(f"FATAL Flags error: {e}") from None
  if fv.init_seed is not None:
    keras.utils.set_random_seed(fv.init_seed)
  num_classes = int(max(y_train.max(), test[1].max()) + 1)
  shape = x_train.shape[1:]
  print(f"{fv.dataset}: {len(train[1])} real training rows, {fv.num_canaries} "
        f"{fv.canary_kind} canaries, {len(test[1])} test; {fv.optimizer}", flush=True)
  try:
    report = audit.run_canary_audit(
        lambda: mlp(shape, num_classes, fv.width), train, num_classes=num_classes,
        canary_kind=fv.canary_kind, num_canaries=fv.num_canaries,
        make_optimizer=make_optimizer,
        batch_size=fv.batch_size, epochs=fv.epochs, noise_multiplier=sigma,
        target_epsilon=eps, delta=fv.delta, sampling=fv.sampling, accountant=fv.accountant,
        conversion=fv.conversion, canary_pool=pool, score=fv.score, confidence=fv.confidence,
        k_plus=fv.k_plus, k_minus=fv.k_minus, gradient_norm=fv.gradient_norm,
        audit_seed=fv.audit_seed, test=test, per_example=fv.per_example,
        physical_batch_size=fv.physical_batch_size, verbose=fv.verbose,
        log=lambda s: print(s, flush=True))
  except ValueError as e:   # e.g. B > N, an invalid plan
    raise SystemExit(f"FATAL Flags error: {e}") from None
  claimed = audit_plots.epsilon_text(report.epsilon_claimed)
  print(f"claimed epsilon {claimed} (delta {fv.delta:g}); audit lower bound "
        f"{report.epsilon_lower_bound:.4g} at {fv.confidence:.0%} ({report.audit.num_correct}/"
        f"{report.audit.num_guesses} correct guesses, m={report.num_canaries}; Steinke et al.), "
        f"f-DP lower bound {report.epsilon_lower_bound_fdp:.4g} (same guesses); test accuracy "
        f"{report.test_accuracy:.4f}", flush=True)
  if report.contradicts_claim:
    print("WARNING: the lower bound exceeds the claimed epsilon: the mechanism does not do "
          "what the accountant assumes.", flush=True)
  if fv.output_dir:
    label = f"{fv.dataset} {fv.optimizer} {fv.canary_kind} canaries"
    if fv.target_unclipped_quantile is not None:
      label += f", adaptive clip (gamma {fv.target_unclipped_quantile:g})"
    write_outputs(report, fv.output_dir, label)
    print(f"audit report: {os.path.join(fv.output_dir, REPORT_FILE)}", flush=True)


if __name__ == "__main__":
  app.run(main)
