#!/usr/bin/env bash
# One prepared GPU check (details: scripts/gpu_check.py). Uses the wheels carried in .whl/ when present.
# Usage: bash scripts/gpu_check.sh [--budget 540] [--quick] [--out DIR] [other gpu_check.py options]
set -u
cd "$(dirname "$0")/.." || exit 2
PY="${PYTHON:-$(command -v python3 || command -v python)}"
args=()
if [ -d .whl ]; then
    args+=(--wheels .whl)
fi
exec "$PY" scripts/gpu_check.py ${args[@]+"${args[@]}"} "$@"
