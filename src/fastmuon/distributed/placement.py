"""Where each matrix's Newton–Schulz runs, decided per piece of the plan by predicted time.

A piece is a run of a bucket's slots with the same holders, cut to at most a quarter of a rank's
fair share, to at least one piece per rank where slots allow, and to the round cap. It runs where
it lies (a rank holding it whole: no bytes move), at one owner elsewhere (parts in, results out),
or, for one matrix costing more than a fair share, at an owner group: ``g`` aligned consecutive
ranks, inside a node where there are nodes, splitting it by columns (:mod:`.group_ns`).

An option is priced by what it adds to the ranks it touches: NS seconds at the cost model's rate,
the larger of bytes sent and received at the link rate (an ``all_to_all`` moves both at once), Gram
all-reduces at the group's. Pieces go largest first to the option leaving the busiest touched rank
least loaded (LPT). Pure and deterministic: every rank (and ``fastmuon plan``) computes the same
placement. Owner groups are our design; the Gram all-reduce per iteration is what NVIDIA's
Emerging-Optimizers does for tensor-parallel shards (its ``tp_mode="distributed"``).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import numpy.typing as npt
import torch
from numpy.typing import NDArray

from ..ns.planner import Bucket, CostModel, Member, Plan, kernels_per_bucket, ns_cost
from .group_ns import group_form, group_ns_flops, group_reduce_elements
from .owners import WorkUnit, candidate_runs
from .parts import Region
from .sharded import ShardedMatrix


@dataclass(frozen=True)
class Links:
    """Link rates bytes are priced at (bytes/s each way, per rank): the exchange's, an owner
    group's Gram all-reduce inside a node, and how many consecutive ranks share a node."""

    exchange_bytes_per_s: float
    group_bytes_per_s: float
    ranks_per_node: int


#: Assumed links: on CUDA NVLink-class in a node of 8, a 400 Gb/s NIC per GPU beyond; gloo 1 GB/s.
def default_links(device_type: str, world: int, ranks_per_node: int | None = None) -> Links:
    if device_type == "cuda":
        node = min(ranks_per_node or 8, world)
        return Links(450e9 if world <= node else 50e9, 450e9, node)
    node = min(ranks_per_node or world, world)
    return Links(1e9, 1e9, node)


class Holding:
    """How a matrix lies over the ranks: its elements, each distinct part's elements and the
    ranks holding it (ascending), and the bytes per element it travels in (the NS dtype)."""

    def __init__(
        self, numel: int, part_numel: npt.ArrayLike, part_ranks: Sequence[npt.ArrayLike], itemsize: int
    ):
        self.numel, self.itemsize = int(numel), int(itemsize)
        self.part_numel = np.asarray(part_numel, dtype=np.int64)
        self.part_ranks = [np.asarray(r, dtype=np.int64) for r in part_ranks]
        counts = [len(r) for r in self.part_ranks]
        # every (rank, elements) pair, flat: the arrays the per-rank sums index with
        self.ranks = np.concatenate(self.part_ranks) if self.part_ranks else np.zeros(0, dtype=np.int64)
        self.numels = np.repeat(self.part_numel, counts)
        held = int(self.numels.sum())
        self.copies = max(1, held // max(self.numel, 1))
        whole = len(self.part_numel) == 1 and int(self.part_numel[0]) == self.numel
        self.candidates: tuple[int, ...] | None = tuple(self.part_ranks[0].tolist()) if whole else None


def _valid_group_sizes(
    long_side: int, world: int, node: int, fixed: int | None, limit: int | None = None
) -> list[int]:
    """Owner-group sizes a matrix may take: ``fixed`` where given, else the powers of two up to
    ``limit`` (default the node) dividing both the world and the matrix's long side."""
    if fixed is not None:
        return [fixed] if fixed > 1 else []
    sizes, g = [], 2
    while g <= (limit or node):
        if world % g == 0 and long_side % g == 0:
            sizes.append(g)
        g *= 2
    return sizes


def group_link(g: int, links: Links) -> float:
    """The rate an owner group of ``g`` sums its Gram matrices at: inside a node, or across."""
    return links.group_bytes_per_s if g <= links.ranks_per_node else links.exchange_bytes_per_s


def holding_of(matrix: ShardedMatrix, itemsize: int) -> Holding:
    """The :class:`Holding` of a :class:`~fastmuon.distributed.sharded.ShardedMatrix`."""
    parts: dict[Region, list[int]] = {}
    for r, region in enumerate(matrix.held):
        if region is not None:
            parts.setdefault(region, []).append(r)
    numel = math.prod(matrix.shape)
    sizes = [math.prod(b - a for a, b in region) for region in parts]
    return Holding(numel, sizes, list(parts.values()), itemsize)


def ranks_per_node() -> int | None:
    """Ranks per node as the launcher says (torchrun's ``LOCAL_WORLD_SIZE``), else None."""
    value = os.environ.get("LOCAL_WORLD_SIZE", "")
    return int(value) if value.isdigit() and int(value) > 0 else None


#: Pieces per fair share: largest-first placement leaves up to a piece's size of imbalance.
PIECES_PER_SHARE = 4


def _member_seconds(m: Member, g: int, bucket: Bucket, steps: int, model: CostModel, links: Links) -> float:
    """An owner-group member's seconds on ``m``: NS FLOPs at device rate, Gram all-reduces at the group's."""
    short, long_side = min(m.rows, m.cols), max(m.rows, m.cols)
    nj = long_side // g
    flops = group_ns_flops(short, nj, steps, group_form(short, nj), bucket.preconditioning)
    item = torch.empty((), dtype=bucket.dtype).element_size()
    reduce_b = group_reduce_elements(1, short, steps, bucket.preconditioning) * item * 2 * (g - 1) / g
    return flops * model.flop_seconds(bucket.dtype) + reduce_b / group_link(g, links)


class _Loads:
    """Every rank's predicted NS seconds and bytes sent and received so far."""

    def __init__(self, world: int):
        self.ns = np.zeros(world)
        self.sent = np.zeros(world)
        self.received = np.zeros(world)


class _Piece(NamedTuple):
    """Slots ``start:stop`` of a bucket, the NS seconds they take and their whole cost (NS and moves)."""

    bucket: int
    start: int
    stop: int
    seconds: float
    cost: float


def place(
    plan: Plan,
    world: int,
    holdings: Sequence[Holding] | None,
    model: CostModel,
    links: Links,
    owner_group_size: int | None = None,
    threads: int = 1,
    splittable: Sequence[bool] | None = None,
    max_piece_bytes: int | None = None,
) -> list[WorkUnit]:
    """The plan's work units with their owners (see the module docstring). ``holdings[i]``: how
    matrix ``i`` lies (None: every rank holds every matrix whole, DDP); ``owner_group_size``: None
    chooses per matrix, 1 never splits, ``g`` splits every matrix costing more than a fair share
    over ``g`` ranks; ``max_piece_bytes``: the cap on a piece's round buffer on its owner."""
    steps = plan.steps
    per_slot_s: list[float] = []
    for bucket in plan.buckets:
        _, r, c = bucket.shape
        cost = ns_cost(r, c, steps, bucket.method, bucket.dtype, model.eigh, threads, bucket.preconditioning)
        per_slot_s.append(cost * model.flop_seconds(bucket.dtype))
    candidates = None if holdings is None else [h.candidates for h in holdings]
    # seconds to fan a slot's results out to every holder (pieces are cut by NS and these together)
    link = links.exchange_bytes_per_s
    moved_s: list[list[float]] = []
    for bucket in plan.buckets:
        per = [0.0] * bucket.shape[0]
        if holdings is not None:
            for m in bucket.members:
                h = holdings[m.index]
                fan = h.copies if h.candidates is None else h.copies - 1
                per[m.slot] = h.numel * fan * h.itemsize / link
        moved_s.append(per)
    total = sum(s * b.shape[0] + sum(mv) for s, b, mv in zip(per_slot_s, plan.buckets, moved_s))
    share = total / max(world, 1)
    ns_share = sum(s * b.shape[0] for s, b in zip(per_slot_s, plan.buckets)) / max(world, 1)
    if owner_group_size is not None and owner_group_size > 1 and world % owner_group_size:
        raise ValueError(
            f"owner_group_size={owner_group_size} must divide the {world} ranks the step runs on; "
            f"give a divisor of {world}, or None to let the step choose, or 1 for whole-matrix owners"
        )
    pieces: list[_Piece] = []
    for b, bucket in enumerate(plan.buckets):
        mv = moved_s[b]
        slot_bytes = [0] * bucket.shape[0]
        if holdings is not None:
            for m in bucket.members:
                h = holdings[m.index]
                slot_bytes[m.slot] = h.numel * (h.copies + 2) * h.itemsize  # in, out, and its own part
        for lo, hi, _ in candidate_runs(bucket, candidates):
            run_cost = per_slot_s[b] * (hi - lo) + sum(mv[lo:hi])
            n = (
                1
                if world == 1 or share <= 0
                else min(hi - lo, max(1, math.ceil(run_cost * PIECES_PER_SHARE / share)))
            )
            if world > 1:  # a piece per rank, slots allowing: every rank makes one NS call of it
                n = max(n, min(hi - lo, world))
            widest = max(slot_bytes[lo:hi])
            if max_piece_bytes and widest:  # slots of a run are alike: as many as fit per piece
                per_piece = max(1, max_piece_bytes // widest)
                n = max(n, min(hi - lo, math.ceil((hi - lo) / per_piece)))
            bounds = [lo + round(k * (hi - lo) / n) for k in range(n + 1)]
            pieces += [
                _Piece(b, a, z, per_slot_s[b] * (z - a), per_slot_s[b] * (z - a) + sum(mv[a:z]))
                for a, z in zip(bounds, bounds[1:])
            ]
    loads = _Loads(world)
    owners: dict[tuple[int, int], tuple[int, ...]] = {}
    for b, lo, hi, seconds, cost in sorted(pieces, key=lambda p: (-p.cost, p.bucket, p.start)):
        bucket = plan.buckets[b]
        members = bucket.members[lo:hi]
        launch = kernels_per_bucket(steps, bucket.method, bucket.preconditioning) * model.launch_cost(
            bucket.dtype
        )
        ns_s = seconds + launch
        recv_b, send_b, cand = _move_bytes(members, holdings, world)
        link = links.exchange_bytes_per_s
        after = loads.ns + ns_s + np.maximum(loads.sent + send_b, loads.received + recv_b) / link
        if cand is not None:  # a holder owns it: it sends the result to the other holders only
            at = np.asarray(cand)
            fan_b = _fan_out_bytes(members, holdings)
            after[at] = loads.ns[at] + ns_s + np.maximum(loads.sent[at] + fan_b, loads.received[at]) / link
        best = int(np.argmin(after))
        choice: tuple[int, ...] = (best,)
        best_time = float(after[best])
        m = members[0]
        split_ok = splittable is None or splittable[m.index]
        if hi - lo == 1 and (seconds > ns_share or cost > share) and world > 1 and split_ok:
            short, long_side = min(m.rows, m.cols), max(m.rows, m.cols)
            if owner_group_size is not None and owner_group_size > 1 and long_side % owner_group_size:
                raise ValueError(
                    f"owner_group_size={owner_group_size} cannot split a {m.rows}x{m.cols} matrix "
                    f"(its long side {long_side} is not a multiple of {owner_group_size}); give a size "
                    "dividing every matrix larger than a rank's share, or None to let the step choose"
                )
            sizes = [g for g in _valid_group_sizes(long_side, world, links.ranks_per_node, owner_group_size)]
            if owner_group_size is None and sizes:
                # the smallest group whose member's work fits a fair share (a larger one adds
                # redundant work and Gram bytes), else the one with the least work per member
                work = {g: _member_seconds(m, g, bucket, steps, model, links) for g in sizes}
                fitting = [g for g in sizes if work[g] <= ns_share]
                chosen = fitting[0] if fitting else min(sizes, key=lambda g: (work[g], g))
                if max_piece_bytes and holdings is not None:  # a member's block must fit a round:
                    h = holdings[m.index]  # past the node where the replicas' fan-out needs it
                    wider = _valid_group_sizes(long_side, world, links.ranks_per_node, None, world)
                    while h.numel // chosen * (h.copies + 2) * h.itemsize > max_piece_bytes:
                        larger = [g for g in wider if g > chosen]
                        if not larger:
                            break
                        chosen = larger[0]
                sizes = [chosen]
            for g in sizes:
                t, block = _group_option(m, g, bucket, steps, model, links, loads, holdings)
                if owner_group_size is not None or t < best_time:
                    best_time, choice = t, tuple(range(block * g, block * g + g))
                    if owner_group_size is not None:
                        break
        _charge(loads, choice, ns_s, members, bucket, steps, model, links, holdings, recv_b, send_b, cand)
        owners[(b, lo)] = choice
    units = []
    for b, lo, hi, _, _ in pieces:
        who = owners[(b, lo)]
        bucket = plan.buckets[b]
        if len(who) == 1:
            flops = bucket.flops(steps) // bucket.shape[0] * (hi - lo)
        else:
            m = bucket.members[lo]
            short, long_side = min(m.rows, m.cols), max(m.rows, m.cols)
            nj = long_side // len(who)
            flops = group_ns_flops(short, nj, steps, group_form(short, nj), bucket.preconditioning)
        units.append(WorkUnit(b, lo, hi, flops, who[0], who if len(who) > 1 else ()))
    return units


def _move_bytes(
    members: Sequence[Member], holdings: Sequence[Holding] | None, world: int
) -> tuple[NDArray[np.float64], NDArray[np.float64], tuple[int, ...] | None]:
    """Bytes an owner at each rank would receive and send for these matrices, its own parts
    excluded, and the ranks holding them all whole (None if none)."""
    recv = np.zeros(world)
    send = np.zeros(world)
    if holdings is None:  # replicated: every rank holds it, the broadcast is the same from any
        return recv, send, tuple(range(world))
    cand: set[int] | None = None
    for m in members:
        h = holdings[m.index]
        item = h.itemsize
        recv += h.numel * item
        send += h.numel * h.copies * item
        np.subtract.at(recv, h.ranks, h.numels * item)
        np.subtract.at(send, h.ranks, h.numels * item)
        c = h.candidates
        cand = (set(c) if cand is None else cand & set(c)) if c is not None else set()
    if not cand:
        return recv, send, None
    return recv, send, tuple(sorted(cand))


def _fan_out_bytes(members: Sequence[Member], holdings: Sequence[Holding] | None) -> float:
    """Bytes a holder that owns these matrices sends the other holders of them (replicas)."""
    if holdings is None:
        return 0.0
    return float(
        sum(
            holdings[m.index].numel * (holdings[m.index].copies - 1) * holdings[m.index].itemsize
            for m in members
        )
    )


def _group_option(
    m: Member,
    g: int,
    bucket: Bucket,
    steps: int,
    model: CostModel,
    links: Links,
    loads: _Loads,
    holdings: Sequence[Holding] | None,
) -> tuple[float, int]:
    """The best aligned block of ``g`` ranks to own ``m``: its busiest member's finish time, its number."""
    ns_s = _member_seconds(m, g, bucket, steps, model, links)
    item = torch.empty((), dtype=bucket.dtype).element_size()
    moved = 0.0 if holdings is None else holdings[m.index].numel * item / g
    fan = 1 if holdings is None else holdings[m.index].copies
    link = links.exchange_bytes_per_s
    after = loads.ns + ns_s + np.maximum(loads.sent + moved * fan, loads.received + moved) / link
    per_block = after.reshape(-1, g).max(axis=1)
    block = int(np.argmin(per_block))
    return float(per_block[block]), block


def _charge(
    loads: _Loads,
    choice: tuple[int, ...],
    ns_s: float,
    members: Sequence[Member],
    bucket: Bucket,
    steps: int,
    model: CostModel,
    links: Links,
    holdings: Sequence[Holding] | None,
    recv_b: NDArray[np.float64],
    send_b: NDArray[np.float64],
    cand: tuple[int, ...] | None,
) -> None:
    """Add a placed piece's predicted cost to the ranks it touches."""
    if len(choice) == 1:
        r = choice[0]
        loads.ns[r] += ns_s
        if cand is not None and r in cand:
            loads.sent[r] += _fan_out_bytes(members, holdings)
            if holdings is not None:
                for mem in members:
                    h = holdings[mem.index]
                    others = h.ranks[h.ranks != r]
                    loads.received[others] += h.numel * h.itemsize
        else:
            loads.sent[r] += send_b[r]
            loads.received[r] += recv_b[r]
            if holdings is not None:  # each part's nearest holder sends it and takes its result
                for mem in members:
                    h = holdings[mem.index]
                    if len(h.ranks) == len(h.part_ranks):  # one holder per part: it is the source
                        away = h.ranks != r
                        np.add.at(loads.sent, h.ranks[away], h.numels[away] * h.itemsize)
                        np.add.at(loads.received, h.ranks[away], h.numels[away] * h.itemsize)
                        continue
                    for n, ranks in zip(h.part_numel.tolist(), h.part_ranks):
                        if len(ranks) == 1 or r not in ranks:
                            src = int(ranks[np.argmin(np.abs(ranks - r))])
                            if src != r:
                                loads.sent[src] += n * h.itemsize
                                loads.received[src] += n * h.itemsize
        return
    g = len(choice)
    m = members[0]
    idx = list(choice)
    loads.ns[idx] += _member_seconds(m, g, bucket, steps, model, links)
    if holdings is not None:
        h = holdings[m.index]
        moved = h.numel * h.itemsize / g
        loads.received[idx] += moved
        loads.sent[idx] += moved * h.copies
