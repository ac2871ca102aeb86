#!/usr/bin/env bash
# The tests, set-up included: scripts/setup_venv.sh (a venv at .venv with torch and the project; a no-op once done),
# then `python -m pytest tests` in the repository root with the venv's Python. Arguments go to pytest and replace
# `tests`: scripts/run_tests.sh tests/single_process/test_schedules.py -q, scripts/run_tests.sh -x -k gpipe (pytest's
# testpaths still names tests/ when only options are given). This is what .ci/run runs.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${LPP_VENV:-$ROOT/.venv}"
[[ "$VENV" == /* ]] || VENV="$PWD/$VENV"
export LPP_VENV="$VENV"
"$ROOT/scripts/setup_venv.sh"
cd "$ROOT"
if [[ $# -eq 0 ]]; then set -- tests; fi
exec "$VENV/bin/python" -m pytest "$@"
