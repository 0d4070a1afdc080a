"""Memory order of a tensor: the one fact about strides that packing and snapshots both need."""

from __future__ import annotations

from torch import Tensor


def memory_order(t: Tensor) -> tuple[int, ...] | None:
    """The dim order that walks ``t``'s memory contiguously, or None if it has gaps or overlaps."""
    strides = t.stride()
    perm = tuple(sorted(range(t.ndim), key=lambda d: -strides[d]))
    return perm if t.permute(perm).is_contiguous() else None
