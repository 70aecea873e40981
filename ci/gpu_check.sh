#!/usr/bin/env bash
# The single-GPU check in one command: bash ci/gpu_check.sh OUTDIR [--dry-run] [--only STEPS]
#
# Runs in the interpreter it finds (python3, or $PYTHON), which must already have torch with CUDA
# and pytest (no network is assumed). Wheels carried in for what it lacks (megatron-core and its
# pure-Python needs; hypothesis and sortedcontainers, which the GPU test files import) are installed
# first from $KIT_WHEELS, offline, if that folder is set: `pip download hypothesis megatron-core -d
# wheels` on a machine with network. The pytest step collects only the files holding GPU tests and
# names, in one line, a module they import that the interpreter lacks. The repository root goes on
# PYTHONPATH, so the kit itself needs no install.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
if [ "$#" -lt 1 ]; then
  echo "usage: bash ci/gpu_check.sh OUTDIR [--dry-run] [--only STEP,...] [--budget-s S]" >&2
  exit 2
fi
if [ -n "${KIT_WHEELS:-}" ]; then
  shopt -s nullglob
  wheels=("$KIT_WHEELS"/*.whl)
  if [ "${#wheels[@]}" -gt 0 ]; then
    "$PY" -m pip install --quiet --no-index --find-links "$KIT_WHEELS" "${wheels[@]}"
  fi
fi
cd "$ROOT"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
exec "$PY" -m ci gpu-check "$@"
