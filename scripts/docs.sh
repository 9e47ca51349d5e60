#!/usr/bin/env bash
# Serve the manual (docs/, mkdocs.yml) at http://127.0.0.1:8000, rebuilt on every change; Ctrl-C stops it.
# Installs the `docs` extra into the virtual environment on first use. Extra words go to `mkdocs serve`.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${DDPKIT_VENV:-.venv}"
[[ -x "$venv/bin/python" ]] || bash scripts/setup.sh
if ! "$venv/bin/python" -c "import mkdocs, material, mkdocstrings_handlers.python" >/dev/null 2>&1; then
  echo "docs: installing the docs extra (mkdocs-material, mkdocstrings-python)" >&2
  "$venv/bin/python" -m pip install -q -e ".[docs]"
fi
exec "$venv/bin/python" -m mkdocs serve "$@"
