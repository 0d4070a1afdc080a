"""Importing third-party trainers (Transformers, Lightning) for the integration tests."""

from __future__ import annotations

import importlib
import sys
from types import ModuleType

import pytest


def import_offline(mp: pytest.MonkeyPatch, name: str, home: str) -> ModuleType:
    """``import name`` with the Hugging Face hub offline, caches under ``home``, torchvision hidden.

    Skips the test when ``name`` is not installed.
    """
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
        mp.setenv(var, "1")
    mp.setenv("HF_HOME", home)
    mp.setenv("MPLCONFIGDIR", home)
    if "torchvision" not in sys.modules and importlib.util.find_spec("torchvision") is not None:
        hide_torchvision(mp)
    return pytest.importorskip(name)


def hide_torchvision(mp: pytest.MonkeyPatch) -> None:
    """Make Transformers and Lightning (through torchmetrics) see no torchvision.

    Both import it whenever it is installed, and PyPI's x86-64 torchvision wheels, built against
    the CUDA torch, fail to import beside the CPU one. Neither needs it to train a small model.
    Transformers asks ``importlib.util.find_spec`` (``None`` for a ``None`` module entry);
    torchmetrics asks lightning_utilities' ``RequirementCache``, which reads package metadata.
    """
    mp.setitem(sys.modules, "torchvision", None)
    try:
        from lightning_utilities.core.imports import RequirementCache
    except ImportError:
        return
    check_requirement = RequirementCache._check_requirement

    def without_torchvision(self) -> None:
        if (self.requirement or "").startswith("torchvision"):
            self.available, self.message = False, "torchvision hidden by the test"
        else:
            check_requirement(self)

    mp.setattr(RequirementCache, "_check_requirement", without_torchvision)
