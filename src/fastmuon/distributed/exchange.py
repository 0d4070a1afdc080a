"""Newton–Schulz of matrices whose parts lie on several ranks (FSDP2, HSDP, tensor parallel,
expert parallel, and plain tensors replicated beside them).

Each matrix has one owner. One ``all_to_all`` brings the owner every part of its matrices (from
the nearest rank holding that part: a replica in the owner's own replica group under HSDP), the
owner orthogonalises its buckets, and a second ``all_to_all`` sends every rank that holds part
of a matrix its part of the result: every replica receives the same update. This is the
gather-to-owner / scatter-back scheme of muon-fsdp2 and torchtitan, over boxes of any layout
and batched here to two collectives per NS dtype and step. Sizes are exact (every rank computes
every box's size from the boxes of :mod:`.parts`), so uneven and empty shards need no padding.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ..ns.engine import NSConfig, Orthogonalizer, TensorLayout
from ..ns.planner import Plan
from .inflight import InFlight
from .parts import Region, region_numel, region_sizes, whole_region
from .replicated import CommStats, Timer, assign_work, sub_plan


def contiguous_layout(shape: Sequence[int]) -> TensorLayout:
    """The layout of a whole matrix as the owner assembles it: contiguous."""
    return TensorLayout.of(torch.empty(tuple(shape), device="meta"))


def source_of(holders: Sequence[int], owner: int) -> int:
    """The rank an owner takes a part from: itself if it holds the part, else the nearest
    holder by rank number (ranks of one node, or of one replica group, are numbered together)."""
    if owner in holders:
        return owner
    return min(holders, key=lambda r: (abs(r - owner), r))


class Routes:
    """Who sends which part of which matrix to whom: a pure function of the plan, the matrices'
    boxes on every rank, and the world size (so every rank computes the same, and a planner can
    compute it for any world size without running one).

    ``owner[i]`` orthogonalises matrix ``i``; ``order[o]`` lists the matrices rank ``o`` owns in
    bucket-slot order; ``sources[i]`` the ``(rank, region)`` pairs it is assembled from.
    """

    def __init__(
        self,
        plan: Plan,
        shapes: Sequence[tuple[int, ...]],
        held: Sequence[Sequence[Region | None]],
        world: int,
    ):
        self.world = world
        self.shapes, self.held = list(shapes), [tuple(h) for h in held]
        # a matrix some ranks hold whole is owned by one of them: nothing to gather
        wholes = [whole_region(s) for s in self.shapes]
        candidates = [
            [r for r, reg in enumerate(h) if reg == whole] or None for h, whole in zip(self.held, wholes)
        ]
        self.units = assign_work(plan, world, candidates)
        self.order: dict[torch.dtype, list[list[int]]] = {}
        self.owner: dict[int, int] = {}
        for u in self.units:
            bucket = plan.buckets[u.bucket]
            order = self.order.setdefault(bucket.dtype, [[] for _ in range(world)])
            for m in bucket.members[u.start : u.stop]:
                order[u.owner].append(m.index)
                self.owner[m.index] = u.owner
        self.sources: list[list[tuple[int, Region]]] = []
        for i, regions in enumerate(self.held):
            holders: dict[Region, list[int]] = {}
            for r, region in enumerate(regions):
                if region is not None:
                    holders.setdefault(region, []).append(r)
            owner = self.owner.get(i, 0)
            picked = [(source_of(ranks, owner), region) for region, ranks in holders.items()]
            self.sources.append(sorted(picked, key=lambda sr: sr[1]))

    def gather_sizes(self, dtype: torch.dtype, rank: int) -> tuple[list[int], list[int]]:
        """Elements ``rank`` sends each owner, and receives as owner from each rank."""
        order = self.order[dtype]
        send = [0] * self.world
        for o in range(self.world):
            for i in order[o]:
                send[o] += sum(region_numel(reg) for s, reg in self.sources[i] if s == rank)
        recv = [0] * self.world
        for i in order[rank]:
            for s, reg in self.sources[i]:
                recv[s] += region_numel(reg)
        return send, recv

    def sizes(
        self, rank: int
    ) -> dict[torch.dtype, tuple[tuple[list[int], list[int]], tuple[list[int], list[int]]]]:
        """Per NS dtype, ``rank``'s gather sizes and scatter sizes (see those methods)."""
        return {
            dtype: (self.gather_sizes(dtype, rank), self.scatter_sizes(dtype, rank)) for dtype in self.order
        }

    def scatter_sizes(self, dtype: torch.dtype, rank: int) -> tuple[list[int], list[int]]:
        """Elements ``rank`` sends each rank as owner, and receives from each owner."""
        order = self.order[dtype]
        send = [sum(region_numel(self.held[i][r]) for i in order[rank]) for r in range(self.world)]
        recv = [sum(region_numel(self.held[i][rank]) for i in order[o]) for o in range(self.world)]
        return send, recv


class ShardedOrthogonalizer:
    """Gather each matrix to its owner, orthogonalise there in buckets, scatter the parts back.

    Two ``all_to_all_single`` calls per NS dtype and step (see the module docstring); parts
    travel cast to the NS dtype, as the single-process engine casts when packing. The four
    exchange buffers per NS dtype persist between steps, and the results are views of the last
    one: valid until the next call.
    """

    def __init__(
        self,
        plan: Plan,
        shapes: Sequence[tuple[int, ...]],
        held: Sequence[Sequence[Region | None]],
        configs: dict[Hashable, NSConfig],
        group: Any,
        compile: bool = False,
        host_reads: bool = True,
    ):
        self.plan, self.shapes, self.group = plan, [tuple(s) for s in shapes], group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        routes = self.routes = Routes(plan, self.shapes, held, self.world)
        self.units = routes.units
        me = self.rank
        layouts = [contiguous_layout(s) for s in self.shapes]
        owned = [u for u in self.units if u.owner == me]
        # one engine per NS dtype (each dtype is exchanged apart), over this rank's units
        self._engines: dict[torch.dtype, Orthogonalizer] = {}
        for dtype in dict.fromkeys(plan.buckets[u.bucket].dtype for u in owned):
            local_plan, index = sub_plan(plan, [u for u in owned if plan.buckets[u.bucket].dtype == dtype])
            self._engines[dtype] = Orthogonalizer(
                local_plan, [layouts[i] for i in index], configs, compile=compile, host_reads=host_reads
            )
        self._mine = [h[me] for h in routes.held]
        # what this rank sends each owner, in the order owners expect it
        self._send_order = {
            dtype: [
                i for o in range(self.world) for i in order[o] if any(s == me for s, _ in routes.sources[i])
            ]
            for dtype, order in routes.order.items()
        }
        self._sizes = routes.sizes(me)
        self._bytes = moved_bytes(self._sizes, me)
        self._buffers: dict[tuple[torch.dtype, str], Tensor] = {}
        self._inflight = InFlight()
        self.profile = False
        self.stats = CommStats(total_flops=plan.flops(), owned_flops=sum(u.flops for u in owned))

    def __call__(self, sources: Sequence[Tensor], out_dtypes: Sequence[torch.dtype]) -> list[Tensor]:
        """``sources`` are this rank's parts (empty where it holds none); so are the results."""
        self._inflight.settle()  # the last call's all_to_alls (finished long ago)
        device = sources[0].device
        timer = Timer(self.profile, device)
        results: list[Tensor | None] = [None] * len(sources)
        stats = CommStats(total_flops=self.stats.total_flops, owned_flops=self.stats.owned_flops)
        me, world, routes = self.rank, self.world, self.routes
        for dtype, order in routes.order.items():
            (to_owner, from_rank), (to_rank, from_owner) = self._sizes[dtype]
            t0 = timer.now()
            # 1. every part to its matrix's owner, cast to NS dtype on the way
            send = self._buffer(dtype, "gather send", sum(to_owner), device)
            blocks = [sources[i].reshape(-1) for i in self._send_order[dtype]]
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
            # 3. every holder's part of each result back to it
            send = self._buffer(dtype, "scatter send", sum(to_rank), device)
            parts = [
                _part(out, routes.held[i][r]).reshape(-1)
                for r in range(world)
                for i, out in zip(order[me], owned)
                if routes.held[i][r] is not None
            ]
            if parts:
                torch.cat(parts, out=send)
            recv = self._buffer(dtype, "scatter recv", sum(from_owner), device)
            self._inflight.issue(dist.all_to_all_single, recv, send, from_owner, to_rank, group=self.group)
            self._inflight.wait()
            casts: dict[torch.dtype, Tensor] = {}
            offset = 0
            for o in range(world):
                for i in order[o]:
                    region = self._mine[i]
                    if region is None:
                        continue
                    out_dtype = out_dtypes[i]
                    if out_dtype not in casts:
                        casts[out_dtype] = recv if recv.dtype == out_dtype else recv.to(out_dtype)
                    size = region_numel(region)
                    results[i] = casts[out_dtype][offset : offset + size].view(region_sizes(region))
                    offset += size
            t3 = timer.now()
            stats.ns_seconds += t2 - t1
            stats.comm_seconds += (t1 - t0) + (t3 - t2)
        stats.bytes_sent, stats.bytes_received = self._bytes
        self.stats = stats
        for i, r in enumerate(results):
            if r is None:  # this rank holds no part of it
                results[i] = sources[i].new_empty(sources[i].shape, dtype=out_dtypes[i])
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
        """Whole matrices from the parts every rank sent, a run of matrices with equal shapes
        and equal boxes at a time: a view where one part is the whole, one ``cat`` where the
        parts are row blocks, else copies into the whole."""
        chunks = list(recv.split(recv_sizes))
        offsets = [0] * self.world
        routes = self.routes
        full: list[Tensor] = []
        k = 0
        while k < len(owned):
            first = owned[k]
            shape, held = self.shapes[first], routes.held[first]
            end = k
            while end < len(owned) and self.shapes[owned[end]] == shape and routes.held[owned[end]] == held:
                end += 1
            count = end - k
            blocks = []
            for s, region in routes.sources[first]:
                size = count * region_numel(region)
                blocks.append(
                    (region, chunks[s][offsets[s] : offsets[s] + size].view(count, *region_sizes(region)))
                )
                offsets[s] += size
            full += list(_whole(blocks, shape, count))
            k = end
        return full


def _part(t: Tensor, region: Region) -> Tensor:
    return t[tuple(slice(a, b) for a, b in region)]


def _whole(blocks: list[tuple[Region, Tensor]], shape: tuple[int, ...], count: int) -> Tensor:
    """``count`` whole matrices of ``shape`` from their parts (each ``(count, *part)``)."""
    if len(blocks) == 1 and blocks[0][0] == whole_region(shape):
        return blocks[0][1]
    if all(region[1:] == whole_region(shape)[1:] for region, _ in blocks):  # row blocks, in row order
        return torch.cat([b for _, b in blocks], dim=1)
    out = blocks[0][1].new_empty((count, *shape))
    for region, block in blocks:
        out[(slice(None), *(slice(a, b) for a, b in region))] = block
    return out


def exchange_bytes(routes: Routes, rank: int) -> tuple[int, int]:
    """Bytes ``rank`` sends and receives per step under ``routes`` (its own parts excluded)."""
    return moved_bytes(routes.sizes(rank), rank)


def moved_bytes(sizes: dict, rank: int) -> tuple[int, int]:
    """Bytes sent and received given ``rank``'s :meth:`Routes.sizes` (its own parts excluded)."""
    sent = received = 0
    for dtype, ((to_owner, from_rank), (to_rank, from_owner)) in sizes.items():
        item = torch.empty((), dtype=dtype).element_size()
        sent += item * (sum(to_owner) - to_owner[rank] + sum(to_rank) - to_rank[rank])
        received += item * (sum(from_rank) - from_rank[rank] + sum(from_owner) - from_owner[rank])
    return sent, received
