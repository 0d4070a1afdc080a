"""The matrices of parameters whose parts lie on several ranks, and the step's executor for them.

Every matrix a matrix map makes (the tensor, an expert, a head, a fused projection's part) is a
box of the whole tensor; its part on a rank is the overlap with the rank's box (:mod:`.parts`).
A matrix one rank alone holds whole is orthogonalised there without exchange; every other goes
through :class:`~fastmuon.distributed.exchange.ShardedOrthogonalizer`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ..ns.engine import Orthogonalizer
from ..ns.matrices import Box, MatrixMap
from .exchange import ShardedOrthogonalizer
from .parts import Parts, Region
from .stats import CommStats


def shard_rows(rows: int, world: int) -> list[int]:
    """Rows each rank holds under ``Shard(0)``: ``torch.chunk`` sizes, trailing ranks maybe empty."""
    chunk = math.ceil(rows / world) if rows else 0
    return [max(0, min(chunk, rows - r * chunk)) for r in range(world)]


@dataclass(frozen=True)
class ShardedMatrix:
    """One matrix of a parameter held in parts: its whole shape as stored and each rank's box."""

    shape: tuple[int, ...]
    held: tuple[Region | None, ...]
    dtype: torch.dtype
    device: torch.device

    @property
    def exchanged(self) -> bool:
        """Whether the matrix moves: unless one rank alone holds it, whole."""
        holders = [r for r in self.held if r is not None]
        return not (len(holders) == 1 and holders[0] == tuple((0, n) for n in self.shape))


def held_pieces(m: MatrixMap, p: Tensor, grad: Tensor, buf: Tensor, parts: Parts) -> list[Piece]:
    """The matrices under map ``m`` this rank takes part in (holds part of, or exchanged: every rank
    joins those, maybe with an empty part), as :class:`Piece` views of its local ``p``, ``grad`` and
    ``buf``; every rank computes every box from ``parts``, so all agree on which are exchanged."""
    shape, local, mine = parts.shape, (p, grad, buf), parts.mine
    boxes: list[Box] = []
    pieces: list[tuple[Tensor, Tensor, Tensor, tuple[int, ...], ShardedMatrix]] = []
    for box, factor_shape in zip(m.boxes(shape), m.shapes(shape)):
        ranges, kept = _box_ranges(box, shape)
        held = tuple(_within(ranges, kept, region) for region in parts.regions)
        matrix = ShardedMatrix(
            tuple(len(range(*r)) for r, k in zip(ranges, kept) if k), held, local[0].dtype, local[0].device
        )
        if held[parts.rank] is None and not matrix.exchanged:
            continue
        local_box = _local_box(ranges, kept, mine)
        boxes.append(local_box)
        pv, gv, bv = (t[local_box] for t in local)
        pieces.append((pv, gv, bv, factor_shape, matrix))
    split = functools.partial(_cut, tuple(boxes))
    return [
        Piece(pv, gv, bv, shape_, split, k, whole) for k, (pv, gv, bv, shape_, whole) in enumerate(pieces)
    ]


@dataclass(frozen=True)
class Piece:
    """One matrix of a parameter as a step's items take it: views, factor shape, how a gradient
    is cut into pieces (None: the matrix is the whole tensor), its number, and the matrix across
    ranks (None where this rank holds it whole)."""

    param: Tensor
    grad: Tensor
    buf: Tensor
    shape: tuple[int, ...]
    split: Callable[[Tensor], list[Tensor]] | None = None
    number: int = 0
    whole: ShardedMatrix | None = None


#: A box's extent in one dim of the whole tensor: ``(start, stop, step)``, as ``range`` takes it.
Extent = tuple[int, int, int]


def _box_ranges(box: Box, shape: tuple[int, ...]) -> tuple[list[Extent], list[bool]]:
    """A box as ``(start, stop, step)`` per dim, and the dims the matrix keeps (not int-indexed)."""
    ranges, kept = [], []
    for d, size in enumerate(shape):
        index = box[d] if d < len(box) else slice(None)
        if isinstance(index, slice):
            a, b, step = index.indices(size)
            ranges.append((a, max(a, b), step))
            kept.append(True)
        else:
            ranges.append((int(index), int(index) + 1, 1))
            kept.append(False)
    return ranges, kept


def _meet(extent: Extent, s: int, e: int) -> tuple[int, int]:
    """Which of the extent's entries (counted from 0) lie in ``[s, e)``: ``(first, stop)``, empty
    where ``first >= stop``. The entries are ``a, a+step, ...``, so those in a range are a run."""
    a, b, step = extent
    n = len(range(a, b, step))
    first = max(0, -(-(s - a) // step))
    stop = min(n, max(0, -(-(e - a) // step)))
    return first, stop


def _within(ranges: Sequence[Extent], kept: Sequence[bool], region: Region | None) -> Region | None:
    """The part of the box in ``region`` (a rank's box), in the matrix's own coordinates."""
    if region is None:
        return None
    out = []
    for extent, k, (s, e) in zip(ranges, kept, region):
        lo, hi = _meet(extent, s, e)
        if lo >= hi:
            return None
        if k:
            out.append((lo, hi))
    return tuple(out)


def _local_box(ranges: Sequence[Extent], kept: Sequence[bool], mine: Region | None) -> Box:
    """The index into this rank's local tensor of its part of the box (empty where none)."""
    if mine is None:
        return tuple(slice(0, 0) for _ in ranges)
    index: list[int | slice] = []
    for extent, k, (s, e) in zip(ranges, kept, mine):
        lo, hi = _meet(extent, s, e)
        a, _, step = extent
        if lo >= hi:
            return tuple(slice(0, 0) for _ in ranges)
        first, last = a + lo * step - s, a + (hi - 1) * step - s  # local positions of its entries
        index.append(slice(first, last + 1, step) if k else first)
    return tuple(index)


def _cut(boxes: tuple[Box, ...], t: Tensor) -> list[Tensor]:
    """A step's local gradient cut into this rank's pieces (see :func:`held_pieces`)."""
    return [t[box] for box in boxes]


class SplitShardedOrthogonalizer:
    """Exchanged matrices through the exchange, those this rank alone holds whole through a
    local engine; those another rank alone holds are skipped."""

    def __init__(
        self,
        exchanged: ShardedOrthogonalizer | None,
        exchanged_index: list[int],
        local: Orthogonalizer | None,
        local_index: list[int],
        count: int,
    ):
        self.exchanged, self.local = exchanged, local
        self.exchanged_index, self.local_index = exchanged_index, local_index
        self.count = count
        self.plan = exchanged.plan if exchanged is not None else local.plan if local is not None else None
        self.stats = exchanged.stats if exchanged is not None else CommStats()

    @property
    def profile(self) -> bool:
        return self.exchanged is not None and self.exchanged.profile

    @profile.setter
    def profile(self, value: bool) -> None:
        if self.exchanged is not None:
            self.exchanged.profile = value

    def __call__(self, sources: Sequence[Tensor], out_dtypes: Sequence[torch.dtype]) -> list[Tensor]:
        results: list[Tensor | None] = [None] * self.count
        for engine, index in ((self.exchanged, self.exchanged_index), (self.local, self.local_index)):
            if engine is None:
                continue
            outs = engine([sources[i] for i in index], [out_dtypes[i] for i in index])
            for i, out in zip(index, outs):
                results[i] = out
        if self.exchanged is not None:
            self.stats = self.exchanged.stats
        for i, r in enumerate(results):
            if r is None:  # held by another rank: no part here
                results[i] = sources[i].new_empty(sources[i].shape, dtype=out_dtypes[i])
        return results  # type: ignore[return-value]

    def workspaces(self) -> list[Tensor]:
        return [t for e in (self.exchanged, self.local) if e is not None for t in e.workspaces()]
