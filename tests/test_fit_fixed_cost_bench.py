"""``benchmarks/fit_fixed_cost.py`` (issue 49): its table, phases and CSV, without timing.

The quick tier checks the script's pure parts (the machine's CPU line, the profile's
phases, the CSV rows) without importing TensorFlow; the slow test runs the script on the
Dense model once and checks that every row and phase is there. No timing is asserted.
"""

import csv
import doctest
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import fit_fixed_cost as bench  # noqa: E402  (standard library only at import)
import zygote  # children forked from a pre-imported process (tests/zygote.py)


def test_the_script_imports_no_tensorflow_and_its_doctests_pass():
  assert "tensorflow" not in vars(bench)
  assert doctest.testmod(bench).failed == 0


def test_cpu_info_reads_the_first_processor_and_avx512():
  text = ("processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Platinum 8480+\n"
          "flags\t\t: fpu sse2 avx2 avx512f avx512bw\n\n"
          "processor\t: 1\nmodel name\t: other\nflags\t\t: fpu\n")
  assert bench.cpu_info(text) == {"cpu_model": "Intel(R) Xeon(R) Platinum 8480+",
                                  "avx512": "yes"}
  assert bench.cpu_info("model name : AMD EPYC\nflags : sse avx2\n")["avx512"] == "no"
  assert bench.cpu_info("") == {"cpu_model": "unknown", "avx512": "no"}


def test_phases_sum_a_functions_entries_in_its_file_only():
  sep = os.sep
  stats = {(f"{sep}r{sep}tf_dpnsgd{sep}training.py", 10, "compile"): (1, 1, 0.0, 0.25, {}),
           (f"{sep}r{sep}tf_dpnsgd{sep}training.py", 90, "compile"): (1, 1, 0.0, 0.5, {}),
           (f"{sep}r{sep}keras{sep}training.py", 5, "compile"): (1, 1, 0.0, 9.0, {}),
           (f"{sep}r{sep}tf_dpnsgd{sep}ledger.py", 3, "state"): (7, 7, 0.0, 0.007, {})}
  phases = dict(bench.phase_ms(stats, (("compile", "training.py", "compile"),
                                       ("state", "ledger.py", "state"))))
  assert phases == pytest.approx({"compile": 750.0, "state": 7.0})
  names = [name for name, _, _ in bench.PHASES]
  assert len(names) == len(set(names))
  assert bench.top_functions(stats, 2) == [
      (500.0, 1, "training.py:90(compile)"), (250.0, 1, "training.py:10(compile)")]


def test_csv_has_one_row_per_measure_and_phase_with_the_machine(tmp_path):
  results = {"dense": {"medians": {"plain": {"first": [300.0, 200.0], "second": [60.0, 40.0]},
                                   "private": {"first": [900.0, 700.0],
                                               "second": [200.0, 150.0]}},
                       "phases": [("  ledger init", 80.0, 60.0)], "top": [],
                       "library": "/r/tf_dpnsgd"}}
  args = type("Args", (), {"label": "after", "repeats": 3, "steps": 4, "batch": 8})()
  info = {"date": "2026-01-01", "cpu_model": "AMD EPYC", "cores": 2, "avx512": "yes"}
  rows = bench.csv_rows(results, info, args, {"tensorflow": "2.21.0", "keras": "3.15.1"})
  path = str(tmp_path / "out.csv")
  bench.write_csv(path, rows, append=False)
  bench.write_csv(path, rows, append=True)  # appends rows, not a second header
  with open(path, encoding="utf-8") as f:
    read = list(csv.DictReader(f))
  assert len(read) == 2 * 5 and set(read[0]) == set(bench.CSV_FIELDS)
  first = {(r["path"], r["measure"]): r for r in read[:5]}
  assert first[("private", "first fit")]["wall_ms"] == "900"
  assert first[("plain", "second fit")]["cpu_ms"] == "40"
  phase = first[("private (cProfile)", "phase: ledger init")]
  assert (phase["wall_ms"], phase["cpu_ms"]) == ("80", "60")
  assert {r["cpu_model"] for r in read} == {"AMD EPYC"} and read[0]["avx512"] == "yes"


# runs the benchmark's child process: TensorFlow import, warm-up and a few fits (~1 min)
@pytest.mark.slow
def test_the_script_runs_on_the_dense_model_and_writes_every_row(tmp_path):
  out_csv = str(tmp_path / "fit_fixed_cost.csv")
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", CUDA_VISIBLE_DEVICES="")
  out = zygote.run([sys.executable, os.path.join(ROOT, "benchmarks", "fit_fixed_cost.py"),
                    "--models=dense", "--repeats=1", "--steps=2", "--top=3",
                    f"--output={out_csv}"],
                   capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  assert "dense  private" in out.stdout and "interaction probe" in out.stdout, out.stdout
  with open(out_csv, encoding="utf-8") as f:
    rows = list(csv.DictReader(f))
  assert len(rows) == 4 + len(bench.PHASES)
  timed = [r for r in rows if not r["path"].endswith("(cProfile)")]
  assert all(float(r["wall_ms"]) > 0 and float(r["cpu_ms"]) > 0 for r in timed), timed
  assert all(r["cpu_ms"] != "" for r in rows), rows
  probe = [r for r in rows if r["measure"] == "phase: interaction probe"]
  assert float(probe[0]["wall_ms"]) > 0  # the probe ran in the profiled fit
