"""fastmuon against the peers it claims to be a drop-in for, where they are installed."""

import importlib
import importlib.metadata
import importlib.util

import pytest
import torch
from conftest import rel_err
from helpers import clone_params, make_grads, make_params, run_optimizer

from fastmuon import Muon, MuSGD
from fastmuon.bench.contenders import (
    Unavailable,
    _fp32_zeropower,
    _torch_muon_with_fp32_ns,
    load_ultralytics_musgd,
)

SHAPES = [(16, 8, 3, 3), (16, 8, 3, 3), (32, 16, 1, 1), (8, 3, 3, 3), (24, 40), (40, 24), (16,), (40,)]
MATRICES = [0, 1, 2, 3, 4, 5]
OTHERS = [6, 7]


def _ultralytics_with_fp32_ns():
    try:
        return load_ultralytics_musgd(fp32_ns=True)[0]
    except Unavailable as e:
        pytest.skip(str(e))


@pytest.mark.parametrize("nesterov", [True, False])
def test_musgd_matches_ultralytics_musgd(nesterov):
    """Ultralytics' own MuSGD (its batching and foreach code, NS swapped to the same iteration in
    fp32) and fastmuon's MuSGD take the same steps, channels_last weights included."""
    ultralytics_musgd = _ultralytics_with_fp32_ns()
    params = make_params(SHAPES, channels_last={1})
    grads = make_grads(params, steps=3)
    hyper = dict(lr=0.02, momentum=0.9, nesterov=nesterov, weight_decay=5e-4)
    mixing = dict(muon=0.3, sgd=0.7)

    def groups(ps):
        return [
            {"params": [ps[i] for i in MATRICES], "use_muon": True, **hyper},
            {"params": [ps[i] for i in OTHERS], "use_muon": False, **hyper, "lr": 0.05},
        ]

    theirs, ours = clone_params(params), clone_params(params)
    run_optimizer(ultralytics_musgd(groups(theirs), **mixing), theirs, grads)
    run_optimizer(MuSGD(groups(ours), **mixing, ns_dtype=torch.float32), ours, grads)
    for t, o, shape in zip(theirs, ours, SHAPES):
        assert rel_err(o.detach(), t.detach()) <= 1e-5, shape


def test_muon_matches_torch_optim_muon_with_its_ns_in_fp32():
    """torch.optim.Muon with its NS swapped to fp32 (the benchmark's equal-precision contender)
    and fastmuon's Muon at fp32 (batched, Gram-space where it applies) take the same steps."""
    torch_muon_fp32 = _torch_muon_with_fp32_ns()
    if torch_muon_fp32 is None:
        pytest.skip("this torch has no torch.optim.Muon")
    params = make_params([(32, 64), (64, 32), (48, 48), (16, 96), (16, 96)])
    grads = make_grads(params, steps=3)
    hyper = dict(lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True)
    theirs, ours = clone_params(params), clone_params(params)
    run_optimizer(torch_muon_fp32(theirs, **hyper), theirs, grads)
    run_optimizer(Muon(ours, **hyper, ns_dtype=torch.float32), ours, grads)
    for p, o, t in zip(params, ours, theirs):
        assert rel_err((o - p).detach(), (t - p).detach()) <= 1e-5, p.shape
    # the swap is undone after each step: torch's own Muon still runs its bf16 NS
    module = importlib.import_module(torch.optim.Muon.__init__.__module__)
    assert module._zeropower_via_newtonschulz is not _fp32_zeropower


# ----- the Muon peers in the benchmark: each steps as the peer itself does ----------------------
TINY_MUON = {
    "model": "tiny-muon",
    "param_groups": [
        {"lr": 0.02, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01, "use_muon": True},
        {"lr": 3e-3, "momentum": 0.9, "nesterov": True, "weight_decay": 0.0, "use_muon": False},
    ],
    "params": [
        {"name": "conv.weight", "shape": [8, 4, 3, 3], "group": 0},
        {"name": "fc.weight", "shape": [16, 8], "group": 0},
        {"name": "fc2.weight", "shape": [8, 16], "group": 0},
        {"name": "bn.weight", "shape": [8], "group": 1},
        {"name": "fc.bias", "shape": [16], "group": 1},
    ],
}
MATRIX_HYPER, OTHER_HYPER = TINY_MUON["param_groups"]


def _workbench():
    from fastmuon.bench.contenders import Workbench
    from fastmuon.bench.manifest import manifest_from_dict, materialize

    manifest = manifest_from_dict(TINY_MUON)
    params = materialize(manifest, torch.device("cpu"), seed=0)
    return Workbench(manifest, params, torch.device("cpu"), "muon", torch.bfloat16, "auto", fastmuon=Muon)


def _contender_params(contender):
    return [p for opt in contender.optimizers for g in opt.param_groups for p in g["params"]]


def _twins(wb):
    """The workbench's tensors (values and gradients) as fresh leaves: matrices, then the rest."""
    twins = []
    for p in wb.params:
        q = torch.nn.Parameter(p.detach().clone())
        q.grad = p.grad.clone()
        twins.append(q)
    return twins[:3], twins[3:]


def test_heavyball_row_steps_as_heavyball_does():
    heavyball = pytest.importorskip("heavyball")
    from fastmuon.bench.peers import heavyball_contender, heavyball_eager

    wb = _workbench()
    contender = heavyball_contender(wb)
    # heavyball's README: SplitOpt with Muon for the matrices and AdamW for the rest
    matrices, others = _twins(wb)
    direct = heavyball.SplitOpt(
        [
            {
                "params": matrices,
                "optimizer": heavyball.Muon,
                "lr": MATRIX_HYPER["lr"],
                "betas": (MATRIX_HYPER["momentum"], 0.99),
                "weight_decay": MATRIX_HYPER["weight_decay"],
                "nesterov": True,
                "heavyball_momentum": True,
                "consume_grad": False,
            },
            {
                "params": others,
                "optimizer": heavyball.AdamW,
                "lr": OTHER_HYPER["lr"],
                "betas": (0.9, 0.95),
                "weight_decay": 0.0,
                "consume_grad": False,
            },
        ]
    )
    for _ in range(2):
        torch.manual_seed(7)  # heavyball rounds stochastically into bf16
        contender.step()
        torch.manual_seed(7)
        with heavyball_eager(heavyball):
            direct.step()
    ours = _contender_params(contender)
    assert [tuple(p.shape) for p in ours] == [tuple(p.shape) for p in matrices + others]
    for o, d, p in zip(ours, matrices + others, wb.params):
        assert not torch.equal(o, p), o.shape  # it moved
        assert rel_err((o - p).detach(), (d - p).detach()) <= 1e-6, o.shape
    assert all(p.grad is not None for p in ours)  # consume_grad=False: gradients stay attached
    assert contender.state_bytes() > 0  # the inner optimizers' state is found through SplitOpt


def test_pytorch_optimizer_row_steps_as_pytorch_optimizer_does():
    module = pytest.importorskip("pytorch_optimizer")
    from fastmuon.bench.peers import pytorch_optimizer_contender

    wb = _workbench()
    contender = pytorch_optimizer_contender(wb)
    # its docstring: groups flagged use_muon, its AdamW settings on the others
    matrices, others = _twins(wb)
    direct = module.Muon(
        [
            {"params": matrices, "use_muon": True, **{k: MATRIX_HYPER[k] for k in ("lr", "momentum")}}
            | {"nesterov": True, "weight_decay": MATRIX_HYPER["weight_decay"]},
            {"params": others, "use_muon": False, "lr": OTHER_HYPER["lr"], "betas": (0.9, 0.95)}
            | {"weight_decay": 0.0},
        ]
    )
    for _ in range(2):
        contender.step()
        direct.step()
    for o, d, p in zip(_contender_params(contender), matrices + others, wb.params):
        assert not torch.equal(o, p), o.shape
        assert rel_err((o - p).detach(), (d - p).detach()) <= 1e-6, o.shape
    # it writes into its gradients (Nesterov): the row steps a private copy, the shared ones stay
    assert all(torch.equal(p.grad, g) for p, g in zip(wb.params, _fresh_grads(wb)))


def _fresh_grads(wb):
    from fastmuon.bench.manifest import materialize

    return [p.grad for p in materialize(wb.manifest, torch.device("cpu"), seed=0)]


def test_a_missing_peer_is_a_skipped_row_with_the_reason(monkeypatch):
    from fastmuon.bench import peers
    from fastmuon.bench.runner import build_contenders

    real_version = importlib.metadata.version

    def version(name):
        if name in ("heavyball", "pytorch_optimizer"):
            raise importlib.metadata.PackageNotFoundError(name)
        return real_version(name)

    monkeypatch.setattr(peers.importlib.metadata, "version", version)
    contenders, skipped = build_contenders(_workbench())
    notes = {r.name: r.skipped for r in skipped}
    assert "not installed (pip install 'fastmuon[peers]')" in notes["heavyball Muon"]
    assert "not installed (pip install 'fastmuon[peers]')" in notes["pytorch-optimizer Muon"]
    assert any(c.name == "fastmuon Muon" for c in contenders)


@pytest.mark.parametrize("optimizer", ["muon", "musgd"])
def test_the_bench_puts_the_peers_beside_fastmuon(tmp_path, optimizer):
    import json

    from fastmuon.tools.cli import main

    manifest = tmp_path / "tiny.json"
    manifest.write_text(json.dumps(TINY_MUON))
    out = tmp_path / "out.json"
    args = ["bench", "--model", str(manifest), "--optimizer", optimizer, "--ns-dtype", "bfloat16"]
    assert (
        main([*args, "--steps", "1", "--rounds", "1", "--threads", "1", "--json", str(out), "--quiet"]) == 0
    )
    results = json.loads(out.read_text())["results"]
    for prefix, package in (("heavyball Muon", "heavyball"), ("pytorch-optimizer Muon", "pytorch_optimizer")):
        rows = [r for r in results if r["name"].startswith(prefix)]
        if optimizer == "musgd":  # Muon optimizers: compared under --optimizer muon only
            assert rows == []
            continue
        (row,) = rows
        if importlib.util.find_spec(package) is None:
            assert "not installed" in row["skipped"]
        else:
            assert row["skipped"] is None and row["steps_timed"] == 1, row["skipped"]
            assert row["host_ms"] > 0 and row["kernels_per_step"] > 0
