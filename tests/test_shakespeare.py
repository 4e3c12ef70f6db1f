"""Shakespeare roles as users: the loader (tf_dpnsgd.data.shakespeare) on a fixture written
here, and the launcher (tf_dpnsgd.launch.shakespeare) at both privacy units and without DP
on synthetic data in the same file format, in one process (tests/launch_each.py)."""

import json
import os

import numpy as np
import pytest

from launch_each import checked
from launch_each import launch_each
from tf_dpnsgd.data import shakespeare

FIXTURE = """First Citizen:
Before we proceed.

All:
Speak, speak.

First Citizen:
You are all resolved?

stray block without a speaker

MENENIUS:
Why, masters.
"""


def _write(folder, text):
  os.makedirs(folder, exist_ok=True)
  with open(os.path.join(folder, shakespeare.FILENAME), "w", encoding="utf-8") as f:
    f.write(text)
  return str(folder)


def test_parse_joins_a_roles_speeches_in_file_order_and_skips_blocks_without_speaker():
  texts = shakespeare.user_texts(shakespeare.parse_speeches(FIXTURE))
  assert texts == {"First Citizen": "Before we proceed.\nYou are all resolved?",
                   "All": "Speak, speak.", "MENENIUS": "Why, masters."}


def test_windows_predict_each_strided_character_from_the_left_padded_context():
  ids = shakespeare.encode("abcdef")
  x, y = shakespeare.windows(ids, context=3, stride=2)
  a, b, c, d, e, f = ids.tolist()
  assert x.tolist() == [[0, 0, a], [a, b, c], [c, d, e]]  # targets at positions 1, 3, 5
  assert y.tolist() == [b, d, f]
  assert shakespeare.encode("\u00e9")[0] == 0  # outside the public vocabulary: padding id


def test_loader_splits_by_role_and_keeps_every_row_of_a_role_together(tmp_path):
  data_dir = _write(tmp_path, FIXTURE)
  fractions = {n: shakespeare.is_test_user(n, 0.5) for n in ("First Citizen", "All", "MENENIUS")}
  assert fractions == {"First Citizen": True, "All": False, "MENENIUS": True}  # md5 of names
  train, test = shakespeare.load_shakespeare(data_dir, context=4, stride=5, test_fraction=0.5)
  assert not set(train.users) & set(test.users)
  for split in (train, test):
    assert split.x.shape == (len(split.y), 4) and split.x.dtype == np.int32
    for name in set(split.users):
      assert fractions[name] == (split is test)
  rows = {n: int(np.sum(np.r_[train.users, test.users] == n)) for n in fractions}
  # targets at 1, 6, 11, ... of each role's joined text
  assert rows == {n: len(range(1, len(t), 5)) for n, t in
                  shakespeare.user_texts(shakespeare.parse_speeches(FIXTURE)).items()}


def test_loader_says_how_to_get_the_file(tmp_path):
  with pytest.raises(FileNotFoundError, match="shakespeare_setup.sh"):
    shakespeare.load_shakespeare(str(tmp_path))


def _synthetic(folder, roles=40, seed=0):
  """A tinyshakespeare-format file: ``roles`` roles with 1 to 30 speeches each."""
  rng = np.random.default_rng(seed)
  words = ["thou", "art", "my", "lord", "good", "sir", "the", "king", "and", "love"]
  blocks = []
  for r in range(roles):
    for _ in range(int(rng.integers(1, 30)) if r % 3 else 1):
      speech = " ".join(rng.choice(words, size=int(rng.integers(3, 12))))
      blocks.append(f"ROLE {r}:\n{speech.capitalize()}.")
  rng.shuffle(blocks)
  return _write(folder, "\n\n".join(blocks) + "\n")


@pytest.mark.slow
def test_launcher_user_example_and_nonprivate_runs_report_their_unit(tmp_path):
  data_dir = _synthetic(tmp_path / "data")
  common = [f"--data_dir={data_dir}", "--context=8", "--stride=8", "--width=8",
            "--max_examples_per_user=4", "--epochs=2", "--seed=0"]
  runs = {"user": ["--privacy_unit=user", "--batch_size=8", "--target_epsilon=8"],
          "example": ["--privacy_unit=example", "--batch_size=16", "--target_epsilon=8"],
          "sgd": ["--optimizer=sgd", "--learning_rate=0.1", "--batch_size=16"]}
  argvs = [common + argv + [f"--model_dir={tmp_path / name}"] for name, argv in runs.items()]
  argvs.append(common[:-3] + ["--privacy_unit=user", "--max_examples_per_user=0",
                              f"--model_dir={tmp_path / 'bad'}"])
  results = launch_each("tf_dpnsgd.launch.shakespeare", argvs)
  reports = {}
  for name, result in zip(runs, results):
    checked(result, name)
    assert "test accuracy" in result.stdout
    with open(tmp_path / name / "privacy_report.json") as f:
      reports[name] = json.load(f)
    with open(tmp_path / name / "bound_diagnostics.json") as f:
      diag = json.load(f)
    assert diag["max_examples_per_user"] == 4 and diag["users_truncated"] >= 1
    assert "NOT_PRIVATE" in diag and "rows_unused" not in reports[name]
  user, example, sgd = reports["user"], reports["example"], reports["sgd"]
  assert user["sampling"] == "user_poisson" and user["epsilon"] <= 8.0 + 1e-6
  assert any("privacy unit is a user" in n for n in user["notes"])
  for private in (user, example):  # the exact counts the launcher prints are named
    assert any("bound_diagnostics.json" in item for item in private["not_covered"])
  assert example["sampling"] == "poisson" and example["privacy_unit"] == "example"
  group = example["group_privacy"]  # extra fields sit at the top level
  assert group["rows_per_user"] == 4 and group["epsilon"] <= 8.0 and group["delta"] <= 1e-4
  # the group statement is the example-level run's accounting, converted
  # (at a smaller example-level delta than the report's, so at least k times its epsilon)
  assert group["epsilon"] >= 4 * example["epsilon"] * (1 - 1e-9)
  assert example["epsilon"] <= 8.0 / 4
  # the example-level run trains on the bounded rows only: at most k per role
  assert example["dataset_size"] <= 4 * user["dataset_size"]
  assert sgd["private"] is False and sgd.get("epsilon") is None
  bad = results[-1]
  assert bad.returncode == 1 and "max_examples_per_user must be >= 1" in bad.stderr
