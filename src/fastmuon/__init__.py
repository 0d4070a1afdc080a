"""fastmuon: Muon-family optimizers whose step costs a few kernels per bucket, not per matrix."""

from .groups.build import param_groups
from .ns.build import orthogonalize
from .ns.newton_schulz import PRESETS, newton_schulz
from .ns.planner import CostModel, Plan
from .optim.muon import Muon
from .optim.musgd import MuSGD
from .optim.normuon import AdaMuon, NorMuon

__version__ = "0.5.0"

__all__ = [
    "MuSGD",
    "Muon",
    "NorMuon",
    "AdaMuon",
    "param_groups",
    "newton_schulz",
    "orthogonalize",
    "PRESETS",
    "CostModel",
    "Plan",
    "__version__",
]
