"""Importing third-party trainers (Transformers, Lightning, Ultralytics) for the integration tests.

They run against the packages as installed, torchvision included: nothing is hidden or stood in
for. Where an installed torchvision cannot load beside this torch (PyPI's x86-64 wheels are built
against its CUDA torch), the tests that reach it skip and say so; ``./test.sh`` also runs the
suite on torch 2.14.1 with torchvision 0.29.1, where it loads.
"""

from __future__ import annotations

import functools
import importlib.util
import subprocess
import sys
from types import ModuleType

import pytest

#: where the integration tests do run when torchvision cannot load here
TESTED_WITH_TORCHVISION = "./test.sh runs them on torch 2.14.1 with torchvision 0.29.1"


@functools.cache
def torchvision_problem() -> str | None:
    """Why torchvision cannot be imported here (None: it can). Asked in a fresh interpreter, so
    that a failed import leaves no half-loaded module in this one."""
    if importlib.util.find_spec("torchvision") is None:
        return "torchvision is not installed"
    probe = "import torchvision, torchvision.ops; torchvision.ops.nms"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    if done.returncode == 0:
        return None
    last = (done.stderr.strip().splitlines() or ["no message"])[-1]
    return f"the installed torchvision does not import beside this torch ({last})"


def require_torchvision() -> None:
    """Skip the test, saying why, unless torchvision imports here."""
    problem = torchvision_problem()
    if problem is not None:
        pytest.skip(f"needs an importable torchvision: {problem}; {TESTED_WITH_TORCHVISION}")


def import_offline(mp: pytest.MonkeyPatch, name: str, home: str) -> ModuleType:
    """``import name`` with the Hugging Face hub offline and its caches under ``home``.

    Skips the test when ``name`` is not installed, or when a torchvision is installed that
    cannot load here (Transformers and Lightning import any torchvision that is installed).
    """
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
        mp.setenv(var, "1")
    mp.setenv("HF_HOME", home)
    mp.setenv("MPLCONFIGDIR", home)
    if importlib.util.find_spec("torchvision") is not None:
        require_torchvision()
    return pytest.importorskip(name)
