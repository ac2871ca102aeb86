#!/usr/bin/env bash
# The tests, set-up included: scripts/setup_venv.sh (a venv at .venv with torch and the project; a no-op once done),
# then `python -m pytest tests -n 2 --dist loadfile` in the repository root with the venv's Python: two pytest-xdist
# workers, each running whole files (a file's module fixtures run once), so that one worker's waits (a launch's
# start, a failure test's timeout) overlap the other's compute; LPP_TEST_WORKERS sets the count (0: one process).
# Arguments go to pytest and replace all of that: scripts/run_tests.sh tests/single_process/test_schedules.py -q,
# scripts/run_tests.sh -x -k gpipe (pytest's testpaths still names tests/ when only options are given; add -n 2 for
# workers). This is what .ci/run runs.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${LPP_VENV:-$ROOT/.venv}"
[[ "$VENV" == /* ]] || VENV="$PWD/$VENV"
export LPP_VENV="$VENV"
"$ROOT/scripts/setup_venv.sh"
cd "$ROOT"
if [[ $# -eq 0 ]]; then set -- tests -n "${LPP_TEST_WORKERS:-2}" --dist loadfile; fi
exec "$VENV/bin/python" -m pytest "$@"
