#!/usr/bin/env bash
# The GPU proof in one call, within 8 minutes: the tests that need CUDA, then `fastmuon bench
# --device cuda` for (a) yolo26n MuSGD beside Ultralytics' MuSGD and (b) GPT-2 Muon beside
# torch.optim.Muon (and heavyball's / pytorch-optimizer's Muon where installed), each with eager
# steps and with steps in torch.compile(mode="reduce-overhead") (CUDA graphs). Writes one JSON,
# gpu-check.json, under $OUT if set, else ./gpu-check/, and prints a short summary.
#
# Assumes: run from anywhere inside a fastmuon checkout on a machine with Python >= 3.10 (3.12
# expected) whose `python3` (or $PYTHON) already imports a CUDA build of torch; nothing here
# installs or changes torch, and no network is needed. fastmuon itself is installed from this
# checkout with `pip install -e . --no-deps --no-build-isolation` where it is not installed yet,
# and src/ is put first on PYTHONPATH either way. Optional, used when importable: pytest (+ hypothesis) for the tests,
# rich for tables, ultralytics / heavyball / pytorch_optimizer for the peer rows (their rows
# say "not installed" otherwise).
#
# Usage: scripts/gpu-check.sh [--device cuda|cpu] [--quick] [--out DIR] [--budget-s S]
#   --device cpu --quick runs the same flow on a CPU in well under a minute (a dry run).
# Exit status: 0 when every part ran (or was skipped for a stated reason), 1 when one failed or
# timed out (its row in the JSON says which and shows the end of its output), 2 on a usage mistake.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY="${PYTHON:-python3}"
START=$SECONDS

if ! "$PY" -c "import torch" 2>/dev/null; then
  echo "gpu-check: error: $PY cannot import torch; install a CUDA build of torch first" >&2
  exit 2
fi
# set-up (its own time slot, never fatal): fastmuon from this checkout, unless already installed;
# src/ first on PYTHONPATH either way, so that the code measured is this checkout's
if ! "$PY" -c "import fastmuon" 2>/dev/null; then
  timeout 60 "$PY" -m pip install -q -e . --no-deps --no-build-isolation >/dev/null 2>&1 \
    || echo "gpu-check: pip install -e . did not work; using src/ on PYTHONPATH" >&2
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"

# the parts share what is left of 8 minutes (470 s, with a margin for the summary)
LEFT=$((470 - (SECONDS - START)))
exec timeout --kill-after=5 "$LEFT" "$PY" -m fastmuon.bench.gpucheck --budget-s "$((LEFT - 5))" "$@"
