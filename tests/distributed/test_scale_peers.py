"""The peers' designs on worlds small enough to check by hand: four matrices of known shapes on
two or three ranks, every figure worked out in the test from the rule the design's code follows
(see fastmuon/scale/peers.py and docs/scale.md), and the refusal where a design does not
take the layout."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fastmuon.ns.planner import COST_MODELS
from fastmuon.scale import DESIGNS, Workload, figures, parse_layout, workload
from fastmuon.scale.figures import Settings, fastmuon_figures
from fastmuon.scale.models import COLWISE, ROWWISE, Tensor
from fastmuon.scale.peers import PEERS, held
from fastmuon.tools.cli import main

STEPS = 5
CPU = COST_MODELS["cpu"]
LINK = 1e9

#: layer 0: a column-wise (8, 4) and a row-wise (4, 8) weight; layer 1: an (8, 4) and a (4, 4)
#: weight tensor parallelism leaves whole
SMALL = Workload(
    "small",
    "four matrices",
    (
        Tensor("layers.0.a", (8, 4), tp=COLWISE),
        Tensor("layers.0.b", (4, 8), tp=ROWWISE),
        Tensor("layers.1.c", (8, 4)),
        Tensor("layers.1.d", (4, 4)),
    ),
)


def nsf(rows: int, cols: int) -> int:
    """Five standard NS steps on one matrix: ``X·Xᵀ``, ``A²`` and ``B·X`` on the short side s."""
    s, l = sorted((rows, cols))
    return STEPS * (4 * s * s * l + 2 * s**3)


def run(design: str, spec: str, world: int, w: Workload = SMALL, **settings):
    lay = parse_layout(spec, world, w.num_experts)
    return figures(design, w, lay, Settings(cost_model=CPU, **settings), CPU, LINK)


def test_designs_list_fastmuon_then_every_peer():
    assert list(DESIGNS) == ["fastmuon", *PEERS]


# ----- plain ----------------------------------------------------------------------------------------
def test_plain_orthogonalises_everything_everywhere_and_gathers_what_is_sharded():
    total = nsf(8, 4) + nsf(4, 8) + nsf(8, 4) + nsf(4, 4)
    ddp = run("plain", "ddp", 2)
    assert ddp.flops.tolist() == [total, total] and ddp.received.tolist() == [0, 0] and not ddp.collectives
    fsdp = run("plain", "fsdp", 2)
    # each rank holds half the rows of every matrix: it receives the other half, sends its own (bf16)
    half = (16 + 16 + 16 + 8) * 2
    assert fsdp.flops.tolist() == [total, total]
    assert fsdp.sent.tolist() == [half, half] and fsdp.received.tolist() == [half, half]
    assert fsdp.buffers.tolist() == [32 * 2, 32 * 2] and fsdp.collectives == {"all_gather": 4}


# ----- keller ---------------------------------------------------------------------------------------
def test_keller_takes_parameters_by_size_w_at_a_time_and_gathers_each_round():
    fig = run("keller", "ddp", 2)
    # sorted by shape, largest first: a (8, 4), c (8, 4), b (4, 8), d (4, 4); rounds [a, c], [b, d]
    assert fig.flops.tolist() == [nsf(8, 4) + nsf(4, 8), nsf(8, 4) + nsf(4, 4)]
    p = 4  # fp32 parameters
    assert fig.sent.tolist() == [(32 + 32) * p, (32 + 16) * p]
    assert fig.received.tolist() == [(32 + 16) * p, (32 + 32) * p]
    # W − len mod W = 2 empty copies of the last (smallest) parameter, d
    assert fig.buffers.tolist() == [2 * 16 * p] * 2
    assert fig.collectives == {"all_gather": 2} and fig.itemsize == p


def test_keller_pads_the_last_round_with_copies_of_the_smallest_parameter():
    fig = run("keller", "ddp", 3, param_dtype=torch.bfloat16)
    # rounds [a, c, b], [d, pad, pad]: the pads are d-sized and every rank gathers them
    assert fig.flops.tolist() == [nsf(8, 4) + nsf(4, 4), nsf(8, 4), nsf(4, 8)]
    assert fig.sent.tolist() == [(32 + 16) * 2 * 2, (32 + 16) * 2 * 2, (32 + 16) * 2 * 2]
    assert fig.received.tolist() == [(64 + 32) * 2, (64 + 32) * 2, (64 + 32) * 2]
    assert fig.buffers.tolist() == [2 * 16 * 2] * 3


def test_keller_refuses_sharded_gradients():
    assert run("keller", "fsdp", 2) == "needs every gradient whole on every rank (DDP only)"


# ----- dion -----------------------------------------------------------------------------------------
def test_dion_runs_one_task_per_shape_padded_to_the_group():
    fig = run("dion", "fsdp", 2)
    # tasks: (8, 4) ×2 (a, c), (4, 8) ×1 padded to 2, (4, 4) ×1 padded to 2; one of each per rank
    assert fig.flops.tolist() == [nsf(8, 4) + nsf(4, 8) + nsf(4, 4)] * 2
    # per task, a rank's shard of each matrix it does not orthogonalise goes out and back (bf16)
    moved = 2 * (16 + 16 + 8) * 2
    assert fig.sent.tolist() == [moved] * 2 and fig.received.tolist() == [moved] * 2
    # a task's four exchange buffers: 2 matrices × a shard each, three tasks in flight
    assert fig.buffers.tolist() == [4 * 2 * (16 + 16 + 8) * 2] * 2
    assert fig.collectives == {"all_to_all": 6} and fig.itemsize == 2


def test_dion_pads_each_shard_to_the_ceiling_of_the_rows_over_the_group():
    w = Workload("odd", "", (Tensor("layers.0.e", (3, 4)),))
    fig = run("dion", "fsdp", 2, w)
    # 3 rows on 2 ranks: shards of 2 rows, the assembled matrix (4, 4) with a zero row; the
    # second rank orthogonalises a zero pad matrix
    assert fig.flops.tolist() == [nsf(4, 4)] * 2
    assert fig.sent.tolist() == [2 * 8 * 2] * 2


def test_dion_gathers_tensors_whole_everywhere_and_leaves_a_lone_one_to_every_rank():
    fig = run("dion", "ddp", 2)
    # (8, 4) ×2: one each, then an all_gather; (4, 8) and (4, 4) alone: every rank does them
    assert fig.flops.tolist() == [nsf(8, 4) + nsf(4, 8) + nsf(4, 4)] * 2
    assert fig.sent.tolist() == [32 * 2] * 2 and fig.received.tolist() == [32 * 2] * 2
    assert fig.buffers.tolist() == [(1 + 2) * 32 * 2] * 2  # its matrix and the 2 gathered
    assert fig.collectives == {"all_gather": 1}


def test_dion_orthogonalises_stacks_sharded_on_their_experts_where_they_lie():
    w = Workload("moe", "", (Tensor("layers.0.experts", (2, 4, 8), "experts", experts=True),))
    fig = run("dion", "ep:2", 2, w)
    assert fig.flops.tolist() == [nsf(4, 8)] * 2
    assert fig.sent.tolist() == [0, 0] and not fig.collectives


def test_dion_refuses_two_sharded_mesh_dims():
    assert "sharded on two mesh dims" in run("dion", "fsdp+tp:2x2", 4)


# ----- torchtitan ----------------------------------------------------------------------------------
def test_torchtitan_owners_balance_each_bucket_and_exchange_whole_matrices():
    fig = run("torchtitan", "fsdp", 2)
    # buckets: layer 0 (a, b), layers 1-2 (c, d); loads 5·s²·(2l + s): a, b, c 1,600, d 960.
    # bucket 0: a to rank 0, b (tied) to rank 1; bucket 1: c to rank 0 (tie on this bucket's load,
    # then bytes, then the earlier buckets'), d to rank 1
    assert fig.flops.tolist() == [2 * nsf(8, 4), nsf(4, 8) + nsf(4, 4)]
    # every matrix: the non-owner's half to the owner and back, in fp32
    moved = (16 + 16 + 16 + 8) * 4
    assert fig.sent.tolist() == [moved] * 2 and fig.received.tolist() == [moved] * 2
    # two slots: bucket 0 (storage 32, owned 32, largest part 16, largest owned 32 on each rank),
    # bucket 1 (storage 24; rank 0 owns c: 32, 16, 32; rank 1 owns d: 16, 16, 16)
    assert fig.buffers.tolist() == [
        (32 + 32 + 16 + 32 + 24 + 32 + 16 + 32) * 4,
        (112 + 24 + 16 + 16 + 16) * 4,
    ]
    assert fig.collectives == {"all_to_all": 4} and fig.itemsize == 4


def test_torchtitan_orthogonalises_stacks_where_fsdp_leaves_them():
    w = Workload("moe", "", (Tensor("layers.0.experts", (4, 4, 8), "experts", experts=True),))
    fig = run("torchtitan", "fsdp", 2, w)
    assert fig.flops.tolist() == [2 * nsf(4, 8)] * 2 and not fig.collectives


@pytest.mark.parametrize(
    "spec, world, message",
    [
        ("ddp", 2, "needs DTensor parameters"),
        ("fsdp+tp:1x2", 2, "every storage mesh dim but the redistributed one must be replicated"),
    ],
)
def test_torchtitan_refusals(spec, world, message):
    assert message in run("torchtitan", spec, world)


# ----- megatron -------------------------------------------------------------------------------------
def test_megatron_lays_parameters_out_by_ns_load_under_the_shard_cap():
    fig = run("megatron", "ddp", 2)
    # backprop order d, c, b, a; sorted by max·min² (128, 128, 128, 64): c, b, a, d; the cap is
    # 1.3 × 112 / 2 = 72.8 elements a shard, starts aligned to 64:
    #   c -> shard 0 (both fit, loads equal); b -> shard 1 (64 + 32 > 72.8 on shard 0);
    #   a -> fits nowhere: the least filled, shard 0 (cursor 96); d -> fits nowhere: shard 1 (80)
    assert fig.flops.tolist() == [2 * nsf(8, 4), nsf(4, 8) + nsf(4, 4)]
    shard = math.ceil(96 / 64) * 64  # padded to lcm(64, lcm(2, 128) / 2) = 64
    assert fig.sent.tolist() == [shard * 4] * 2 and fig.received.tolist() == [shard * 4] * 2
    assert fig.buffers.tolist() == [(2 * shard - 112) * 4] * 2
    assert fig.collectives == {"all_gather": 1}


def test_megatron_under_tensor_parallelism_gathers_each_tp_shard_and_duplicates_ns():
    fig = run("megatron", "fsdp+tp:1x2", 2)
    total = nsf(8, 4) + nsf(4, 8) + nsf(8, 4) + nsf(4, 4)
    assert fig.flops.tolist() == [total, total]
    # a and b: each rank's half (16 elements) out, the other half in, fp32
    assert fig.sent.tolist() == [2 * 16 * 4] * 2 and fig.received.tolist() == [2 * 16 * 4] * 2
    assert fig.collectives == {"all_gather": 2} and fig.itemsize == 4


@pytest.mark.parametrize(
    "spec, world, message",
    [
        ("fsdp", 2, "needs every parameter whole on every data-parallel rank"),
        ("fsdp+tp:2x2", 4, "shards it over 2 ranks; give fsdp+tp:1x2 or ddp"),
    ],
)
def test_megatron_refusals(spec, world, message):
    assert message in run("megatron", spec, world)


# ----- emerging -------------------------------------------------------------------------------------
def test_emerging_reduces_a_gram_matrix_per_step_for_tp_shards():
    fig = run("emerging", "fsdp+tp:1x2", 2)
    # a: rows sharded (2 ranks × 4), Gram over its 4 columns; b: columns sharded, Gram over its 4
    # rows: per step 4·g²·l + 2·g³ with g = 4, l = 4; c and d whole on every rank
    tp = STEPS * (4 * 16 * 4 + 2 * 64)
    assert fig.flops.tolist() == [2 * tp + nsf(8, 4) + nsf(4, 4)] * 2
    # per step an all_reduce of the 4×4 bf16 Gram matrix: 2·(T − 1)/T of its bytes each way
    moved = 2 * STEPS * (2 * 1 * 16 * 2 // 2)
    assert fig.sent.tolist() == [moved] * 2 and fig.received.tolist() == [moved] * 2
    assert fig.collectives == {"all_reduce": 2 * (STEPS + 1)}


@pytest.mark.parametrize(
    "spec, world, message",
    [
        ("ddp", 2, "no tensor-parallel shards under ddp"),
        ("fsdp", 2, "the megatron design"),
        ("fsdp+tp:2x2", 4, "shards it over 2 ranks; give fsdp+tp:1x2"),
    ],
)
def test_emerging_refusals(spec, world, message):
    why = run("emerging", spec, world)
    assert message in why and "or ddp" not in why  # ddp has no TP shards for it


# ----- every design ---------------------------------------------------------------------------------
@pytest.mark.parametrize("spec", ["fsdp", "hsdp:2x2", "fsdp+tp:2x2", "ddp"])
def test_every_peer_reports_the_shard_fastmuon_reports(spec):
    w = workload("gpt2")
    lay = parse_layout(spec, 4)
    settings = Settings(cost_model=CPU, plan_device="cpu")
    expected = fastmuon_figures(w, lay, settings, CPU, LINK).held
    assert np.array_equal(held(w, lay), expected)
    for design in PEERS:
        fig = figures(design, w, lay, settings, CPU, LINK)
        if not isinstance(fig, str):
            assert np.array_equal(fig.held, expected), design


def test_ns_seconds_are_the_flops_at_the_ns_rate_and_a_launch_set_per_call():
    fig = run("keller", "ddp", 2)
    per_flop, launch = CPU.flop_seconds(torch.bfloat16), CPU.launch_cost(torch.bfloat16)
    assert fig.ns_seconds.tolist() == pytest.approx(
        (fig.flops * per_flop + 2 * (3 + 3 * STEPS) * launch).tolist()
    )


def test_the_plan_command_takes_every_peer_by_name(capsys):
    for design in ("torchtitan", "megatron", "emerging"):
        assert main(["plan", "--model", "gpt2", "--world", "8", "--layout", "fsdp", "--design", design]) == 0
    out = capsys.readouterr().out
    assert "torchtitan: NS imbalance" in out and "megatron: n/a" in out and "emerging: n/a" in out
