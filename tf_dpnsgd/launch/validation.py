"""The launchers' flag rules: the allowed values and the cross-flag checks.

Pure functions of a dict of flag values (absl multi-flag validators, registered by
:func:`tf_dpnsgd.launch.common.define_flags` from :data:`CHECKS`); each raises
``ValueError`` with a message that says what to do. Kept apart from
:mod:`tf_dpnsgd.launch.common` (which re-exports these names) so that the rules can be
read, and tested, without the run machinery.
"""

from __future__ import annotations

from typing import Optional

OPTIMIZERS = ("dpnsgd", "dpsgd", "dpadam", "dpnadam", "sgd", "adam")
NON_PRIVATE = ("sgd", "adam")  # the baselines: no noise, no plan, no epsilon
SAMPLINGS = ("poisson", "uniform", "shuffle", "cyclic_poisson")  # cyclic_poisson: bandmf, blt
NOISES = ("independent", "bandmf", "blt", "auto")  # auto: independent or bandmf, chosen
PRIVACY_FLAGS = ("noise_multiplier", "target_epsilon")
ADAPTIVE_FLAGS = ("target_unclipped_quantile", "clip_learning_rate", "clipped_count_stddev")


def non_private_message(optimizer: str) -> str:
  """The error for a privacy flag given to a non-private baseline (``sgd``, ``adam``)."""
  return (f"--optimizer={optimizer} trains without privacy: drop --noise_multiplier / "
          "--target_epsilon, or choose a DP optimizer.")


class LaunchError(ValueError):
  """A user error found before training (flags that do not fit the data, an existing
  export directory, ...): launchers print it as one line, without a traceback."""


def _check_enums(d):
  if d["optimizer"] not in OPTIMIZERS:
    raise ValueError(f"--optimizer must be one of {OPTIMIZERS}; got {d['optimizer']!r}.")
  if d["sampling"] not in SAMPLINGS:
    raise ValueError(f"--sampling must be one of {SAMPLINGS}; got {d['sampling']!r}.")


def _check_noise(d):
  """The noise mechanism (``--noise``, ``--bands``, ``--blt_buffers``) against the flags it
  constrains.

  ``--noise=bandmf --bands=b`` (b >= 2) is banded matrix-factorization noise, accounted under
  cyclic Poisson sampling (Choquette-Choo et al. 2023, Thm. 4; docs/correlated_noise.md).
  ``--noise=blt --bands=b [--blt_buffers=d]`` (b >= 1) is BLT noise under the same sampling
  (each example at most once every ``b`` steps), accounted without amplification.
  ``b`` against the data (``b B <= N``, ``b <= steps``) is checked with the plan
  (:func:`check_bands_fit`).
  """
  noise, bands, sampling = d.get("noise", "independent"), d.get("bands"), d["sampling"]
  buffers = d.get("blt_buffers")
  if noise not in NOISES:
    raise ValueError(f"--noise must be one of {', '.join(NOISES)}; got {noise!r}.")
  if buffers is not None and noise != "blt":
    raise ValueError(f"--blt_buffers={buffers} needs --noise=blt (BLT noise).")
  if noise == "independent":
    if bands is not None:
      raise ValueError(f"--bands={bands} needs --noise=bandmf or --noise=blt (correlated "
                       "noise); drop --bands for independent noise.")
    if sampling == "cyclic_poisson":
      raise ValueError("--sampling=cyclic_poisson goes with correlated noise: give "
                       "--noise=bandmf --bands=b (or --noise=blt), or another --sampling.")
    return
  if noise == "auto":
    _check_auto_noise(d)
    return
  if noise == "bandmf" and (bands is None or bands < 2):
    raise ValueError(f"--noise=bandmf needs --bands=b with b >= 2 (the number of bands of the "
                     f"noise; b=1 is independent noise: use --noise=independent); got "
                     f"--bands={bands}.")
  if noise == "blt" and (bands is None or bands < 1):
    raise ValueError(f"--noise=blt needs --bands=b with b >= 1 (the separation of an "
                     f"example's steps: cyclic Poisson sampling over b parts); got "
                     f"--bands={bands}.")
  if buffers is not None and buffers < 1:
    raise ValueError(f"--blt_buffers must be >= 1; got {buffers}.")
  if sampling != "cyclic_poisson":
    raise ValueError(f"--noise={noise} is accounted under cyclic Poisson sampling (each example "
                     f"at most once every b steps); got --sampling={sampling}. Drop --sampling "
                     f"(--noise={noise} sets --sampling=cyclic_poisson).")
  _check_correlated_fits(d, noise)


def _check_correlated_fits(d, noise):
  """Correlated noise (or ``auto``, which may choose it) needs a DP optimizer, a fixed clip
  and one replica."""
  what = f"--noise={noise}" + (" may choose correlated noise, which" if noise == "auto" else "")
  if d["optimizer"] in NON_PRIVATE:
    raise ValueError(f"--noise={noise} is DP noise; --optimizer={d['optimizer']} trains without "
                     "privacy. Drop --noise/--bands, or choose a DP optimizer.")
  adaptive = [n for n in ADAPTIVE_FLAGS if d.get(n) is not None]
  if adaptive:
    raise ValueError(f"{what} cannot use adaptive clipping (--{adaptive[0]}): its noise std "
                     "changes every step, which the correlated analysis does not cover. Use a "
                     "fixed --l2_norm_clip, or --noise=independent.")
  if d.get("distribution_strategy", "none") != "none":
    raise ValueError(f"{what} runs on one replica (correlated noise across tf.distribute "
                     "replicas is not implemented): use --distribution_strategy=none, or "
                     "--noise=independent.")


def _check_auto_noise(d):
  """``--noise=auto [--bands=most]``: independent noise or BandMF with at most ``most`` bands
  (default 32), whichever the plan's accounting and the strategies predict leaves less noise
  at ``--target_epsilon`` (:mod:`tf_dpnsgd.noise_choice`); chosen when the data is loaded."""
  bands = d.get("bands")
  if bands is not None and bands < 1:
    raise ValueError(f"--noise=auto takes --bands=b >= 1 as the most bands it may choose; got "
                     f"--bands={bands}.")
  if d["sampling"] != "poisson":
    raise ValueError(f"--noise=auto chooses the sampling with the noise (Poisson for "
                     f"independent noise, cyclic Poisson for BandMF); drop "
                     f"--sampling={d['sampling']}.")
  if d.get("noise_multiplier") is not None:
    raise ValueError("--noise=auto compares the mechanisms at one epsilon: give "
                     "--target_epsilon, not --noise_multiplier.")
  _check_correlated_fits(d, "auto")


def check_bands_fit(bands: int, batch_size: int, dataset_size: int,
                    num_steps: Optional[int] = None) -> None:
  """Raises ``ValueError`` unless ``b`` parts of ``N`` hold batches of ``B`` (``b B <= N``)
  and the run has at least ``b`` steps (``num_steps``, when given)."""
  if bands * batch_size > dataset_size:
    raise ValueError(f"--bands={bands} with --batch_size={batch_size} needs b * B <= N "
                     f"({bands * batch_size} > {dataset_size} examples): cyclic Poisson samples "
                     "each step from one of b parts of N/b examples. Use fewer bands or a "
                     "smaller batch.")
  if num_steps is not None and bands > num_steps:
    raise ValueError(f"--bands={bands} is more than the run's {num_steps} planned steps: use "
                     f"--bands <= {num_steps}, or train longer.")


def _check_regularizer(d):
  if d["optimizer"] in ("dpnsgd", "dpnadam") and not (d["regularizer"] or 0) > 0:
    raise ValueError(f"--regularizer must be > 0 for {d['optimizer']}; got {d['regularizer']}.")


def _check_clip(d):
  if d["optimizer"] in ("dpsgd", "dpadam") and not (d["l2_norm_clip"] or 0) > 0:
    raise ValueError(f"--l2_norm_clip must be > 0 for {d['optimizer']}; got {d['l2_norm_clip']}.")


def _check_adaptive_clipping(d):
  given = [n for n in ADAPTIVE_FLAGS if d[n] is not None]
  if not given:
    return
  if d["optimizer"] not in ("dpsgd", "dpadam"):
    raise ValueError(f"--{given[0]} (quantile-adaptive clipping) needs a clipping optimizer "
                     f"(--optimizer=dpsgd or dpadam); got --optimizer={d['optimizer']}.")
  if d["target_unclipped_quantile"] is None:
    raise ValueError(f"--{given[0]} needs --target_unclipped_quantile (adaptive clipping).")
  if not 0 <= d["target_unclipped_quantile"] <= 1:
    raise ValueError("--target_unclipped_quantile must be in [0, 1]; got "
                     f"{d['target_unclipped_quantile']}.")
  if d["clip_learning_rate"] is not None and not d["clip_learning_rate"] >= 0:
    raise ValueError(f"--clip_learning_rate must be >= 0; got {d['clip_learning_rate']}.")
  if d["clipped_count_stddev"] is not None and not d["clipped_count_stddev"] >= 0:
    raise ValueError(f"--clipped_count_stddev must be >= 0; got {d['clipped_count_stddev']}.")


def check_momentum(d):
  """``--momentum`` is heavy-ball momentum of the SGD variants; Adam's moments are its own."""
  momentum = d.get("momentum") or 0.0
  if not 0 <= momentum < 1:
    raise ValueError(f"--momentum must be in [0, 1); got {momentum}.")
  if momentum and d["optimizer"] in ("dpadam", "dpnadam", "adam"):
    raise ValueError(f"--momentum={momentum} is SGD momentum; --optimizer={d['optimizer']} "
                     "keeps Adam's moments (beta_1 0.9) and would ignore it. Drop --momentum "
                     "(or give --momentum=0 after a flag file that sets it).")


def _check_ema(d):
  m = d.get("ema_momentum")
  if m is not None and not 0 < m < 1:
    raise ValueError(f"--ema_momentum must be in (0, 1) (e.g. 0.99), or left out for no "
                     f"average; got {m}.")


def _check_learning_rate(d):
  if not (d["learning_rate"] is not None and d["learning_rate"] > 0):
    raise ValueError(f"--learning_rate must be > 0; got {d['learning_rate']}.")


def _check_max_steps(d):
  if d["max_steps"] is not None and d["max_steps"] < 1:
    raise ValueError(f"--max_steps must be >= 1; got {d['max_steps']}.")


def _check_epochs(d):
  if not (d["epochs"] is not None and d["epochs"] > 0):
    raise ValueError(f"--epochs must be > 0; got {d['epochs']}.")


def _check_batch_sizes(d):
  if d["batch_size"] is None or d["batch_size"] < 1:
    raise ValueError(f"--batch_size must be >= 1; got {d['batch_size']}.")
  if d["physical_batch_size"] is not None and not 1 <= d["physical_batch_size"] <= d["batch_size"]:
    raise ValueError(f"--physical_batch_size ({d['physical_batch_size']}) must lie in "
                     f"[1, --batch_size ({d['batch_size']})].")


STRATEGIES = ("none", "mirrored", "multi_worker", "tpu")


def _check_strategy(d):
  strategy = d.get("distribution_strategy", "none")
  if strategy not in STRATEGIES:
    raise ValueError(f"--distribution_strategy must be one of {STRATEGIES}; got {strategy!r}.")
  if (strategy == "tpu") != bool(d.get("tpu")):
    raise ValueError("--tpu (the TPU address, e.g. grpc://10.0.0.2:8470 or a TPU name; "
                     "'local' on a TPU VM) goes with --distribution_strategy=tpu, and only "
                     "with it.")


# (flags read, check raising ValueError): run by ExperimentConfig and, at flag parsing, by
# absl validators (so a bad combination is a one-line flag error, before anything loads).
CHECKS = (
    (("optimizer", "sampling"), _check_enums),
    (("optimizer", "regularizer"), _check_regularizer),
    (("optimizer", "l2_norm_clip"), _check_clip),
    (("optimizer",) + ("target_unclipped_quantile", "clip_learning_rate",
                       "clipped_count_stddev"), _check_adaptive_clipping),
    (("learning_rate",), _check_learning_rate),
    (("optimizer", "momentum"), check_momentum),
    (("ema_momentum",), _check_ema),
    (("max_steps",), _check_max_steps),
    (("epochs",), _check_epochs),
    (("batch_size", "physical_batch_size"), _check_batch_sizes),
    (("distribution_strategy", "tpu"), _check_strategy),
    (("noise", "bands", "blt_buffers", "sampling", "optimizer", "distribution_strategy")
     + ADAPTIVE_FLAGS, _check_noise),
)


def resolve_privacy(optimizer: str, noise_multiplier: Optional[float],
                    target_epsilon: Optional[float], explicit=()) -> tuple:
  """``(noise_multiplier, target_epsilon)`` of a run from the flag values.

  ``explicit`` names the privacy flags given on the command line (or in a
  flag file); the others hold the launcher's defaults. A private optimizer
  uses the explicit one of the two, else the default (the launcher's target
  epsilon); ``--optimizer=sgd`` uses neither.

  Raises:
    ValueError: both flags given explicitly; ``--optimizer=sgd`` with either
      given explicitly; a private optimizer and no value at all.
  """
  given = {n for n in PRIVACY_FLAGS if n in explicit}
  values = {"noise_multiplier": noise_multiplier, "target_epsilon": target_epsilon}
  given = {n for n in given if values[n] is not None}
  if optimizer in NON_PRIVATE:
    if given:
      raise ValueError(non_private_message(optimizer))
    return None, None
  if len(given) == 2:
    raise ValueError("Give only one of --noise_multiplier and --target_epsilon (both were "
                     "given).")
  if given:
    name = given.pop()
    return ((noise_multiplier, None) if name == "noise_multiplier" else (None, target_epsilon))
  if target_epsilon is not None:  # neither given: the launcher's default target epsilon
    return None, target_epsilon
  if noise_multiplier is not None:
    return noise_multiplier, None
  raise ValueError(f"--optimizer={optimizer} needs --noise_multiplier or --target_epsilon.")
