"""One buffer for the buckets that a CPU step runs one at a time.

A bucket's NS needs its input batch, the kernel's temporaries and, for some steps, its results
cast to the parameters' dtype; none of it outlives the bucket, since the step consumes each
bucket's results before the next bucket starts. So every bucket lays its buffers out from the
start of one flat buffer, kept between steps (a CPU allocator returns large freed blocks to the
OS, so fresh ones are page-faulted in again, zero-filled, every step), and what a step keeps is
the largest bucket's layout, not a buffer per bucket and role.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


class SharedWorkspace:
    """The flat buffer, and each bucket's layout in it (see :class:`BucketLayout`).

    It grows only between buckets (:meth:`BucketLayout.open`), so no buffer a kernel holds is
    ever moved under it: a request that does not fit during a bucket's call is served with a
    fresh tensor and fits from the next call on.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.flat = torch.empty(0, dtype=torch.uint8, device=device)
        self.layouts: list[BucketLayout] = []

    def grow(self) -> None:
        """Reach the largest layout known, dropping every view of the buffer it replaces (so
        that one is freed now, not kept alive by a bucket's views until its next call)."""
        need = max(layout.end for layout in self.layouts)
        if need > self.flat.numel():
            for layout in self.layouts:
                layout.views.clear()
                layout.cache.clear()
            self.flat = torch.empty(0, dtype=torch.uint8, device=self.device)  # freed first
            self.flat = torch.empty(need, dtype=torch.uint8, device=self.device)

    def layout(self, dtype: torch.dtype, shape: Sequence[int]) -> BucketLayout:
        layout = BucketLayout(self, dtype, tuple(shape))
        self.layouts.append(layout)
        return layout


def _align(n: int) -> int:
    return -(-n // 64) * 64  # every region starts on a cache line, as the allocator's blocks do


class BucketLayout:
    """One bucket's regions of the shared buffer: its input batch at the start, then each
    temporary the kernel asks for by tag (newton_schulz.Scratch), in the order first asked."""

    def __init__(self, space: SharedWorkspace, dtype: torch.dtype, shape: tuple[int, ...]):
        self.space = space
        self.dtype = dtype
        self.shape = shape
        self.offsets: dict[tuple[str, tuple[int, ...]], int] = {}
        self.end = _align(_numel(shape) * dtype.itemsize)
        self.views: dict[tuple[str, tuple[int, ...]], Tensor] = {}
        # what a caller derives from the views (e.g. its members' views of them), dropped
        # with them when the buffer grows
        self.cache: dict[str, object] = {}

    def open(self) -> Tensor:
        """The input batch, with the buffer grown to this layout first (made once per buffer)."""
        if self.end > self.space.flat.numel():
            self.space.grow()
        return self.batch()

    def batch(self) -> Tensor:
        """The input batch (the bucket's shape and dtype, at the start of the buffer)."""
        return self._view("input", self.shape, 0)

    def _view(
        self, tag: str, shape: tuple[int, ...], offset: int, dtype: torch.dtype | None = None
    ) -> Tensor:
        space = self.space
        key = (tag, shape)
        view = self.views.get(key)
        if view is None:
            dtype = dtype or self.dtype
            nbytes = _numel(shape) * dtype.itemsize
            view = self.views[key] = space.flat[offset : offset + nbytes].view(dtype).view(shape)
        return view

    def scratch(self, tag: str, shape: tuple[int, ...]) -> Tensor:
        """The kernel's temporary ``tag`` (newton_schulz.Scratch), in the bucket's dtype."""
        shape = tuple(shape)
        offset = self.offsets.get((tag, shape))
        if offset is None:
            offset = self.offsets[(tag, shape)] = self.end
            self.end += _align(_numel(shape) * self.dtype.itemsize)
        if offset + _numel(shape) * self.dtype.itemsize > self.space.flat.numel():
            return torch.empty(shape, dtype=self.dtype, device=self.space.device)  # fits from the next call
        return self._view(tag, shape, offset)

    def free_after(self, result: Tensor, nbytes: int) -> tuple[int, bool]:
        """Where ``nbytes`` fit without touching ``result`` (what the kernel returned): the start
        of the buffer where they fit before ``result``, else just after it; and whether the
        buffer reaches that far now (else it does from the next call on)."""
        flat = self.space.flat
        offset = 0  # a fresh result (one that did not fit yet) leaves all of the buffer free
        if result.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr():
            start = result.data_ptr() - flat.data_ptr()
            if nbytes > start:
                offset = _align(start + _extent(result))
        self.end = max(self.end, offset + nbytes)
        return offset, offset + nbytes <= flat.numel()

    def place(self, tag: str, dtype: torch.dtype, numel: int, offset: int) -> Tensor:
        """A flat view of ``numel`` elements of ``dtype`` at ``offset`` (made once per buffer)."""
        return self._view(f"{tag}:{dtype}@{offset}", (numel,), offset, dtype)


def _extent(t: Tensor) -> int:
    """Bytes from ``t``'s first element to just past its last (dense or strided)."""
    if t.numel() == 0:
        return 0
    last = sum((s - 1) * st for s, st in zip(t.shape, t.stride()))
    return (last + 1) * t.element_size()


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
