"""Who orthogonalises what: a plan's buckets cut into FLOP-balanced units, each with an owner rank
(or owner group), and the plans of one rank's units. Pure and deterministic: every rank computes
the same units from the same plan without talking to the others. The idea of an owner per matrix
followed by an exchange is Keller Jordan's Muon (round-robin owners, then all_gather) and Dion's
(one collective per same-shape group); the FLOP-balanced assignment of whole buckets is ours."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

import torch

from ..ns.planner import Bucket, Member, Plan


@dataclass(frozen=True)
class WorkUnit:
    """Slots ``start:stop`` of bucket ``bucket``, orthogonalised by rank ``owner`` or, where
    ``group`` names ranks, by that owner group (member ``k`` holds column block ``k`` of the one
    matrix's wide orientation; ``owner`` is the first member, ``flops`` each member's work)."""

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
    A bucket larger than a share is cut by batch slots, so one huge bucket cannot leave the other
    ranks idle; pieces go largest first to the least-loaded rank (LPT). ``candidates[i]`` limits
    who may own matrix ``i`` (the ranks holding it whole: nothing to gather)."""
    steps = plan.steps
    share = plan.flops() / max(world, 1)
    pieces: list[tuple[WorkUnit, tuple[int, ...] | None]] = []  # each piece (owner -1) and who may own it
    for b, bucket in enumerate(plan.buckets):
        slots = bucket.shape[0]
        per_slot = bucket.flops(steps) // slots
        for lo, hi, who in candidate_runs(bucket, candidates):
            run_flops = per_slot * (hi - lo)
            n = 1 if world == 1 or share <= 0 else min(hi - lo, max(1, math.ceil(run_flops / share)))
            bounds = [lo + round(k * (hi - lo) / n) for k in range(n + 1)]
            pieces += [(WorkUnit(b, a, z, per_slot * (z - a), -1), who) for a, z in zip(bounds, bounds[1:])]
    load = [0] * world
    owners: dict[tuple[int, int], int] = {}
    for unit, who in sorted(pieces, key=lambda p: (-p[0].flops, p[0].bucket, p[0].start)):
        rank = min(range(world) if who is None else who, key=lambda r: (load[r], r))
        load[rank] += unit.flops
        owners[(unit.bucket, unit.start)] = rank
    return [replace(unit, owner=owners[(unit.bucket, unit.start)]) for unit, _ in pieces]


class SlotRun(NamedTuple):
    """Slots ``start:stop`` of a bucket whose matrices have the same owner candidates."""

    start: int
    stop: int
    who: tuple[int, ...] | None  # the ranks that may own them (None: any)


def candidate_runs(bucket: Bucket, candidates: Sequence[Sequence[int] | None] | None) -> list[SlotRun]:
    """A bucket's slots as runs with the same owner candidates (one run where unrestricted)."""
    slots = bucket.shape[0]
    if candidates is None:
        return [SlotRun(0, slots, None)]
    who_at: list[tuple[int, ...] | None] = [None] * slots
    for m in bucket.members:
        c = candidates[m.index]
        who_at[m.slot] = None if c is None else tuple(c)
    runs: list[SlotRun] = []
    for slot, who in enumerate(who_at):
        if runs and runs[-1].who == who:
            runs[-1] = SlotRun(runs[-1].start, slot + 1, who)
        else:
            runs.append(SlotRun(slot, slot + 1, who))
    return runs


def sub_plan(plan: Plan, units: Sequence[WorkUnit]) -> tuple[Plan, list[int]]:
    """A plan holding only ``units``, one bucket each, members renumbered from 0; and for each
    new index the matrix's index in ``plan``."""
    buckets: list[Bucket] = []
    indices: list[int] = []
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
    """As :func:`sub_plan`, but units cut from alike buckets are batched again (up to the bucket
    cap), so that a rank's many pieces of one shape make as few NS calls as the planner would."""
    alike: dict[tuple[Any, ...], list[WorkUnit]] = {}
    for u in units:
        b = plan.buckets[u.bucket]
        alike.setdefault((b.shape[1:], b.dtype, b.device, b.key, b.method, b.preconditioning), []).append(u)
    buckets: list[Bucket] = []
    indices: list[int] = []
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
