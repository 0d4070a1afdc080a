"""fastmuon: Muon-family optimizers whose step costs a few kernels per bucket, not per matrix.

The public names are imported on first use (PEP 562): ``import fastmuon`` alone loads neither
torch nor the optimizers, so that the ``fastmuon`` command's ``--help`` answers at once.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.5.0"

#: public name -> the module that defines it
_PUBLIC = {
    "MuSGD": "fastmuon.optim.musgd",
    "Muon": "fastmuon.optim.muon",
    "NorMuon": "fastmuon.optim.normuon",
    "AdaMuon": "fastmuon.optim.normuon",
    "param_groups": "fastmuon.groups.build",
    "newton_schulz": "fastmuon.ns.newton_schulz",
    "orthogonalize": "fastmuon.ns.build",
    "PRESETS": "fastmuon.ns.newton_schulz",
    "CostModel": "fastmuon.ns.planner",
    "Plan": "fastmuon.ns.planner",
}

__all__ = [*_PUBLIC, "__version__"]

if TYPE_CHECKING:
    from .groups.build import param_groups as param_groups
    from .ns.build import orthogonalize as orthogonalize
    from .ns.newton_schulz import PRESETS as PRESETS
    from .ns.newton_schulz import newton_schulz as newton_schulz
    from .ns.planner import CostModel as CostModel
    from .ns.planner import Plan as Plan
    from .optim.muon import Muon as Muon
    from .optim.musgd import MuSGD as MuSGD
    from .optim.normuon import AdaMuon as AdaMuon
    from .optim.normuon import NorMuon as NorMuon


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'fastmuon' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_PUBLIC})
