"""Newton–Schulz shared across ranks that hold the same gradients (DDP): each rank
orthogonalises its share of the plan's buckets and one broadcast per share hands the results on.

Shares are balanced by NS FLOPs: whole buckets where that balances, a bucket split by batch slots
where it does not. The idea of an owner per matrix followed by an exchange is Keller Jordan's Muon
(round-robin owners, then all_gather) and Dion's (one collective per same-shape group); the
FLOP-balanced assignment of whole buckets is ours.
"""

from __future__ import annotations

import math
import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch import Tensor

from ..ns.engine import NSConfig, Orthogonalizer, TensorLayout
from ..ns.planner import Member, Plan
from .inflight import InFlight


# ----- who orthogonalises what ----------------------------------------------------------------
@dataclass(frozen=True)
class WorkUnit:
    """Slots ``start:stop`` of bucket ``bucket``, orthogonalised by rank ``owner``, or, where
    ``group`` names ranks, by that owner group together (one matrix, split in column blocks of
    its wide orientation, member ``k`` of ``group`` holding block ``k``; ``owner`` is the first
    member and ``flops`` what each member computes)."""

    bucket: int
    start: int
    stop: int
    flops: int
    owner: int
    group: tuple[int, ...] = ()

    @property
    def owners(self) -> tuple[int, ...]:
        return self.group or (self.owner,)


def assign_work(
    plan: Plan, world: int, candidates: Sequence[Sequence[int] | None] | None = None
) -> list[WorkUnit]:
    """Split the plan into per-rank shares of about equal NS FLOPs, in bucket order.

    A bucket larger than an even share is cut by batch slots into near-equal pieces (each at
    most one share), so one huge bucket cannot leave the other ranks idle; then the pieces go,
    largest first, to the least-loaded rank (LPT). ``candidates[i]``, where given, restricts who
    may own matrix ``i`` (the ranks that hold it whole: then nothing needs gathering); a bucket
    is first cut into runs of slots with the same candidates. Pure and deterministic: every rank
    computes the same assignment from the same plan without talking to the others.
    """
    steps = plan.steps
    share = plan.flops() / max(world, 1)
    pieces: list[tuple[int, int, int, int, tuple[int, ...] | None]] = []  # (bucket, start, stop, flops, who)
    for b, bucket in enumerate(plan.buckets):
        slots = bucket.shape[0]
        per_slot = bucket.flops(steps) // slots
        for lo, hi, who in candidate_runs(bucket, candidates):
            run_flops = per_slot * (hi - lo)
            n = 1 if world == 1 or share <= 0 else min(hi - lo, max(1, math.ceil(run_flops / share)))
            bounds = [lo + round(k * (hi - lo) / n) for k in range(n + 1)]
            pieces += [(b, a, z, per_slot * (z - a), who) for a, z in zip(bounds, bounds[1:])]
    load = [0] * world
    owners: dict[tuple[int, int], int] = {}
    for b, lo, _, flops, who in sorted(pieces, key=lambda p: (-p[3], p[0], p[1])):
        rank = min(range(world) if who is None else who, key=lambda r: (load[r], r))
        load[rank] += flops
        owners[(b, lo)] = rank
    return [WorkUnit(b, lo, hi, flops, owners[(b, lo)]) for b, lo, hi, flops, _ in pieces]


def candidate_runs(bucket, candidates) -> list[tuple[int, int, tuple[int, ...] | None]]:
    """A bucket's slots as runs with the same owner candidates (one run where unrestricted)."""
    slots = bucket.shape[0]
    if candidates is None:
        return [(0, slots, None)]
    who_at: list[tuple[int, ...] | None] = [None] * slots
    for m in bucket.members:
        c = candidates[m.index]
        who_at[m.slot] = None if c is None else tuple(c)
    runs: list[tuple[int, int, tuple[int, ...] | None]] = []
    for slot, who in enumerate(who_at):
        if runs and runs[-1][2] == who:
            runs[-1] = (runs[-1][0], slot + 1, who)
        else:
            runs.append((slot, slot + 1, who))
    return runs


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


def owner_plan(plan: Plan, units: Sequence[WorkUnit]) -> tuple[Plan, list[int]]:
    """A plan for one rank's ``units``: those cut from buckets alike (same padded shape, dtype,
    device, settings) batched together again, up to the plan's bucket memory cap, so that a rank
    owning many pieces of one shape makes as few NS calls as the planner would have.

    Returns the plan and, for each new index, the matrix's index in ``plan``.
    """
    alike: dict[tuple, list[WorkUnit]] = {}
    for u in units:
        b = plan.buckets[u.bucket]
        alike.setdefault((b.shape[1:], b.dtype, b.device, b.key, b.method, b.preconditioning), []).append(u)
    buckets, indices = [], []
    for group in alike.values():
        first = plan.buckets[group[0].bucket]
        _, rows, cols = first.shape
        per_slot = rows * cols * torch.empty((), dtype=first.dtype).element_size()
        room = max(1, plan.max_bucket_bytes // max(per_slot, 1))
        slots = [m for u in group for m in plan.buckets[u.bucket].members[u.start : u.stop]]
        for at in range(0, len(slots), room):
            chunk = slots[at : at + room]
            members = []
            for k, m in enumerate(chunk):
                members.append(Member(len(indices), k, m.rows, m.cols, m.transposed))
                indices.append(m.index)
            buckets.append(replace(first, shape=(len(chunk), rows, cols), members=tuple(members)))
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


class Timer:
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
        units: Sequence[WorkUnit] | None = None,
    ):
        self.plan, self.layouts, self.group = plan, list(layouts), group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.units = list(units) if units is not None else assign_work(plan, self.world)
        assert not any(u.group for u in self.units), "replicated NS keeps whole-matrix owners"
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
        timer = Timer(self.profile, device)
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
