#!/usr/bin/env bash
# Set up (with the test tools and cluster software) and run the whole test suite.
# Extra words are passed to pytest, e.g. scripts/test.sh tests/data -x
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --test
exec "${DDPKIT_VENV:-.venv}/bin/python" -m pytest "$@"
