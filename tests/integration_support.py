"""Importing third-party trainers (Transformers, Lightning) for the integration tests."""

from __future__ import annotations

import importlib
import sys
from types import ModuleType

import pytest


def import_offline(mp: pytest.MonkeyPatch, name: str, home: str) -> ModuleType:
    """``import name`` with the Hugging Face hub offline, caches under ``home``, torchvision hidden.

    Transformers and Lightning import torchvision whenever it is installed, and PyPI's x86-64
    torchvision wheels, built against the CUDA torch, fail to import beside the CPU one. Neither
    trainer needs it for a language model, so it is hidden unless something already imported it.
    Skips the test when ``name`` is not installed.
    """
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
        mp.setenv(var, "1")
    mp.setenv("HF_HOME", home)
    if "torchvision" not in sys.modules and importlib.util.find_spec("torchvision") is not None:
        mp.setitem(sys.modules, "torchvision", None)
    return pytest.importorskip(name)
