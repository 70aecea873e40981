#!/usr/bin/env bash
# Creates the virtual environment for one megatron-core release (once) and installs the kit with its
# dev extra (this repository's tools, with the user's `test` and `charts` extras) and inspect, plus that release. Prints the interpreter to use on stdout (the only line
# it prints there; everything else goes to stderr), so callers run `py=$(bash ci/setup.sh)`.
#
# The release is KIT_MEGATRON_CORE (default: the newest release the registry serves, below). Each
# release has its own venv: `.venv` for the default, `.venv-mcore-<release>` for any other (an overlay
# over `.venv` holding only that megatron-core; KIT_VENV=path makes a full venv there instead). megatron-core 0.17+ declares Requires-Python >=3.12: on 3.12+ it is a plain
# install; on an older Python it is installed with --no-deps --ignore-requires-python and then its
# real dependencies (numpy, packaging, and triton, which `megatron.core.models.gpt` imports without
# declaring it). CPU machines get torch==2.13.0 first: a bare `torch` requirement would pull a
# multi-GB CUDA build. Transformer Engine is never installed here: on a machine without CUDA it
# raises RuntimeError at import and breaks `import megatron.core`. GPU containers that already ship
# torch and TE set KIT_SYSTEM_PYTHON=1 to install into the interpreter they have; there a
# preinstalled nvdlfw-inspect is kept as it is (NGC images pin it in /etc/pip/constraint.txt, and a
# source build of its v0.2 tag calls itself 0.1.0, so asking for >=0.2 would fail to resolve).
set -euo pipefail
cd "$(dirname "$0")/.."

newest=0.19.2 # the newest megatron-core on PyPI; CI's L0 runs it (bump when a release appears)
mcore=${KIT_MEGATRON_CORE:-$newest}
if ! [[ $mcore =~ ^[0-9]+(\.[0-9]+)*([a-z0-9.+-]*)$ ]]; then
  echo "ci/setup.sh: KIT_MEGATRON_CORE='$mcore' is not a release number (e.g. 0.19.2 or 0.16.1)" >&2
  exit 2
fi

# Fails unless interpreter $1 imports megatron-core $mcore; $2 names where it looked.
check_installed() {
  local got
  got=$("$1" -c 'from importlib.metadata import version; print(version("megatron-core"))')
  if [ "$got" != "$mcore" ]; then
    echo "ci/setup.sh: asked for megatron-core $mcore, $2 has $got" >&2
    exit 1
  fi
}

# Another release than the newest, in the default place: an overlay venv over `.venv` (the newest
# release's), holding only that megatron-core. Everything else (torch, the kit, its extras) is
# `.venv`'s, reached through a .pth file, so a second release costs seconds, not a second 2 GB install.
# Its own megatron-core comes first on sys.path and is the one importlib.metadata reports. `megatron`
# is a namespace package: Python would merge the base venv's `megatron/` into it and show the newest
# release's `megatron/training` to this release's core (0.19.2's over 0.16.1's: "No module named
# megatron.core.tokenizers.utils"). An empty `megatron/__init__.py` here makes the overlay's
# `megatron` a regular package holding only its own release; `python -m ci one-release` checks it
# each time the overlay is handed out.
if [ "${KIT_SYSTEM_PYTHON:-0}" != "1" ] && [ -z "${KIT_VENV:-}" ] && [ "$mcore" != "$newest" ]; then
  base_py=$(KIT_MEGATRON_CORE=$newest bash ci/setup.sh)
  venv=.venv-mcore-$mcore
  [ -x "$venv/bin/python" ] || "$("$base_py" -c 'import sys; print(sys._base_executable)')" -m venv --without-pip "$venv" >&2
  py=$venv/bin/python
  site=$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  base_site=$("$base_py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  want="$( (cat pyproject.toml ci/setup.sh; echo "megatron-core==$mcore") | sha256sum | cut -c1-16) overlay megatron-core==$mcore"
  if [ "$(cat "$venv/.kit-installed" 2>/dev/null || true)" != "$want" ]; then
    echo "ci/setup.sh: megatron-core $mcore in the overlay $venv over $(dirname "$base_py")/.." >&2
    rm -rf "${site:?}"/megatron "$site"/megatron_core-*.dist-info
    echo "import site; site.addsitedir('$(cd "$base_site" && pwd)')" >"$site/_kit_base_venv.pth"
    "$base_py" -m pip --disable-pip-version-check -q install --no-deps --ignore-requires-python \
      --target "$site" "megatron-core==$mcore" >&2
    : >"$site/megatron/__init__.py"
    check_installed "$py" "the overlay $venv"
    echo "$want" >"$venv/.kit-installed"
  fi
  "$py" -m ci one-release >&2
  echo "$py"
  exit 0
fi

if [ "${KIT_SYSTEM_PYTHON:-0}" = "1" ]; then
  py=${PYTHON:-python3}
else
  if [ -n "${KIT_VENV:-}" ]; then
    venv=$KIT_VENV
  elif [ "$mcore" = "$newest" ]; then
    venv=.venv
  else
    venv=.venv-mcore-$mcore
  fi
  [ -x "$venv/bin/python" ] || ${PYTHON:-python3} -m venv "$venv" >&2
  py=$venv/bin/python
fi

# The image's pip constraints (NGC pins every preinstalled package): PIP_CONSTRAINT (pip reads it
# too), else /etc/pip/constraint.txt. Every pip install below passes them, and a pin that cannot
# meet what the kit needs is refused in one line before pip runs (python -m ci pip-constraints).
constraints=()       # pip's arguments: -c FILE ...
constraint_files=()  # the same files, for ci/pip_constraints.py: --constraint FILE ...
files=()
if [ "${KIT_SYSTEM_PYTHON:-0}" = "1" ]; then
  read -r -a files <<<"${PIP_CONSTRAINT:-}"
  if [ "${#files[@]}" = 0 ] && [ -f /etc/pip/constraint.txt ]; then
    files=(/etc/pip/constraint.txt)
  fi
  for file in "${files[@]}"; do
    if [ ! -f "$file" ]; then
      echo "ci/setup.sh: the pip constraint file $file (PIP_CONSTRAINT) does not exist" >&2
      exit 2
    fi
    constraints+=(-c "$file")
    constraint_files+=(--constraint "$file")
  done
fi

stamp_dir=$("$py" -c 'import sys; print(sys.prefix)')
stamp=$stamp_dir/.kit-installed
want="$( (cat pyproject.toml ci/setup.sh; echo "megatron-core==$mcore"; for file in "${files[@]}"; do cat "$file"; done) | sha256sum | cut -c1-16) megatron-core==$mcore"
if [ "$(cat "$stamp" 2>/dev/null || true)" = "$want" ]; then
  echo "$py"
  exit 0
fi

echo "ci/setup.sh: installing the kit with megatron-core $mcore into $stamp_dir" >&2
pip() { "$py" -m pip --disable-pip-version-check -q "$@" "${constraints[@]}" >&2; }
extras="dev"
if [ "${KIT_SYSTEM_PYTHON:-0}" = "1" ] && "$py" -c 'import nvdlfw_inspect' 2>/dev/null; then
  echo "ci/setup.sh: keeping the interpreter's own nvdlfw-inspect" >&2
else
  extras=dev,inspect
fi
if [ "${#constraints[@]}" -gt 0 ]; then
  # megatron-core 0.17+ declares packaging>=24.2 (and torch>=2.6, numpy, which the image has).
  needs=("megatron-core==$mcore")
  [ "$(printf '%s\n' 0.17 "$mcore" | sort -V | head -1)" = 0.17 ] && needs+=("packaging>=24.2")
  "$py" -m ci pip-constraints "${constraint_files[@]}" --extras "$extras" psutil "${needs[@]}" || exit 1
fi
if ! "$py" -c 'import torch' 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    pip install torch
  else
    pip install torch==2.13.0
  fi
fi
# Not the `megatron` extra: it would resolve megatron-core by itself (0.16.1 on Python 3.11).
pip install -e ".[$extras]" psutil
if "$py" -c 'import sys; sys.exit(sys.version_info < (3, 12))'; then
  pip install "megatron-core==$mcore"
elif ! "$py" -m pip --disable-pip-version-check -q install "megatron-core==$mcore" "${constraints[@]}" >&2 2>/dev/null; then
  # Requires-Python >=3.12 (0.17+). Its declared dependencies are torch, numpy and packaging>=24.2;
  # triton is imported by megatron.core.models.gpt (fused kernels) though not declared.
  echo "ci/setup.sh: megatron-core $mcore requires a newer Python than $("$py" -V 2>&1);" \
    "installing it with --no-deps --ignore-requires-python and its real dependencies" >&2
  pip install --no-deps --ignore-requires-python "megatron-core==$mcore"
  pip install 'numpy<2.5' 'packaging>=24.2' triton
fi
# unit/test_workflows.py runs actionlint with shellcheck on every workflow: a Debian package, not a
# wheel. Installed here where we may (root with apt-get); elsewhere the test says what is missing.
if ! command -v shellcheck >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  { apt-get install -y -q shellcheck || { apt-get update -q && apt-get install -y -q shellcheck; }; } >&2 ||
    echo "ci/setup.sh: could not install shellcheck; unit/test_workflows.py will say so" >&2
fi
check_installed "$py" "$stamp_dir"
echo "$want" >"$stamp"
echo "$py"
