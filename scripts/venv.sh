#!/usr/bin/env bash
# Creates or reuses .venv and installs the project into it. CPU torch is installed
# first and pinned, so that nothing later pulls a multi-GB CUDA build. The rest is installed under
# scripts/constraints.txt (the versions the suite last passed with) unless WIDEEP_UNPINNED=1.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$PY" -m venv .venv
stamp=.venv/.installed
pins=(-c scripts/constraints.txt)
[ "${WIDEEP_UNPINNED:-0}" = 1 ] && pins=()
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ scripts/constraints.txt -nt "$stamp" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -c 'import torch' 2>/dev/null || .venv/bin/python -m pip install -q "torch==${TORCH_VERSION:-2.13.0}"
  .venv/bin/python -m pip install -q "${pins[@]}" -e ".[test]"
  touch "$stamp"
fi
