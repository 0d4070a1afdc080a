"""fastmuon: Muon-family optimizers whose step costs a few kernels per bucket, not per matrix."""

from .engine import orthogonalize
from .groups import param_groups
from .muon import Muon
from .musgd import MuSGD
from .newton_schulz import PRESETS, newton_schulz
from .planner import CostModel, Plan

__version__ = "0.4.0"

__all__ = [
    "MuSGD",
    "Muon",
    "param_groups",
    "newton_schulz",
    "orthogonalize",
    "PRESETS",
    "CostModel",
    "Plan",
    "__version__",
]
