#!/usr/bin/env bash
# The main example, set-up included: scripts/setup_venv.sh (a venv at .venv with torch and the project; a no-op once
# done), then examples/train_gpt.py in the repository root with the venv's Python: a GPT-style character model trained
# pipeline-parallel in 2 processes on CPU, TensorBoard logs under lightning_logs/. Arguments go to the example:
# scripts/run_example.sh --help, scripts/run_example.sh --max-steps 50 --schedule gpipe --log-dir /tmp/gpt_runs
# (a relative --log-dir is taken from the repository root).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${LPP_VENV:-$ROOT/.venv}"
[[ "$VENV" == /* ]] || VENV="$PWD/$VENV"
export LPP_VENV="$VENV"
"$ROOT/scripts/setup_venv.sh"
cd "$ROOT"
exec "$VENV/bin/python" examples/train_gpt.py "$@"
