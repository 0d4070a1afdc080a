"""Where the distributed step runs each matrix's NS (``fastmuon.distributed.placement``): a pure
function of the plan, the matrices' parts and the cost constants. Largest-first placement evens
the ranks out, a matrix above a fair share takes an owner group, one held whole by a busy rank
moves to an idle one when that is faster, pieces keep to the round cap; bad settings are refused
naming the option, in a pure call and at a real FSDP2 step (which then changes nothing)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.distributed as dist
from test_distributed import launch

import fastmuon
from fastmuon.distributed.exchange import contiguous_layout
from fastmuon.distributed.placement import Holding, Links, place
from fastmuon.ns.build import plan_for
from fastmuon.ns.engine import NSConfig, spec_of
from fastmuon.ns.planner import default_cost_model

CUDA = default_cost_model("cuda")
CFG = NSConfig.make(5, "jordan", 1e-7, torch.bfloat16, "auto")


def plan_of(shapes):
    specs = [spec_of(torch.empty(0, device="meta"), CFG, contiguous_layout(s)) for s in shapes]
    return plan_for(specs, [CFG] * len(specs), "auto", CUDA, 512 * 2**20, 1)


def row_blocks(shape, world, item=2) -> Holding:
    """FSDP's Shard(0): rank r holds row block r (torch.chunk sizes)."""
    rows, cols = shape
    chunk = -(-rows // world)
    parts = [(r, min(chunk, rows - r * chunk) * cols) for r in range(world) if rows - r * chunk > 0]
    return Holding(rows * cols, [n for _, n in parts], [[r] for r, _ in parts], item)


def loads(plan, units, world):
    per = np.zeros(world)
    for u in units:
        for r in u.owners:
            per[r] += u.flops
    return per


def test_equal_matrices_spread_evenly_and_every_piece_is_placed_once():
    shapes = [(1024, 1024)] * 32
    world = 8
    plan = plan_of(shapes)
    units = place(plan, world, [row_blocks(s, world) for s in shapes], CUDA, Links(50e9, 450e9, 8))
    covered = sorted((u.bucket, slot) for u in units for slot in range(u.start, u.stop))
    assert covered == sorted((b, m.slot) for b, bk in enumerate(plan.buckets) for m in bk.members)
    per = loads(plan, units, world)
    assert per.max() == per.min(), "32 equal matrices over 8 ranks: 4 each"


def test_a_matrix_above_a_fair_share_takes_an_owner_group():
    shapes = [(8192, 2048)] + [(256, 256)] * 8
    world = 8
    plan = plan_of(shapes)
    units = place(plan, world, [row_blocks(s, world) for s in shapes], CUDA, Links(50e9, 450e9, 8))
    big = [u for u in units for m in plan.buckets[u.bucket].members[u.start : u.stop] if m.index == 0]
    assert len(big) == 1 and len(big[0].group) > 1
    g = len(big[0].group)
    assert 8192 % g == 0 and big[0].group == tuple(range(big[0].group[0], big[0].group[0] + g))
    # whole-matrix owners on request: the same matrix stays with one rank
    whole = place(plan, world, [row_blocks(s, world) for s in shapes], CUDA, Links(50e9, 450e9, 8), 1)
    assert not any(u.group for u in whole)


def test_a_busy_holders_matrices_move_to_idle_ranks_when_that_is_faster():
    # rank 0 holds 16 large matrices whole (an expert stack under Shard(0)), the others nothing
    shapes = [(4096, 4096)] * 16
    world = 8
    held = [Holding(4096 * 4096, [4096 * 4096], [[0]], 2) for _ in shapes]
    plan = plan_of(shapes)
    units = place(plan, world, held, CUDA, Links(50e9, 450e9, 8), 1)
    owners = {u.owner for u in units}
    assert owners != {0} and len(owners) > 1, "NS dwarfs the bytes: the idle ranks take some"
    slow = place(plan, world, held, CUDA, Links(1e3, 1e3, 8), 1)  # a link too slow to pay
    assert {u.owner for u in slow} == {0}


def test_pieces_keep_within_the_round_cap():
    shapes = [(1024, 4096)] * 16
    world = 2
    plan = plan_of(shapes)
    held = [row_blocks(s, world) for s in shapes]
    one = 1024 * 4096 * 2 * (1 + 2)  # one matrix in, out and its own part
    units = place(plan, world, held, CUDA, Links(50e9, 450e9, 2), max_piece_bytes=2 * one)
    assert max(u.stop - u.start for u in units) <= 2


@pytest.mark.parametrize(
    "world, group, shapes, message",
    [
        (8, 3, [(64, 64)], "owner_group_size=3 must divide the 8 ranks"),
        (2, 2, [(63, 16), (4, 4)], "owner_group_size=2 cannot split a 63x16 matrix"),
    ],
)
def test_an_owner_group_size_that_does_not_divide_is_refused(world, group, shapes, message):
    plan = plan_of(shapes)
    with pytest.raises(ValueError, match=message):
        place(plan, world, [row_blocks(s, world) for s in shapes], CUDA, Links(50e9, 450e9, 8), group)


@pytest.mark.parametrize("option", ["owner_group_size", "max_exchange_bytes"])
@pytest.mark.parametrize("value", [0, -1, 2.5, True, "2"])
def test_the_options_are_checked_at_construction(option, value):
    p = torch.nn.Parameter(torch.randn(4, 4))
    with pytest.raises(ValueError, match=f"{option} must be None"):
        fastmuon.Muon([p], lr=0.02, **{option: value})


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")
def test_refused_at_the_first_fsdp_step_changing_nothing(tmp_path):
    report = launch(2, tmp_path, script="placement_worker.py")
    runs = [json.loads(line[10:]) for line in report.splitlines() if line.startswith("PLACEMENT ")]
    assert len(runs) == 8, report
    want = {
        "owner_group_size=3": "owner_group_size=3 must divide the 2 ranks",
        "owner_group_size=2 on 63 rows": "owner_group_size=2 cannot split a 63x16 matrix",
        "max_exchange_bytes=64": "max_exchange_bytes=64 is too small",
    }
    for run in runs:
        if run["case"] == "accepted":
            assert run["message"] == "" and not run["unchanged"] and run["state"] > 0, run
            continue
        assert want[run["case"]] in run["message"] and "give" in run["message"], run
        assert run["unchanged"] and run["state"] == 0, run
