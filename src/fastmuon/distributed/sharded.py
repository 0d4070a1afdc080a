"""Newton–Schulz of FSDP2-sharded matrices (``fully_shard``, 1-D mesh, ``Shard(0)``).

Each rank holds a row block of every matrix, and NS needs whole matrices: one ``all_to_all``
brings every block to its matrix's owner, the owner orthogonalises its buckets, and a second
``all_to_all`` sends each rank its rows of the result (the gather-to-owner / scatter-back scheme
of muon-fsdp2 and torchtitan, batched here to two collectives per step). Uneven shards (rows not
divisible by the world size, empty shards) need no padding: every rank computes every block size
from the shapes. A matrix a map cuts out of one rank's rows is that rank's alone: no exchange.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ..matrices import Box, MatrixMap, box_shape
from ..ns.engine import NSConfig, Orthogonalizer, TensorLayout
from ..ns.planner import Plan
from .inflight import InFlight
from .replicated import CommStats, Timer, assign_work, sub_plan


def contiguous_layout(shape: Sequence[int]) -> TensorLayout:
    """The layout of a whole matrix as the owner assembles it: contiguous."""
    return TensorLayout.of(torch.empty(tuple(shape), device="meta"))


def shard_rows(rows: int, world: int) -> list[int]:
    """Rows each rank holds under ``Shard(0)``: ``torch.chunk`` sizes, trailing ranks maybe empty."""
    chunk = math.ceil(rows / world) if rows else 0
    return [max(0, min(chunk, rows - r * chunk)) for r in range(world)]


class ShardedOrthogonalizer:
    """Gather each matrix to its owner, orthogonalise there in buckets, scatter the rows back.

    Two ``all_to_all_single`` calls per NS dtype and step: the first sends every rank's row
    blocks to the owners (cast to NS dtype on the way, as the single-process engine casts when
    packing), the second sends every rank its rows of each result. Sizes are exact, so uneven
    and empty shards cost nothing extra. The four exchange buffers per NS dtype persist between
    steps, and the results are views of the last one: valid until the next call.
    """

    def __init__(
        self,
        plan: Plan,
        matrices: Sequence[ShardedMatrix],
        configs: dict[Hashable, NSConfig],
        group: dist.ProcessGroup,
        compile: bool = False,
        host_reads: bool = True,
    ):
        self.plan, self.shapes, self.group = plan, [m.shape for m in matrices], group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.units = assign_work(plan, self.world)
        layouts = [contiguous_layout(s) for s in self.shapes]
        owned = [u for u in self.units if u.owner == self.rank]
        # one engine per NS dtype (each dtype is exchanged apart), over this rank's units
        self._engines: dict[torch.dtype, Orthogonalizer] = {}
        for dtype in dict.fromkeys(plan.buckets[u.bucket].dtype for u in owned):
            local_plan, index = sub_plan(plan, [u for u in owned if plan.buckets[u.bucket].dtype == dtype])
            self._engines[dtype] = Orthogonalizer(
                local_plan, [layouts[i] for i in index], configs, compile=compile, host_reads=host_reads
            )
        self._rows = [list(m.rows) for m in matrices]  # rows of each matrix each rank holds
        self._cols = [math.prod(s[1:]) for s in self.shapes]
        self._row_starts = [[sum(rows[:r]) for r in range(self.world)] for rows in self._rows]
        # per NS dtype: the matrices each rank owns, in unit and slot order
        self._order: dict[torch.dtype, list[list[int]]] = {}
        for u in self.units:
            bucket = plan.buckets[u.bucket]
            order = self._order.setdefault(bucket.dtype, [[] for _ in range(self.world)])
            order[u.owner] += [m.index for m in bucket.members[u.start : u.stop]]
        # per NS dtype, element counts: this rank's blocks for each owner, and the blocks each
        # rank sends this one as owner. The scatter sends back exactly what the gather brought.
        me, world = self.rank, self.world
        self._sizes: dict[torch.dtype, tuple[list[int], list[int]]] = {}
        for dtype, order in self._order.items():
            mine_to_owner = [sum(self._block(i, me) for i in order[o]) for o in range(world)]
            theirs_to_me = [sum(self._block(i, r) for i in order[me]) for r in range(world)]
            self._sizes[dtype] = (mine_to_owner, theirs_to_me)
        self._buffers: dict[tuple[torch.dtype, str], Tensor] = {}
        self._inflight = InFlight()
        self.profile = False
        self.stats = CommStats(total_flops=plan.flops(), owned_flops=sum(u.flops for u in owned))

    def _block(self, i: int, rank: int) -> int:
        return self._rows[i][rank] * self._cols[i]

    def __call__(self, sources: Sequence[Tensor], out_dtypes: Sequence[torch.dtype]) -> list[Tensor]:
        """``sources`` are this rank's row blocks; so are the results (in ``out_dtypes``)."""
        self._inflight.settle()  # the last call's all_to_alls (finished long ago)
        device = sources[0].device
        timer = Timer(self.profile, device)
        results: list[Tensor | None] = [None] * len(sources)
        stats = CommStats(total_flops=self.stats.total_flops, owned_flops=self.stats.owned_flops)
        me, world = self.rank, self.world
        for dtype, order in self._order.items():
            item = torch.empty((), dtype=dtype).element_size()
            t0 = timer.now()
            # 1. every rank's row blocks to the owners, cast to NS dtype on the way
            to_owner, from_rank = self._sizes[dtype]
            send = self._buffer(dtype, "gather send", sum(to_owner), device)
            blocks = [sources[i].reshape(-1) for o in range(world) for i in order[o]]
            if blocks:
                torch.cat(blocks, out=send)
            recv = self._buffer(dtype, "gather recv", sum(from_rank), device)
            self._inflight.issue(dist.all_to_all_single, recv, send, from_rank, to_owner, group=self.group)
            self._inflight.wait()
            t1 = timer.now()
            # 2. whole matrices on the owner, NS over its buckets
            full = self._assemble(recv, from_rank, order[me])
            owned = self._engines[dtype](full, [dtype] * len(full)) if full else []
            t2 = timer.now()
            # 3. every rank's rows of each result back to it
            to_rank, from_owner = from_rank, to_owner
            send = self._buffer(dtype, "scatter send", sum(to_rank), device)
            rows = [
                out.reshape(out.shape[0], -1).narrow(0, self._row_starts[i][d], self._rows[i][d]).reshape(-1)
                for d in range(world)
                for i, out in zip(order[me], owned)
            ]
            if rows:
                torch.cat(rows, out=send)
            recv = self._buffer(dtype, "scatter recv", sum(from_owner), device)
            self._inflight.issue(dist.all_to_all_single, recv, send, from_owner, to_rank, group=self.group)
            self._inflight.wait()
            casts: dict[torch.dtype, Tensor] = {}
            offset = 0
            for s in range(world):
                for i in order[s]:
                    out_dtype = out_dtypes[i]
                    if out_dtype not in casts:
                        casts[out_dtype] = recv if recv.dtype == out_dtype else recv.to(out_dtype)
                    size = self._block(i, me)
                    results[i] = casts[out_dtype][offset : offset + size].view(
                        self._rows[i][me], *self.shapes[i][1:]
                    )
                    offset += size
            t3 = timer.now()
            stats.ns_seconds += t2 - t1
            stats.comm_seconds += (t1 - t0) + (t3 - t2)
            stats.bytes_sent += item * (sum(to_owner) - to_owner[me] + sum(to_rank) - to_rank[me])
            stats.bytes_received += item * (sum(from_rank) - from_rank[me] + sum(from_owner) - from_owner[me])
        self.stats = stats
        return results  # type: ignore[return-value]

    def _buffer(self, dtype: torch.dtype, role: str, numel: int, device: torch.device) -> Tensor:
        """The persistent exchange buffer for ``role`` in ``dtype`` (its size never changes)."""
        buf = self._buffers.get((dtype, role))
        if buf is None or buf.device != device:
            buf = self._buffers[(dtype, role)] = torch.empty(numel, dtype=dtype, device=device)
        return buf

    def workspaces(self) -> list[Tensor]:
        """Every tensor kept between steps: exchange buffers and the local engines'."""
        return list(self._buffers.values()) + [t for e in self._engines.values() for t in e.workspaces()]

    def _assemble(self, recv: Tensor, recv_sizes: list[int], owned: list[int]) -> list[Tensor]:
        """Whole matrices from the blocks every rank sent, one ``cat`` per run of equal shapes
        (and equal rows per rank)."""
        chunks = list(recv.split(recv_sizes))
        offsets = [0] * self.world
        full: list[Tensor] = []
        k = 0
        while k < len(owned):
            shape, held = self.shapes[owned[k]], self._rows[owned[k]]
            end = k
            while end < len(owned) and self.shapes[owned[end]] == shape and self._rows[owned[end]] == held:
                end += 1
            count, rows, cols = end - k, self._rows[owned[k]], self._cols[owned[k]]
            blocks = []
            for s in range(self.world):
                size = count * rows[s] * cols
                blocks.append(chunks[s][offsets[s] : offsets[s] + size].view(count, rows[s], cols))
                offsets[s] += size
            run = torch.cat(blocks, dim=1)
            full += [run[j].view(shape) for j in range(count)]
            k = end
        return full


# ----- matrices cut out of FSDP2 parameters (see fastmuon.matrices) ---------------------------
@dataclass(frozen=True)
class ShardedMatrix:
    """One matrix of an FSDP2 (``Shard(0)``) parameter: its whole shape as stored (rows first)
    and how many of its rows each rank holds.

    A matrix held by one rank is orthogonalised there, with no exchange at all: an expert of a
    stack sharded on its expert dim, a fused projection's part that falls inside one shard, a
    ``[1, N]`` weight. One spread over ranks goes through :class:`ShardedOrthogonalizer`.
    """

    shape: tuple[int, ...]
    rows: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device

    @property
    def spread(self) -> bool:
        return sum(1 for n in self.rows if n) >= 2

    @classmethod
    def of(cls, whole: Any, local: Tensor, world: int) -> ShardedMatrix:
        """A whole ``Shard(0)`` DTensor parameter as one matrix (``local``: this rank's shard)."""
        shape = tuple(whole.shape)
        return cls(shape, tuple(shard_rows(shape[0], world)), local.dtype, local.device)


def sharded_pieces(m: MatrixMap, p: Any, grad: Any, buf: Any, optimizer: str) -> list[tuple]:
    """The matrices of FSDP2 parameter ``p`` under map ``m`` that this rank takes part in, as
    ``(param, grad, buffer, shape, split, piece, whole)`` with views of its local shards (see
    :func:`fastmuon.step.matrix.matrix_items`); ``whole`` describes the matrix for the planner.

    Each piece is a box of the whole tensor; its rows on a rank are the box's overlap with the
    rank's ``Shard(0)`` chunk. A piece with rows here, or spread over several ranks (then it is
    exchanged, and every rank must take part, maybe with no rows), is kept; one held whole by
    another rank is that rank's alone. Every rank computes every box from the global shape, so
    all agree on which pieces are exchanged.
    """
    for t in (p, grad):
        if not shard0_on_1d_mesh(t):
            raise ValueError(
                f"a DTensor of shape {tuple(p.shape)} has placements {tuple(t.placements)} on a "
                f"{t.device_mesh.ndim}-D mesh; {optimizer} orthogonalises the matrices of "
                "FSDP2's Shard(0) on a 1-D mesh (fully_shard without shard_placement_fn or HSDP; "
                "gradients sharded like their parameters)"
            )
    mesh = p.device_mesh
    world, rank = mesh.size(), mesh.get_local_rank()
    shape = tuple(p.shape)
    counts = shard_rows(shape[0], world)
    starts = [sum(counts[:r]) for r in range(world)]
    lo, hi = starts[rank], starts[rank] + counts[rank]
    local = [t.to_local() for t in (p, grad, buf)]
    boxes: list[Box] = []
    pieces = []
    for box, factor_shape in zip(m.boxes(shape), m.shapes(shape)):
        first = box[0] if box else slice(None)
        whole = box_shape(shape, box)
        if isinstance(first, int):  # a batch index: the matrix lies in one rank's chunk
            rows = tuple(whole[0] if s <= first < s + n else 0 for s, n in zip(starts, counts))
            here: int | slice = first - lo
        else:
            a, b, _ = first.indices(shape[0])
            rows = tuple(max(0, min(b, s + n) - max(a, s)) for s, n in zip(starts, counts))
            start = min(max(a, lo), hi)
            here = slice(start - lo, max(min(b, hi), start) - lo)
        matrix = ShardedMatrix(whole, rows, local[0].dtype, local[0].device)
        if not (rows[rank] or matrix.spread):
            continue
        local_box = (here, *box[1:])
        views = [t[local_box] for t in local]
        boxes.append(local_box)
        pieces.append((*views, factor_shape, matrix))
    split = functools.partial(_cut, tuple(boxes))
    return [(pv, gv, bv, shape_, split, k, whole) for k, (pv, gv, bv, shape_, whole) in enumerate(pieces)]


def _cut(boxes: tuple[Box, ...], t: Tensor) -> list[Tensor]:
    """A step's local gradient shard cut into this rank's pieces (see :func:`sharded_pieces`)."""
    return [t[box] for box in boxes]


def shard0_on_1d_mesh(t: Any) -> bool:
    """Whether DTensor ``t`` is laid out as FSDP2 shards by default: ``Shard(0)`` on a 1-D mesh."""
    from torch.distributed.tensor import Shard

    return t.device_mesh.ndim == 1 and tuple(t.placements) == (Shard(0),)


class SplitShardedOrthogonalizer:
    """FSDP2 matrices by where they live: spread ones through the exchange, ones held whole by
    this rank through a local engine, ones held by another rank not at all (no rows here)."""

    def __init__(self, exchanged, exchanged_index: list[int], local, local_index: list[int], count: int):
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
            if r is None:  # held by another rank: no rows here
                results[i] = sources[i].new_empty(sources[i].shape, dtype=out_dtypes[i])
        return results  # type: ignore[return-value]

    def workspaces(self) -> list[Tensor]:
        return [t for e in (self.exchanged, self.local) if e is not None for t in e.workspaces()]
