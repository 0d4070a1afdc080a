"""fastmuon bench on workloads whose tensors hold several matrices (MoE expert stacks, GPT-2's
fused Conv1D q/k/v): the manifests carry the matrix maps, and every contender steps the same
matrices."""

from __future__ import annotations

import functools
import json

import pytest
import torch
from conftest import rel_err

from fastmuon.bench import ManifestError, load_manifest, manifest_from_module, resolve_workload
from fastmuon.bench.contenders import (
    Unavailable,
    Workbench,
    fastmuon_contender,
    reference_contender,
    torch_muon_fp32_contender,
    ultralytics_fp32_contender,
)
from fastmuon.bench.lineup import CLASSES
from fastmuon.bench.manifest import materialize
from fastmuon.bench.mapped import GPT2Conv1D, gpt2_conv1d_groups, moe_decoder, moe_groups
from fastmuon.bench.workloads import Generated, manifest_of
from fastmuon.ns.matrices import parse
from fastmuon.tools.cli import main

TINY_MOE = Generated(
    functools.partial(moe_decoder, layers=2, vocab=64, d=32, heads=4, kv_heads=2, experts=3, ffn=16),
    "a small MoE decoder",
    moe_groups,
)
TINY_GPT2 = Generated(
    functools.partial(GPT2Conv1D, vocab=64, context=16, d=24, layers=2), "a small GPT-2", gpt2_conv1d_groups
)
#: per layer: q, k, v, o, router, then gate and up of each of the 3 experts, then their downs
TINY_MOE_MATRICES = 2 * (5 + 2 * 3 + 3)
#: per block: q, k and v of c_attn, then c_proj, c_fc, mlp.c_proj
TINY_GPT2_MATRICES = 2 * (3 + 3)


# ----- the workloads ------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("name", "numel", "tensors", "matrices"),
    [
        ("gpt2-split", 124_439_808, 48, 12 * (3 + 3)),
        ("granite-moe", 103_844_864, 7, 4 + 1 + 2 * 32 + 32),
    ],
)
def test_mapped_workloads_resolve_with_their_matrix_counts(name, numel, tensors, matrices):
    m = resolve_workload(name)
    assert m.numel() == numel
    assert len(m.matrices()) == tensors and m.ns_matrices() == matrices
    assert "groups and matrix maps written out" in m.source


def test_granite_moe_stores_its_experts_fused_and_maps_them():
    m = resolve_workload("granite-moe")
    specs = {p.name: (p.shape, spec) for p, spec in zip(m.params, m.map_specs())}
    experts = "model.layers.0.block_sparse_moe.experts"
    assert specs[f"{experts}.gate_up_proj"] == ((32, 1024, 1024), {"batch_dims": 1, "split": [512, 512]})
    assert specs[f"{experts}.down_proj"] == ((32, 1024, 512), "experts")
    assert specs["model.layers.0.block_sparse_moe.router.weight"] == ((32, 1024), "flatten")
    assert specs["model.layers.0.self_attn.k_proj.weight"] == ((512, 1024), "flatten")
    assert {p.name for p in m.params if m.param_groups[p.group]["use_muon"]} == {
        name for name in specs if name.startswith("model.layers.0.") and "layernorm" not in name
    }


def test_gpt2_split_stores_conv1d_weights_transposed():
    m = resolve_workload("gpt2-split")
    specs = {p.name: (p.shape, spec) for p, spec in zip(m.params, m.map_specs())}
    block = "transformer.h.11"
    assert specs[f"{block}.attn.c_attn.weight"] == (
        (768, 2304),
        {"split": [768, 768, 768], "transposed": True},
    )
    assert specs[f"{block}.mlp.c_fc.weight"] == ((768, 3072), "transposed")
    assert specs[f"{block}.mlp.c_proj.weight"] == ((3072, 768), "transposed")
    c_attn = parse(specs[f"{block}.attn.c_attn.weight"][1])
    assert c_attn.shapes((768, 2304)) == [(768, 768)] * 3


# ----- manifests carry the maps -------------------------------------------------------------
@pytest.mark.parametrize("workload", [TINY_MOE, TINY_GPT2], ids=["moe", "gpt2"])
def test_a_mapped_manifest_survives_a_json_round_trip(tmp_path, workload):
    m = manifest_of(workload, "tiny")
    path = tmp_path / "tiny.json"
    m.save(path)
    loaded = load_manifest(path)
    assert loaded.to_dict() == m.to_dict()
    assert loaded.map_specs() == m.map_specs() and loaded.maps() == m.maps()
    assert loaded.ns_matrices() == m.ns_matrices()
    assert any(spec not in (None, "flatten") for spec in loaded.map_specs())


def test_manifest_from_module_writes_maps_as_json_specs():
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Linear(6, 4))
    groups = [
        {"params": [model[0].weight], "use_muon": True, "matrices": parse({"split": (2, 4)})},
        {"params": [model[1].weight], "use_muon": True, "matrices": [{"heads": 2, "dim": 1}]},
        {"params": [model[0].bias, model[1].bias], "use_muon": False},
    ]
    m = manifest_from_module(model, groups, name="two")
    assert [g.get("matrices") for g in m.param_groups] == [{"split": [2, 4]}, [{"heads": 2, "dim": 1}], None]
    assert m.ns_matrices() == 4
    assert json.loads(json.dumps(m.to_dict())) == m.to_dict()


def _mapped_dict(matrices):
    return {
        "model": "mapped",
        "param_groups": [
            {"lr": 0.02, "use_muon": True, "matrices": matrices},
            {"lr": 0.01, "use_muon": False},
        ],
        "params": [
            {"name": "experts", "shape": [4, 6, 8], "group": 0},
            {"name": "norm", "shape": [8], "group": 1},
            {"name": "proj", "shape": [6, 8], "group": 0},
        ],
    }


@pytest.mark.parametrize(
    ("matrices", "message"),
    [
        (
            [{"batch_dims": 1, "split": [2, 3]}, "flatten"],
            r"params\[0\] \('experts', shape \[4, 6, 8\]\) in param_groups\[0\]: .*add up to 5; give sizes "
            "that sum to 6",
        ),
        (["experts"], r"param_groups\[0\] 'matrices': matrices holds 1 maps but the group has 2 parameters"),
        ("rows", r"param_groups\[0\] 'matrices': unknown matrix map 'rows'"),
        (["experts", "experts"], r"params\[2\] \('proj', shape \[6, 8\]\).*needs at least 3 dims"),
    ],
)
def test_a_manifest_with_maps_that_do_not_fit_names_the_entry(tmp_path, matrices, message):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(_mapped_dict(matrices)))
    with pytest.raises(ManifestError, match="bad.json: " + message):
        load_manifest(path)


def test_a_list_of_maps_follows_each_parameter_by_its_place_in_its_group(tmp_path):
    path = tmp_path / "ok.json"
    path.write_text(json.dumps(_mapped_dict(["experts", "flatten"])))
    m = load_manifest(path)
    assert m.map_specs() == ["experts", None, "flatten"]
    assert m.ns_matrices() == 4 + 1
    wb = Workbench(
        m, materialize(m, torch.device("cpu"), 0), torch.device("cpu"), "muon", torch.float32, "auto"
    )
    (kept,) = wb.groups(lambda p, g: p.ndim == 2)  # a selection keeps the maps of what it keeps
    assert [tuple(p.shape) for p in kept["params"]] == [(6, 8)] and kept["matrices"] == ["flatten"]
    assert wb.matrix_flops() == 4 * _ns_flops(6, 8) + _ns_flops(6, 8)


def _ns_flops(rows, cols, steps=5):
    r, c = min(rows, cols), max(rows, cols)
    return steps * (4 * r * r * c + 2 * r**3)


# ----- every contender orthogonalises the same matrices -------------------------------------
def _workbench(manifest, optimizer):
    params = materialize(manifest, torch.device("cpu"), 0)
    return Workbench(
        manifest, params, torch.device("cpu"), optimizer, torch.float32, "auto", fastmuon=CLASSES[optimizer]
    )


@pytest.mark.parametrize(
    ("workload", "matrices"), [(TINY_MOE, TINY_MOE_MATRICES), (TINY_GPT2, TINY_GPT2_MATRICES)]
)
def test_fastmuon_plans_one_matrix_per_expert_and_per_fused_part(workload, matrices):
    m = manifest_of(workload, "tiny")
    assert m.ns_matrices() == matrices
    plan = fastmuon_contender(_workbench(m, "muon")).plan()
    assert plan.num_matrices == matrices
    assert sum(len(b.members) for b in plan.buckets) == matrices


@pytest.mark.parametrize("workload", [TINY_MOE, TINY_GPT2], ids=["moe", "gpt2"])
@pytest.mark.parametrize(
    ("optimizer", "peer"), [("muon", torch_muon_fp32_contender), ("musgd", ultralytics_fp32_contender)]
)
def test_every_contender_steps_the_same_matrices(workload, optimizer, peer):
    """fastmuon with the maps, its per-matrix loop, and a peer given the matrices as 2-D views
    take the same step (fp32 NS everywhere): flattening an expert stack or a fused c_attn
    instead would change it completely."""
    m = manifest_of(workload, "tiny")
    steps = {}
    for factory in (fastmuon_contender, reference_contender, peer):
        wb = _workbench(m, optimizer)
        before = [p.detach().clone() for p in wb.params]
        try:
            contender = factory(wb)
        except Unavailable as e:  # not installed here, or its fp32 row not shown on this CPU
            assert factory is peer, e
            continue
        contender.step()
        steps[factory] = torch.cat([(p.detach() - b).flatten() for p, b in zip(wb.params, before)])
    ours = steps[fastmuon_contender]
    assert ours.abs().sum() > 0
    for factory, step in steps.items():
        assert rel_err(step, ours) <= 1e-5, factory.__name__


def test_a_peer_is_told_how_the_mapped_tensors_were_given_to_it():
    m = manifest_of(TINY_MOE, "tiny")
    wb = _workbench(m, "muon")
    try:
        contender = torch_muon_fp32_contender(wb)
    except Unavailable as e:
        pytest.skip(str(e))
    assert contender.extra["mapped_tensors_as_views"] == 4  # two expert stacks per layer
    assert "4 mapped tensors given as 18 2-D views, one per matrix of their maps" in contender.note


# ----- a short run of the command -----------------------------------------------------------
def test_bench_runs_a_mapped_manifest(tmp_path):
    path = tmp_path / "moe.json"
    manifest_of(TINY_MOE, "tiny-moe").save(path)
    out = tmp_path / "out.json"
    args = ["bench", "--model", str(path), "--optimizer", "muon", "--ns-dtype", "float32", "--quiet"]
    args += ["--contenders", "fastmuon,per-parameter,torch.optim.Muon", "--steps", "1", "--rounds", "1"]
    assert main([*args, "--warmup", "1", "--threads", "1", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["workload"]["matrices"] == 14 and doc["workload"]["ns_matrices"] == TINY_MOE_MATRICES
    results = {r["name"]: r for r in doc["results"]}
    ours, loop = results["fastmuon Muon"], results["per-parameter Muon"]
    for r in (ours, loop):
        assert r["skipped"] is None and r["steps_timed"] == 1
        assert f"14 tensors, {TINY_MOE_MATRICES} matrices" in r["note"]
    assert ours["plan"].startswith(f"plan: {TINY_MOE_MATRICES} matrices")
    # the loop computes standard NS on each matrix the maps make: the plan's per-matrix baseline
    assert loop["ns_flops"] == loop["ns_useful_flops"] == ours["extra"]["ns_baseline_flops"]
    assert doc["run"]["params_finite"] and doc["run"]["grads_unchanged"]
