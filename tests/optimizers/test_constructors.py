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
    warns_no_muon,
)
from torch import nn

import fastmuon
from fastmuon import Muon, MuSGD
from fastmuon.step.matrix import lr_scale

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
    with warns_no_muon():
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
    with warns_no_muon():
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
    """torch's positionals in torch's order with torch's defaults (``ns_steps=None`` is the count
    the coefficients were published for: torch's 5 for torch's coefficients), and
    ``adjust_lr_fn="spectral_unclamped"`` (added in torch 2.14): ``sqrt(A/B)``, below 1 for wide
    matrices."""
    ours = [(p.name, p.default) for p in _positional(Muon)]
    theirs = [(p.name, p.default) for p in _positional(torch.optim.Muon)]
    assert [name for name, _ in ours[: len(theirs)]] == [name for name, _ in theirs]
    implied = {"ns_steps": Muon([nn.Parameter(torch.randn(4, 4))]).defaults["ns_steps"]}
    assert [(n, implied.get(n, d) if d is None else d) for n, d in ours[: len(theirs)]] == theirs
    assert lr_scale("spectral_unclamped", (64, 16)) == pytest.approx(2.0)
    assert lr_scale("spectral_unclamped", (16, 64)) == pytest.approx(0.5)
    assert lr_scale("original", (16, 64)) == 1.0
    assert lr_scale("spectral_unclamped", (8, 4, 3, 3)) == pytest.approx(math.sqrt(8 / 36))
    p = nn.Parameter(torch.randn(4, 16))
    Muon([p], adjust_lr_fn="spectral_unclamped")
    MuSGD([p], use_muon=True, adjust_lr="spectral_unclamped")


@pytest.mark.parametrize("cls", [MuSGD, Muon])
def test_foreach_none_is_the_batched_path(cls, monkeypatch):
    from fastmuon.step import matrix

    calls = []
    real = matrix.MatrixProgram.run

    def spy(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(matrix.MatrixProgram, "run", spy)
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
        ({"nesterov": "no"}, "nesterov"),
        ({"nesterov": None}, "nesterov"),
        ({"lr": "0.1"}, "lr"),
        ({"momentum": None}, "momentum"),
        ({"weight_decay": [0.1]}, "weight_decay"),
    ],
)
def test_wrong_types_are_refused_naming_the_argument(cls, kwargs, match):
    p = nn.Parameter(torch.randn(4, 4))
    with pytest.raises((TypeError, ValueError), match=match):
        cls([p], **kwargs)


@pytest.mark.parametrize("cls", [MuSGD, Muon, fastmuon.NorMuon, fastmuon.AdaMuon])
@pytest.mark.parametrize("foreach", [None, False])
def test_nesterov_takes_an_integer_as_torch_does_and_steps_as_its_truth_value(cls, foreach):
    """``torch.optim.Muon`` and ``SGD`` take ``nesterov=1`` and keep it as given; so does each
    optimizer here, and 1 and 0 step exactly as True and False (matrices and vectors alike)."""
    assert torch.optim.Muon([nn.Parameter(torch.randn(4, 4))], nesterov=1).defaults["nesterov"] == 1
    params = make_params([(8, 4), (6,)])
    grads = make_grads(params, steps=2)
    kw = dict(momentum=0.9, foreach=foreach) | ({"use_muon": True} if cls is MuSGD else {})

    def trained(nesterov) -> list[torch.Tensor]:
        ours = clone_params(params)
        opt = cls([{"params": [ours[0]]}, {"params": [ours[1]], "use_muon": False}], nesterov=nesterov, **kw)
        assert [g["nesterov"] for g in opt.param_groups] == [nesterov, nesterov]
        assert all(type(g["nesterov"]) is type(nesterov) for g in opt.param_groups)
        run_optimizer(opt, ours, grads)
        return [p.detach() for p in ours]

    for flag, same in ((1, True), (0, False)):
        assert all(torch.equal(a, b) for a, b in zip(trained(flag), trained(same)))
    assert not torch.equal(trained(1)[0], trained(0)[0])  # the flag matters: 1 took the Nesterov step


def test_musgd_refuses_cautious_weight_decay_as_a_keyword_with_the_group_keys_reason():
    p = nn.Parameter(torch.randn(6, 4))
    with pytest.raises(ValueError) as by_group:
        MuSGD([{"params": [p], "use_muon": True, "cautious_weight_decay": True}])
    with pytest.raises(
        TypeError, match="^cautious_weight_decay in the constructor's arguments: MuSGD does not"
    ) as by_keyword:
        MuSGD([{"params": [p], "use_muon": True}], cautious_weight_decay=True)
    reason = str(by_group.value).partition(": ")[2]
    assert "coupled" in reason and "use Muon" in reason
    assert str(by_keyword.value).partition(": ")[2] == reason
    # False, as in a group, is accepted and leaves the groups as they are
    opt = MuSGD([{"params": [p], "use_muon": True}], cautious_weight_decay=False)
    assert "cautious_weight_decay" not in opt.param_groups[0] and "cautious_weight_decay" not in opt.defaults
    assert [p.name for p in _positional(MuSGD)] == ULTRALYTICS_ORDER


@pytest.mark.parametrize("cls", [MuSGD, Muon])
def test_tensor_lr_must_be_one_element(cls):
    p = nn.Parameter(torch.randn(4, 4))
    with pytest.raises(ValueError, match="^Tensor lr must be 1-element"):
        cls([p], lr=torch.tensor([1e-3, 1e-3]))
    opt = cls([{"params": [p], "use_muon": True}], lr=torch.tensor(0.01))
    p.grad = torch.randn(4, 4)
    opt.step()
    assert torch.isfinite(p).all()


def test_use_muon_must_be_a_bool_in_musgd():
    p = nn.Parameter(torch.randn(4, 4))
    with pytest.raises((TypeError, ValueError), match="use_muon"):
        MuSGD([p], use_muon="yes")
    with pytest.raises((TypeError, ValueError), match="use_muon"):
        MuSGD([{"params": [p], "use_muon": None}])


@pytest.mark.parametrize("cls", [fastmuon.NorMuon, fastmuon.AdaMuon])
def test_variants_show_every_option_of_muon_in_their_signature(cls):
    """``inspect.signature`` of a variant lists all of Muon's options, each of the same kind and
    default (AdaMuon's plain momentum aside), then its own; nothing hides behind ``**kwargs``."""
    muon = inspect.signature(Muon).parameters
    ours = inspect.signature(cls).parameters
    assert not [p for p in ours.values() if p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]
    different = {"nesterov"} if cls is fastmuon.AdaMuon else set()
    for name, p in muon.items():
        assert name in ours, name
        assert ours[name].kind is p.kind, name
        assert ours[name].annotation == p.annotation, name
        if name not in different:
            assert ours[name].default == p.default, name
    own = {"beta2", "moment_eps", "rescale"} | ({"sign_momentum"} if cls is fastmuon.AdaMuon else set())
    assert set(ours) - set(muon) == own
    assert all(ours[n].kind is inspect.Parameter.KEYWORD_ONLY for n in own)
    assert all(f"{n}:" in cls.__doc__ for n in own)
    # each option reaches the groups or the options, as Muon's do
    p = nn.Parameter(torch.randn(6, 4))
    opt = cls([p], beta2=0.9, moment_eps=1e-6, adamw_lr=1e-4, cautious_weight_decay=True, policy="exact")
    group = opt.param_groups[0]
    assert (group["beta2"], group["moment_eps"], group["cautious_weight_decay"]) == (0.9, 1e-6, True)
    assert (opt.adamw_lr, opt.policy) == (1e-4, "exact")
    assert not hasattr(opt, "_variant_defaults")


def test_a_variant_with_nothing_to_orthogonalise_warns_at_the_callers_line():
    with pytest.warns(UserWarning, match="orthogonalises no parameter") as caught:
        fastmuon.NorMuon([nn.Parameter(torch.randn(3))])
    assert caught[0].filename == __file__


@pytest.mark.parametrize("cls", [MuSGD, Muon], ids=lambda c: c.__name__)
def test_constructor_checks_its_arguments_before_reading_params(cls):
    # the call torch's generic optimizer tests (test_errors) make for every optimizer
    with pytest.raises(ValueError, match="Tensor lr must be 1-element"):
        cls(None, lr=torch.tensor([0.001, 0.001]))
