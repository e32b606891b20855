#!/usr/bin/env bash
# The main job: set up, then generate a story with the embedded default model, offline.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/foudre generate --prompt "${PROMPT:-Once upon a time}" --max-tokens "${MAX_TOKENS:-128}" "$@"
