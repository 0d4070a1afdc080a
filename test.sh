#!/usr/bin/env bash
# The tests: set up (first run only) and run the whole suite once on each tested torch release,
# 2.13.0 (the CPU build, in .venv), 2.14.1 with torchvision 0.29.1 (in .venv-torch2.14, where
# the integration tests meet a real torchvision) and 2.15.0, the newest (in .venv-torch2.15), as
# scripts/requirements-torch-tested.txt lists them. Extra args go to pytest, in every run;
# FASTMUON_TEST_TORCH="2.13.0" runs one release only. Fails when any run fails.
set -euo pipefail
cd "$(dirname "$0")"
tested="$(sed -n 's/^torch==//p' scripts/requirements-torch-tested.txt | tr '\n' ' ')"
releases="${FASTMUON_TEST_TORCH:-$tested}"
for torch in $releases; do
  bash scripts/setup.sh test "$torch"
done
status=0
for torch in $releases; do
  venv=.venv
  [ "$torch" = 2.13.0 ] || venv=".venv-torch${torch%.*}"  # the name scripts/setup.sh gives it
  echo "== torch $torch ($venv)"
  "$venv/bin/python" -m pytest -q "$@" || status=$?
done
exit "$status"
