"""What fastmuon 0.4.0 wrote still loads: its pickled optimizers and its module paths.

``data/optimizers-0.4.0.pkl`` was made with 0.4.0: a MuSGD and a Muon after one step, pickled,
the gradients of a second step, and the weights 0.4.0 reached after it.
"""

from __future__ import annotations

import importlib
import pickle
from pathlib import Path

import pytest
import torch

import fastmuon

DATA = Path(__file__).parent / "data" / "optimizers-0.4.0.pkl"


def _saved() -> dict:
    with DATA.open("rb") as f:
        return pickle.load(f)


@pytest.mark.parametrize("name, cls", [("musgd", fastmuon.MuSGD), ("muon", fastmuon.Muon)])
def test_a_pickled_0_4_optimizer_loads_and_steps_as_0_4_did(name, cls):
    saved = _saved()
    opt = saved[name]
    assert type(opt) is cls
    by_shape = {tuple(g.shape): g for g in saved["grads"]}
    params = [p for g in opt.param_groups for p in g["params"]]
    for p in params:
        p.grad = by_shape[tuple(p.shape)].clone()
    opt.step()
    for p in params:
        # fp32 NS: equal up to the summation order of the CPU's matmul kernels (oneDNN picks them
        # per instruction set, so the file's CPU and this one may round differently)
        torch.testing.assert_close(p.detach(), saved[f"{name}_next"][tuple(p.shape)], rtol=0, atol=1e-6)


def test_a_pickled_0_4_optimizer_state_dict_loads_into_a_new_one():
    opt = _saved()["musgd"]
    params = [torch.nn.Parameter(p.detach().clone()) for g in opt.param_groups for p in g["params"]]
    fresh = fastmuon.MuSGD(
        [dict(params=params[:2], use_muon=True), dict(params=params[2:], use_muon=False)],
        lr=0.02,
        momentum=0.9,
        nesterov=True,
        ns_dtype=torch.float32,
    )
    fresh.load_state_dict(opt.state_dict())
    for a, b in zip(params, (p for g in opt.param_groups for p in g["params"])):
        assert sorted(fresh.state[a]) == sorted(opt.state[b])
        for key, value in opt.state[b].items():
            assert torch.equal(fresh.state[a][key], value)


@pytest.mark.parametrize(
    "old", ["musgd", "muon", "planner", "engine", "compute", "newton_schulz", "inflight"]
)
def test_0_4_module_paths_are_the_modules_themselves(old):
    module = importlib.import_module(f"fastmuon.{old}")
    new = importlib.import_module(f"fastmuon.{fastmuon.module_paths.MOVED[old]}")
    assert module is new
