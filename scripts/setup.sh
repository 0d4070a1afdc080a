#!/usr/bin/env bash
# Make (or reuse) .venv with the CPU build of torch and fastmuon installed editable with EXTRAS.
# Sourced by bench.sh and test.sh so that each is one command on a fresh machine.
set -euo pipefail
EXTRAS="${1:-test}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
# torch first and pinned: an unpinned torch would pull a multi-GB CUDA build.
.venv/bin/python -c "import torch" 2>/dev/null || .venv/bin/python -m pip install -q torch==2.13.0
.venv/bin/python -m pip install -q -e ".[$EXTRAS]"
# The tests run Ultralytics' trainer (the [ultralytics] extra). torch is pinned in the same command
# so that torchvision's torch requirement cannot swap the installed build. Best effort: without it
# the trainer tests skip.
# Skipped once the trainer's own dependencies are there, so that a second run does not install
# (and remove again) torchvision each time.
trainer_ready='import cv2, polars, yaml, importlib.metadata as m; assert m.version("ultralytics") == "8.4.190"'
if [[ ",$EXTRAS," == *,test,* ]] && ! .venv/bin/python -c "$trainer_ready" 2>/dev/null; then
  .venv/bin/python -m pip install -q -e ".[$EXTRAS,ultralytics]" torch==2.13.0 \
    || echo "setup: the [ultralytics] extra did not install; the trainer tests will skip" >&2
  # PyPI's x86-64 torchvision is linked against the CUDA build of torch: beside the CPU build its
  # import fails, and so does every import of transformers or lightning that reaches it. Such a
  # torchvision is removed again (the trainer tests stand in for the NMS Ultralytics takes from it).
  .venv/bin/python -c "import torchvision" 2>/dev/null \
    || .venv/bin/python -m pip uninstall -q -y torchvision 2>/dev/null || true
fi
# Ultralytics' MuSGD, the peer the benchmark and one equivalence test compare with. Only its
# optimizer module is used, which needs nothing but torch: --no-deps keeps its torchvision/OpenCV
# requirements (and a second torch) out. Best effort: without it those rows and that test skip.
.venv/bin/python -m pip show -q ultralytics >/dev/null 2>&1 \
  || .venv/bin/python -m pip install -q --no-deps "ultralytics==8.4.190" \
  || echo "setup: ultralytics not installed; its benchmark rows and equivalence test will skip" >&2
# The Muon peers of `fastmuon bench --optimizer muon` (the [peers] extra: heavyball, pytorch-optimizer).
# torch is pinned to the installed build so that pip never swaps it. Best effort, like Ultralytics.
TORCH_VERSION="$(.venv/bin/python -c 'import torch; print(torch.__version__.split("+")[0])')"
.venv/bin/python -c "import importlib.metadata as m; [m.version(p) for p in ('heavyball', 'pytorch_optimizer')]" \
  2>/dev/null \
  || .venv/bin/python -m pip install -q -e ".[peers]" "torch==$TORCH_VERSION" \
  || echo "setup: the [peers] extra did not install; the heavyball and pytorch-optimizer rows will skip" >&2
