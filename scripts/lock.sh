#!/usr/bin/env bash
# Rewrites scripts/constraints.txt from .venv: run it after `WIDEEP_UNPINNED=1 make test` passes
# on a fresh .venv, to move the pinned set forward.
set -euo pipefail
cd "$(dirname "$0")/.."
{
  grep '^#' scripts/constraints.txt
  .venv/bin/python -m pip freeze | grep -v -E '^-e|^wideep|^torch==|^#'
} > scripts/constraints.txt.new
mv scripts/constraints.txt.new scripts/constraints.txt
