#!/usr/bin/env bash
# Prepares the Shakespeare user-level study offline-ready (docs/user_level.md, "Measured on
# real users"): writes ROOT/input.txt, tinyshakespeare (about 1.1 MB: speeches as
# "Speaker:" then text, blocks separated by blank lines) from karpathy/char-rnn, path
# data/tinyshakespeare/input.txt (repository licence: MIT, per its Readme; the text is
# Shakespeare's, in the public domain). Nothing else downloads: the launcher reads ROOT.
#
#   bash scripts/shakespeare_setup.sh [ROOT]     # default ROOT: ~/shakespeare_data
#
# Set CHAR_RNN_REPO to a local clone (a work tree or a bare git directory) of
# github.com/karpathy/char-rnn where GitHub cannot be reached. The study used commit
# 6f9487a6fe5b420b7ca9afb0d7c078e37c1d1b4e (file md5 below).
set -euo pipefail
ROOT="${1:-$HOME/shakespeare_data}"
MD5=6fb458f1232090904fb40fe944165e91  # md5 of the study's input.txt
mkdir -p "$ROOT"
if [ ! -f "$ROOT/input.txt" ]; then
  REPO="${CHAR_RNN_REPO:-}"
  if [ -z "$REPO" ]; then
    REPO="$ROOT/char-rnn"
    [ -d "$REPO" ] || git clone --quiet --depth 1 https://github.com/karpathy/char-rnn "$REPO"
  fi
  if [ -f "$REPO/data/tinyshakespeare/input.txt" ]; then
    cp "$REPO/data/tinyshakespeare/input.txt" "$ROOT/input.txt"
  else  # a bare git directory
    git --git-dir="$REPO" show HEAD:data/tinyshakespeare/input.txt > "$ROOT/input.txt"
  fi
fi
echo "$MD5  $ROOT/input.txt" | md5sum --check --quiet - \
  || echo "warning: $ROOT/input.txt differs from the file the study used" >&2
echo "--data_dir=$ROOT"
