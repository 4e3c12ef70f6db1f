#!/usr/bin/env bash
# Checks the Bazel build offline: installs Debian's bazel-bootstrap (Bazel 4.2.3)
# if no `bazel` is on PATH, then `bazel query //...`, `bazel build //...` and
# `bazel test` of one fast target (default //:test_transforms).
#
#   bash scripts/bazel_check.sh                      # //:test_transforms
#   bash scripts/bazel_check.sh //:test_noise //:test_doctests
#
# Python: tests run with the virtual environment's python3 ($VENV, default
# .venv, with TensorFlow and the `test` extra: pip install -e ".[test]"), put
# first on PATH; .bazelrc passes PATH to the tests. Not part of .ci/run.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv}"
TARGETS=("$@")
[ ${#TARGETS[@]} -gt 0 ] || TARGETS=(//:test_transforms)

if ! command -v bazel >/dev/null 2>&1; then
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -q
  $SUDO apt-get install -y -q bazel-bootstrap
fi
if [ ! -x "$VENV/bin/python3" ]; then
  echo "bazel_check: no virtual environment at $VENV (python3 -m venv $VENV && $VENV/bin/pip install -e '.[test]')" >&2
  exit 2
fi
export PATH="$PWD/$VENV/bin:$PATH"
# Stop this workspace's Bazel server on exit (it would idle for hours).
trap 'bazel shutdown >/dev/null 2>&1 || true' EXIT

echo "bazel: $(dpkg-query -W -f='${Package} ${Version}' bazel-bootstrap 2>/dev/null || command -v bazel)"
echo "python for tests: $(command -v python3) ($(python3 -c 'import tensorflow as tf; print("tensorflow", tf.__version__)' 2>/dev/null || echo 'no tensorflow'))"

log="$(mktemp)"
run() {  # run a bazel command quietly; on failure print its output and exit
  if ! bazel "$@" >"$log" 2>&1; then
    cat "$log"; echo "bazel $*: FAILED" >&2; exit 1
  fi
}
run query //...
echo "bazel query //...: $(grep -c '^//' "$log") targets ($(grep -c '^//:test_' "$log") py_test)"
run build //...
echo "bazel build //...: OK"
status=0
bazel test "${TARGETS[@]}" >"$log" 2>&1 || status=$?
grep -E '^//|^Executed|^FAIL|^ERROR' "$log" || cat "$log"
echo "bazel test ${TARGETS[*]}: $([ "$status" -eq 0 ] && echo PASSED || echo "FAILED (exit $status)")"
rm -f "$log"
exit "$status"
