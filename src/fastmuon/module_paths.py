"""The 0.4 module paths, kept importable: pickles name a class by its module, and code written
against 0.4 imports ``fastmuon.musgd``, ``fastmuon.planner`` and the like.

Each old path is the new module itself (not a copy), so ``isinstance`` and pickling agree.
"""

from __future__ import annotations

import importlib
import sys

#: 0.4 module -> where it lives now
MOVED = {
    "_base": "optim.base",
    "musgd": "optim.musgd",
    "muon": "optim.muon",
    "checkpoint": "optim.checkpoint",
    "state": "optim.state",
    "param_names": "optim.param_names",
    "reference": "optim.reference",
    "program": "step.program",
    "matrix_update": "step.matrix",
    "adamw": "step.adamw",
    "transforms": "step.elementwise",
    "nonfinite": "step.nonfinite",
    "newton_schulz": "ns.newton_schulz",
    "planner": "ns.planner",
    "engine": "ns.engine",
    "compute": "ns.device",
    "calibrate": "ns.calibrate",
    "layout": "ns.layout",
    "inflight": "distributed.inflight",
}


def register(package: str) -> None:
    """Make ``package.<old>`` resolve to its new module for every entry of :data:`MOVED`."""
    for old, new in MOVED.items():
        sys.modules.setdefault(f"{package}.{old}", importlib.import_module(f"{package}.{new}"))
