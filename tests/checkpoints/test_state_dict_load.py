"""``load_state_dict`` of a fastmuon optimizer: its own checkpoint resumes bit for bit, an fp16 copy
of it is cast back, and checkpoints saved by other optimizers with keys or buffers missing load."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from helpers import by_ndim, clone_params, make_grads, make_params, run_optimizer, warns_no_muon

import fastmuon

OPTIMIZERS = [fastmuon.MuSGD, fastmuon.Muon]
SHAPES = [(16, 8, 3, 3), (24, 40), (40, 24), (12,)]
KW = dict(lr=0.02, momentum=0.9, nesterov=True, weight_decay=1e-3, ns_dtype=torch.float32)


def _musgd_after_one_step() -> tuple[fastmuon.MuSGD, torch.nn.Parameter, torch.nn.Parameter]:
    torch.manual_seed(0)
    w, b = torch.nn.Parameter(torch.randn(20, 30)), torch.nn.Parameter(torch.randn(30))
    opt = fastmuon.MuSGD(
        [dict(params=[w], use_muon=True), dict(params=[b], use_muon=False)], lr=0.05, momentum=0.9
    )
    w.grad, b.grad = torch.randn(20, 30), torch.randn(30)
    opt.step()
    return opt, w, b


def test_saved_groups_without_momentum_keep_their_buffers_at_the_filled_momentum():
    opt, w, b = _musgd_after_one_step()
    saved = copy.deepcopy(opt.state_dict())
    for g in saved["param_groups"]:
        g.pop("momentum")
    expected = {p: {k: v.clone() for k, v in opt.state[p].items()} for p in (w, b)}
    opt.load_state_dict(saved)
    assert opt.param_groups[0]["momentum"] == 0.9
    assert sorted(opt.state[w]) == ["momentum_buffer", "momentum_buffer_SGD"]
    for p in (w, b):
        assert opt.state[p].keys() == expected[p].keys()
        for name, buf in expected[p].items():
            torch.testing.assert_close(opt.state[p][name], buf, rtol=0, atol=0)


@pytest.mark.parametrize("source", ["sgd", "muon"])
def test_torch_state_dicts_without_momentum_keep_their_buffers(source):
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(20, 30))
    if source == "sgd":
        peer = torch.optim.SGD([w], lr=0.05, momentum=0.9)
        with warns_no_muon():  # SGD's state dict, loaded where every parameter takes SGD
            target = fastmuon.MuSGD([dict(params=[w], use_muon=False)], lr=0.05, momentum=0.9)
    else:
        peer = torch.optim.Muon([w], lr=0.05, momentum=0.9)
        target = fastmuon.Muon([w], lr=0.05, momentum=0.9)
    w.grad = torch.randn(20, 30)
    peer.step()
    saved = copy.deepcopy(peer.state_dict())
    saved["param_groups"][0].pop("momentum")
    target.load_state_dict(saved)
    torch.testing.assert_close(
        target.state[w]["momentum_buffer"], peer.state[w]["momentum_buffer"], rtol=0, atol=0
    )


def _sgd_group(**overrides) -> dict:
    """A param group as torch.optim.SGD saves it."""
    group = dict(lr=0.05, momentum=0.9, dampening=0, weight_decay=0.0, nesterov=False, maximize=False)
    return {**group, "foreach": None, "differentiable": False, "fused": None, "params": [0], **overrides}


@pytest.mark.parametrize("use_muon", [True, False])
@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_none_buffers_load_as_no_buffer_and_restart(use_muon, momentum):
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(20, 30))
    twin = torch.nn.Parameter(w.detach().clone())
    with contextlib.nullcontext() if use_muon else warns_no_muon():  # use_muon=False: all SGD
        opt = fastmuon.MuSGD([dict(params=[w], use_muon=use_muon)], lr=0.05, momentum=momentum)
        fresh = fastmuon.MuSGD([dict(params=[twin], use_muon=use_muon)], lr=0.05, momentum=momentum)
    saved = {"state": {0: {"momentum_buffer": None}}, "param_groups": [_sgd_group(momentum=momentum)]}
    opt.load_state_dict(saved)
    assert all(v is not None for v in opt.state[w].values())
    grad = torch.randn(20, 30)
    w.grad, twin.grad = grad.clone(), grad.clone()
    opt.step()
    fresh.step()
    torch.testing.assert_close(w, twin, rtol=0, atol=0)


def test_none_buffers_from_a_muon_state_dict_load_into_muon():
    w = torch.nn.Parameter(torch.randn(20, 30))
    peer = torch.optim.Muon([w], lr=0.05)
    saved = copy.deepcopy(peer.state_dict())
    saved["state"] = {0: {"momentum_buffer": None}}
    opt = fastmuon.Muon([w], lr=0.05)
    opt.load_state_dict(saved)
    assert "momentum_buffer" not in opt.state[w]


@pytest.mark.parametrize("cls", OPTIMIZERS, ids=lambda c: c.__name__)
def test_state_dict_resume_is_identical(cls):
    params = make_params(SHAPES)
    grads = make_grads(params, steps=4)
    straight = clone_params(params)
    run_optimizer(cls(by_ndim(straight), **KW), straight, grads)

    first = clone_params(params)
    opt = cls(by_ndim(first), **KW)
    run_optimizer(opt, first, grads[:2])
    saved = opt.state_dict()
    resumed = clone_params(first)
    opt2 = cls(by_ndim(resumed), **KW)
    opt2.load_state_dict(saved)
    run_optimizer(opt2, resumed, grads[2:])
    for a, b in zip(straight, resumed):
        assert torch.equal(a, b)
    assert "plan" not in str(saved.keys())


@pytest.mark.parametrize("cls", OPTIMIZERS, ids=lambda c: c.__name__)
def test_fp16_checkpoint_is_cast_back(cls):
    params = make_params(SHAPES)
    opt = cls(by_ndim(params), **KW)
    run_optimizer(opt, params, make_grads(params, steps=1))
    sd = opt.state_dict()
    for st in sd["state"].values():
        for k, v in st.items():
            if torch.is_tensor(v) and v.is_floating_point() and k != "step":
                st[k] = v.half()
    opt2 = cls(by_ndim(params), **KW)
    opt2.load_state_dict(sd)
    for p in params:
        for k, v in opt2.state[p].items():
            if k != "step":
                assert v.dtype == p.dtype
    run_optimizer(opt2, params, make_grads(params, steps=1, seed=3))
    assert all(torch.isfinite(p).all() for p in params)
