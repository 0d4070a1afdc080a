"""``fastmuon plan``'s figures: its boxes, bytes, per-rank NS FLOPs and exchange buffers equal
what real 2-, 4- and 8-rank gloo runs hold and count (which step as one process does, with owner
groups and rounds or not), its exchange bytes and buffers equal the exchange's own routes on
small worlds, and the command's output and refusals."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
from scale_worker import EXPERT_ROWS, EXPERTS, STEERS, UNEVEN_ROWS, cases, steer_options
from test_distributed import launch

from fastmuon.distributed.exchange import Routes, exchange_bytes, exchange_caps
from fastmuon.ns.planner import ns_flops
from fastmuon.scale import figures, parse_layout, rank_regions, workload
from fastmuon.scale.figures import Settings, fastmuon_figures, matrices
from fastmuon.scale.layouts import layout_for
from fastmuon.scale.models import COLWISE, ROWWISE, Tensor, Workload
from fastmuon.tools.cli import main


def net(experts: int = 4, rows: int = EXPERT_ROWS) -> Workload:
    """The model of scale_worker.py, as the plan sees it, with ``experts`` experts of ``rows``."""
    return Workload(
        "scale-worker",
        "tests/scale_worker.py",
        (
            Tensor("q_proj.weight", (16, 16), tp=COLWISE),
            Tensor("o_proj.weight", (16, 16), tp=ROWWISE),
            Tensor("gate_proj.weight", (24, 16), tp=COLWISE),
            Tensor("down_proj.weight", (16, 24), tp=ROWWISE),
            Tensor("router.weight", (6, 16)),
            Tensor("up_proj.weight", (128, 16)),
            Tensor("experts", (experts, rows, 16), "experts", experts=True),
        ),
    )


CPU = Settings(ns_dtype=torch.float32, param_dtype=torch.float32, plan_device="cpu", threads=1)


def layout_of(name: str, world: int, experts: int, expert_shard: str = "auto"):
    """The plan's spec of scale_worker.py's layout ``name`` at ``world`` ranks."""
    dp = 2 if world >= 4 else 1
    spec = {"hsdp": f"hsdp:2x{world // 2}", "fsdp+tp": f"fsdp+tp:{dp}x{world // dp}"}.get(name, name)
    return parse_layout(spec, world, experts, expert_shard)


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")
@pytest.mark.parametrize(
    "world", [pytest.param(8, marks=pytest.mark.slow), pytest.param(4, marks=pytest.mark.slow), 2]
)
def test_plan_equals_what_gloo_runs_hold_and_count(world, tmp_path):
    """Every case of scale_worker.py (expert stacks on dim 0 as FSDP2 leaves them, on dim 1 by
    hand, and where torchtitan's rule picks it): the plan's boxes, bytes and FLOPs are the run's."""
    report = launch(world, tmp_path, script="scale_worker.py")
    runs = [json.loads(line[6:]) for line in report.splitlines() if line.startswith("SCALE ")]
    steered = [c for c in cases(world) if c[0] != "ddp" and c[1] == EXPERTS and c[2] == 0]
    assert len(runs) == (len(cases(world)) + len(steered)) * world, report
    split, grouped = 0, 0
    for name, experts, dim, by_rule in cases(world):
        lay = layout_of(name, world, experts, "auto" if by_rule else str(dim))
        assert lay.expert_dim == dim, (name, experts, dim)
        w = net(experts)
        for steer in STEERS:
            options = steer_options(steer, name, world)
            case = (name, experts, dim, steer)
            here = [r for r in runs if (r["layout"], r["experts"], r["dim"], r["steer"]) == case]
            if not here and steer != "default":
                continue
            settings = replace(CPU, **options)
            fig = fastmuon_figures(w, lay, settings, settings.cost_model or _cpu_model(), 1e9)
            assert sorted(r["rank"] for r in here) == list(range(world)), case
            rounds = fig.collectives.get("all_to_all", 0) // 2
            for run in here:
                rank = run["rank"]
                for t in w.tensors:
                    want = rank_regions(lay, t)[rank]
                    got = run["boxes"][t.name]
                    assert (None if got is None else tuple(map(tuple, got))) == want, (case, rank, t.name)
                figures_here = (int(fig.sent[rank]), int(fig.received[rank]), int(fig.flops[rank]))
                assert figures_here == (run["sent"], run["received"], run["flops"]), (case, rank, run)
                if name != "ddp":
                    assert (int(fig.buffers[rank]), rounds) == (run["buffers"], run["rounds"]), (case, run)
                # every layout, with owner groups and rounds or not, steps as one process does
                assert run["diff"] <= 1e-5, (case, rank, run["diff"])
            if steer != "default":
                split, grouped = max(split, rounds), max([grouped] + [r["groups"] for r in here])
    assert split > 1, "the steered runs must take several rounds"
    assert grouped > 0 or world < 4, "at 4 ranks up_proj exceeds a share and takes an owner group"
    # FSDP2 refuses a dim 1 the ranks do not divide, and so does the plan
    uneven = [json.loads(line[13:]) for line in report.splitlines() if line.startswith("SCALE-UNEVEN ")]
    assert len(uneven) == world, report
    for u in uneven:
        assert u["rows"] == UNEVEN_ROWS and u["what"].startswith("raised NotImplementedError"), u
    with pytest.raises(ValueError, match=f"dim 1 \\({UNEVEN_ROWS}\\) does not divide over {world} ranks"):
        layout_for("fsdp", world, net(4, UNEVEN_ROWS), "1")


def _cpu_model():
    from fastmuon.ns.planner import default_cost_model

    return default_cost_model("cpu")


def _routes_bytes(w: Workload, lay, settings: Settings, units) -> tuple[list[tuple[int, int]], list[int]]:
    """Bytes per rank and exchange buffers per rank from the exchange's own ``Routes`` over every
    rank's box of every matrix, for the plan's work units."""
    from fastmuon.ns.matrices import parse

    shapes, helds = [], []
    for t in w.tensors:
        boxes = rank_regions(lay, t)
        for b in parse(t.map).boxes(t.shape):
            ranges = [
                (b[d].indices(n)[:2] if isinstance(b[d], slice) else (b[d], b[d] + 1))
                if d < len(b)
                else (0, n)
                for d, n in enumerate(t.shape)
            ]
            kept = [d >= len(b) or isinstance(b[d], slice) for d in range(len(t.shape))]
            held = []
            for reg in boxes:
                part = None
                if reg is not None:
                    cut = [(max(a, s), min(z, e)) for (a, z), (s, e) in zip(ranges, reg)]
                    if all(lo < hi for lo, hi in cut):
                        part = tuple((lo - a, hi - a) for (lo, hi), (a, _), k in zip(cut, ranges, kept) if k)
                held.append(part)
            shape = tuple(z - a for (a, z), k in zip(ranges, kept) if k)
            whole = tuple((0, n) for n in shape)
            holders = [h for h in held if h is not None]
            if not (len(holders) == 1 and holders[0] == whole):
                shapes.append(shape)
                helds.append(held)
    caps = exchange_caps(settings.max_exchange_bytes, helds, [_item(settings)] * len(shapes), lay.world)
    routes = Routes(settings.plan(shapes), shapes, helds, lay.world, units, caps)
    bytes_ = [exchange_bytes(routes, r) for r in range(lay.world)]
    return bytes_, [routes.buffer_bytes(r) for r in range(lay.world)]


def _item(settings: Settings) -> int:
    return torch.empty((), dtype=settings.ns_dtype).element_size()


GROUPS, ROUNDS = {"owner_group_size": 2}, {"max_exchange_bytes": 12 * 2**20}


@pytest.mark.parametrize(
    "model, spec, world, steer",
    [
        ("gpt2", "fsdp", 6, {}),
        ("gpt2", "hsdp:2x3", 6, {}),
        ("gpt2", "fsdp+tp:2x2", 4, {}),
        ("mixtral-8x7b", "ep:4", 8, {}),
        ("gpt2", "fsdp", 6, ROUNDS),
        ("gpt2", "hsdp:2x3", 6, ROUNDS),
        ("gpt2", "fsdp", 64, {}),
        ("gpt2", "fsdp", 64, GROUPS),
        ("gpt2", "hsdp:8x8", 64, GROUPS | {"max_exchange_bytes": 2**24}),
        ("gpt2", "fsdp+tp:8x8", 64, {}),
    ],
)
def test_bytes_and_buffers_equal_the_exchange_routes(model, spec, world, steer):
    w = workload(model)
    lay = parse_layout(spec, world, w.num_experts)
    settings = Settings(plan_device="cuda", **steer)
    fig = fastmuon_figures(w, lay, settings, _cpu_model(), 1e9)
    plan, units, _ = fig.work
    if world == 64:
        assert any(u.group for u in units), "the case must split some matrix over an owner group"
    routes_bytes, routes_buffers = _routes_bytes(w, lay, settings, units)
    assert list(zip(fig.sent.tolist(), fig.received.tolist())) == routes_bytes
    assert fig.buffers.tolist() == routes_buffers
    if "max_exchange_bytes" in steer:
        assert int(fig.collectives["all_to_all"]) > 2, "the cap must split the exchange into rounds"


def test_every_element_is_in_one_box_and_every_rank_has_one():
    for spec, world in (("fsdp", 1024), ("hsdp:128x8", 1024), ("fsdp+tp:128x8", 1024), ("ep:256", 1024)):
        w = workload("deepseek-v3" if spec.startswith("ep") else "llama3-70b")
        lay = parse_layout(spec, world, w.num_experts)
        for m in matrices(w, lay)[:40]:
            assert sum(m.part_numel.tolist()) == m.numel
            ranks = sorted(r for rs in m.part_ranks for r in rs.tolist())
            assert len(ranks) == len(set(ranks))


@pytest.mark.slow
def test_70b_at_1024_ranks_figures():
    """What docs/scale.md reports: whole-matrix owners stop at one MLP matrix's NS per rank on
    1,024 ranks (560 matrices); owner groups go below it, within 2x the balanced ideal."""
    w = workload("llama3-70b")
    from fastmuon.scale.balance import busiest_seconds, ideal_seconds
    from fastmuon.scale.devices import device

    h100 = device("h100")
    lay = parse_layout("fsdp", 1024)
    # one MLP matrix's NS as the CUDA plan runs it: bf16 Gram-space NS (3.5x as wide as tall)
    largest = ns_flops(8192, 28672, 5, "gram", torch.bfloat16)
    assert largest == 8 * 8192**2 * 28672 + 28 * 8192**3 < 5 * (4 * 8192**2 * 28672 + 2 * 8192**3)
    whole = fastmuon_figures(w, lay, Settings(owner_group_size=1), h100.cost_model, 50e9)
    assert int(whole.flops.max()) == largest
    grouped = figures("fastmuon", w, lay, Settings(), h100.cost_model, 50e9, h100.intra_node_bytes_per_s)
    plan, units, _ = grouped.work
    assert any(u.group for u in units)
    assert int(grouped.flops.max()) < largest
    assert busiest_seconds(grouped) <= 2 * ideal_seconds(grouped)
    assert fastmuon_figures(w, parse_layout("fsdp", 64), Settings(), h100.cost_model, 50e9).imbalance < 1.1
    assert figures("keller", w, parse_layout("fsdp", 8), Settings(), h100.cost_model, 50e9).startswith(
        "needs"
    )


def test_plan_command(capsys, tmp_path):
    out = tmp_path / "plan.json"
    assert main(["plan", "--model", "gpt2", "--world", "8", "--layout", "hsdp:2x4", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "fastmuon: NS imbalance" in text and "keller: n/a" in text and "dion: NS imbalance" in text
    data = json.loads(out.read_text())
    assert data["layout"] == "hsdp:2x4" and data["world"] == 8
    classes = data["designs"]["fastmuon"]["classes"]
    assert sum(c["count"] for c in classes) == 8


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--layout", "hsdp:3x3", "--world", "8"], "must multiply to --world 8"),
        (["--layout", "zero"], "unknown layout 'zero'"),
        (["--layout", "ep", "--model", "gpt2"], "has no expert stacks"),
        (["--measure"], "give --device cpu-measured"),
    ],
)
def test_plan_refusals(argv, message, capsys):
    assert main(["plan", "--model", "gpt2", *argv]) == 2
    assert message in capsys.readouterr().err
