"""NorMuon, AdaMuon and cautious weight decay against per-matrix fp32 references written from
their papers (tests/reference_impl.py), batched and per parameter, with matrix maps, through a
state dict, and against pytorch-optimizer's implementations where the rules coincide."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from reference_impl import adamw_reference_step, variant_reference_step

import fastmuon

F32 = torch.float32
KW = dict(lr=0.02, momentum=0.95, weight_decay=0.1)
# a wide and a tall matrix, a conv kernel, two of one shape, a vector (AdamW)
SHAPES = [(8, 12), (12, 8), (6, 3, 3, 3), (8, 12), (5, 7), (9,)]
VARIANTS = {
    "normuon": (fastmuon.NorMuon, {}, dict(variant="normuon", nesterov=True)),
    "normuon_rms": (
        fastmuon.NorMuon,
        {"rescale": "rms"},
        dict(variant="normuon", nesterov=True, rescale="rms"),
    ),
    "normuon_cautious": (
        fastmuon.NorMuon,
        {"cautious_weight_decay": True, "beta2": 0.9},
        dict(variant="normuon", nesterov=True, cautious=True, beta2=0.9),
    ),
    "adamuon": (fastmuon.AdaMuon, {}, dict(variant="adamuon", nesterov=False, sign_momentum=True)),
    "adamuon_nosign": (
        fastmuon.AdaMuon,
        {"sign_momentum": False, "nesterov": True},
        dict(variant="adamuon", nesterov=True, sign_momentum=False),
    ),
    "muon_cautious": (fastmuon.Muon, {"cautious_weight_decay": True}, dict(variant="muon", nesterov=True)),
}
VARIANTS["muon_cautious"][2]["cautious"] = True


def make(shapes, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(0.5 * torch.randn(s, generator=g)) for s in shapes]


def grads_for(params, t):
    g = torch.Generator().manual_seed(100 + t)
    return [torch.randn(p.shape, generator=g) for p in params]


def run(cls, params, kwargs, steps, start=0, opt=None):
    opt = opt or cls(params, ns_dtype=F32, ns_method="standard", **{**KW, **kwargs})
    for t in range(start, start + steps):
        for p, g in zip(params, grads_for(params, t)):
            p.grad = g
        opt.step()
    return opt


def reference(params, ref_kw, steps, pieces=None):
    ps = [p.detach().clone() for p in params]
    states = [{} for _ in ps]
    for t in range(steps):
        for k, (p, g, st) in enumerate(zip(ps, grads_for(ps, t), states)):
            if p.ndim >= 2:
                variant_reference_step(
                    p,
                    g,
                    st,
                    lr=KW["lr"],
                    momentum=KW["momentum"],
                    weight_decay=KW["weight_decay"],
                    pieces=pieces[k] if pieces else None,
                    **ref_kw,
                )
            else:
                adamw_reference_step(p, g, st, lr=KW["lr"], weight_decay=KW["weight_decay"])
    return ps


def max_rel(got, want):
    return max(((a - b).norm() / b.norm()).item() for a, b in zip(got, want))


@pytest.mark.parametrize("name", list(VARIANTS))
@pytest.mark.parametrize("path", ["batched", "min_launches", "per_parameter"])
def test_variant_against_reference(name, path):
    cls, kwargs, ref_kw = VARIANTS[name]
    extra = {"foreach": False} if path == "per_parameter" else {"policy": path} if path != "batched" else {}
    params = make(SHAPES)
    ref = reference(params, ref_kw, 3)
    run(cls, params, {**kwargs, **extra}, 3)
    # fp32 NS and statistics on both sides: only rounding differs (5 NS iterations, 3 steps)
    assert max_rel([p.detach() for p in params], ref) < 2e-5


@pytest.mark.parametrize("name", ["normuon", "adamuon", "muon_cautious"])
def test_batched_equals_per_parameter(name):
    cls, kwargs, _ = VARIANTS[name]
    a, b = make(SHAPES), make(SHAPES)
    run(cls, a, kwargs, 3)
    run(cls, b, {**kwargs, "foreach": False}, 3)
    assert max_rel([p.detach() for p in a], [p.detach() for p in b]) < 1e-5


def test_padded_bucket_rows_use_real_columns():
    """Matrices of different widths packed into one padded bucket: each row's mean is over its
    matrix's own columns (a padded mean would shrink the statistics of the narrow ones)."""
    shapes = [(6, 4), (6, 9), (6, 16)]
    params = make(shapes)
    ref = reference(params, VARIANTS["normuon"][2], 2)
    opt = run(fastmuon.NorMuon, params, {"policy": "min_launches"}, 2)
    assert len(opt.last_plan.buckets) < len(shapes)  # shared, so padded
    assert max_rel([p.detach() for p in params], ref) < 2e-5
    rows = opt.state[params[0]]["second_moment"]
    assert rows.shape == (6,)


MAP_SHAPES = [(4, 6, 5), (15, 5), (5, 15), (7, 5)]
MAPS = ["experts", {"split": [5, 5, 5]}, {"split": [5, 5, 5], "transposed": True}, {"split": [3, 4]}]
ALL = slice(None)
PIECES = [
    [((e,), False) for e in range(4)],
    [((slice(a, a + 5),), False) for a in (0, 5, 10)],
    [((ALL, slice(a, a + 5)), True) for a in (0, 5, 10)],
    [((slice(0, 3),), False), ((slice(3, 7),), False)],
]


@pytest.mark.parametrize("name", ["normuon", "adamuon", "normuon_cautious"])
@pytest.mark.parametrize("foreach", [None, False])
def test_matrix_maps_have_their_own_statistics(name, foreach):
    cls, kwargs, ref_kw = VARIANTS[name]
    params = make(MAP_SHAPES)
    ref = reference(params, ref_kw, 3, pieces=PIECES)
    opt = cls(
        [{"params": params, "matrices": MAPS}],
        ns_dtype=F32,
        ns_method="standard",
        foreach=foreach,
        **{**KW, **kwargs},
    )
    run(cls, params, {}, 3, opt=opt)
    assert max_rel([p.detach() for p in params], ref) < 2e-5
    if name.startswith("normuon"):  # one entry per row of each mapped matrix
        assert [opt.state[p]["second_moment"].shape for p in params] == [(24,), (15,), (15,), (7,)]


@pytest.mark.parametrize("name", ["normuon", "adamuon"])
def test_state_dict_round_trip(name):
    cls, kwargs, _ = VARIANTS[name]
    whole, part = make(SHAPES), make(SHAPES)
    run(cls, whole, kwargs, 4)
    first = run(cls, part, kwargs, 2)
    saved = copy.deepcopy(first.state_dict())
    assert all("second_moment" in s for k, s in saved["state"].items() if part[k].ndim >= 2)
    resumed = cls(part, ns_dtype=F32, ns_method="standard", **{**KW, **kwargs})
    resumed.load_state_dict(saved)
    run(cls, part, kwargs, 2, start=2, opt=resumed)
    for a, b in zip(whole, part):
        assert torch.equal(a, b)


def test_mismatched_moment_is_refused_and_changes_nothing():
    params = make([(8, 12)])
    opt = run(fastmuon.NorMuon, params, {}, 1)
    opt.state[params[0]]["second_moment"] = torch.zeros(5)
    before = params[0].detach().clone()
    params[0].grad = torch.randn(8, 12)
    opt.invalidate()
    with pytest.raises(ValueError, match="second_moment"):
        opt.step()
    assert torch.equal(params[0], before)


def test_options_are_checked():
    p = [torch.nn.Parameter(torch.randn(4, 4))]
    with pytest.raises(ValueError, match="rescale"):
        fastmuon.NorMuon(p, rescale="spectral")
    with pytest.raises(ValueError, match="adjust_lr_fn"):
        fastmuon.NorMuon(p, rescale="rms", adjust_lr_fn="match_rms_adamw")
    with pytest.raises(ValueError, match="beta2"):
        fastmuon.AdaMuon(p, beta2=1.0)
    with pytest.raises(TypeError, match="cautious_weight_decay"):
        fastmuon.Muon(p, cautious_weight_decay="yes")
    with pytest.raises(TypeError, match="sign_momentum"):
        fastmuon.AdaMuon(p, sign_momentum=1)


def test_cautious_decay_only_where_signs_agree():
    """Cautious and plain decay differ by lr·wd·p exactly where the update and p disagree."""
    a, b = make([(6, 5)]), make([(6, 5)])
    start = a[0].detach().clone()
    kw = dict(lr=0.5, weight_decay=0.2, momentum=0.0, ns_dtype=F32)
    plain = fastmuon.Muon(a, **kw)
    cautious = fastmuon.Muon(b, cautious_weight_decay=True, **kw)
    g = torch.randn(6, 5, generator=torch.Generator().manual_seed(3))
    a[0].grad, b[0].grad = g, g.clone()
    plain.step()
    cautious.step()
    # the update u is what both subtracted apart from the decay: u = (start·(1−lr·wd) − a)/lr
    u = (start * (1 - 0.5 * 0.2) - a[0].detach()) / 0.5
    disagree = u * start < 0
    assert disagree.any() and (~disagree).any()
    want = a[0].detach() + torch.where(disagree, 0.5 * 0.2 * start, 0)
    assert torch.allclose(b[0].detach(), want, atol=1e-6)


# ----- against pytorch-optimizer -------------------------------------------------------------
po = pytest.importorskip("pytorch_optimizer")


def _fp32_ns(monkeypatch, module):
    from pytorch_optimizer.optimizer.utils.matrix import zero_power_via_newton_schulz_5

    monkeypatch.setattr(
        module, "zero_power_via_newton_schulz_5", functools.partial(zero_power_via_newton_schulz_5, dtype=F32)
    )


PEER_SHAPES = [(8, 12), (12, 8), (6, 3, 3, 3), (16, 16)]


def _peer_run(opt, params, steps):
    for t in range(steps):
        for p, g in zip(params, grads_for(params, t)):
            p.grad = g.clone()  # the peer's Nesterov step writes into the gradient
        opt.step()


@pytest.mark.parametrize("foreach", [False])  # its foreach path takes one lr factor per group
def test_normuon_agrees_with_pytorch_optimizer(monkeypatch, foreach):
    """pytorch-optimizer's NorMuon with update_scale="preserve_norm" (the authors' code) and
    Keller Jordan's lr factor is fastmuon's rescale="norm" with adjust_lr_fn=None. Both at fp32
    NS: the results differ by rounding (and by where ε enters the norm: ‖Ô‖+ε there, max(‖Ô‖, ε)
    here, a relative 1e-8), so a relative 1e-5 on the updates holds with a wide margin."""
    import pytorch_optimizer.optimizer.muon.normuon as peer_module

    _fp32_ns(monkeypatch, peer_module)
    mine, theirs = make(PEER_SHAPES), make(PEER_SHAPES)
    start = [p.detach().clone() for p in mine]
    run(fastmuon.NorMuon, mine, {"moment_eps": 1e-8}, 3)
    peer = po.NorMuon(
        [{"params": theirs, "use_muon": True}],
        lr=KW["lr"],
        momentum=KW["momentum"],
        beta2=0.95,
        weight_decay=KW["weight_decay"],
        nesterov=True,
        ns_coeffs="original",
        eps=1e-8,
        foreach=foreach,
    )
    _peer_run(peer, theirs, 3)
    assert max_rel([a - s for a, s in zip(mine, start)], [b - s for b, s in zip(theirs, start)]) < 1e-5


@pytest.mark.parametrize("foreach", [False])
def test_adamuon_agrees_with_pytorch_optimizer(monkeypatch, foreach):
    """pytorch-optimizer's AdaMuon orthogonalises the momentum itself (fastmuon's
    sign_momentum=False), without Nesterov, bias-corrects ``v`` (cancelled by the RMS rescale up to
    ε's weight, a relative 1e-7 here) and scales by 0.2·√(mn)/‖Ô‖ as fastmuon's rescale="rms"."""
    import pytorch_optimizer.optimizer.muon.adamuon as peer_module

    _fp32_ns(monkeypatch, peer_module)
    mine, theirs = make(PEER_SHAPES), make(PEER_SHAPES)
    start = [p.detach().clone() for p in mine]
    run(fastmuon.AdaMuon, mine, {"sign_momentum": False, "nesterov": False}, 3)
    peer = po.AdaMuon(
        [{"params": theirs, "use_muon": True}],
        lr=KW["lr"],
        betas=(KW["momentum"], 0.95),
        weight_decay=KW["weight_decay"],
        ns_coeffs="original",
        eps=1e-8,
        foreach=foreach,
    )
    _peer_run(peer, theirs, 3)
    assert max_rel([a - s for a, s in zip(mine, start)], [b - s for b, s in zip(theirs, start)]) < 1e-5


def test_musgd_refuses_cautious_weight_decay_rather_than_ignoring_it():
    """MuSGD's decay is coupled: a cautious flag in its group would be silently meaningless."""
    w = torch.nn.Parameter(torch.randn(6, 8))
    with pytest.raises(ValueError, match="cautious_weight_decay in param group 0.*coupled"):
        fastmuon.MuSGD([dict(params=[w], use_muon=True, cautious_weight_decay=True)], lr=0.02)
    opt = fastmuon.MuSGD([dict(params=[w], use_muon=True)], lr=0.02, momentum=0.9)
    with pytest.raises(ValueError, match="cautious_weight_decay"):
        opt.add_param_group(dict(params=[torch.nn.Parameter(torch.randn(3, 3))], cautious_weight_decay=True))
    assert len(opt.param_groups) == 1
