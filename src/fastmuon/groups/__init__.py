"""Param groups from a model: which tensors Muon orthogonalises and how each maps to matrices
(:func:`param_groups` in :mod:`.build`; the maps of known fused and expert layers in
:mod:`.layer_maps`). The groups are plain dicts that any optimizer taking param groups accepts.
"""

from .build import OUTSIDE_SHARE_WARNING, param_groups

__all__ = ["OUTSIDE_SHARE_WARNING", "param_groups"]
