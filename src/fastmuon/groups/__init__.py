"""Param groups from a model: which tensors Muon orthogonalises and how each maps to matrices.

- :mod:`.build`: :func:`param_groups`, the split into the Muon group and the rest;
- :mod:`.layer_maps`: the matrix maps of known fused and expert layers;
- the attention queries and keys QK-clip scales are read by :mod:`fastmuon.optim.qk_clip`.

The groups are plain dicts that any optimizer taking param groups accepts; the maps they carry
are the data :mod:`fastmuon.ns.matrices` defines.
"""

from .build import OUTSIDE_SHARE_WARNING, param_groups

__all__ = ["OUTSIDE_SHARE_WARNING", "param_groups"]
