#!/usr/bin/env bash
# Set everything up and run a short SPD generation on the embedded default model.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m spd_fast generate --user "${1:-Write a haiku about rain.}" --max-new-tokens 64
