#!/usr/bin/env bash
# Set up (with the test tools and cluster software) and run the whole test suite.
# Extra words are passed to pytest, e.g. scripts/test.sh tests/data -x
# The modules run on DDPKIT_TEST_WORKERS pytest-xdist workers (default 2), each module whole on one
# worker (its module-scoped fixtures, such as a warm worker server, are shared by its tests); -n 0 runs
# everything in this process.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --test
exec "${DDPKIT_VENV:-.venv}/bin/python" -m pytest -n "${DDPKIT_TEST_WORKERS:-2}" --dist loadfile "$@"
