#!/usr/bin/env bash
# The whole test suite: lint, format check, types, then pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check foudre tests benchmarks
.venv/bin/ruff format --check foudre tests benchmarks
.venv/bin/mypy
.venv/bin/python -m pytest "$@"
