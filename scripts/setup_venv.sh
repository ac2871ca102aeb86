#!/usr/bin/env bash
# Sets up the project's virtual environment, then exits: creates it when there is none (.venv at the repository root),
# installs the pinned torch -- the CPU build where no NVIDIA GPU answers `nvidia-smi`, the CUDA build where one does --
# and the project with its dev extras. run_tests.sh and run_example.sh call it first; it can also run alone.
#
# A second call is a no-op: a stamp file in the venv records what was installed (the torch pin and build, the extras,
# pyproject.toml's hash, the Python version, the repository path); any change there, or a missing stamp (a set-up that
# failed half-way), installs again. Delete the venv to start from scratch.
#
# Settings (environment variables, all optional):
#   LPP_VENV          where the venv lives                        (default: <repository>/.venv)
#   LPP_PYTHON        the interpreter that creates it, 3.10 or later  (default: python3, else python)
#   LPP_TORCH_BUILD   auto, cpu or cuda                           (default: auto, by nvidia-smi)
#   LPP_TORCH_INDEX   PyTorch's CPU wheel index                   (default: https://download.pytorch.org/whl/cpu)
#   LPP_EXTRAS        the project's extras                        (default: dev)
#
# Only python -m venv and pip: on machines that serve a local torch wheel to pip (this project's CI machine), pip finds
# it and uv or poetry would not.
set -euo pipefail

TORCH_VERSION="2.13.0"

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${LPP_VENV:-$ROOT/.venv}"
[[ "$VENV" == /* ]] || VENV="$PWD/$VENV"
EXTRAS="${LPP_EXTRAS:-dev}"
TORCH_INDEX="${LPP_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}"
STAMP="$VENV/.lightning_pp_setup"

say() { echo "[setup_venv] $*" >&2; }

# --- which torch build ------------------------------------------------------------------------------------------------
BUILD="${LPP_TORCH_BUILD:-auto}"
if [[ "$BUILD" == auto ]]; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then
        BUILD=cuda
    else
        BUILD=cpu
    fi
fi
if [[ "$BUILD" != cpu && "$BUILD" != cuda ]]; then
    say "LPP_TORCH_BUILD must be auto, cpu or cuda, not '$BUILD'"
    exit 2
fi

# --- the venv ---------------------------------------------------------------------------------------------------------
PY="$VENV/bin/python"
if [[ ! -x "$PY" ]] || ! "$PY" -c "" >/dev/null 2>&1; then
    BASE="${LPP_PYTHON:-}"
    if [[ -z "$BASE" ]]; then
        if command -v python3 >/dev/null 2>&1; then BASE=python3; else BASE=python; fi
    fi
    if ! "$BASE" -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null; then
        say "$BASE is missing or older than Python 3.10; point LPP_PYTHON at a Python 3.10 or later"
        exit 2
    fi
    if [[ -f "$VENV/pyvenv.cfg" ]]; then
        say "$VENV is a virtual environment whose Python no longer runs: making it anew"
        rm -rf "$VENV"
    elif [[ -e "$VENV" && -n "$(ls -A "$VENV" 2>/dev/null)" ]]; then
        say "$VENV exists and is no virtual environment; move it away or point LPP_VENV elsewhere"
        exit 2
    fi
    base_desc="$("$BASE" -c 'import sys; print(sys.executable, sys.version.split()[0])')"
    say "creating the virtual environment $VENV with $base_desc"
    "$BASE" -m venv "$VENV"
fi

# --- is it already set up? --------------------------------------------------------------------------------------------
want="torch=$TORCH_VERSION build=$BUILD extras=$EXTRAS root=$ROOT"
want+=" python=$("$PY" -c 'import sys; print("%d.%d.%d" % sys.version_info[:3])')"
want+=" pyproject=$(cksum <"$ROOT/pyproject.toml" | cut -d' ' -f1)"
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$want" ]]; then
    exit 0
fi
rm -f "$STAMP"

# --- torch ------------------------------------------------------------------------------------------------------------
pip() { "$PY" -m pip --disable-pip-version-check "$@"; }

have="$("$PY" -c 'from importlib.metadata import version
try:
    print(version("torch"))
except Exception:
    print("")')"
# a CPU build is tagged +cpu (untagged on macOS); a CUDA build is untagged (PyPI's Linux wheel) or tagged +cuXYZ. An
# untagged one is kept on a machine without a GPU too (it runs on the CPU): it got there through the fallback below,
# and replacing it would only download it again.
torch_ok=0
case "$BUILD:$have" in
    cpu:"$TORCH_VERSION" | cpu:"$TORCH_VERSION+cpu"*) torch_ok=1 ;;
    cuda:"$TORCH_VERSION" | cuda:"$TORCH_VERSION+cu"*) torch_ok=1 ;;
esac
if [[ "$torch_ok" == 0 ]]; then
    if [[ -n "$have" ]]; then
        say "replacing torch $have with the $BUILD build of torch $TORCH_VERSION"
        pip uninstall --yes --quiet torch
    fi
    if [[ "$BUILD" == cpu ]]; then
        say "installing torch==$TORCH_VERSION, CPU build (from $TORCH_INDEX, else the default index)"
        # PyTorch's CPU index first, given up on quickly (10 s timeout, one retry) where it cannot be reached; then
        # the plain pin, which on this project's CI machine is a local CPU wheel (elsewhere, on Linux, PyPI's CUDA
        # build: it runs on the CPU too)
        log="$(mktemp)"
        if pip install --quiet --timeout 10 --retries 1 --index-url "$TORCH_INDEX" "torch==$TORCH_VERSION" >"$log" 2>&1
        then
            rm -f "$log"
        else
            why="$(grep -m1 -E 'ERROR|Could not' "$log" || true)"
            say "PyTorch's CPU index did not serve torch==$TORCH_VERSION ($why);"
            say "installing the plain pin torch==$TORCH_VERSION instead"
            rm -f "$log"
            pip install --quiet "torch==$TORCH_VERSION"
        fi
    else
        say "installing torch==$TORCH_VERSION, CUDA build (PyPI's default Linux wheel; several GB)"
        pip install --quiet "torch==$TORCH_VERSION"
    fi
fi

# --- the project ------------------------------------------------------------------------------------------------------
# torch stays pinned so that no dependency swaps the build installed above
say "installing the project: pip install -e \".[$EXTRAS]\" (torch==$TORCH_VERSION kept)"
pip install --quiet -e "$ROOT[$EXTRAS]" "torch==$TORCH_VERSION"

"$PY" -c 'import torch, lightning_pp' >/dev/null
say "ready: $VENV (torch $("$PY" -c 'from importlib.metadata import version; print(version("torch"))'))"
echo "$want" >"$STAMP"
