#!/usr/bin/env bash
# Creates .venv (once) and installs the kit with its test, megatron and inspect extras.
# CPU machines get torch==2.13.0 first: a bare `torch` requirement would pull a multi-GB CUDA build.
# Transformer Engine is never installed here: on a machine without CUDA it raises RuntimeError at
# import and breaks `import megatron.core`. GPU containers that already ship torch and TE set
# KIT_SYSTEM_PYTHON=1 to install into the interpreter they have instead of a fresh venv.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "${KIT_SYSTEM_PYTHON:-0}" = "1" ]; then
  py=${PYTHON:-python3}
else
  venv=${KIT_VENV:-.venv}
  [ -x "$venv/bin/python" ] || ${PYTHON:-python3} -m venv "$venv"
  py=$venv/bin/python
fi

stamp_dir=$("$py" -c 'import sys; print(sys.prefix)')
stamp=$stamp_dir/.kit-installed
want=$(cat pyproject.toml ci/setup.sh | sha256sum | cut -c1-16)
if [ "$(cat "$stamp" 2>/dev/null || true)" = "$want" ]; then
  exit 0
fi

echo "ci/setup.sh: installing the kit into $stamp_dir" >&2
pip() { "$py" -m pip --disable-pip-version-check -q "$@"; }
if ! "$py" -c 'import torch' 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    pip install torch
  else
    pip install torch==2.13.0
  fi
fi
pip install -e ".[test,megatron,inspect]"
echo "$want" > "$stamp"
