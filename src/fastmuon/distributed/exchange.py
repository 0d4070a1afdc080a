"""Newton–Schulz of matrices whose parts lie on several ranks (FSDP2, HSDP, tensor parallel,
expert parallel, and plain tensors replicated beside them).

Each matrix has one owner, and each distinct part of it one *primary* holder: the holder nearest
the owner by rank number (the owner itself where it holds the part; under HSDP a rank of the
owner's own replica group). One ``all_to_all`` brings the owner every part of its matrices from
their primaries, the owner orthogonalises its buckets, a second ``all_to_all`` sends each primary
its part of the result, and — where parts are replicated — a third sends each primary's part on
to the other ranks holding the same part: every replica gets the same bytes, and no rank sends a
result once per replica (the owner of a large matrix under HSDP would otherwise send it ``R``
times, and hold ``R`` copies in its send buffer). This is the gather-to-owner / scatter-back
scheme of muon-fsdp2 and torchtitan, over boxes of any layout, batched here to two or three
collectives per NS dtype and step. Sizes are exact (every rank computes every part's size from
the boxes of :mod:`.parts`), so uneven and empty shards need no padding.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
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
    bucket-slot order; ``sources[i]`` the ``(primary, region)`` pairs it is assembled from (and
    whose parts of the result go back to those primaries); ``copies[i]`` the
    ``(primary, region, other holders)`` of each part more than one rank holds.
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
        self.copies: list[list[tuple[int, Region, list[int]]]] = []
        self.primary: list[list[int | None]] = []  # per matrix, per rank: its part's primary
        for i, regions in enumerate(self.held):
            holders: dict[Region, list[int]] = {}
            for r, region in enumerate(regions):
                if region is not None:
                    holders.setdefault(region, []).append(r)
            owner = self.owner.get(i, 0)
            picked = {region: source_of(ranks, owner) for region, ranks in holders.items()}
            self.sources.append(sorted(((p, region) for region, p in picked.items()), key=lambda sr: sr[1]))
            self.copies.append(
                [(picked[region], region, [r for r in ranks if r != picked[region]])
                 for region, ranks in holders.items() if len(ranks) > 1]
            )  # fmt: skip
            self.primary.append([None if reg is None else picked[reg] for reg in regions])
        self.copied = {
            dtype: any(self.copies[i] for o in order for i in o) for dtype, order in self.order.items()
        }

    def gather_sizes(self, dtype: torch.dtype, rank: int) -> tuple[list[int], list[int]]:
        """Elements ``rank`` sends each owner, and receives as owner from each rank. The
        scatter sends back exactly these, the other way."""
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

    def copy_sizes(self, dtype: torch.dtype, rank: int) -> tuple[list[int], list[int]]:
        """Elements ``rank`` passes on to each rank as a primary, and receives from each."""
        send, recv = [0] * self.world, [0] * self.world
        for o in self.order[dtype]:
            for i in o:
                for p, region, others in self.copies[i]:
                    n = region_numel(region)
                    if p == rank:
                        for r in others:
                            send[r] += n
                    elif rank in others:
                        recv[p] += n
        return send, recv


class ShardedOrthogonalizer:
    """Gather each matrix to its owner, orthogonalise there in buckets, scatter the parts back
    to their primaries, and pass replicated parts on to the other holders.

    Two ``all_to_all_single`` calls per NS dtype and step, three where parts are replicated
    (see the module docstring); parts travel cast to the NS dtype, as the single-process engine
    casts when packing. The exchange buffers (four per NS dtype, six with copies) persist
    between steps, and the results are views of them: valid until the next call.
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
        me, world = self.rank, self.world
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
        primary = routes.primary
        self._routes: dict[torch.dtype, _DtypeRoutes] = {}
        for dtype, order in routes.order.items():
            by_owner = [i for o in range(world) for i in order[o]]  # every matrix, owners in rank order
            sends_to_owners = [i for i in by_owner if primary[i][me] == me]
            copies_to = [
                (r, i) for r in range(world) for i in sends_to_owners if r != me and primary[i][r] == me
            ]
            copies_from = [(p, i) for p in range(world) if p != me for i in by_owner if primary[i][me] == p]
            self._routes[dtype] = _DtypeRoutes(
                sends_to_owners,
                [(i, reg) for p in range(world) for i in order[me] for q, reg in routes.sources[i] if q == p],
                [i for _, i in copies_to],
                [i for _, i in copies_from],
                routes.gather_sizes(dtype, me),
                routes.copy_sizes(dtype, me),
                routes.copied[dtype],
            )
        self._bytes = exchange_bytes(routes, me)
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
        me = self.rank
        for dtype, r in self._routes.items():
            (to_owner, from_rank), (copy_to, copy_from) = r.gather, r.copy
            t0 = timer.now()
            # 1. every part from its primary to its matrix's owner, cast to NS dtype on the way
            send = self._buffer(dtype, "gather send", sum(to_owner), device)
            if r.gather_order:
                torch.cat([sources[i].reshape(-1) for i in r.gather_order], out=send)
            recv = self._buffer(dtype, "gather recv", sum(from_rank), device)
            self._exchange(recv, send, from_rank, to_owner)
            t1 = timer.now()
            # 2. whole matrices on the owner, NS over its buckets
            order = self.routes.order[dtype][me]
            full = self._assemble(recv, from_rank, order)
            owned = dict(zip(order, self._engines[dtype](full, [dtype] * len(full)))) if full else {}
            t2 = timer.now()
            # 3. each part of each result back to its primary (what the gather brought, reversed)
            send = self._buffer(dtype, "scatter send", sum(from_rank), device)
            if r.scatter_order:
                torch.cat([_part(owned[i], reg).reshape(-1) for i, reg in r.scatter_order], out=send)
            back = self._buffer(dtype, "scatter recv", sum(to_owner), device)
            self._exchange(back, send, to_owner, from_rank)
            # 4. replicated parts on from their primaries to the other holders
            copies = None
            if r.copied:
                offsets = _offsets(r.gather_order, self._mine)
                send = self._buffer(dtype, "copy send", sum(copy_to), device)
                if r.copy_order:
                    parts = [
                        back[offsets[i] : offsets[i] + region_numel(self._mine[i])] for i in r.copy_order
                    ]
                    torch.cat(parts, out=send)
                copies = self._buffer(dtype, "copy recv", sum(copy_from), device)
                self._exchange(copies, send, copy_from, copy_to)
            casts: dict[tuple[str, torch.dtype], Tensor] = {}
            for role, buffer, index in (("back", back, r.gather_order), ("copies", copies, r.copied_order)):
                offset = 0
                for i in index:
                    out_dtype = out_dtypes[i]
                    key = (role, out_dtype)
                    if key not in casts:
                        casts[key] = buffer if buffer.dtype == out_dtype else buffer.to(out_dtype)
                    results[i] = _at(casts[key], offset, self._mine[i])
                    offset += region_numel(self._mine[i])
            t3 = timer.now()
            stats.ns_seconds += t2 - t1
            stats.comm_seconds += (t1 - t0) + (t3 - t2)
        stats.bytes_sent, stats.bytes_received = self._bytes
        self.stats = stats
        for i, res in enumerate(results):
            if res is None:  # this rank holds no part of it
                results[i] = sources[i].new_empty(sources[i].shape, dtype=out_dtypes[i])
        return results  # type: ignore[return-value]

    def _exchange(self, recv: Tensor, send: Tensor, recv_sizes: list[int], send_sizes: list[int]) -> None:
        self._inflight.issue(dist.all_to_all_single, recv, send, recv_sizes, send_sizes, group=self.group)
        self._inflight.wait()

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


@dataclass(frozen=True)
class _DtypeRoutes:
    """One NS dtype's routes as this rank runs them: the matrices whose part it sends each owner
    (owners in rank order; its parts of the results come back in the same order), the parts of
    its owned results it sends back (primaries in rank order), the parts it passes on as a
    primary and receives as another holder, and the element counts of each exchange."""

    gather_order: list[int]
    scatter_order: list[tuple[int, Region]]
    copy_order: list[int]
    copied_order: list[int]
    gather: tuple[list[int], list[int]]
    copy: tuple[list[int], list[int]]
    copied: bool  # whether any rank passes a part on (the third exchange runs on every rank)


def _part(t: Tensor, region: Region) -> Tensor:
    return t[tuple(slice(a, b) for a, b in region)]


def _at(flat: Tensor, offset: int, region: Region) -> Tensor:
    """A part laid out flat at ``offset``, viewed in its own shape."""
    return flat[offset : offset + region_numel(region)].view(region_sizes(region))


def _offsets(order: list[int], mine: list[Region | None]) -> dict[int, int]:
    offsets, offset = {}, 0
    for i in order:
        offsets[i] = offset
        offset += region_numel(mine[i])
    return offsets


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
    sent = received = 0
    for dtype in routes.order:
        item = torch.empty((), dtype=dtype).element_size()
        (to_owner, from_rank), (copy_to, copy_from) = (
            routes.gather_sizes(dtype, rank),
            routes.copy_sizes(dtype, rank),
        )
        away = sum(to_owner) - to_owner[rank] + sum(from_rank) - from_rank[rank]  # gather, then scatter back
        sent += item * (away + sum(copy_to))
        received += item * (away + sum(copy_from))
    return sent, received
