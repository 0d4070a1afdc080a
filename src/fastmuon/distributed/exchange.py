"""Newton–Schulz across ranks: replicated parameters (DDP) and FSDP2-sharded ones (DTensor).

With data parallelism every rank holds the same gradients, so a plain Muon orthogonalises every
matrix world_size times. Here each rank runs NS only on its *share* of the plan's buckets —
shares balanced by NS FLOPs, whole buckets where that balances, a bucket split by batch slots
where it does not — and the results are exchanged with one broadcast per share of a bucket.
The idea of an owner per matrix followed by an exchange is Keller Jordan's Muon (round-robin
owners, then all_gather) and Dion's (one collective per same-shape group); the FLOP-balanced
assignment of whole buckets is ours.

Under FSDP2 (``fully_shard``, 1-D mesh, ``Shard(0)``) each rank holds a row block of every
matrix, and NS needs whole matrices: one ``all_to_all`` brings every block to its matrix's
owner, the owner orthogonalises its buckets, and a second ``all_to_all`` sends each rank its
rows of the result (the gather-to-owner / scatter-back scheme of muon-fsdp2 and torchtitan,
batched here to two collectives per step). Uneven shards (rows not divisible by the world
size, empty shards) need no padding: every rank computes every block size from the shapes.

Everything is ``torch.distributed``; the only assumption is that all ranks step the same set of
parameters, which :func:`begin_step` enforces with one small all_reduce per step. Every
collective goes through an :class:`~fastmuon.distributed.inflight.InFlight`, and exchange buffers persist
between steps: nothing a collective touched is freed by the process group's own threads.
"""

from __future__ import annotations

import functools
import math
import operator
import pickle
import sys
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ..matrices import Box, MatrixMap, box_shape
from ..ns.engine import NSConfig, Orthogonalizer, TensorLayout, spec_of
from ..ns.planner import CostModel, Member, Plan, plan_buckets
from .inflight import InFlight


def is_dtensor(t: Any) -> bool:
    """Whether ``t`` is a DTensor, without importing DTensor support when nobody has."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def local_shard(t: Tensor) -> Tensor:
    """A DTensor's local shard (a view: writing to it writes the DTensor), else ``t``."""
    return t.to_local() if is_dtensor(t) else t


#: A DTensor's own local tensor. ``to_local()`` of a parameter returns a new view at every call
#: (one that is a Parameter too), so the tensor's identity is read from this field.
_local_tensor = operator.attrgetter("_local_tensor")


class LocalShards:
    """The local tensors of a step program's DTensor parameters, as they were when it was built.

    The program updates views of them. FSDP2 gives a parameter a new local tensor when it
    re-pads one (after ``nn.Module._apply`` or ``load_state_dict(assign=True)``), and views of
    the old one would then update memory that is no longer the parameter's: :meth:`current`
    tells whether each parameter still holds the tensor the program was built over.
    """

    def __init__(self, params: Sequence[Any]):
        self._params = [p for p in params if is_dtensor(p)]
        self._locals = list(map(_local_tensor, self._params))

    def current(self) -> bool:
        return all(map(operator.is_, map(_local_tensor, self._params), self._locals))


# ----- who orthogonalises what ----------------------------------------------------------------
@dataclass(frozen=True)
class WorkUnit:
    """Slots ``start:stop`` of bucket ``bucket``, orthogonalised by rank ``owner``."""

    bucket: int
    start: int
    stop: int
    flops: int
    owner: int


def assign_work(plan: Plan, world: int) -> list[WorkUnit]:
    """Split the plan into per-rank shares of about equal NS FLOPs, in bucket order.

    A bucket larger than an even share is cut by batch slots into near-equal pieces (each at
    most one share), so one huge bucket cannot leave the other ranks idle; then the pieces go,
    largest first, to the least-loaded rank (LPT). Pure and deterministic: every rank computes
    the same assignment from the same plan without talking to the others.
    """
    steps = plan.steps
    share = plan.flops() / max(world, 1)
    pieces: list[tuple[int, int, int, int]] = []  # (bucket, start, stop, flops)
    for b, bucket in enumerate(plan.buckets):
        slots = bucket.shape[0]
        per_slot = bucket.flops(steps) // slots
        n = 1 if world == 1 or share <= 0 else min(slots, max(1, math.ceil(bucket.flops(steps) / share)))
        bounds = [round(k * slots / n) for k in range(n + 1)]
        pieces += [(b, lo, hi, per_slot * (hi - lo)) for lo, hi in zip(bounds, bounds[1:])]
    load = [0] * world
    owners: dict[tuple[int, int], int] = {}
    for b, lo, _, flops in sorted(pieces, key=lambda p: (-p[3], p[0], p[1])):
        rank = min(range(world), key=lambda r: (load[r], r))
        load[rank] += flops
        owners[(b, lo)] = rank
    return [WorkUnit(b, lo, hi, flops, owners[(b, lo)]) for b, lo, hi, flops in pieces]


def sub_plan(plan: Plan, units: Sequence[WorkUnit]) -> tuple[Plan, list[int]]:
    """A plan holding only ``units``, one bucket each, over their members renumbered from 0.

    Returns the plan and, for each new index, the matrix's index in ``plan``.
    """
    buckets, indices = [], []
    for u in units:
        bucket = plan.buckets[u.bucket]
        members = []
        for m in bucket.members[u.start : u.stop]:
            members.append(Member(len(indices), m.slot - u.start, m.rows, m.cols, m.transposed))
            indices.append(m.index)
        shape = (u.stop - u.start, bucket.shape[1], bucket.shape[2])
        buckets.append(replace(bucket, shape=shape, members=tuple(members)))
    return Plan(tuple(buckets), len(indices), plan.policy, plan.steps, plan.max_bucket_bytes), indices


@dataclass
class CommStats:
    """What the last step cost this rank: NS seconds, exchange seconds, bytes in and out."""

    ns_seconds: float = 0.0
    comm_seconds: float = 0.0
    bytes_sent: int = 0
    bytes_received: int = 0
    owned_flops: int = 0
    total_flops: int = 0


class _Timer:
    """Wall time of a region, synchronising CUDA first so queued kernels are counted (opt-in)."""

    def __init__(self, enabled: bool, device: torch.device):
        self.enabled, self.device = enabled, device

    def now(self) -> float:
        if not self.enabled:
            return 0.0
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()


# ----- replicated parameters (DDP) ------------------------------------------------------------
class ReplicatedOrthogonalizer:
    """Each rank orthogonalises its units; one broadcast per unit hands the result to the rest.

    Units are visited in one global order on every rank, so the collectives match: a rank
    runs NS on a unit it owns and starts its broadcast at once (async), and posts receives for
    the others, so the exchange of earlier units overlaps NS on later ones. A unit's results
    travel as one flat buffer in the NS compute dtype (each matrix in its own memory order),
    which every rank — owner included — casts to the parameters' dtype and views per matrix,
    so all ranks apply bit-identical updates.

    The flat buffers persist (one per unit, written again each step), and the results may be
    views of them: valid until the next call, as the optimizer's step consumes them at once.
    """

    def __init__(
        self,
        plan: Plan,
        layouts: Sequence[TensorLayout],
        configs: dict[Hashable, NSConfig],
        group: dist.ProcessGroup | None,
        compile: bool = False,
        host_reads: bool = True,
    ):
        self.plan, self.layouts, self.group = plan, list(layouts), group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.units = assign_work(plan, self.world)
        self._unit_members: list[list[int]] = []
        self._engines: list[Orthogonalizer | None] = []  # one per owned unit, with its own buffers
        for u in self.units:
            unit_plan, members = sub_plan(plan, [u])
            self._unit_members.append(members)
            owned = u.owner == self.rank
            engine = Orthogonalizer(
                unit_plan, [self.layouts[i] for i in members], configs, compile=compile, host_reads=host_reads
            )
            self._engines.append(engine if owned else None)
        self._src = [u.owner if group is None else dist.get_global_rank(group, u.owner) for u in self.units]
        self._numel = [
            sum(math.prod(self.layouts[i].shape) for i in members) for members in self._unit_members
        ]
        self._flats: list[Tensor | None] = [None] * len(self.units)
        self._inflight = InFlight()
        self.profile = False
        owned_flops = sum(u.flops for u in self.units if u.owner == self.rank)
        self.stats = CommStats(total_flops=plan.flops(), owned_flops=owned_flops)

    def __call__(self, sources: Sequence[Tensor], out_dtypes: Sequence[torch.dtype]) -> list[Tensor]:
        self._inflight.settle()  # the last call's broadcasts (finished long ago)
        device = sources[0].device
        timer = _Timer(self.profile, device)
        start = timer.now()
        ns_seconds = 0.0
        flats = []
        sent = received = 0
        for k, (unit, members, src, engine) in enumerate(
            zip(self.units, self._unit_members, self._src, self._engines)
        ):
            flat = self._flat(k, self.plan.buckets[unit.bucket].dtype, device)
            if engine is not None:
                t0 = timer.now()
                outs = engine([sources[i] for i in members], [flat.dtype] * len(members))
                ns_seconds += timer.now() - t0
                torch.cat([_memory_order(o, self.layouts[i]) for o, i in zip(outs, members)], out=flat)
                sent += flat.numel() * flat.element_size() * (self.world - 1)
            else:
                received += flat.numel() * flat.element_size()
            self._inflight.issue(dist.broadcast, flat, src=src, group=self.group)
            flats.append(flat)
        self._inflight.wait()
        results: list[Tensor | None] = [None] * len(sources)
        for flat, members in zip(flats, self._unit_members):
            _views(flat, members, self.layouts, out_dtypes, results)
        total = timer.now() - start
        self.stats.ns_seconds, self.stats.comm_seconds = ns_seconds, total - ns_seconds
        self.stats.bytes_sent, self.stats.bytes_received = sent, received
        return results  # type: ignore[return-value]

    def _flat(self, k: int, dtype: torch.dtype, device: torch.device) -> Tensor:
        """Unit ``k``'s exchange buffer: its matrices back to back, made once."""
        flat = self._flats[k]
        if flat is None or flat.device != device:
            flat = self._flats[k] = torch.empty(self._numel[k], dtype=dtype, device=device)
        return flat

    def workspaces(self) -> list[Tensor]:
        """Every tensor kept between steps: exchange buffers and the owned units' engines'."""
        kept = [f for f in self._flats if f is not None]
        return kept + [t for e in self._engines if e is not None for t in e.workspaces()]


def _memory_order(t: Tensor, layout: TensorLayout) -> Tensor:
    """``t`` (with ``layout``'s strides) flattened in memory order: a view, no copy."""
    return t.permute(layout.perm).reshape(-1)


def _views(flat: Tensor, members, layouts, out_dtypes, results: list) -> None:
    """Split a unit's flat buffer back into per-matrix tensors with their layouts' strides."""
    by_dtype: dict[torch.dtype, Tensor] = {}
    offset = 0
    for i in members:
        dtype = out_dtypes[i]
        cast = by_dtype.get(dtype)
        if cast is None:
            cast = by_dtype[dtype] = flat if flat.dtype == dtype else flat.to(dtype)
        layout = layouts[i]
        results[i] = torch.as_strided(cast, layout.shape, layout.stride, offset)
        offset += math.prod(layout.shape)


# ----- FSDP2 shards (DTensor, Shard(0) on a 1-D mesh) ----------------------------------------
def _contiguous_layout(shape: Sequence[int]) -> TensorLayout:
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
        layouts = [_contiguous_layout(s) for s in self.shapes]
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
        timer = _Timer(self.profile, device)
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
        if not _shard0_on_1d_mesh(t):
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


def _shard0_on_1d_mesh(t: Any) -> bool:
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


# ----- the optimizer side: building, agreeing, localising ------------------------------------
@dataclass(frozen=True)
class DistContext:
    """What an optimizer hands the distributed layer (never itself): the ranks, the keeper of
    in-flight collectives, its settings, and how to name a parameter or build a local engine."""

    process_group: Any  # DDP: the ranks that share the NS work; None under FSDP2 (the mesh's)
    inflight: InFlight  # holds every collective's tensors until the next step settles them
    options: Any  # the optimizer's Options: cost model, compile, bucket cap
    optimizer: str  # the optimizer's class name, for errors
    groups: list[dict[str, Any]]  # its param groups, to name parameters in errors
    param_name: Callable[[dict[str, Any], int], str]
    build_local: Callable[[Sequence[Tensor], Sequence[NSConfig], str], Any]  # an engine of this rank's own


def build_distributed(
    ctx: DistContext,
    params: Sequence[Tensor],
    configs: Sequence[NSConfig],
    wholes: Sequence[Any],
    policy: str,
):
    """The orthogonalizer for a step's matrices: sharded if they are DTensors (or matrices cut
    out of DTensors: ``wholes`` holds what each matrix is whole), else replicated."""
    sharded = [is_dtensor(g) or isinstance(g, ShardedMatrix) for g in wholes]
    if any(sharded) and not all(sharded):
        raise ValueError(
            "some matrix parameters are FSDP2 DTensors and some are plain tensors; "
            f"{ctx.optimizer} needs all of them sharded (apply fully_shard to the root module too)"
        )
    if all(sharded) and params:
        group = mesh_group(ctx)
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        matrices = [
            g if isinstance(g, ShardedMatrix) else ShardedMatrix.of(g, p, world)
            for g, p in zip(wholes, params)
        ]
        spread = [i for i, m in enumerate(matrices) if m.spread]
        mine = [i for i, m in enumerate(matrices) if not m.spread and m.rows[rank]]
        exchanged = None
        if spread:  # the same list on every rank: computed from global shapes alone
            # the planner sees each matrix whole; its device and dtype are the local shard's
            specs = [
                spec_of(
                    torch.empty(0, dtype=params[i].dtype, device=params[i].device),
                    configs[i],
                    _contiguous_layout(matrices[i].shape),
                )
                for i in spread
            ]
            plan = _plan(ctx, specs, [configs[i] for i in spread], policy, group)
            configs_by_key = {(params[i].dtype, configs[i]): configs[i] for i in spread}
            exchanged = ShardedOrthogonalizer(
                plan,
                [matrices[i] for i in spread],
                configs_by_key,
                group,
                compile=ctx.options.compile,
                host_reads=not ctx.options.capturable,
            )
            if len(spread) == len(params):
                return exchanged
        local = (
            ctx.build_local([params[i] for i in mine], [configs[i] for i in mine], policy) if mine else None
        )
        return SplitShardedOrthogonalizer(exchanged, spread, local, mine, len(params))
    layouts = [TensorLayout.of(p) for p in params]
    specs = [spec_of(p, c, lay) for p, c, lay in zip(params, configs, layouts)]
    plan = _plan(ctx, specs, configs, policy, ctx.process_group)
    configs_by_key = {(p.dtype, c): c for p, c in zip(params, configs)}
    return ReplicatedOrthogonalizer(
        plan,
        layouts,
        configs_by_key,
        ctx.process_group,
        compile=ctx.options.compile,
        host_reads=not ctx.options.capturable,
    )


def _plan(ctx: DistContext, specs, configs, policy, group) -> Plan:
    """The plan every rank builds alike: what varies by rank and steers the planner (a
    calibrated cost model, the thread count that prices eigendecompositions) is rank 0's,
    sent to all."""
    cost_model = ctx.options.cost_model
    box: list[Any] = [cost_model, torch.get_num_threads()]
    if cost_model == "calibrate" and specs:
        from ..ns.calibrate import calibrated_cost_model

        box[0] = calibrated_cost_model(specs[0].device, {s.dtype for s in specs})
    src = 0 if group is None else dist.get_global_rank(group, 0)
    device = specs[0].device if specs else torch.device("cpu")
    cost_model, threads = _broadcast_object(box, src, group, ctx.inflight, device)
    return plan_buckets(
        specs,
        policy=policy,
        steps=max((c.steps for c in configs), default=5),
        max_bucket_bytes=ctx.options.max_bucket_bytes,
        cost_model=cost_model if isinstance(cost_model, CostModel) else None,
        threads=threads,
    )


def _broadcast_object(obj: Any, src: int, group, inflight: InFlight, device: torch.device) -> Any:
    """``obj`` as rank ``src`` (a global rank) has it, on every rank: ``broadcast_object_list``'s
    pickle and two broadcasts, with the buffers held by ``inflight`` (see inflight.py)."""
    if dist.get_backend(group) == "nccl" and device.type != "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    data = pickle.dumps(obj) if dist.get_rank() == src else b""
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    inflight.issue(dist.broadcast, size, src=src, group=group)
    inflight.wait()
    payload = (
        torch.tensor(list(data), dtype=torch.uint8) if data else torch.empty(int(size), dtype=torch.uint8)
    )
    payload = payload.to(device)
    inflight.issue(dist.broadcast, payload, src=src, group=group)
    inflight.wait()
    return pickle.loads(bytes(payload.tolist()))


def mesh_group(ctx: DistContext) -> dist.ProcessGroup:
    """The process group of the mesh every sharded parameter lives on (checked: Shard(0), 1-D)."""
    mesh = None
    for group in ctx.groups:
        for j, p in enumerate(group["params"]):
            if not is_dtensor(p):
                continue
            mesh = p.device_mesh if mesh is None else mesh
            if not _shard0_on_1d_mesh(p):
                raise ValueError(
                    f"{ctx.param_name(group, j)} is a DTensor with placements {tuple(p.placements)} "
                    f"on a {p.device_mesh.ndim}-D mesh; {ctx.optimizer} supports FSDP2's "
                    "Shard(0) on a 1-D mesh (fully_shard without shard_placement_fn or HSDP)"
                )
            if p.device_mesh != mesh:
                raise ValueError(
                    f"{ctx.param_name(group, j)} lives on another device mesh than the first "
                    "sharded parameter; shard all parameters over one mesh"
                )
    assert mesh is not None, "no sharded parameter"
    return mesh.get_group()


def step_group(ctx: DistContext, params: Sequence[Tensor], sharded: bool) -> dist.ProcessGroup | None:
    """The group the ranks agree on: the DTensors' mesh if any, else the optimizer's process group."""
    if sharded:
        for p in params:
            if is_dtensor(p):
                return p.device_mesh.get_group()
    return ctx.process_group


def agree_across_ranks(keep: Tensor, group: Any, inflight: InFlight) -> Tensor:
    """Every rank's keep flags combined (finite only where finite on every rank), one
    all-reduce (held by ``inflight``, see inflight.py)."""
    ok = torch.stack([f.to(keep[0].device) for f in keep]).float()
    inflight.issue(dist.all_reduce, ok, op=dist.ReduceOp.MIN, group=group)
    inflight.wait()
    return ok > 0.5


def begin_step(ctx: DistContext, params: Sequence[Tensor], sharded: bool) -> dict[Tensor, Tensor]:
    """Agree across ranks on which of ``params`` step; returns zero gradients for the missing ones.

    A parameter steps on every rank if any rank has a gradient for it (a rank without one
    treats it as zero), so all ranks build the same plan and issue the same collectives.
    ``ctx.inflight`` keeps the all_reduce's buffer until the next step settles it.
    """
    if not params:
        return {}
    group = step_group(ctx, params, sharded)
    device = local_shard(params[0]).device
    if dist.get_backend(group) == "nccl" and device.type != "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    has = torch.tensor([p.grad is not None for p in params], dtype=torch.int32, device=device)
    ctx.inflight.issue(dist.all_reduce, has, op=dist.ReduceOp.MAX, group=group)
    ctx.inflight.wait()
    zeros = {}
    for p, anywhere in zip(params, has.tolist()):
        if anywhere and p.grad is None:
            zeros[p] = torch.zeros_like(p)
    return zeros


def localize(items: Sequence[Any], optimizer: str) -> None:
    """Swap every DTensor field of the step's items for its local shard, in place.

    The elementwise maths is then plain foreach work on local tensors (DTensor dispatch per op
    would cost more than the maths). A matrix item keeps its whole DTensor in ``whole``, so the
    NS step can find the matrix's global shape.
    """
    for item in items:
        param = getattr(item, "param", None)
        for f in fields(item):
            value = getattr(item, f.name)
            if f.name == "whole" or not is_dtensor(value):
                continue
            if f.name == "grad" and tuple(value.placements) != tuple(param.placements):
                raise ValueError(
                    f"a gradient has placements {tuple(value.placements)} but its parameter "
                    f"{tuple(param.placements)}; {optimizer} needs gradients sharded "
                    "like their parameters (as FSDP2 leaves them after backward)"
                )
            if f.name == "param" and hasattr(item, "whole"):
                item.whole = value
            setattr(item, f.name, value.to_local())
