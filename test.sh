#!/usr/bin/env bash
# The tests: set up (first run only) and run the whole suite once on each tested torch release,
# 2.13.0 (the CPU build, in .venv), 2.14.1 with torchvision 0.29.1 (in .venv-torch2.14, where
# the integration tests meet a real torchvision) and 2.15.0, the newest (in .venv-torch2.15), as
# scripts/requirements-torch-tested.txt lists them. Extra args go to pytest, in every run;
# FASTMUON_TEST_TORCH="2.13.0" runs one release only. mypy (pyproject.toml's [tool.mypy]) checks
# the package once, in the first release's environment. Fails when the type check or any run fails.
set -euo pipefail
cd "$(dirname "$0")"
tested="$(sed -n 's/^torch==//p' scripts/requirements-torch-tested.txt | tr '\n' ' ')"
releases="${FASTMUON_TEST_TORCH:-$tested}"
for torch in $releases; do
  bash scripts/setup.sh test "$torch"
done
venv_of() {  # the name scripts/setup.sh gives the environment of torch release $1
  if [ "$1" = 2.13.0 ]; then echo .venv; else echo ".venv-torch${1%.*}"; fi
}
status=0
read -r first_release _ <<<"$releases"
first="$(venv_of "$first_release")"
echo "== mypy ($first)"
"$first/bin/python" -m mypy || status=$?
for torch in $releases; do
  venv="$(venv_of "$torch")"
  echo "== torch $torch ($venv)"
  "$venv/bin/python" -m pytest -q "$@" || status=$?
done
exit "$status"
