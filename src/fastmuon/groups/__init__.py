"""Param groups from a model (:func:`param_groups`, plain dicts any optimizer taking param groups
accepts): which tensors Muon orthogonalises and how each maps to matrices (:mod:`.layer_maps`).
"""

from .build import OUTSIDE_SHARE_WARNING, param_groups

__all__ = ["OUTSIDE_SHARE_WARNING", "param_groups"]
