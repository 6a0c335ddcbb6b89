#!/usr/bin/env bash
# Set everything up and run the test suite (what CI runs).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Unbuffered, so a run that is cut off still shows how far it got; pytest-timeout fails a test that
# hangs (limit in pyproject.toml); the outer timeout interrupts the whole run in time to print the
# summary and the slowest tests, well inside CI's 90 minutes.
export PYTHONUNBUFFERED=1
limit=()
command -v timeout >/dev/null && limit=(timeout -s INT -k 120 "${SPD_FAST_TEST_BUDGET_S:-4800}")  # coreutils
exec ${limit[@]+"${limit[@]}"} .venv/bin/python -m pytest -q --durations=15 "$@"
