"""fastmuon against the peers it claims to be a drop-in for, where they are installed."""

import importlib

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
