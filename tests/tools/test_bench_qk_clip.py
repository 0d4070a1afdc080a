"""fastmuon bench's ``qk-clip`` row: fastmuon's step with QK-clip on the workload's queries and
keys, every head over τ, beside plain fastmuon; unavailable where there is no attention."""

from __future__ import annotations

import functools
import json

import pytest
import torch
from reference_impl import qk_clip_reference

from fastmuon import param_groups
from fastmuon.bench import manifest_from_module
from fastmuon.bench import workloads as workloads_module
from fastmuon.bench.contenders import Unavailable, Workbench, fastmuon_contender
from fastmuon.bench.lineup import CLASSES
from fastmuon.bench.manifest import Manifest, materialize
from fastmuon.bench.mapped import moe_decoder, moe_groups
from fastmuon.bench.models import Llama
from fastmuon.bench.qk_clip import OVER, TAU, qk_clip_contender, workload_parts
from fastmuon.bench.workloads import Generated, manifest_of
from fastmuon.tools.cli import main

#: llama-1b's layout at test size: 2 layers, 4 query heads, 2 key heads of 8
TINY_LLAMA = Generated(
    functools.partial(Llama, vocab=64, d=32, layers=2, heads=4, kv_heads=2, hidden=48),
    "Llama 3.2 1B's layout, small",
)
TINY_MOE = Generated(
    functools.partial(moe_decoder, layers=2, vocab=64, d=32, heads=4, kv_heads=2, experts=3, ffn=16),
    "granite-moe's layout, small",
    moe_groups,
)


def _workbench(manifest: Manifest, optimizer: str) -> Workbench:
    params = materialize(manifest, torch.device("cpu"), seed=0)
    return Workbench(
        manifest, params, torch.device("cpu"), optimizer, torch.float32, "auto", fastmuon=CLASSES[optimizer]
    )


def _clip_against_reference(manifest: Manifest, optimizer: str, layers: dict[str, str]) -> None:
    """One step of the qk-clip row against one of fastmuon's from the same values, then clipped by
    the per-head reference (every head's maximum ``OVER·τ``); ``layers``: q_proj weight -> layer."""
    plain, clipped = _workbench(manifest, optimizer), _workbench(manifest, optimizer)
    fastmuon_contender(plain).step()
    contender = qk_clip_contender(clipped)
    contender.step()
    assert contender.name.startswith("qk-clip ") and "every head clipped" in contender.note
    names = [p.name for p in manifest.params]
    after = dict(zip(names, clipped.params))
    expected = {n: p.detach().clone() for n, p in zip(names, plain.params)}
    for q_name in layers:
        k_name = q_name.replace("q_proj", "k_proj")
        q, k = qk_clip_reference(
            expected[q_name], expected[k_name], [OVER * TAU] * 4, heads=4, kv_heads=2, tau=TAU, alpha=0.5
        )
        expected[q_name], expected[k_name] = q, k
    for name in names:
        torch.testing.assert_close(after[name].detach(), expected[name], rtol=1e-6, atol=0, msg=name)
    before = dict(zip(names, plain.params))
    unchanged = [n for n in names if torch.equal(after[n].detach(), before[n].detach())]
    assert len(unchanged) == len(names) - 2 * len(layers)  # only the queries and keys differ


@pytest.mark.parametrize("optimizer", ["muon", "normuon", "adamuon"])
def test_the_row_scales_every_query_and_key_head_of_a_llama_workload(optimizer):
    manifest = manifest_of(TINY_LLAMA, "llama-1b")
    layers = {f"layers.{i}.q_proj.weight": f"layers.{i}" for i in range(2)}
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(workloads_module.GENERATED, "llama-1b", TINY_LLAMA)
        parts = workload_parts(manifest)
        assert parts == {
            **{q: {"layer": layer, "part": "query", "heads": 4} for q, layer in layers.items()},
            **{
                q.replace("q_proj", "k_proj"): {"layer": layer, "part": "key", "heads": 2}
                for q, layer in layers.items()
            },
        }
        _clip_against_reference(manifest, optimizer, layers)


def test_the_row_finds_the_attention_of_a_moe_workload():
    manifest = manifest_of(TINY_MOE, "granite-moe")
    layers = {f"model.layers.{i}.self_attn.q_proj.weight": f"model.layers.{i}.self_attn" for i in range(2)}
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(workloads_module.GENERATED, "granite-moe", TINY_MOE)
        assert {p["layer"] for p in workload_parts(manifest).values()} == set(layers.values())
        _clip_against_reference(manifest, "muon", layers)


def test_a_manifest_written_with_attention_parts_gives_them_to_the_row():
    """A user's manifest from ``param_groups(model, attention=...)`` carries the parts in its
    groups, and the row clips by them (the model is no generated workload)."""
    model = TINY_LLAMA.build()
    given = {"*.q_proj.weight": {"part": "query", "heads": 4}, "*.k_proj.weight": {"part": "key", "heads": 2}}
    groups = param_groups(model, attention=given)
    manifest = manifest_from_module(model, groups, name="my-llama")
    layers = {f"layers.{i}.q_proj.weight": f"layers.{i}" for i in range(2)}
    assert len(workload_parts(manifest)) == 4
    _clip_against_reference(manifest, "muon", layers)


def test_bench_runs_the_row_beside_fastmuon(tmp_path, monkeypatch):
    monkeypatch.setitem(workloads_module.GENERATED, "llama-1b", TINY_LLAMA)
    out = tmp_path / "out.json"
    args = ["bench", "--model", "llama-1b", "--optimizer", "muon", "--contenders", "fastmuon,qk-clip"]
    args += ["--ns-dtype", "float32", "--steps", "1", "--rounds", "1", "--threads", "1"]
    assert main([*args, "--json", str(out), "--quiet"]) == 0
    doc = json.loads(out.read_text())
    results = {r["name"]: r for r in doc["results"]}
    assert list(results) == ["fastmuon Muon", "qk-clip Muon"]
    ours, clipped = results["fastmuon Muon"], results["qk-clip Muon"]
    assert clipped["skipped"] is None and clipped["median_ms"] > 0
    assert "made once outside the timed step" in clipped["note"]
    # the same update and state: the clip adds only its scaling
    assert clipped["ns_flops"] == ours["ns_flops"] and clipped["state_bytes"] == ours["state_bytes"]
    assert clipped["kernels_per_step"] > ours["kernels_per_step"]
    assert doc["run"]["params_finite"] and doc["run"]["grads_unchanged"]


def test_the_row_is_unavailable_without_attention(tmp_path):
    out = tmp_path / "out.json"
    args = ["bench", "--model", "yolo26n", "--optimizer", "muon", "--contenders", "qk-clip"]
    assert main([*args, "--steps", "1", "--rounds", "1", "--json", str(out), "--quiet"]) == 0
    (row,) = json.loads(out.read_text())["results"]
    assert row["name"] == "qk-clip" and row["skipped"].startswith(
        "yolo26n has no attention queries and keys that QK-clip knows: it needs Llama-style "
        "q_proj/k_proj (e.g. --model llama-1b)"
    )


def test_the_row_is_unavailable_for_musgd():
    wb = _workbench(manifest_of(TINY_LLAMA, "llama-1b"), "musgd")
    with pytest.raises(Unavailable, match="MuSGD takes no QK-clip: run with --optimizer muon"):
        qk_clip_contender(wb)


def test_a_manifest_part_that_does_not_fit_is_refused_naming_the_parameter(tmp_path):
    """The optimizer's refusal of a part (its heads do not tile the rows) becomes the reason of
    every row that steps the manifest's groups as given, fastmuon's too."""
    model = TINY_LLAMA.build()
    given = {"*.q_proj.weight": {"part": "query", "heads": 4}, "*.k_proj.weight": {"part": "key", "heads": 2}}
    doc = manifest_from_module(model, param_groups(model, attention=given), name="my-llama").to_dict()
    (matrices,) = [g for g in doc["param_groups"] if "attention" in g]
    matrices["attention"][0] = {**matrices["attention"][0], "heads": 3}  # 32 rows: not 3 heads
    path, out = tmp_path / "bad.json", tmp_path / "out.json"
    path.write_text(json.dumps(doc))
    args = ["bench", "--model", str(path), "--optimizer", "muon", "--contenders", "fastmuon,qk-clip"]
    assert (
        main([*args, "--ns-dtype", "float32", "--steps", "1", "--rounds", "1", "--json", str(out), "--quiet"])
        == 0
    )
    results = {r["name"]: r["skipped"] for r in json.loads(out.read_text())["results"]}
    assert set(results) == {"fastmuon", "qk-clip"}
    for reason in results.values():
        assert reason.startswith("failed to build: ValueError: parameter 'layers.0.q_proj.weight'"), reason
        assert "its 32 rows do not split into 3 heads of equal size" in reason
