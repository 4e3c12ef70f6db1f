"""Running the cells: one subprocess of the base launcher per cell, resumable.

Each cell of the grid is one run of the base launcher (``python -m <base>
--flagfile=<base_flagfile> --<fixed> --<cell flags> --model_dir=<sweep_dir>/cells/<cell>``),
one after the other. A cell is finished when its ``privacy_report.json``
(:class:`tf_dpnsgd.records.RunRecord`) exists; running again skips finished
cells and resumes the others (the launchers resume from their checkpoints). A
cell whose recorded flags differ from the current ones stops the sweep.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
from typing import Sequence

from tf_dpnsgd.records import RunRecord
from tf_dpnsgd.sweeps.grid import PRIVACY_FLAGS, Cell, SweepError, SweepOptions, echo
from tf_dpnsgd.sweeps.results import FINISHED_MARKER, cell_dir, fmt, is_finished


def cell_record(opts: SweepOptions, cell: Cell) -> dict:
  """What ``cell.json`` records: the cell, its base launcher and arguments (no seed)."""
  return {"cell": cell.name, "assignments": dict(cell.assignments), "base": opts.base,
          "argv": opts.cell_argv(cell), "base_flagfile_sha256": opts.flagfile_sha256}


def check_cell_record(opts: SweepOptions, cell: Cell, directory: str) -> None:
  """Raises unless the cell folder is new or was started with the same flags."""
  path = os.path.join(directory, "cell.json")
  if not os.path.exists(path):
    if is_finished(directory):
      raise SweepError(f"{directory} holds a finished run but no cell.json: not started by "
                       "this sweep. Use a new --sweep_dir.")
    return
  with open(path) as f:
    old = json.load(f)
  new = cell_record(opts, cell)
  keys = ("base", "argv", "base_flagfile_sha256")
  if any(old.get(k) != new[k] for k in keys):
    diff = {k: (old.get(k), new[k]) for k in keys if old.get(k) != new[k]}
    raise SweepError(f"Cell {cell.name} in {opts.sweep_dir} was started with different "
                     f"settings {diff}; its run would not match this grid. Use a new "
                     "--sweep_dir (or delete that cell's folder).")


def run_cell(opts: SweepOptions, cell: Cell, directory: str) -> dict:
  """Runs (or resumes) one cell as a subprocess; returns ``{"status", "seconds", ...}``."""
  os.makedirs(directory, exist_ok=True)
  record = cell_record(opts, cell)
  with open(os.path.join(directory, "cell.json"), "w") as f:
    json.dump(record, f, indent=1)
  argv = [sys.executable, "-m", opts.base, *record["argv"], f"--model_dir={directory}"]
  if opts.cell_seeds == "fresh":  # initialisation only; noise and sampling seeds are the OS's
    argv.append(f"--seed={secrets.randbelow(2 ** 31 - 2) + 1}")
  env = dict(os.environ)
  env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  start = time.time()
  with open(os.path.join(directory, "log.txt"), "a") as log:
    log.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(record['argv'])}\n")
    log.flush()
    try:
      proc = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, env=env,
                            timeout=opts.cell_timeout, check=False)
      code = proc.returncode
    except subprocess.TimeoutExpired:
      code = None
  seconds = time.time() - start
  record.update({"seconds": round(seconds, 1), "returncode": code})
  with open(os.path.join(directory, "cell.json"), "w") as f:
    json.dump(record, f, indent=1)
  if code == 0 and is_finished(directory):
    return {"status": "finished", "seconds": seconds}
  reason = (f"timed out after {opts.cell_timeout} s" if code is None
            else f"exit code {code}" + ("" if code else f" but no {FINISHED_MARKER}"))
  return {"status": "failed", "seconds": seconds, "reason": reason,
          "log": os.path.join(directory, "log.txt")}


def run_cells(opts: SweepOptions, cells: Sequence[Cell], print_fn=echo) -> dict:
  """Runs the unfinished cells one after another; returns ``{cell name: outcome}``."""
  for cell in cells:  # check every recorded cell before running anything
    check_cell_record(opts, cell, cell_dir(opts, cell))
  outcomes = {}
  todo = [c for c in cells if not is_finished(cell_dir(opts, c))]
  print_fn(f"{len(cells)} cells: {len(cells) - len(todo)} finished (skipped), "
           f"{len(todo)} to run.")
  for i, cell in enumerate(cells):
    directory = cell_dir(opts, cell)
    if is_finished(directory):
      outcomes[cell.name] = {"status": "finished", "skipped": True}
      continue
    print_fn(f"[{i + 1}/{len(cells)}] {cell.name} ...")
    outcome = run_cell(opts, cell, directory)
    outcomes[cell.name] = outcome
    if outcome["status"] == "finished":
      record = RunRecord.read(os.path.join(directory, FINISHED_MARKER))
      print_fn(f"    done in {outcome['seconds']:.0f} s: accuracy "
               f"{fmt(record.metric('accuracy'), '.4f')}, "
               + ("non-private" if record.epsilon is None else f"epsilon {fmt(record.epsilon)}"))
    else:
      print_fn(f"    FAILED ({outcome['reason']}); see {outcome['log']}")
      if not opts.keep_going:
        raise SweepError(f"Cell {cell.name} failed ({outcome['reason']}); see {outcome['log']}.")
  return outcomes


def check_cells(opts: SweepOptions, cells: Sequence[Cell]) -> None:
  """Raises :class:`SweepError` for cells that cannot run as defined (before any runs)."""
  for cell in cells:
    opts.cell_argv(cell)  # e.g. a privacy axis on an sgd cell
  sgd = [c.name for c in cells if opts.cell_optimizer(c) == "sgd"]
  if sgd and opts.base_flagfile:
    with open(opts.base_flagfile) as f:
      names = {line.strip().lstrip("-").partition("=")[0] for line in f
               if line.strip().startswith("--")}
    given = sorted(names & set(PRIVACY_FLAGS))
    if given:
      raise SweepError(f"The base flag file {opts.base_flagfile} sets --{given[0]}, which the "
                       f"non-private cells {sgd} (optimizer=sgd) cannot take; use a base flag "
                       "file without privacy flags and set them with --fixed or a grid axis.")



__all__ = ["cell_record", "check_cell_record", "check_cells", "run_cell", "run_cells"]
