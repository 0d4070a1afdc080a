"""Newton–Schulz of matrices whose parts lie on several ranks (FSDP2, HSDP, TP, EP).

One ``all_to_all`` brings each matrix's owner every part (from its nearest holder, under HSDP in
its own replica group), the owner orthogonalises its buckets, and a second sends every holder,
replicas alike, its part of the result: the gather-to-owner / scatter-back scheme of muon-fsdp2 and
torchtitan, over boxes of any layout, batched to two collectives per NS dtype and round. Every rank
knows every box (:mod:`.parts`): uneven and empty shards need no padding.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from ..ns.engine import NSConfig, Orthogonalizer, TensorLayout
from ..ns.planner import Plan
from .group_ns import group_newton_schulz, group_reduce_elements
from .inflight import InFlight
from .owners import WorkUnit, assign_work, owner_plan
from .parts import Region, region_numel, region_sizes, whole_region
from .stats import CommStats, Timer
from .subgroups import local_subgroup, world_subgroup

#: A rank's gather and scatter sizes of one round, in elements (see :meth:`Routes.round_sizes`).
RoundSizes = tuple[tuple[list[int], list[int]], tuple[list[int], list[int]]]
Index = tuple[slice, ...]
#: A piece of a result a rank receives: (matrix, region, offset, numel, sizes).
Back = tuple[int, Region, int, int, tuple[int, ...]]


def contiguous_layout(shape: Sequence[int]) -> TensorLayout:
    """The layout of a whole matrix as the owner assembles it: contiguous."""
    return TensorLayout.of(torch.empty(tuple(shape), device="meta"))


def source_of(holders: Sequence[int], owner: int) -> int:
    """The rank an owner takes a part from: itself, else the nearest holder by rank number
    (ranks of one node, or of one replica group, are numbered together)."""
    if owner in holders:
        return owner
    return min(holders, key=lambda r: (abs(r - owner), r))


#: The default per-rank buffer cap is the larger of the rank's shard (NS dtype) and twice this
#: less the shard, so its results (one shard) plus round buffers stay within max(2x shard, 2 GiB).
DEFAULT_MIN_EXCHANGE_BYTES = 2**30


def exchange_caps(
    given: int | None, held: Sequence[Sequence[Region | None]], itemsizes: Sequence[int], world: int
) -> list[int]:
    """Every rank's round-buffer cap in bytes: ``given``, else :data:`DEFAULT_MIN_EXCHANGE_BYTES`'s."""
    if given is not None:
        return [int(given)] * world
    shard = [0] * world
    for regions, item in zip(held, itemsizes):
        for r, region in enumerate(regions):
            shard[r] += region_numel(region) * item
    return [max(s, 2 * DEFAULT_MIN_EXCHANGE_BYTES - s) for s in shard]


def pack_rounds(
    needs: Sequence[tuple[np.ndarray, np.ndarray]],
    dtypes: Sequence[torch.dtype],
    caps: Sequence[int] | None,
    world: int,
) -> dict[torch.dtype, list[list[int]]]:
    """Units per NS dtype packed greedily, in order, into rounds: a unit starts a new round where
    a rank it needs bytes on (``needs[k]``: ranks, bytes) would pass its cap, so an oversized unit
    gets a round alone. ``caps`` None: one round per dtype."""
    rounds: dict[torch.dtype, list[list[int]]] = {}
    cap = None if caps is None else np.asarray(caps, dtype=np.int64)
    for dtype in dict.fromkeys(dtypes):
        out: list[list[int]] = []
        used = np.zeros(world, dtype=np.int64)
        for k, d in enumerate(dtypes):
            if d != dtype:
                continue
            ranks, need = needs[k]
            busy = need > 0
            fits = cap is None or bool(np.all(used[ranks[busy]] + need[busy] <= cap[ranks[busy]]))
            if not out or not fits:
                out.append([])
                used[:] = 0
            out[-1].append(k)
            np.add.at(used, ranks, need)
        rounds[dtype] = out
    return rounds


def block_region(shape: Sequence[int], k: int, g: int) -> Region:
    """Block ``k`` of ``g`` of a matrix split along its long side, in the matrix's coordinates."""
    rows, cols = shape[0], math.prod(shape[1:])
    d = 0 if rows > cols else 1
    n = shape[d]
    step = n // g
    out = [(0, int(x)) for x in shape]
    out[d] = (k * step, (k + 1) * step)
    return tuple(out)


def _meet(a: Region, b: Region) -> Region | None:
    out = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b))
    return out if all(lo < hi for lo, hi in out) else None


def _within(inner: Region, outer: Region) -> Region:
    """``inner`` in ``outer``'s own coordinates."""
    return tuple((a - o, b - o) for (a, b), (o, _) in zip(inner, outer))


@dataclass(frozen=True)
class Target:
    """What one rank orthogonalises of a matrix: all, or its owner group's block ``member`` (``region``)."""

    matrix: int
    region: Region
    owner: int
    unit: int
    member: int = 0


class Routes:
    """Who sends which part of which matrix to whom, in which round: a pure function of the
    units, every rank's boxes, the world size and the caps, so every rank computes the same.
    ``sources[t]``: the ``(rank, region)`` pairs target ``t`` is assembled from (each part's
    nearest holder); ``pieces[t]``: every holder's piece of its result; ``rounds[dtype]``: each
    NS dtype's units in rounds within every rank's cap (``caps[r]`` bytes, :func:`pack_rounds`)."""

    def __init__(
        self,
        plan: Plan,
        shapes: Sequence[tuple[int, ...]],
        held: Sequence[Sequence[Region | None]],
        world: int,
        units: Sequence[WorkUnit] | None = None,
        caps: Sequence[int] | None = None,
    ):
        self.world, self.plan = world, plan
        self.shapes, self.held = list(shapes), [tuple(h) for h in held]
        if units is None:  # a matrix some ranks hold whole is owned by one of them: nothing to gather
            wholes = [whole_region(s) for s in self.shapes]
            candidates = [
                [r for r, reg in enumerate(h) if reg == whole] or None for h, whole in zip(self.held, wholes)
            ]
            units = assign_work(plan, world, candidates)
        self.units = list(units)
        self.targets: list[Target] = []
        self.unit_targets: list[list[int]] = []
        self.dtype_of_unit = [plan.buckets[u.bucket].dtype for u in self.units]
        self.owner: dict[int, int] = {}
        for k, u in enumerate(self.units):
            ids = []
            for m in plan.buckets[u.bucket].members[u.start : u.stop]:
                shape = self.shapes[m.index]
                if u.group:
                    for j, r in enumerate(u.group):
                        ids.append(len(self.targets))
                        self.targets.append(Target(m.index, block_region(shape, j, len(u.group)), r, k, j))
                else:
                    ids.append(len(self.targets))
                    self.targets.append(Target(m.index, whole_region(shape), u.owner, k))
                self.owner[m.index] = u.owner
            self.unit_targets.append(ids)
        self.sources: list[list[tuple[int, Region]]] = []
        self.pieces: list[list[tuple[int, Region]]] = []  # (holder, region in the matrix) per target
        parts_of: dict[int, dict[Region, list[int]]] = {}
        for t in self.targets:
            holders = parts_of.get(t.matrix)
            if holders is None:
                holders = parts_of[t.matrix] = {}
                for r, region in enumerate(self.held[t.matrix]):
                    if region is not None:
                        holders.setdefault(region, []).append(r)
            picked, back = [], []
            for region, ranks in holders.items():
                cut = _meet(region, t.region)
                if cut is None:
                    continue
                picked.append((source_of(ranks, t.owner), cut))
                back += [(r, cut) for r in ranks]
            self.sources.append(sorted(picked, key=lambda sr: sr[1]))
            self.pieces.append(sorted(back))
        self.rounds = self._rounds(caps)

    def unit_bytes(self, k: int, rank: int) -> int:
        """Round-buffer bytes unit ``k`` needs on ``rank``: what it sends to owners, receives as
        an owner, and sends back as an owner (what it receives back lands in its results)."""
        item = self.dtype_of_unit[k].itemsize
        n = 0
        for t in self.unit_targets[k]:
            target = self.targets[t]
            n += sum(region_numel(reg) for s, reg in self.sources[t] if s == rank)
            if target.owner == rank:
                n += sum(region_numel(reg) for _, reg in self.sources[t])
                n += sum(region_numel(reg) for _, reg in self.pieces[t])
        return n * item

    def _rounds(self, caps: Sequence[int] | None) -> dict[torch.dtype, list[list[int]]]:
        needs = []
        for k in range(len(self.units)):
            touched = self._unit_ranks(k)
            needs.append(
                (np.fromiter(touched, dtype=np.int64), np.fromiter(touched.values(), dtype=np.int64))
            )
        return pack_rounds(needs, self.dtype_of_unit, caps, self.world)

    def check_caps(self, caps: Sequence[int]) -> None:
        """Refuse a cap some unit cannot fit in on its own, naming the bytes it needs."""
        for k in range(len(self.units)):
            for r, need in self._unit_ranks(k).items():
                if need > caps[r]:
                    t = self.targets[self.unit_targets[k][0]]
                    shape = "x".join(map(str, self.shapes[t.matrix]))
                    raise ValueError(
                        f"max_exchange_bytes={caps[r]} is too small: rank {r}'s share of the exchange of "
                        f"a {shape} matrix needs {need} bytes of round buffers on its own; give "
                        f"max_exchange_bytes >= {need}, or None for the default cap"
                    )

    def _unit_ranks(self, k: int) -> dict[int, int]:
        """Round-buffer bytes of unit ``k`` on every rank it touches."""
        ranks: set[int] = set()
        for t in self.unit_targets[k]:
            ranks.add(self.targets[t].owner)
            ranks.update(s for s, _ in self.sources[t])
        return {r: self.unit_bytes(k, r) for r in sorted(ranks)}

    def owned(self, units: Sequence[int]) -> list[list[int]]:
        """Per owner, the targets of ``units`` it orthogonalises, in unit order."""
        order: list[list[int]] = [[] for _ in range(self.world)]
        for k in units:
            for t in self.unit_targets[k]:
                order[self.targets[t].owner].append(t)
        return order

    def round_sizes(self, units: Sequence[int], rank: int) -> RoundSizes:
        """``rank``'s gather sizes ``(send to each owner, receive as owner from each rank)`` and
        scatter sizes ``(send as owner to each rank, receive from each owner)``, in elements."""
        order = self.owned(units)
        g_send, g_recv = [0] * self.world, [0] * self.world
        s_send, s_recv = [0] * self.world, [0] * self.world
        for o in range(self.world):
            for t in order[o]:
                for s, reg in self.sources[t]:
                    if s == rank:
                        g_send[o] += region_numel(reg)
                    if o == rank:
                        g_recv[s] += region_numel(reg)
                for r, reg in self.pieces[t]:
                    if o == rank:
                        s_send[r] += region_numel(reg)
                    if r == rank:
                        s_recv[o] += region_numel(reg)
        return (g_send, g_recv), (s_send, s_recv)

    def sizes(self, rank: int) -> dict[torch.dtype, list[RoundSizes]]:
        """Per NS dtype, ``rank``'s :meth:`round_sizes` for each round."""
        return {d: [self.round_sizes(units, rank) for units in rs] for d, rs in self.rounds.items()}

    def buffer_bytes(self, rank: int) -> int:
        """Exchange-buffer bytes ``rank`` keeps: per NS dtype, a round buffer and every round's results."""
        total = 0
        for dtype, per_round in self.sizes(rank).items():
            total += dtype.itemsize * (_round_numel(per_round) + _results_numel(per_round))
        return total

    def group_reduce_bytes(self, rank: int) -> int:
        """Bytes ``rank`` moves each way in its owner groups' Gram all-reduces per step."""
        return _group_reduce_bytes(self, self.plan, rank)


class ShardedOrthogonalizer:
    """Gather each target to its owner, orthogonalise it there (in buckets, or with its owner
    group), scatter the parts back, in rounds within the caps. Parts travel in the NS dtype, as
    the one-process engine packs them; results view persistent buffers, valid until the next call."""

    def __init__(
        self,
        plan: Plan,
        shapes: Sequence[tuple[int, ...]],
        held: Sequence[Sequence[Region | None]],
        configs: dict[Hashable, NSConfig],
        group: Any,
        compile: bool = False,
        host_reads: bool = True,
        units: Sequence[WorkUnit] | None = None,
        caps: Sequence[int] | None = None,
        cap_given: bool = False,
    ):
        self.plan, self.shapes, self.group = plan, [tuple(s) for s in shapes], group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        routes = self.routes = Routes(plan, self.shapes, held, self.world, units, caps)
        if cap_given and caps is not None:
            routes.check_caps(caps)
        self.units = routes.units
        me = self.rank
        self.configs = configs
        # per NS dtype and round: an engine over this rank's single-owner units of the round
        self._engines: dict[tuple[torch.dtype, int], tuple[Orthogonalizer, list[int]]] = {}
        for dtype, rounds in routes.rounds.items():
            for r, ks in enumerate(rounds):
                mine = [self.units[k] for k in ks if self.units[k].owner == me and not self.units[k].group]
                if not mine:
                    continue
                local_plan, index = owner_plan(plan, mine)
                layouts = [contiguous_layout(self.shapes[i]) for i in index]
                engine = Orthogonalizer(local_plan, layouts, configs, compile=compile, host_reads=host_reads)
                self._engines[(dtype, r)] = (engine, index)
        self._groups = _owner_groups(self.units, me, group)
        self._mine = [h[me] for h in routes.held]
        self._round_plans = {
            (dtype, r): self._round_plan(ks)
            for dtype, rounds in routes.rounds.items()
            for r, ks in enumerate(rounds)
        }
        self._sizes = routes.sizes(me)
        self._bytes = moved_bytes(self._sizes, me)
        self._reduce_bytes = routes.group_reduce_bytes(me)
        self._buffers: dict[tuple[torch.dtype, str], Tensor] = {}
        self._inflight = InFlight()
        self.profile = False
        owned_flops = sum(u.flops for u in self.units if me in u.owners)
        self.stats = CommStats(total_flops=plan.flops(), owned_flops=owned_flops)

    def __call__(self, sources: Sequence[Tensor], out_dtypes: Sequence[torch.dtype]) -> list[Tensor]:
        """``sources`` are this rank's parts (empty where it holds none); so are the results."""
        self._inflight.settle()  # the last call's all_to_alls (finished long ago)
        device = sources[0].device
        timer = Timer(self.profile, device)
        results: list[Tensor | None] = [None] * len(sources)
        pieces: dict[int, list[tuple[Region, Tensor]]] = {}
        stats = CommStats(total_flops=self.stats.total_flops, owned_flops=self.stats.owned_flops)
        routes = self.routes
        for dtype, rounds in routes.rounds.items():
            kept = self._buffer(dtype, "results", _results_numel(self._sizes[dtype]), device)
            arena = self._buffer(dtype, "round", _round_numel(self._sizes[dtype]), device)
            kept_at = 0
            for r in range(len(rounds)):
                (to_owner, from_rank), (to_rank, from_owner) = self._sizes[dtype][r]
                gather, owned, scatter, back = self._round_plans[(dtype, r)]
                t0 = timer.now()
                n_send, n_recv = sum(to_owner), sum(from_rank)
                send = arena[:n_send]
                blocks = [sources[i][index].reshape(-1) for i, index in gather]
                if blocks:
                    torch.cat(blocks, out=send)
                recv = arena[n_send : n_send + n_recv]
                self._inflight.issue(
                    dist.all_to_all_single, recv, send, from_rank, to_owner, group=self.group
                )
                self._inflight.wait()
                t1 = timer.now()
                inputs = self._assemble(recv, from_rank, owned)
                outs = self._orthogonalise(dtype, r, owned, inputs)
                t2 = timer.now()
                send = arena[n_send + n_recv : n_send + n_recv + sum(to_rank)]
                parts = [outs[j][index].reshape(-1) for j, index in scatter]
                if parts:
                    torch.cat(parts, out=send)
                size = sum(from_owner)
                recv = kept[kept_at : kept_at + size]
                kept_at += size
                self._inflight.issue(
                    dist.all_to_all_single, recv, send, from_owner, to_rank, group=self.group
                )
                self._inflight.wait()
                for i, reg, offset, n, sizes in back:
                    pieces.setdefault(i, []).append((reg, recv[offset : offset + n].view(sizes)))
                t3 = timer.now()
                stats.ns_seconds += t2 - t1
                stats.comm_seconds += (t1 - t0) + (t3 - t2)
        for i, got in pieces.items():
            results[i] = _my_part(got, self._mine[i], out_dtypes[i])
        stats.bytes_sent, stats.bytes_received = self._bytes
        stats.bytes_sent += self._reduce_bytes
        stats.bytes_received += self._reduce_bytes
        self.stats = stats
        for i, res in enumerate(results):
            if res is None:  # this rank holds no part of it
                results[i] = sources[i].new_empty(sources[i].shape, dtype=out_dtypes[i])
        return results  # type: ignore[return-value]

    def _round_plan(
        self, ks: Sequence[int]
    ) -> tuple[list[tuple[int, Index]], list[int], list[tuple[int, Index]], list[Back]]:
        """This rank's share of the round of units ``ks``, worked out once: parts to send (in the
        order owners expect), targets owned, result pieces to send back, and pieces received."""
        me, routes = self.rank, self.routes
        order = routes.owned(ks)
        gather = [
            (routes.targets[t].matrix, _index(_within(reg, self._own_part(routes.targets[t].matrix))))
            for o in range(self.world)
            for t in order[o]
            for s, reg in routes.sources[t]
            if s == me
        ]
        scatter = [
            (j, _index(_within(reg, routes.targets[t].region)))
            for q in range(self.world)
            for j, t in enumerate(order[me])
            for h, reg in routes.pieces[t]
            if h == q
        ]
        back: list[Back] = []
        offset = 0
        for o in range(self.world):
            for t in order[o]:
                for h, reg in routes.pieces[t]:
                    if h == me:
                        n = region_numel(reg)
                        back.append((routes.targets[t].matrix, reg, offset, n, region_sizes(reg)))
                        offset += n
        return gather, order[me], scatter, back

    def _own_part(self, i: int) -> Region:
        """This rank's part of matrix ``i``: one whose parts it sends holds one."""
        region = self._mine[i]
        assert region is not None, "a rank sends only parts it holds"
        return region

    def _orthogonalise(
        self, dtype: torch.dtype, r: int, mine: list[int], inputs: list[Tensor]
    ) -> list[Tensor]:
        """NS of this rank's targets of round ``r``; group blocks in unit order, as members call."""
        routes = self.routes
        outs: list[Tensor | None] = [None] * len(mine)
        single = [j for j, t in enumerate(mine) if not self.units[routes.targets[t].unit].group]
        if single:  # the engine takes its matrices in its own plan's order
            engine, index = self._engines[(dtype, r)]
            at = {routes.targets[mine[j]].matrix: j for j in single}
            got = engine([inputs[at[i]] for i in index], [dtype] * len(index))
            for i, out in zip(index, got):
                outs[at[i]] = out
        for j, t in enumerate(mine):
            if outs[j] is not None:
                continue
            target = routes.targets[t]
            unit = self.units[target.unit]
            bucket = self.plan.buckets[unit.bucket]
            config = self.configs[bucket.key]
            block = inputs[j].reshape(inputs[j].shape[0], -1)
            tall = _is_tall(self.shapes[target.matrix])  # the whole matrix decides, not its block
            wide = block.mT if tall else block
            reduce = functools.partial(dist.all_reduce, group=self._groups[unit.group])
            out = group_newton_schulz(wide.unsqueeze(0), config, reduce)[0]
            outs[j] = (out.mT if tall else out).reshape(inputs[j].shape)
        return outs  # type: ignore[return-value]

    def _buffer(self, dtype: torch.dtype, role: str, numel: int, device: torch.device) -> Tensor:
        """The persistent exchange buffer for ``role`` in ``dtype`` (its size never changes)."""
        buf = self._buffers.get((dtype, role))
        if buf is None or buf.device != device:
            buf = self._buffers[(dtype, role)] = torch.empty(numel, dtype=dtype, device=device)
        return buf

    def workspaces(self) -> list[Tensor]:
        """Every tensor kept between steps: exchange buffers and the local engines'."""
        kept = list(self._buffers.values())
        return kept + [t for e, _ in self._engines.values() for t in e.workspaces()]

    def _assemble(self, recv: Tensor, recv_sizes: list[int], owned: list[int]) -> list[Tensor]:
        """Each owned target whole from the parts every rank sent (see ``_whole``)."""
        chunks = list(recv.split_with_sizes(recv_sizes))
        offsets = [0] * self.world
        routes = self.routes
        full: list[Tensor] = []
        for t in owned:
            target = routes.targets[t]
            shape = region_sizes(target.region)
            blocks = []
            for s, region in routes.sources[t]:
                size = region_numel(region)
                local = _within(region, target.region)
                blocks.append(
                    (local, chunks[s][offsets[s] : offsets[s] + size].view(1, *region_sizes(region)))
                )
                offsets[s] += size
            full.append(_whole(blocks, shape, 1)[0])
        return full


def _is_tall(shape: Sequence[int]) -> bool:
    return shape[0] > math.prod(shape[1:])


def _round_numel(per_round: list[RoundSizes]) -> int:
    """Elements of the round buffer: the largest round's gather send, receive and scatter send."""
    return max(sum(gs) + sum(gr) + sum(ss) for (gs, gr), (ss, _) in per_round)


def _results_numel(per_round: list[RoundSizes]) -> int:
    """Elements of every round's results together: this rank's parts of every result."""
    return sum(sum(sr) for _, (_, sr) in per_round)


def _my_part(got: list[tuple[Region, Tensor]], region: Region | None, dtype: torch.dtype) -> Tensor:
    """This rank's part (``region``) of a result, in ``dtype``, from the pieces owners sent."""
    if len(got) == 1:
        out = got[0][1]
    else:
        assert region is not None, "a result comes back only to a rank holding part of it"
        out = got[0][1].new_empty(region_sizes(region))
        for reg, piece in got:
            out[tuple(slice(a, b) for a, b in _within(reg, region))] = piece
    return out if out.dtype == dtype else out.to(dtype)


def _owner_groups(units: Sequence[WorkUnit], rank: int, group: Any) -> dict[tuple[int, ...], Any]:
    """A process group per owner group this rank is in: over every rank of the job made by all in
    one order, over some ranks by the members alone (only where nothing splits: :mod:`.subgroups`)."""
    wanted = sorted({u.group for u in units if u.group})
    out: dict[tuple[int, ...], Any] = {}
    everyone = group is None or dist.get_world_size(group) == dist.get_world_size()
    for members in wanted:
        ranks = tuple(r if group is None else dist.get_global_rank(group, r) for r in members)
        if everyone:
            made = world_subgroup(ranks, rank in members)
            if made is not None:
                out[members] = made
        elif rank in members:
            out[members] = local_subgroup(ranks)
    return out


def _group_reduce_bytes(routes: Routes, plan: Plan, rank: int) -> int:
    """:meth:`Routes.group_reduce_bytes` (a ring all-reduce moves ``2(g-1)/g`` of the tensor)."""
    total = 0
    for u in routes.units:
        if rank not in u.group:
            continue
        g, bucket = len(u.group), plan.buckets[u.bucket]
        m = bucket.members[u.start]
        n = group_reduce_elements(1, min(m.rows, m.cols), plan.steps, bucket.preconditioning)
        total += 2 * (g - 1) * n * bucket.dtype.itemsize // g
    return total


def _index(region: Region) -> tuple[slice, ...]:
    return tuple(slice(a, b) for a, b in region)


def _whole(blocks: list[tuple[Region, Tensor]], shape: tuple[int, ...], count: int) -> Tensor:
    """``count`` whole matrices of ``shape`` from their parts (each ``(count, *part)``): a view
    where one part is the whole, one ``cat`` of row blocks, else copies."""
    if len(blocks) == 1 and blocks[0][0] == whole_region(shape):
        return blocks[0][1]
    if all(region[1:] == whole_region(shape)[1:] for region, _ in blocks):  # row blocks, in row order
        return torch.cat([b for _, b in blocks], dim=1)
    out = blocks[0][1].new_empty((count, *shape))
    for region, block in blocks:
        index = (slice(None), *(slice(a, b) for a, b in region))
        out[index] = block
    return out


def exchange_bytes(routes: Routes, rank: int) -> tuple[int, int]:
    """Bytes ``rank`` sends and receives per step, owner-group all-reduces included."""
    sent, received = moved_bytes(routes.sizes(rank), rank)
    reduced = routes.group_reduce_bytes(rank)
    return sent + reduced, received + reduced


def moved_bytes(sizes: dict[torch.dtype, list[RoundSizes]], rank: int) -> tuple[int, int]:
    """Bytes sent and received given ``rank``'s :meth:`Routes.sizes` (its own parts excluded)."""
    sent = received = 0
    for dtype, per_round in sizes.items():
        item = dtype.itemsize
        for (to_owner, from_rank), (to_rank, from_owner) in per_round:
            sent += item * (sum(to_owner) - to_owner[rank] + sum(to_rank) - to_rank[rank])
            received += item * (sum(from_rank) - from_rank[rank] + sum(from_owner) - from_owner[rank])
    return sent, received
