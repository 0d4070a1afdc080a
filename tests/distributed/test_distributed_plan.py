"""The pure parts of the distributed step: who orthogonalises what, and who holds which rows."""

from __future__ import annotations

import pytest
import torch

from fastmuon.distributed.replicated import assign_work, sub_plan
from fastmuon.distributed.sharded import shard_rows
from fastmuon.ns.planner import MatrixSpec, plan_buckets
from fastmuon.tools.cli import build_parser

SHAPES = [(64, 64)] * 9 + [(32, 96)] * 5 + [(128, 16), (16, 128), (8, 8), (3, 200), (256, 256)]


def make_plan(shapes=SHAPES, policy="exact"):
    return plan_buckets([MatrixSpec(r, c) for r, c in shapes], policy=policy, steps=5)


@pytest.mark.parametrize("world", [1, 2, 3, 5, 40])
def test_every_slot_of_every_bucket_has_exactly_one_owner(world):
    plan = make_plan()
    units = assign_work(plan, world)
    covered = {}
    for u in units:
        assert 0 <= u.owner < world and 0 <= u.start < u.stop <= plan.buckets[u.bucket].shape[0]
        for slot in range(u.start, u.stop):
            assert (u.bucket, slot) not in covered
            covered[(u.bucket, slot)] = u.owner
    assert len(covered) == sum(b.shape[0] for b in plan.buckets)
    assert sum(u.flops for u in units) == plan.flops()
    assert units == assign_work(plan, world), "the assignment must be deterministic"


@pytest.mark.parametrize("world", [2, 3, 4])
def test_shares_are_balanced_and_buckets_split_only_when_needed(world):
    plan = make_plan()
    units = assign_work(plan, world)
    load = [sum(u.flops for u in units if u.owner == r) for r in range(world)]
    share = plan.flops() / world
    biggest_piece = max(u.flops for u in units)
    assert max(load) <= share + biggest_piece
    for b, bucket in enumerate(plan.buckets):
        pieces = [u for u in units if u.bucket == b]
        if bucket.flops(plan.steps) <= share:
            assert len(pieces) == 1, f"bucket {b} fits one share but was split"
        for u in pieces:  # a split bucket's pieces each fit a share (or are one slot)
            assert u.flops <= share or u.stop - u.start == 1


def test_one_dominant_bucket_is_split_across_ranks():
    plan = make_plan([(64, 64)] * 12)
    units = assign_work(plan, 3)
    assert len(plan.buckets) == 1 and len(units) == 3
    assert sorted(u.owner for u in units) == [0, 1, 2]
    assert [u.stop - u.start for u in units] == [4, 4, 4]


def test_sub_plan_renumbers_members_and_keeps_batch_shapes():
    plan = make_plan()
    units = [u for u in assign_work(plan, 2) if u.owner == 1]
    sub, index = sub_plan(plan, units)
    assert sub.num_matrices == len(index) == sum(u.stop - u.start for u in units)
    seen = []
    for u, bucket in zip(units, sub.buckets):
        original = plan.buckets[u.bucket]
        assert bucket.shape == (u.stop - u.start, *original.shape[1:])
        for m, om in zip(bucket.members, original.members[u.start : u.stop]):
            assert index[m.index] == om.index and m.slot == om.slot - u.start
            seen.append(m.index)
    assert seen == list(range(len(index)))


@pytest.mark.parametrize("rows", [0, 1, 2, 5, 7, 12, 13])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_shard_rows_match_torch_chunk(rows, world):
    chunks = [c.numel() for c in torch.arange(rows).chunk(world)] if rows else []
    assert shard_rows(rows, world) == chunks + [0] * (world - len(chunks))


def test_bench_takes_nproc():
    args = build_parser().parse_args(
        ["bench", "--nproc", "3", "--dist-mode", "fsdp", "--ns-dtype", "float32"]
    )
    assert (args.nproc, args.dist_mode, args.ns_dtype) == (3, "fsdp", "float32")
