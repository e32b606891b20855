#!/usr/bin/env bash
# The whole test suite: lint, format check, types, then pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check foudre tests benchmarks
.venv/bin/ruff format --check foudre tests benchmarks
.venv/bin/mypy
# two worker processes (one torch thread each: tests/conftest.py), a module at a time each, so
# that a module's fixtures are built once; FOUDRE_TEST_WORKERS=0 runs them in this process
.venv/bin/python -m pytest -n "${FOUDRE_TEST_WORKERS:-2}" --dist loadscope "$@"
