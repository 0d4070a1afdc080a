#!/usr/bin/env bash
# The tests: set up (first run only) and run the whole suite. Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")"
bash scripts/setup.sh test
exec .venv/bin/python -m pytest -q "$@"
