r"""Shakespeare's speaking roles as users: user-level DP against example-level DP.

  bash scripts/shakespeare_setup.sh ~/shakespeare_data
  python -m tf_dpnsgd.launch.shakespeare --flagfile=configs/shakespeare/user_k16_eps8.flags \
      --data_dir=~/shakespeare_data --model_dir=runs/shakespeare_user

Data: :mod:`tf_dpnsgd.data.shakespeare` (tinyshakespeare, one user per speaking role,
next-character prediction over a public 96-symbol vocabulary, roles split by a public hash
of their names). Model: ``--context`` character ids -> Embedding -> Flatten -> tanh Dense
-> logits (6,057 parameters at the defaults; every layer has a layer-wise rule). The
defaults are those of configs/shakespeare/user_k16_eps8.flags.

``--privacy_unit`` picks the unit the epsilon is about:

* ``user``: ``make_private(privacy_unit="user", user_key="role",
  max_examples_per_user=k)``; ``--batch_size`` is USERS per batch, ``--target_epsilon``
  the user-level epsilon (docs/user_level.md).
* ``example``: ordinary example-level DP on the rows each role keeps under the same bound
  (the first ``k`` of its rows in the public hash order of :class:`tf_dpnsgd.users.UserTable`),
  so that every role has at most ``k`` rows and group privacy covers it.
  ``--batch_size`` is rows per batch. With ``--target_epsilon`` (default) the noise is
  calibrated so that the GROUP-privacy statement for ``k`` rows at ``--delta``
  (:func:`tf_dpnsgd.accounting.example_level_for_group`) equals ``--target_epsilon``: the
  same user-level epsilon as a ``user`` run. ``--noise_multiplier`` sets the noise directly
  (no group statement is then reported).
* ``--optimizer=sgd`` or ``adam``: non-private reference on the same rows.

``--max_examples_per_user=0`` (example-level or non-private only) keeps every row; group
privacy then has no bound to convert with and is not reported.

Writes ``model_dir/privacy_report.json`` (the epsilon, the unit, and for example-level runs
the group-privacy statement under ``group_privacy``) and
``model_dir/bound_diagnostics.json``: how many roles and rows the bound cut. Those counts are
exact counts of the private data, NOT covered by any epsilon: they are for the data owner
and this benchmark, not for release. ``--seed`` fixes the initialisation only; DP noise and
batches draw OS seeds.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time

from absl import app
from absl import flags
import keras
import numpy as np

import tf_dpnsgd
from tf_dpnsgd import accounting
from tf_dpnsgd import export as export_lib
from tf_dpnsgd import users as users_lib
from tf_dpnsgd.data import shakespeare as shakespeare_data
from tf_dpnsgd.launch import common
from tf_dpnsgd.records import RunRecord

#: What this launcher releases outside the epsilon (the report names it).
COUNTS_NOT_COVERED = (
    "Counts of the training data: the log line and bound_diagnostics.json give exact numbers "
    "of roles, rows and rows cut by --max_examples_per_user, computed from the private data "
    "without noise; not covered by the epsilon (for the data owner, not for release).")

USER_KEY = "role"
INPUT_KEY = "chars"

common.define_flags(optimizer="dpnsgd", learning_rate=0.5, regularizer=0.01, l2_norm_clip=1.0,
                    target_epsilon=8.0, delta=1e-4, batch_size=48, epochs=20,
                    sampling="poisson", verbose=0)
flags.DEFINE_string("data_dir", None, "Folder with input.txt (scripts/shakespeare_setup.sh).")
flags.DEFINE_enum("privacy_unit", "user", users_lib.PRIVACY_UNITS,
                  "user: a speaking role is the unit (--batch_size: roles per batch); "
                  "example: one row is the unit, noise calibrated by group privacy for k rows.")
flags.DEFINE_integer("max_examples_per_user", 16,
                     "k: the most rows of one role training uses (both units: the example-level "
                     "run trains on the same bounded rows). 0: every row (not with "
                     "--privacy_unit=user, nor with group-privacy calibration).")
flags.DEFINE_integer("context", 8, "Characters before the predicted one.")
flags.DEFINE_integer("stride", 16, "Characters between two predicted positions of a role.")
flags.DEFINE_float("test_fraction", 0.2, "Fraction of roles held out (by a hash of the name).")
flags.DEFINE_integer("embedding_dim", 8, "Size of a character's embedding.")
flags.DEFINE_integer("width", 32, "Units of the tanh hidden layer.")
flags.adopt_module_key_flags(common)


def char_model(context: int, vocab_size: int, embedding_dim: int, width: int) -> keras.Model:
  """Character ids ``[context]`` -> logits over the vocabulary."""
  inputs = keras.Input((context,), dtype="int32", name=INPUT_KEY)
  x = keras.layers.Embedding(vocab_size, embedding_dim, name="embedding")(inputs)
  x = keras.layers.Flatten()(x)
  x = keras.layers.Dense(width, activation="tanh", name="hidden")(x)
  return keras.Model(inputs, keras.layers.Dense(vocab_size, name="logits")(x),
                     name="shakespeare_chars")


bounded_rows = users_lib.kept_rows  # the sampler's own rule


def group_calibrated_noise(dataset_size: int, batch_size: int, epochs: float, k: int,
                           user_epsilon: float, delta: float, sampling: str = "poisson",
                           accountant: str = "rdp") -> tuple:
  """``(sigma, (eps_k, delta_k))``: the smallest example-level noise multiplier (to 0.1%)
  whose group-privacy statement for ``k`` rows (:func:`accounting.example_level_for_group`,
  ``delta_k <= delta``) has ``eps_k <= user_epsilon``, and that statement."""
  spec = accounting.make_spec(dataset_size, batch_size, sampling, accountant)
  steps = accounting.planned_steps(epochs, dataset_size, batch_size, sampling)

  def group(sigma):
    acc = spec.make_accountant()
    acc.compose(spec.composed_event(sigma, steps))
    return accounting.example_level_for_group(acc.get_epsilon, k, delta)

  lo, hi = 0.3, 1e4
  if group(hi)[0] > user_epsilon:
    raise common.LaunchError(f"No noise multiplier up to {hi:g} gives a user with k = {k} rows "
                             f"epsilon {user_epsilon:g} by group privacy at delta {delta:g}.")
  while hi / lo > 1.001:
    mid = math.sqrt(lo * hi)
    lo, hi = (lo, mid) if group(mid)[0] <= user_epsilon else (mid, hi)
  return hi, group(hi)


def make_optimizer(cfg, total_steps: int):
  """The optimizer of ``cfg`` (the plan hands a private one its noise multiplier);
  ``total_steps`` sizes ``--lr_schedule``."""
  if cfg.optimizer == "sgd":
    return keras.optimizers.SGD(learning_rate=cfg.learning_rate, momentum=cfg.momentum)
  if cfg.optimizer == "adam":
    return keras.optimizers.Adam(learning_rate=cfg.learning_rate)
  return common.make_optimizer(cfg, None, total_steps)


def _privacy_kwargs(cfg, unit, k, n_rows):
  """``(make_private kwargs, extra report fields)`` of a private run."""
  kw = dict(delta=cfg.delta, batch_size=cfg.batch_size, epochs=cfg.epochs,
            accountant=cfg.accountant)
  if unit == "user":
    if cfg.sampling != "poisson":
      raise common.LaunchError("User-level runs sample users by Poisson sampling: leave "
                               f"--sampling at poisson (got {cfg.sampling}).")
    kw.update(privacy_unit="user", user_key=USER_KEY, max_examples_per_user=k)
    privacy = ({"noise_multiplier": cfg.noise_multiplier} if cfg.noise_multiplier is not None
               else {"target_epsilon": cfg.target_epsilon})
    return {**kw, **privacy}, {}
  kw["sampling"] = cfg.sampling
  if cfg.noise_multiplier is not None:
    return {**kw, "noise_multiplier": cfg.noise_multiplier}, {}
  if not k:
    raise common.LaunchError("--target_epsilon of an example-level run is the USER-level "
                             "epsilon reached by group privacy for k rows: give "
                             "--max_examples_per_user=k > 0, or --noise_multiplier.")
  sigma, (eps_k, delta_k) = group_calibrated_noise(
      n_rows, cfg.batch_size, cfg.epochs, k, cfg.target_epsilon, cfg.delta, cfg.sampling,
      cfg.accountant)
  return {**kw, "noise_multiplier": sigma}, {"group_privacy": {
      "rows_per_user": k, "epsilon": eps_k, "delta": delta_k,
      "target_user_epsilon": cfg.target_epsilon}}


def train_model(cfg, unit: str, k: int, base: keras.Model, train: tuple, num_users: int):
  """``(trained model, report fields)``: ``base`` trained on ``train = (x, y, roles)`` at
  ``unit`` (DP, the model's own plan) or without DP (``--optimizer=sgd|adam``)."""
  x, y, roles = train
  loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
  if not cfg.private:
    epochs = max(1, round(cfg.epochs))
    base.compile(optimizer=make_optimizer(cfg, epochs * math.ceil(len(y) / cfg.batch_size)),
                 loss=loss, metrics=["accuracy"])
    base.fit(x, y, batch_size=cfg.batch_size, epochs=epochs, verbose=cfg.verbose)
    return base, {}
  kwargs, more = _privacy_kwargs(cfg, unit, k, len(y))
  try:
    model = tf_dpnsgd.make_private(base, per_example=cfg.per_example, **kwargs)
  except ValueError as e:
    raise common.LaunchError(str(e)) from None
  steps = accounting.planned_steps(cfg.epochs, num_users if unit == "user" else len(y),
                                   cfg.batch_size, kwargs.get("sampling", "poisson"))
  model.compile(optimizer=make_optimizer(cfg, steps), loss=loss, metrics=["accuracy"])
  model.fit({INPUT_KEY: x, USER_KEY: roles} if unit == "user" else x, y, verbose=cfg.verbose)
  return model, more


def main(argv):
  del argv
  FLAGS = flags.FLAGS
  cfg = common.config_from_flags()
  unit, k = FLAGS.privacy_unit, FLAGS.max_examples_per_user
  if not FLAGS.data_dir:
    raise common.LaunchError("--data_dir is required (scripts/shakespeare_setup.sh).")
  if k < 0 or (unit == "user" and cfg.private and k == 0):
    raise common.LaunchError(f"--max_examples_per_user must be >= 1 at the user level "
                             f"(0: every row, example level only); got {k}.")
  try:
    train, test = shakespeare_data.load_shakespeare(FLAGS.data_dir, FLAGS.context, FLAGS.stride,
                                                    FLAGS.test_fraction)
  except (FileNotFoundError, ValueError) as e:
    raise common.LaunchError(str(e)) from None
  diagnostics = users_lib.bound_diagnostics(train.users, k) if k else {
      "users": users_lib.num_users(train.users), "rows": len(train.y), "users_truncated": 0,
      "rows_unused": 0}
  x, y, roles = train
  if k and (unit == "example" or not cfg.private):
    keep = bounded_rows(x, y, roles, k)
    x, y, roles = x[keep], y[keep], roles[keep]
  used = diagnostics["rows"] - diagnostics["rows_unused"]
  print(f"shakespeare: {diagnostics['users']} roles, {used} training rows used of "
        f"{diagnostics['rows']} (k = {k or 'all'}; NOT private counts), {len(test.y)} test rows "
        f"of {len(set(test.users))} held-out roles; unit {unit if cfg.private else 'none'}",
        flush=True)
  if cfg.seed is not None:  # public: initialisation only
    keras.utils.set_random_seed(cfg.seed)
  base = char_model(FLAGS.context, shakespeare_data.VOCAB_SIZE, FLAGS.embedding_dim,
                    FLAGS.width)
  extra = {"dataset": "tinyshakespeare (karpathy/char-rnn), roles as users",
           "privacy_unit": unit if cfg.private else None, "max_examples_per_user": k,
           "context": FLAGS.context, "stride": FLAGS.stride,
           "test_fraction": FLAGS.test_fraction, "embedding_dim": FLAGS.embedding_dim,
           "width": FLAGS.width}
  started = time.time()
  model, more = train_model(cfg, unit, k, base, (x, y, roles), diagnostics["users"])
  extra.update(more)
  seconds = time.time() - started
  final = model.evaluate(test.x, test.y, verbose=0, return_dict=True, batch_size=1024)
  extra["train_seconds"] = seconds
  run = {"hyperparameters": cfg.hyperparameters(),
         "final_metrics": {n: float(v) for n, v in final.items()},
         "best_val_accuracy": float(final["accuracy"]), "extra": extra}
  if cfg.private:
    report = model.privacy_report()
    record = RunRecord.from_privacy_report(report, **run)
    record = dataclasses.replace(record, not_covered=record.not_covered + (COUNTS_NOT_COVERED,))
  else:
    record = RunRecord.non_private(steps=int(model.optimizer.iterations.numpy()),
                                   dataset_size=len(y), **run)
  if cfg.model_dir:
    os.makedirs(cfg.model_dir, exist_ok=True)
    export_lib.write_privacy_report(os.path.join(cfg.model_dir, "privacy_report.json"),
                                    **record.to_dict())
    with open(os.path.join(cfg.model_dir, "bound_diagnostics.json"), "w") as f:
      json.dump({"NOT_PRIVATE": "exact counts of the training data: not covered by any "
                                "epsilon, not for release", "max_examples_per_user": k,
                 **diagnostics}, f, indent=1)
  group = extra.get("group_privacy")
  claim = record.epsilon_text() if cfg.private else "non-private"
  if group:
    claim += (f"; a role with <= {k} rows: ({group['epsilon']:.3f}, {group['delta']:.2g})-DP "
              "by group privacy")
  print(f"test accuracy {final['accuracy']:.4f}; {claim}; {record.steps} steps in "
        f"{seconds:.0f} s", flush=True)


if __name__ == "__main__":
  app.run(common.main_with_usage_errors(main))
