#!/usr/bin/env bash
# The one-GPU check: every part of lightning_pp that one GPU can run, one line per check (CHECK name PASS|FAIL|SKIP
# detail), ending with "gpu_check: N passed, N failed, N skipped". For a lent GPU machine: it uses that machine's own
# Python (LPP_PYTHON, else python3; torch, lightning, optionally transformers) with the repository on PYTHONPATH and
# installs nothing. Arguments pass through to scripts/gpu_check.py: --cpu (the same checks on the CPU, as CI runs
# them), --budget SECONDS (default 420: what is not started by then is skipped), -k NAME (only checks whose name
# contains NAME).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${LPP_PYTHON:-python3}"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export TOKENIZERS_PARALLELISM=false
exec "$PY" "$ROOT/scripts/gpu_check.py" "$@"
