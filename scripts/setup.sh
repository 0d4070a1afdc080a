#!/usr/bin/env bash
# Make (or reuse) a virtual environment with a pinned torch and fastmuon installed editable with
# EXTRAS: `setup.sh [EXTRAS] [TORCH]`. TORCH is one of these releases:
#   2.11.0:           the oldest supported, PyPI's build (CUDA, runs on a CPU too), in .venv-torch2.11,
#                     without torchvision (PyPI's 0.26.0 pairs with it, but the [ultralytics] extra
#                     asks for 0.28 or later): the trainer tests skip there;
#   2.13.0 (default): the CPU build, in .venv, beside PyPI's torchvision 0.28.0, which does not
#                     import beside it and is removed again (the tests that need it skip here);
#   2.14.1:           PyPI's build (CUDA, runs on a CPU too), in .venv-torch2.14, beside
#                     torchvision 0.29.1, which imports: Ultralytics' trainer tests run there;
#   2.15.0:           the newest release, PyPI's build, in .venv-torch2.15, without torchvision
#                     (none is published for it here): the trainer tests skip there.
# Sourced by bench.sh and test.sh so that each is one command on a fresh machine; a second run
# installs nothing that is already there.
set -euo pipefail
EXTRAS="${1:-test}"
TORCH="${2:-2.13.0}"
case "$TORCH" in
  2.11.0) VENV=.venv-torch2.11 TORCHVISION= ;;
  2.13.0) VENV=.venv TORCHVISION=0.28.0 ;;
  2.14.1) VENV=.venv-torch2.14 TORCHVISION=0.29.1 ;;
  2.15.0) VENV=.venv-torch2.15 TORCHVISION= ;;
  *) echo "setup: torch $TORCH is not one of the releases set up here (2.11.0, 2.13.0, 2.14.1, 2.15.0)" >&2; exit 2 ;;
esac
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="$VENV/bin/python"
if [ ! -x "$PY" ]; then
  python3 -m venv "$VENV"
fi
# Ultralytics goes in last, without the dependencies it cannot have here (see the end): once it is
# there, a later install that adds one of them makes pip print its "dependency conflicts" ERROR. So
# where this run asks for extras the venv has not had yet (./bench.sh made it, ./test.sh now adds
# the test extra, or the other way round), it is taken out first and put back at the end.
STAMP="$VENV/fastmuon-extras"
if ! grep -qxF "$EXTRAS" "$STAMP" 2>/dev/null && "$PY" -m pip show -q ultralytics >/dev/null 2>&1; then
  "$PY" -m pip uninstall -q -y ultralytics
fi
# torch first and pinned: an unpinned torch would pull whatever build is newest. Without pip's
# cache: a CUDA build's wheels are several GB, and the cache would keep a second copy of them.
torch_ready="import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$TORCH')"
if ! "$PY" -c "$torch_ready" 2>/dev/null && ! "$PY" -m pip install -q --no-cache-dir "torch==$TORCH"; then
  echo "setup: pip could not install torch==$TORCH; if it says '(constraint) torch<=...', a pip" \
    "constraint file caps torch on this machine (pip config list shows which): lift it, or run" \
    "the other releases alone (FASTMUON_TEST_TORCH=\"2.13.0 2.14.1\" ./test.sh). If it says" \
    "'No space left on device': a CUDA build takes 6 to 7 GB in its venv; free here:" \
    "$(df -h --output=avail "$ROOT" 2>/dev/null | tail -n 1 | tr -d ' ')" >&2
  exit 1
fi
"$PY" -m pip install -q -e ".[$EXTRAS]" "torch==$TORCH"
# Ultralytics goes in last: once it is there without its dependencies (torchvision removed, or
# --no-deps below), every later pip install that touches one of them prints pip's "dependency
# conflicts" ERROR for it, a line per missing requirement. So the complete installs come first.
# The Muon peers of `fastmuon bench --optimizer muon` (the [peers] extra: heavyball, pytorch-optimizer).
# torch is pinned to the installed build so that pip never swaps it. Best effort: without them
# the heavyball and pytorch-optimizer rows skip.
"$PY" -c "import importlib.metadata as m; [m.version(p) for p in ('heavyball', 'pytorch_optimizer')]" \
  2>/dev/null \
  || "$PY" -m pip install -q -e ".[peers]" "torch==$TORCH" \
  || echo "setup: the [peers] extra did not install; the heavyball and pytorch-optimizer rows will skip" >&2
# The tests run Ultralytics' trainer (the [ultralytics] extra) with torch and its torchvision pinned
# in the same command, so that torchvision's torch requirement cannot swap the installed build.
# Best effort: without it the trainer tests skip. Skipped once the trainer's own dependencies are
# there, so that a second run does not install (and remove again) torchvision each time.
trainer_ready='import cv2, polars, yaml, importlib.metadata as m; assert m.version("ultralytics") == "8.4.190"'
if [[ ",$EXTRAS," == *,test,* ]] && [ -n "$TORCHVISION" ] && ! "$PY" -c "$trainer_ready" 2>/dev/null; then
  "$PY" -m pip install -q -e ".[$EXTRAS,ultralytics]" "torch==$TORCH" "torchvision==$TORCHVISION" \
    || echo "setup: the [ultralytics] extra did not install; the trainer tests will skip" >&2
  # PyPI's x86-64 torchvision is linked against PyPI's (CUDA) build of torch: beside the CPU build
  # its import fails, and so does every import of transformers or lightning that reaches it. Such
  # a torchvision is removed again; the tests that need one skip, saying why.
  "$PY" -c "import torchvision" 2>/dev/null \
    || "$PY" -m pip uninstall -q -y torchvision 2>/dev/null || true
fi
# Ultralytics' MuSGD, the peer the benchmark and one equivalence test compare with. Only its
# optimizer module is used, which needs nothing but torch: --no-deps keeps its torchvision/OpenCV
# requirements (and a second torch) out. Best effort: without it those rows and that test skip.
"$PY" -m pip show -q ultralytics >/dev/null 2>&1 \
  || "$PY" -m pip install -q --no-deps "ultralytics==8.4.190" \
  || echo "setup: ultralytics not installed; its benchmark rows and equivalence test will skip" >&2
grep -qxF "$EXTRAS" "$STAMP" 2>/dev/null || echo "$EXTRAS" >>"$STAMP"
