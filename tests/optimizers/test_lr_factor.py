"""The per-matrix learning-rate factor: one option name in every optimizer (``adjust_lr_fn``, with
``adjust_lr`` as MuSGD's alias) and the update RMS of "match_rms_adamw" as a value (``rms_scale``)."""

import copy
import inspect
import math

import pytest
import torch
from helpers import clone_params, make_grads, make_params, run_optimizer

from fastmuon import AdaMuon, Muon, MuSGD, NorMuon

SHAPES = [(8, 16), (16, 8), (4, 4, 3, 3), (6,)]
F32 = {"ns_dtype": torch.float32}


def step_once(cls, **kwargs):
    torch.manual_seed(0)
    params = make_params(SHAPES)
    opt = (
        cls(params, lr=0.02, momentum=0.9, use_muon=True, **F32, **kwargs)
        if cls is MuSGD
        else cls(params, lr=0.02, momentum=0.9, **F32, **kwargs)
    )
    run_optimizer(opt, params, make_grads(params, steps=1))
    return params, opt


@pytest.mark.parametrize("cls", [MuSGD, Muon])
@pytest.mark.parametrize("foreach", [None, False])
def test_rms_scale_scales_the_orthogonalised_update(cls, foreach):
    """rms_scale=r gives the update r/0.2 times the one of the default (weight decay off)."""
    start = make_params(SHAPES)
    updates = {}
    for r in (0.2, 0.18):
        params = clone_params(start)
        hp = dict(lr=0.02, momentum=0.9, weight_decay=0.0, adjust_lr_fn="match_rms_adamw", rms_scale=r)
        if cls is MuSGD:
            hp.update(use_muon=True, sgd=0.0)
        opt = cls(params, foreach=foreach, **F32, **hp)
        run_optimizer(opt, params, make_grads(params, steps=1))
        updates[r] = [p.detach() - s.detach() for p, s in zip(params, start) if p.ndim >= 2]
    for a, b in zip(updates[0.2], updates[0.18]):
        torch.testing.assert_close(b, a * (0.18 / 0.2), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("cls", [MuSGD, Muon])
def test_default_rms_scale_is_bit_identical_to_the_fixed_factor(cls):
    """rms_scale=0.2 is the factor the optimizers always used: the same bits as before."""
    a, _ = step_once(cls, adjust_lr_fn="match_rms_adamw")
    b, _ = step_once(cls, adjust_lr_fn="match_rms_adamw", rms_scale=0.2)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    _, opt = step_once(cls, adjust_lr_fn="match_rms_adamw", rms_scale=0.18)
    assert opt.param_groups[0]["rms_scale"] == 0.18


@pytest.mark.parametrize("cls", [MuSGD, Muon])
def test_rms_scale_refusals_name_the_fix(cls):
    p = torch.nn.Parameter(torch.randn(4, 4))
    with pytest.raises(
        ValueError, match=r"rms_scale=0.18 in param group 0 is read by adjust_lr_fn='match_rms_adamw'"
    ):
        cls([p], rms_scale=0.18)
    for bad in (0.0, -1.0, math.inf, math.nan, "0.2", True):
        with pytest.raises(ValueError, match="invalid rms_scale"):
            cls([p], adjust_lr_fn="match_rms_adamw", rms_scale=bad)
    opt = cls([{"params": [p], "use_muon": True}], adjust_lr_fn="match_rms_adamw")
    with pytest.raises(ValueError, match="invalid rms_scale"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.randn(3, 3))], "rms_scale": -1})
    assert len(opt.param_groups) == 1


def test_musgd_takes_adjust_lr_as_an_alias_of_adjust_lr_fn():
    """The alias as a keyword and as a group key: stored as adjust_lr_fn, the same updates."""
    cls = MuSGD
    a, opt_a = step_once(cls, adjust_lr_fn="spectral_unclamped")
    b, opt_b = step_once(cls, adjust_lr="spectral_unclamped")
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert "adjust_lr" not in opt_b.defaults and opt_b.defaults["adjust_lr_fn"] == "spectral_unclamped"
    group = {"params": [torch.nn.Parameter(torch.randn(3, 5))], "adjust_lr": "none"}
    opt_b.add_param_group(group)
    assert opt_b.param_groups[-1]["adjust_lr_fn"] == "none" and "adjust_lr" not in opt_b.param_groups[-1]
    with pytest.raises(ValueError, match="adjust_lr_fn='original' and its alias adjust_lr='none' disagree"):
        cls([torch.nn.Parameter(torch.randn(3, 3))], adjust_lr_fn="original", adjust_lr="none")
    with pytest.raises(ValueError, match="sets both adjust_lr_fn='original' and its alias adjust_lr='none'"):
        opt_a.add_param_group(
            {
                "params": [torch.nn.Parameter(torch.randn(3, 3))],
                "adjust_lr_fn": "original",
                "adjust_lr": "none",
            }
        )
    assert len(opt_a.param_groups) == 1


@pytest.mark.parametrize("cls", [Muon, NorMuon, AdaMuon])
def test_an_optimizer_without_the_alias_refuses_adjust_lr(cls):
    """Its only lr-factor name is adjust_lr_fn (torch.optim.Muon's): adjust_lr as a keyword is
    not in the signature, and as a group key it is refused, naming adjust_lr_fn, the optimizer
    left as it was."""
    assert "adjust_lr" not in inspect.signature(cls).parameters
    p = torch.nn.Parameter(torch.randn(3, 5))
    with pytest.raises(TypeError, match="adjust_lr"):
        cls([p], adjust_lr="none")
    opt = cls([p])
    with pytest.raises(
        ValueError, match=r"sets adjust_lr='none', which \w+ does not read; .*adjust_lr_fn='none'"
    ):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.randn(3, 3))], "adjust_lr": "none"})
    assert len(opt.param_groups) == 1


@pytest.mark.parametrize("cls", [MuSGD, Muon])
def test_alias_set_on_a_group_later_is_refused_before_anything_changes(cls):
    params, opt = step_once(cls)
    before = copy.deepcopy(opt.state_dict())
    weights = [p.detach().clone() for p in params]
    opt.param_groups[0]["adjust_lr"] = "original"
    for p, g in zip(params, make_grads(params, steps=1, seed=5)[0]):
        p.grad = g
    with pytest.raises(ValueError, match=r"set group\['adjust_lr_fn'\] instead"):
        opt.step()
    assert all(torch.equal(p.detach(), w) for p, w in zip(params, weights))
    del opt.param_groups[0]["adjust_lr"]
    assert str(opt.state_dict()) == str(before)


def test_older_musgd_state_dict_with_adjust_lr_loads_its_value():
    """An older fastmuon MuSGD saved the factor as adjust_lr: it loads as adjust_lr_fn."""
    params, opt = step_once(MuSGD, adjust_lr_fn="original")
    saved = copy.deepcopy(opt.state_dict())
    for g in saved["param_groups"]:
        g["adjust_lr"] = g.pop("adjust_lr_fn")
        g.pop("rms_scale")
    twin = clone_params(params)
    loaded = MuSGD(twin, lr=0.02, momentum=0.9, use_muon=True, **F32)
    loaded.load_state_dict(saved)
    group = loaded.param_groups[0]
    assert group["adjust_lr_fn"] == "original" and "adjust_lr" not in group and group["rms_scale"] == 0.2
    grads = make_grads(params, steps=2, seed=3)
    run_optimizer(opt, params, grads)
    run_optimizer(loaded, twin, grads)
    assert all(torch.equal(a, b) for a, b in zip(params, twin))


def test_the_lr_factor_stays_with_its_family_across_loads():
    """MuSGD's factor scales lr·muon, Muon's lr: loading one's state dict into the other keeps the
    target's own adjust_lr_fn and rms_scale (as before both used one name)."""
    _, musgd = step_once(MuSGD, adjust_lr_fn="match_rms_adamw", rms_scale=0.18)
    params = make_params(SHAPES)
    muon = Muon(params, lr=0.02, momentum=0.9, **F32)
    muon.load_state_dict(musgd.state_dict())
    assert muon.param_groups[0]["adjust_lr_fn"] is None and muon.param_groups[0]["rms_scale"] == 0.2
    back = MuSGD(make_params(SHAPES), lr=0.02, momentum=0.9, use_muon=True, **F32)
    back.load_state_dict(muon.state_dict())
    assert back.param_groups[0]["adjust_lr_fn"] == "ultralytics"
