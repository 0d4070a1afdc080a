"""What fastmuon 0.4.0 saved still loads: its optimizers' state dicts, which are data (tensors,
numbers, strings and dicts), so they load with ``torch.load(..., weights_only=True)`` and name
none of fastmuon's classes.

``data/state-dicts-0.4.0.pt`` was written by fastmuon 0.4.0: for a MuSGD and a Muon after one
step, the parameters and ``optimizer.state_dict()``; the gradients of a second step; and the
weights 0.4.0 reached after it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import fastmuon

DATA = Path(__file__).parent / "data" / "state-dicts-0.4.0.pt"

#: the constructor arguments of the saved optimizers (the state dict holds every group value)
MADE = {
    "musgd": (fastmuon.MuSGD, dict(lr=0.02, momentum=0.9, nesterov=True, ns_dtype=torch.float32)),
    "muon": (fastmuon.Muon, dict(lr=0.02, weight_decay=0.1, adamw_lr=3e-4, ns_dtype=torch.float32)),
}


def _saved() -> dict:
    return torch.load(DATA, weights_only=True)


def _fresh(name: str, saved: dict) -> tuple[torch.optim.Optimizer, list[torch.nn.Parameter]]:
    cls, kwargs = MADE[name]
    params = [torch.nn.Parameter(p.clone()) for p in saved[name]["params"]]
    groups = saved[name]["state_dict"]["param_groups"]
    split = [dict(params=[params[i] for i in g["params"]], use_muon=g["use_muon"]) for g in groups]
    return cls(split, **kwargs), params


@pytest.mark.parametrize("name", list(MADE))
def test_a_0_4_state_dict_loads_and_steps_as_0_4_did(name):
    saved = _saved()
    opt, params = _fresh(name, saved)
    opt.load_state_dict(saved[name]["state_dict"])
    by_shape = {tuple(g.shape): g for g in saved["grads"]}
    for p in params:
        p.grad = by_shape[tuple(p.shape)].clone()
    opt.step()
    for p in params:
        # fp32 NS: equal up to the summation order of the CPU's matmul kernels (oneDNN picks them
        # per instruction set, so the file's CPU and this one may round differently)
        torch.testing.assert_close(p.detach(), saved[f"{name}_next"][tuple(p.shape)], rtol=0, atol=1e-6)


@pytest.mark.parametrize("name", list(MADE))
def test_a_0_4_state_dict_carries_every_buffer(name):
    saved = _saved()
    opt, params = _fresh(name, saved)
    opt.load_state_dict(saved[name]["state_dict"])
    for i, p in enumerate(params):
        buffers = saved[name]["state_dict"]["state"][i]
        assert sorted(opt.state[p]) == sorted(buffers)
        for key, value in buffers.items():
            assert torch.equal(opt.state[p][key], value)


def test_a_0_4_musgd_state_dict_keeps_its_lr_factor():
    saved = _saved()
    assert saved["musgd"]["state_dict"]["param_groups"][0]["adjust_lr"] == "ultralytics"
    opt, _ = _fresh("musgd", saved)
    opt.load_state_dict(saved["musgd"]["state_dict"])
    assert [g["adjust_lr_fn"] for g in opt.param_groups] == ["ultralytics", "ultralytics"]
    assert all("adjust_lr" not in g for g in opt.param_groups)
