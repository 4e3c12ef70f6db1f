"""GLUE SST-2 (binary sentiment): local GLUE TSVs first, then tensorflow-datasets.

GLUE's test split has no public labels, so SST-2 accuracy is conventionally
reported on the dev split; :func:`load_sst2` returns train and dev.
"""

from __future__ import annotations

import csv
import os

import numpy as np

SST2_FOLDER = "SST-2"
SST2_URL = "https://dl.fbaipublicfiles.com/glue/data/SST-2.zip"
SST2_FILES = ("train.tsv", "dev.tsv")
NUM_CLASSES = 2

LAYOUT_HELP = (
    f"Expected the GLUE SST-2 folder: '{SST2_FOLDER}/train.tsv' and '{SST2_FOLDER}/dev.tsv', "
    "tab-separated, UTF-8, header 'sentence<TAB>label', labels 0/1. Download "
    f"{SST2_URL}, unzip it, and pass data_dir=<the GLUE folder containing {SST2_FOLDER}> "
    "(or the SST-2 folder itself).")


def load_sst2(data_dir=None):
  """Loads SST-2 train and dev sentences with their labels.

  Args:
    data_dir: local GLUE data: the ``SST-2`` folder or a folder containing it.
      ``None``: tensorflow-datasets ``glue/sst2`` (train and validation).

  Returns:
    ``(train_sentences, train_labels, dev_sentences, dev_labels)``: lists of
    ``str`` and int64 arrays of 0 (negative) / 1 (positive).

  Raises:
    FileNotFoundError: ``data_dir`` lacks the layout, or no ``data_dir`` was
      given and tensorflow-datasets cannot provide the data; the message names
      the layout to provide and where to download it.
    ValueError: a malformed TSV (the message names file and line).
  """
  if data_dir is not None:
    folder = find_sst2_dir(data_dir)
    train = read_labeled_tsv(os.path.join(folder, "train.tsv"))
    dev = read_labeled_tsv(os.path.join(folder, "dev.tsv"))
  else:
    try:
      train, dev = _load_tfds()
    except Exception as e:  # ImportError, network errors, tfds' own errors.
      raise FileNotFoundError(
          f"SST-2 is not available: no data_dir was given and tensorflow-datasets could not "
          f"provide 'glue/sst2' ({type(e).__name__}: {e}). {LAYOUT_HELP}") from e
  for name, (_, labels) in (("train", train), ("dev", dev)):
    _check_binary(labels, name)
  return train[0], train[1], dev[0], dev[1]


def find_sst2_dir(data_dir) -> str:
  """Returns the folder holding ``train.tsv`` and ``dev.tsv``: ``data_dir`` or ``data_dir/SST-2``."""
  data_dir = os.fspath(data_dir)
  for folder in (data_dir, os.path.join(data_dir, SST2_FOLDER)):
    if all(os.path.isfile(os.path.join(folder, f)) for f in SST2_FILES):
      return folder
  raise FileNotFoundError(f"No SST-2 train.tsv/dev.tsv in '{data_dir}'. {LAYOUT_HELP}")


def read_labeled_tsv(path, text_column="sentence", label_column="label"):
  """Reads a GLUE-style TSV with a header row.

  Quotes are literal text (GLUE files are not CSV-quoted), as in the GLUE
  reference processors (``csv.reader(..., quotechar=None)``).

  Args:
    path: the ``.tsv`` file.
    text_column, label_column: header names of the text and integer label.

  Returns:
    ``(texts: list[str], labels: int64 array)``.

  Raises:
    ValueError: missing columns, a row with the wrong number of fields, or a
      non-integer label (the message names the line).
  """
  with open(path, encoding="utf-8", newline="") as f:
    rows = csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE)
    header = next(rows, None)
    if header is None or text_column not in header or label_column not in header:
      raise ValueError(f"{path}: the header must name '{text_column}' and '{label_column}'; "
                       f"got {header}. {LAYOUT_HELP}")
    text_at, label_at = header.index(text_column), header.index(label_column)
    texts, labels = [], []
    for line, row in enumerate(rows, start=2):
      if len(row) != len(header):
        raise ValueError(f"{path}:{line}: {len(row)} tab-separated fields, the header has "
                         f"{len(header)}.")
      try:
        labels.append(int(row[label_at]))
      except ValueError:
        raise ValueError(f"{path}:{line}: label {row[label_at]!r} is not an integer.") from None
      texts.append(row[text_at])
  return texts, np.asarray(labels, dtype=np.int64)


def _check_binary(labels, split):
  bad = sorted(set(np.unique(labels).tolist()) - {0, 1})
  if bad:
    raise ValueError(f"SST-2 {split} labels must be 0 or 1; found {bad}.")


def _load_tfds():
  import tensorflow_datasets as tfds  # optional dependency
  splits = tfds.load("glue/sst2", split=["train", "validation"])
  out = []
  for split in splits:  # batches, not batch_size=-1 (which needs the split sizes' metadata)
    texts, labels = [], []
    for batch in tfds.as_numpy(split.batch(10_000)):
      texts += [s.decode("utf-8") for s in batch["sentence"].tolist()]
      labels.append(batch["label"])
    out.append((texts, np.concatenate(labels).astype(np.int64)))
  return tuple(out)


__all__ = ["LAYOUT_HELP", "NUM_CLASSES", "SST2_URL", "find_sst2_dir", "load_sst2",
           "read_labeled_tsv"]
