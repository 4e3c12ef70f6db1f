"""The MNIST audit of docs/auditing.md: claimed epsilon vs. the one-run lower bounds.

For each optimizer (DP-NSGD, DP-SGD), each target epsilon (and no noise)
and each canary kind (white-box Dirac gradient canaries, black-box
mislabeled input canaries), trains the MNIST MLP once with m canaries under
the run's PrivacyPlan (Poisson sampling) and audits it
(:func:`tf_dpnsgd.audit.run_canary_audit`, the same call as
``python -m tf_dpnsgd.launch.audit``). Cells are resumable: a cell whose
``audit_report.json`` exists is read back, not rerun.

  # The two configurations of docs/auditing.md (each ~15-30 min on 2 shared CPU cores):
  python benchmarks/audit_mnist.py --data_path=../shared/data/mnist.npz \
      --batch_size=1000 --epochs=20 --score=loss --out_dir=runs/audit/mnist_b1000 \
      --figures_dir=docs/figures --figure_prefix=audit_mnist_b1000
  python benchmarks/audit_mnist.py --data_path=../shared/data/mnist.npz \
      --batch_size=128 --epochs=60 --score=margin --out_dir=runs/audit/mnist_b128 \
      --figures_dir=docs/figures --figure_prefix=audit_mnist_b128

Every cell reports both one-run lower bounds from the same guesses (Steinke,
Nasr, Jagielski 2023 and the f-DP bound of Mahloujifar, Melis, Chaudhuri 2025;
:class:`tf_dpnsgd.audit.CanaryScoreAuditor`); cells written before the f-DP bound
existed are re-audited from their saved scores. ``--repeats=R`` trains every cell
``R`` times (fresh coins, noise and batches; cells ``<cell>_r1``, ...).

Writes ``out_dir/<cell>/audit_report.json`` and ``audit_scores.png`` per cell,
``out_dir/results.json`` (one row per cell, with the white-box audit of an ideal
Gaussian mechanism of the same sigma, T, q and m, simulated, for both bounds), a
markdown table on stdout, and into ``figures_dir``: ``<prefix>_claimed_vs_lower.png`` (both methods)
and the score histograms of a few cells (``<prefix>_scores_<cell>.png``). Coins,
noise and sampler seeds come from the OS (a real audit); ``--audit_seed`` fixes the coins only.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

METHODS = {
    # name: (launcher optimizer, learning rate, regularizer, clip)
    "DP-NSGD": ("dpnsgd", 2.0, 0.01, 1.0),
    "DP-SGD": ("dpsgd", 2.0, 0.01, 1.0),
}


def cell_name(method, kind, eps, repeat=0):
  tag = "nonoise" if eps is None else f"eps{eps:g}"
  return f"{METHODS[method][0]}_{kind}_{tag}" + (f"_r{repeat}" if repeat else "")


def simulated_white_box(noise_multiplier, steps, dataset_size, batch_size, num_canaries, delta,
                        draws=20, seed=0):
  """The white-box audit of an ideal mechanism with the same (sigma, T, q, m): each canary's
  score is (number of batches holding it) + sigma sqrt(T) Z, nothing else. Returns
  ``{method: [5%, 50%, 95%]}``, the quantiles of each lower bound over ``draws``
  coin/noise/sampling draws."""
  import numpy as np

  from tf_dpnsgd import audit
  rng = np.random.default_rng(seed)
  q = batch_size / dataset_size
  values = {"steinke": [], "fdp": []}
  for _ in range(draws):
    included = rng.random(num_canaries) < 0.5
    hits = rng.binomial(steps, q, num_canaries)
    scores = (np.where(included, hits, 0)
              + noise_multiplier * np.sqrt(steps) * rng.normal(size=num_canaries))
    result = audit.CanaryScoreAuditor.from_scores(scores, included).audit(delta)
    for method in values:
      values[method].append(result.bounds[method].epsilon_lower_bound)
  return {k: [float(x) for x in np.quantile(v, [0.05, 0.5, 0.95])] for k, v in values.items()}


def audit_of_report(d, delta):
  """The auditor's result for a saved report (its f-DP bound and measures, recomputed from
  the saved scores when the report predates them)."""
  if d.get("canary_audit"):
    return d["canary_audit"]
  from tf_dpnsgd import audit
  return audit.CanaryScoreAuditor(d["scores_in"], d["scores_out"]).audit(delta).to_dict()


def run_cell(args, method, kind, eps, cell_dir):
  import keras

  from tf_dpnsgd import audit
  from tf_dpnsgd.launch import audit as launcher

  (x_train, y_train), test = launcher.load_data("mnist", args.data_path,
                                                max_test_examples=args.max_test_examples)
  train, pool = launcher.split_canary_pool(x_train, y_train, args.num_canaries, kind,
                                           args.max_train_examples)
  name, lr, reg, clip = METHODS[method]
  keras.backend.clear_session()
  report = audit.run_canary_audit(
      lambda: launcher.mlp(x_train.shape[1:], 10, args.width), train, num_classes=10,
      canary_kind=kind, num_canaries=args.num_canaries,
      make_optimizer=launcher.optimizer_factory(name, lr, reg, clip),
      batch_size=args.batch_size, epochs=args.epochs,
      noise_multiplier=0.0 if eps is None else None, target_epsilon=eps, delta=args.delta,
      canary_pool=pool, score=args.score, audit_seed=args.audit_seed, test=test,
      log=lambda s: print(s, flush=True))
  label = f"MNIST {method}, {kind} canaries"
  return launcher.write_outputs(report, cell_dir, label)


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--data_path", required=True)
  p.add_argument("--out_dir", default="runs/audit/mnist")
  p.add_argument("--figures_dir", default=None, help="copy the figures here (docs/figures)")
  p.add_argument("--methods", default="DP-NSGD,DP-SGD")
  p.add_argument("--kinds", default="gradient,input")
  p.add_argument("--epsilons", default="1,4,16,none", help="'none': no noise")
  p.add_argument("--num_canaries", type=int, default=1000)
  p.add_argument("--max_train_examples", type=int, default=20000)
  p.add_argument("--max_test_examples", type=int, default=10000)
  p.add_argument("--batch_size", type=int, default=128)
  p.add_argument("--epochs", type=float, default=60)
  p.add_argument("--width", type=int, default=128)
  p.add_argument("--delta", type=float, default=1e-5)
  p.add_argument("--score", default="margin")
  p.add_argument("--audit_seed", type=int, default=None)
  p.add_argument("--repeats", type=int, default=1, help="train every cell this many times")
  p.add_argument("--figure_prefix", default="audit_mnist",
                 help="file name prefix of the figures copied to --figures_dir")
  p.add_argument("--histograms", default=None,
                 help="cells whose score histogram is copied (default: epsilon 4 and no noise)")
  args = p.parse_args()

  epsilons = [None if e == "none" else float(e) for e in args.epsilons.split(",")]
  rows = []
  cells = [(method, kind, eps, k) for method in args.methods.split(",")
           for kind in args.kinds.split(",") for eps in epsilons for k in range(args.repeats)]
  for method, kind, eps, repeat in cells:
    cell = cell_name(method, kind, eps, repeat)
    cell_dir = os.path.join(args.out_dir, cell)
    path = os.path.join(cell_dir, "audit_report.json")
    if os.path.exists(path):
      with open(path) as f:
        d = json.load(f)
      print(f"{cell}: done before", flush=True)
    else:
      print(f"{cell}: running", flush=True)
      start = time.perf_counter()
      d = run_cell(args, method, kind, eps, cell_dir)
      print(f"{cell}: {time.perf_counter() - start:.0f} s", flush=True)
    canary_audit = audit_of_report(d, args.delta)
    bounds = canary_audit["lower_bounds"]
    rows.append({"cell": cell, "method": method, "canary_kind": kind,
                 "target_epsilon": eps, "epsilon_claimed": d["epsilon_claimed"],
                 "epsilon_lower_bound": bounds["steinke"]["epsilon_lower_bound"],
                 "epsilon_lower_bound_fdp": bounds["fdp"]["epsilon_lower_bound"],
                 "gdp_epsilon_estimate": canary_audit["gdp_epsilon_estimate"],
                 "auroc": canary_audit["auroc"],
                 "noise_multiplier": d["noise_multiplier"], "steps": d["steps"],
                 "dataset_size": d["dataset_size"], "num_canaries": d["num_canaries"],
                 "num_included": d["num_included"],
                 "k_plus": bounds["steinke"]["k_plus"],
                 "k_minus": bounds["steinke"]["k_minus"],
                 "num_guesses": bounds["steinke"]["num_guesses"],
                 "num_correct": bounds["steinke"]["num_correct"],
                 "test_accuracy": d["test_accuracy"],
                 "clopper_pearson_comparison":
                     d["clopper_pearson_comparison"]["epsilon_lower_bound"],
                 "timings_seconds": d["timings_seconds"]})
    if kind == "gradient" and eps is not None:
      rows[-1]["ideal_white_box"] = simulated_white_box(
          d["noise_multiplier"], d["steps"], d["dataset_size"], d["batch_size"],
          d["num_canaries"], args.delta)
    with open(os.path.join(args.out_dir, "results.json"), "w") as f:
      json.dump(rows, f, indent=1)

  from tf_dpnsgd import audit
  from tf_dpnsgd.audit import plots
  figure = os.path.join(args.out_dir, f"{args.figure_prefix}_claimed_vs_lower.png")
  plots.claimed_vs_lower_bound(
      figure, rows, title=(f"MNIST MLP, batch {args.batch_size}, {args.epochs:g} epochs, "
                           f"m={args.num_canaries} canaries, one run per point"),
      ceiling=audit.one_run_max_epsilon(args.num_canaries, delta=args.delta),
      ceiling_fdp=audit.fdp_one_run_max_epsilon(args.num_canaries, delta=args.delta))
  print("| method | canaries | target eps | sigma | claimed eps | Steinke et al. (95%) | "
        "f-DP (95%) | correct/guesses | ideal mechanism, Steinke / f-DP (5/50/95%) | "
        "GDP estimate | AUROC | test acc | train s |")
  print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
  for r in rows:
    claimed = "inf (no noise)" if r["epsilon_claimed"] is None else f"{r['epsilon_claimed']:.2f}"
    target = "-" if r["target_epsilon"] is None else f"{r['target_epsilon']:g}"
    t = r["timings_seconds"]
    ideal = "-"
    if "ideal_white_box" in r:
      ideal = " ; ".join("{:.2f} / {:.2f} / {:.2f}".format(*r["ideal_white_box"][k])
                         for k in ("steinke", "fdp"))
    print(f"| {r['method']} | {r['canary_kind']} | {target} | {r['noise_multiplier']:.3f} | "
          f"{claimed} | {r['epsilon_lower_bound']:.2f} | {r['epsilon_lower_bound_fdp']:.2f} | "
          f"{r['num_correct']}/{r['num_guesses']} | {ideal} | {r['gdp_epsilon_estimate']:.2f} | "
          f"{r['auroc']:.3f} | {r['test_accuracy']:.3f} | {t['train']:.0f} |")
  noisy = [r for r in rows if r["epsilon_claimed"] is not None]
  at_least = sum(r["epsilon_lower_bound_fdp"] >= r["epsilon_lower_bound"] for r in rows)
  below = sum(max(r["epsilon_lower_bound"], r["epsilon_lower_bound_fdp"]) <= r["epsilon_claimed"]
              for r in noisy)
  print(f"f-DP >= Steinke in {at_least}/{len(rows)} cells; no bound above its claim in "
        f"{below}/{len(noisy)} noisy cells")
  if args.figures_dir:
    os.makedirs(args.figures_dir, exist_ok=True)
    shutil.copy(figure, os.path.join(args.figures_dir, os.path.basename(figure)))
    wanted = (None if args.histograms is None else set(args.histograms.split(",")))
    for r in rows:
      src = os.path.join(args.out_dir, r["cell"], "audit_scores.png")
      chosen = (r["target_epsilon"] in (4.0, None) if wanted is None else r["cell"] in wanted)
      if chosen and os.path.exists(src):
        shutil.copy(src, os.path.join(args.figures_dir,
                                      f"{args.figure_prefix}_scores_{r['cell']}.png"))


if __name__ == "__main__":
  main()
