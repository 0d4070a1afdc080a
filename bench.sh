#!/usr/bin/env bash
# The main job: set up (first run only) and run the side-by-side benchmark. Extra args go to `fastmuon bench`.
set -euo pipefail
cd "$(dirname "$0")"
bash scripts/setup.sh bench
exec .venv/bin/fastmuon bench "$@"
