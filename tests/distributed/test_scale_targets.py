"""The balanced ideal, the buffer bound and the at-scale targets' table (``fastmuon plan --targets``)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from fastmuon.scale import Figures, Settings, Workload, figures, parse_layout, targets, workload
from fastmuon.scale.balance import (
    BUFFER_FLOOR_BYTES,
    buffer_bounds,
    buffers_fit,
    busiest_seconds,
    ideal_ratio,
    ideal_seconds,
    priced,
    tightest_rank,
)
from fastmuon.scale.designs import summary
from fastmuon.scale.devices import GPU_EFFICIENCY, device
from fastmuon.scale.models import Tensor
from fastmuon.tools.cli import main

GiB = 2**30


def _figures(**given) -> Figures:
    """Two ranks' figures, every array given or zero."""
    arrays = {k: np.asarray(given.pop(k, [0, 0])) for k in ("flops", "sent", "received", "buffers", "held")}
    seconds = {k: np.asarray(given.pop(k, [0.0, 0.0]), dtype=float) for k in ("ns_seconds", "comm_seconds")}
    return Figures("fastmuon", "fsdp", 2, **arrays, **seconds, **given)


def test_ideal_of_hand_made_figures():
    fig = priced(_figures(ns_seconds=[3.0, 1.0], comm_seconds=[0.5, 4.0], held=[5, 7], itemsize=2), 2.0)
    # mean NS (3 + 1) / 2, plus the largest shard, 7 elements of 2 bytes, over 2 bytes/s
    assert ideal_seconds(fig) == 2.0 + 7.0
    assert busiest_seconds(fig) == 5.0  # rank 1: 1 + 4
    assert ideal_ratio(fig) == pytest.approx(5.0 / 9.0)


def test_ideal_needs_the_link():
    with pytest.raises(ValueError, match="priced"):
        ideal_seconds(_figures())
    assert summary(_figures())["ideal_seconds"] is None


def test_ideal_of_one_matrix_by_hand():
    """One 64×128 matrix in FSDP on 2 ranks, every rank orthogonalising it alone (``plain``):
    standard NS's FLOPs at the H100 rate plus its launches, and half the matrix over NVLink."""
    w = Workload("one", "a 64x128 matrix", (Tensor("w", (64, 128)),))
    h100 = device("h100")
    link = h100.link_bytes_per_s(2)
    fig = figures("plain", w, parse_layout("fsdp", 2), Settings(), h100.cost_model, link)
    r, c, steps = 64, 128, 5
    flop = 5 * (4 * r * r * c + 2 * r**3)  # per step: X·Xᵀ, A·A, B·X
    launches = 3 + 3 * steps  # normalisation, then 3 per step
    ns = flop / (989e12 * GPU_EFFICIENCY) + launches * h100.cost_model.launch_cost(torch.bfloat16)
    shard = 32 * 128 * 2  # 32 rows of bf16
    assert link == 450e9
    assert ideal_seconds(fig) == pytest.approx(ns + shard / link, rel=1e-9)


def test_buffer_bound_is_the_rank_s_own():
    big = 2 * GiB  # elements: a 4 GiB shard in bf16
    fig = _figures(held=[1, big], buffers=[BUFFER_FLOOR_BYTES + 1, 8 * GiB], itemsize=2)
    assert buffer_bounds(fig).tolist() == [BUFFER_FLOOR_BYTES, 8 * GiB]
    assert tightest_rank(fig) == 0 and not buffers_fit(fig)  # rank 0 one byte over its floor
    fig.buffers[0] = BUFFER_FLOOR_BYTES
    assert buffers_fit(fig)


def test_summary_carries_the_measures():
    h100 = device("h100")
    fig = figures("fastmuon", workload("gpt2"), parse_layout("fsdp", 8), Settings(), h100.cost_model, 450e9)
    s = summary(fig)
    assert s["optimizer_seconds_max"] == pytest.approx(float((fig.ns_seconds + fig.comm_seconds).max()))
    assert s["ideal_seconds"] == pytest.approx(ideal_seconds(fig))
    assert s["ideal_ratio"] == pytest.approx(s["optimizer_seconds_max"] / s["ideal_seconds"])
    assert s["buffers_fit"] is True


def test_the_33_configurations():
    configs = targets.target_configs()
    assert len(configs) == len(set(configs)) == 33
    assert ("llama3-8b", "hsdp:8x8", 64) in configs and ("llama3-70b", "fsdp+tp:128x8", 1024) in configs
    assert not [c for c in configs if c[2] == 8 and c[1].startswith(("hsdp", "fsdp+tp"))]  # one node: none
    assert {c[1] for c in configs if c[0] == "mixtral-8x7b" and c[1].startswith("ep")} == {"ep:8"}
    deepseek_ep = [c[1] for c in configs if c[0] == "deepseek-v3" and c[1].startswith("ep")]
    assert deepseek_ep == ["ep:8", "ep:64", "ep:64"]
    assert [c for c in configs if c[1] == "ddp"] == [("llama3-8b", "ddp", w) for w in (8, 64, 1024)]
    for model, spec, world in configs:
        assert str(parse_layout(spec, world, workload(model).num_experts)) == spec


SUBSET = [("gpt2", "ddp", 8), ("gpt2", "fsdp", 8), ("gpt2", "hsdp:2x4", 8)]


def test_table_of_a_subset():
    h100 = device("h100")
    outcomes = targets.evaluate_all(SUBSET, Settings(cost_model=h100.cost_model), h100)
    assert [(o.model, o.layout, o.world) for o in outcomes] == SUBSET
    for o in outcomes:
        assert o.within_ideal == (o.seconds <= 2 * o.ideal_seconds)
        assert o.beats_peers == (o.seconds <= o.peer_seconds * (1 + targets.TIE))
        assert o.buffers_fit == (o.buffer_bytes <= o.bound_bytes)
        assert o.holds == (not o.failing())
    ddp = outcomes[0]
    assert ddp.peer in ("keller", "dion", "plain")  # keller applies under DDP alone
    lines = targets.table(outcomes).splitlines()
    assert len(lines) == 1 + len(SUBSET) + 1
    assert lines[0].split()[:3] == ["model", "layout", "world"]
    assert lines[-1] == f"{sum(o.holds for o in outcomes)} of {len(SUBSET)} configurations hold"
    assert all(len(targets.cells(o)) == len(targets.HEADER) for o in outcomes)


def test_targets_command(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(targets, "target_configs", lambda: SUBSET)
    out = tmp_path / "targets.json"
    assert main(["plan", "--targets", "--json", str(out)]) == 0
    captured = capsys.readouterr()
    assert "configurations hold" in captured.out and "computing 3/3: gpt2 hsdp:2x4" in captured.err
    data = json.loads(out.read_text())
    assert data["total"] == 3 and len(data["targets"]) == 3 and data["ns_dtype"] == "bfloat16"
    assert {"seconds", "ideal_seconds", "ratio", "peer", "failing", "holds"} <= set(data["targets"][0])


@pytest.mark.parametrize(
    "argv, flag",
    [(["--model", "gpt2"], "--model"), (["--world", "8"], "--world"), (["--design", "dion"], "--design")],
)
def test_targets_refusals(argv, flag, capsys):
    assert main(["plan", "--targets", *argv]) == 2
    err = capsys.readouterr().err
    assert "--targets computes its own 33 configurations" in err and f"leave out {flag}" in err
