#!/usr/bin/env bash
# The tests. `./test.sh` sets up .venv (first run only: torch 2.13.0's CPU build), type-checks the
# package with mypy and runs the quick suite there: every test but those marked `slow` (pyproject's
# markers), which still imports and exercises every module. `./test.sh --all` is what CI runs:
# every tested release of scripts/requirements-torch-tested.txt, each in its own venv (see
# scripts/setup.sh), the whole suite (slow tests included) on the releases in FULL_RELEASES and the
# quick suite on the others, so that four releases stay within CI's time. Other arguments go to
# pytest, in every run (`./test.sh -k planner`). FASTMUON_TEST_TORCH="2.15.0" picks the releases of
# a run, FASTMUON_TEST_FULL="2.13.0 2.15.0" those that get the whole suite under --all. Fails when
# the type check or any run fails.
set -euo pipefail
cd "$(dirname "$0")"
all=0
if [ "${1:-}" = --all ]; then
  all=1
  shift
fi
tested="$(sed -n 's/^torch==//p' scripts/requirements-torch-tested.txt | tr '\n' ' ')"
if [ "$all" = 1 ]; then default_releases="$tested"; else default_releases=2.13.0; fi
releases="${FASTMUON_TEST_TORCH:-$default_releases}"
# the whole suite where torchvision is there (Ultralytics' trainer runs) and on the newest release
full_releases="${FASTMUON_TEST_FULL:-2.14.1 2.15.0}"
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
  if [ "$all" = 1 ] && [[ " $full_releases " == *" $torch "* ]]; then
    echo "== torch $torch ($venv): the whole suite"
    "$venv/bin/python" -m pytest -q "$@" || status=$?
  else
    echo "== torch $torch ($venv): the quick suite (-m 'not slow'; ./test.sh --all runs the rest)"
    "$venv/bin/python" -m pytest -q -m "not slow" "$@" || status=$?
  fi
done
exit "$status"
