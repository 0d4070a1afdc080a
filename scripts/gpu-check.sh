#!/usr/bin/env bash
# The GPU proof in one call, within 8 minutes (python -m fastmuon.bench.gpucheck; the parts and
# their figures: docs/performance.md, "On a GPU"). Each part is its own process with its own time
# slot (plus whatever the parts before it left unused), cheap and most telling first:
#   correctness  MuSGD, Muon, NorMuon, AdaMuon steps (NS in bf16 and fp32; a packed model and
#                72 MiB of same-shape matrices, stepped bucket by bucket) against the CPU
#                per-parameter fp32 reference at the suite's bounds; a NaN gradient under
#                nonfinite="skip"; torch.optim.SGD(fused=True) against MuSGD's SGD half
#   memory       yolo26n MuSGD, GPT-2 Muon, Llama 3 8B's layers: measured peak extra memory, host
#                syncs (set_sync_debug_mode warnings, profiler host waits) and ms/step beside the
#                trace's predictions on fake tensors (bytes moved are modelled, not measured)
#   cuda-graph   docs/performance.md's capturable recipe captured, replayed, timed beside eager
#   distributed  a one-process NCCL world: a DDP-style and an FSDP2 step, host syncs counted
#   *-trace      `fastmuon bench --device cuda --trace`: the modelled times of each contender
#   *-eager      `fastmuon bench --device cuda`: yolo26n MuSGD beside Ultralytics' MuSGD, GPT-2
#                Muon beside torch.optim.Muon (and heavyball's / pytorch-optimizer's Muon)
#   cuda-tests   the tests that need CUDA (pytest -m cuda)
#   *-compiled   the same benchmarks, steps in torch.compile(mode="reduce-overhead") (CUDA graphs)
# Writes one JSON, gpu-check.json, under $OUT if set, else ./gpu-check/, after every part (a part
# that times out loses only itself), prints a short summary and a closing table (claim,
# predicted, measured, holds?), also in the JSON as "verdict".
#
# Assumes: run from anywhere inside a fastmuon checkout on a machine with Python >= 3.10 (3.12
# expected) whose `python3` (or $PYTHON) already imports a CUDA build of torch; nothing here
# installs or changes torch, and no network is needed. fastmuon itself is installed from this
# checkout with `pip install -e . --no-deps --no-build-isolation` where it is not installed yet,
# and src/ is put first on PYTHONPATH either way. Optional, used when importable: pytest (+ hypothesis) for the tests,
# rich for tables, ultralytics / heavyball / pytorch_optimizer for the peer rows (their rows
# say "not installed" otherwise).
#
# Peers without a network: beforehand, on a machine with the registry, put their wheels in
# .gpu-wheels/ (ignored by git) for the GPU machine's Python (3.12 on the lent image):
#   pip download --no-deps --only-binary=:all: --python-version 3.12 -d .gpu-wheels \
#     ultralytics==8.4.190 heavyball==3.2.1 pytorch_optimizer==4.1.0 \
#     pytest pluggy iniconfig packaging hypothesis attrs sortedcontainers
# (no dependencies, so pip never fetches or swaps torch). Where the folder holds wheels, the
# check installs them with --no-index --no-deps into a scratch folder put on PYTHONPATH after
# src/, so the Ultralytics MuSGD and peer rows run, and the CUDA tests (skipped, with the reason,
# where pytest or hypothesis cannot be imported); nothing is installed into the environment.
#
# Usage: scripts/gpu-check.sh [--device cuda|cpu] [--quick] [--out DIR] [--budget-s S]
#   --device cpu --quick runs every part a CPU can run, at toy sizes (gloo for NCCL); the graph,
#   compiled and CUDA-test parts are listed as skipped with their reason (a dry run, itself a
#   test: tests/tools/test_gpu_check.py).
# Exit status: 0 when every part ran (or was skipped for a stated reason) and every correctness
# claim holds; 1 when a part failed or timed out (its row in the JSON says which and shows the
# end of its output) or a correctness claim does not hold; 2 on a usage mistake.
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
if compgen -G ".gpu-wheels/*.whl" >/dev/null; then
  SCRATCH="$(mktemp -d "${TMPDIR:-/tmp}/gpu-check-peers.XXXXXX")"
  if timeout 60 "$PY" -m pip install -q --no-index --no-deps --target "$SCRATCH" .gpu-wheels/*.whl; then
    export PYTHONPATH="$PYTHONPATH:$SCRATCH"
  else
    echo "gpu-check: the wheels in .gpu-wheels/ did not install; the peer rows will say not installed" >&2
  fi
fi

# the parts share what is left of 8 minutes (470 s, with a margin for the summary)
LEFT=$((470 - (SECONDS - START)))
exec timeout --kill-after=5 "$LEFT" "$PY" -m fastmuon.bench.gpucheck --budget-s "$((LEFT - 5))" "$@"
