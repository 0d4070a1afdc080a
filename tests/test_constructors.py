"""Constructor semantics: Ultralytics' MuSGD order and defaults, torch.optim.Muon's signature,
``foreach=None`` as the fast path, and clear refusals of wrongly typed arguments."""

from __future__ import annotations

import inspect
import math

import pytest
import torch
from helpers import (
    clone_params,
    make_grads,
    make_params,
    run_musgd_reference,
    run_optimizer,
    ultralytics_musgd_class,
)
from torch import nn

import fastmuon
from fastmuon import Muon, MuSGD
from fastmuon.step.elementwise import lr_scale

ULTRALYTICS_ORDER = ["params", "lr", "momentum", "weight_decay", "nesterov", "use_muon", "muon", "sgd"]


def _positional(cls) -> list[inspect.Parameter]:
    return [
        p for p in inspect.signature(cls.__init__).parameters.values() if p.kind is p.POSITIONAL_OR_KEYWORD
    ][1:]  # without self


def test_musgd_positionals_are_ultralytics_order_and_defaults():
    ours = _positional(MuSGD)
    assert [p.name for p in ours] == ULTRALYTICS_ORDER
    assert [p.default for p in ours[1:]] == [1e-3, 0.0, 0.0, False, False, 0.5, 0.5]
    theirs = _positional(ultralytics_musgd_class())
    assert [(p.name, p.default) for p in ours] == [(p.name, p.default) for p in theirs]


def test_positional_call_sets_what_ultralytics_sets():
    p = nn.Parameter(torch.randn(6, 4))
    opt = MuSGD([p], 0.01, 0.9, 5e-4, True, True, 0.3, 0.7)
    group = opt.param_groups[0]
    assert (group["lr"], group["momentum"], group["weight_decay"], group["nesterov"], group["use_muon"]) == (
        0.01,
        0.9,
        5e-4,
        True,
        True,
    )
    assert (opt.muon, opt.sgd, group["muon"], group["sgd"]) == (0.3, 0.7, 0.3, 0.7)
    # the third and fourth positionals are weight decay and nesterov, not the reverse
    opt = MuSGD([p], 0.01, 0.9, 5e-4)
    assert (opt.param_groups[0]["weight_decay"], opt.param_groups[0]["nesterov"]) == (5e-4, False)


def test_muon_and_sgd_attributes_set_every_group_as_ultralytics_reads_them_each_step():
    a, b = nn.Parameter(torch.randn(4, 4)), nn.Parameter(torch.randn(3))
    opt = MuSGD([{"params": [a], "use_muon": True}, {"params": [b]}], muon=0.2, sgd=1.0)
    assert (opt.muon, opt.sgd) == (0.2, 1.0)
    opt.muon, opt.sgd = 0.4, 0.6
    assert [(g["muon"], g["sgd"]) for g in opt.param_groups] == [(0.4, 0.6), (0.4, 0.6)]
    with pytest.raises(ValueError, match="muon"):
        opt.muon = -1.0
    assert opt.muon == 0.4


def test_a_group_without_use_muon_is_plain_sgd_as_in_ultralytics():
    """``MuSGD(model.parameters())`` puts nothing into Muon: every tensor takes SGD at lr."""
    model = nn.Sequential(nn.Linear(8, 6), nn.Linear(6, 3))
    params = list(model.parameters())
    grads = make_grads(params, steps=2)
    hp = dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3, muon=0.5, sgd=0.5)
    ref, _ = run_musgd_reference(params, grads, [(list(range(len(params))), {"use_muon": False})], hp)
    ours = clone_params(params)
    opt = MuSGD(ours, **hp)
    run_optimizer(opt, ours, grads)
    for o, r in zip(ours, ref):
        assert torch.allclose(o.detach(), r, rtol=1e-6, atol=1e-7)
    assert all(set(opt.state[p]) == {"momentum_buffer"} for p in ours)
    assert opt.plan() is None or opt.plan().num_matrices == 0
    # use_muon=True as the default: the matrices go to Muon, their groups need not say
    opt = MuSGD([{"params": ours[:1]}], use_muon=True)
    assert opt.param_groups[0]["use_muon"] is True
    # fastmuon.param_groups says use_muon in every group, so its users see no change
    groups = fastmuon.param_groups(nn.Sequential(nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, 3)))
    assert [g["use_muon"] for g in MuSGD(groups).param_groups] == [True, False, False]


def test_muon_keeps_torch_optim_muons_signature_and_its_spectral_unclamped_mode():
    """torch's positionals in torch's order, and ``adjust_lr_fn="spectral_unclamped"`` (added in
    torch 2.14): ``sqrt(A/B)``, below 1 for wide matrices."""
    ours = [(p.name, p.default) for p in _positional(Muon)]
    theirs = [(p.name, p.default) for p in _positional(torch.optim.Muon)]
    assert ours[: len(theirs)] == theirs
    assert lr_scale("spectral_unclamped", (64, 16)) == pytest.approx(2.0)
    assert lr_scale("spectral_unclamped", (16, 64)) == pytest.approx(0.5)
    assert lr_scale("original", (16, 64)) == 1.0
    assert lr_scale("spectral_unclamped", (8, 4, 3, 3)) == pytest.approx(math.sqrt(8 / 36))
    p = nn.Parameter(torch.randn(4, 16))
    Muon([p], adjust_lr_fn="spectral_unclamped")
    MuSGD([p], adjust_lr="spectral_unclamped")


@pytest.mark.parametrize("cls", [MuSGD, Muon])
def test_foreach_none_is_the_batched_path(cls, monkeypatch):
    from fastmuon.step import matrix as matrix_update

    calls = []
    real = matrix_update.MatrixProgram.run

    def spy(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(matrix_update.MatrixProgram, "run", spy)
    params = make_params([(8, 4), (6, 10)])
    kw = {"use_muon": True} if cls is MuSGD else {}
    opt = cls(params, **kw)
    assert opt.foreach is None
    run_optimizer(opt, params, make_grads(params, steps=1))
    assert calls
    calls.clear()
    run_optimizer(cls(params, **kw, foreach=False), params, make_grads(params, steps=1))
    assert not calls


@pytest.mark.parametrize("cls", [MuSGD, Muon])
@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"foreach": "yes"}, "foreach"),
        ({"foreach": 1}, "foreach"),
        ({"nesterov": 1}, "nesterov"),
        ({"nesterov": "no"}, "nesterov"),
        ({"lr": "0.1"}, "lr"),
        ({"momentum": None}, "momentum"),
        ({"weight_decay": [0.1]}, "weight_decay"),
    ],
)
def test_wrong_types_are_refused_naming_the_argument(cls, kwargs, match):
    p = nn.Parameter(torch.randn(4, 4))
    with pytest.raises((TypeError, ValueError), match=match):
        cls([p], **kwargs)


@pytest.mark.parametrize("cls", [MuSGD, Muon])
def test_tensor_lr_must_be_one_element(cls):
    p = nn.Parameter(torch.randn(4, 4))
    with pytest.raises(ValueError, match="^Tensor lr must be 1-element"):
        cls([p], lr=torch.tensor([1e-3, 1e-3]))
    opt = cls([p], lr=torch.tensor(0.01))
    p.grad = torch.randn(4, 4)
    opt.step()
    assert torch.isfinite(p).all()


def test_use_muon_must_be_a_bool_in_musgd():
    p = nn.Parameter(torch.randn(4, 4))
    with pytest.raises((TypeError, ValueError), match="use_muon"):
        MuSGD([p], use_muon="yes")
    with pytest.raises((TypeError, ValueError), match="use_muon"):
        MuSGD([{"params": [p], "use_muon": None}])
