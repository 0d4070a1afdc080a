import pytest
import torch
from conftest import MIXED_SHAPES, rel_err
from helpers import (
    clone_params,
    count_fused_tensors,
    make_grads,
    make_params,
    run_checking_grads_untouched,
    run_muon_reference,
    run_optimizer,
    warns_no_muon,
)

from fastmuon import Muon
from fastmuon.ns.device import cpu_low_precision

HP = dict(lr=0.02, momentum=0.95, nesterov=True, weight_decay=0.1)
ADAMW = dict(lr=0.02, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("adjust_lr_fn", [None, "original", "match_rms_adamw", "spectral_unclamped"])
@pytest.mark.parametrize("policy", ["exact", "min_launches"])
def test_matches_reference_with_adamw_for_vectors(nesterov, adjust_lr_fn, policy):
    shapes = MIXED_SHAPES + [(32,), (7,)]
    params = make_params(shapes, channels_last=(1,))
    grads = make_grads(params, steps=3)
    n = len(MIXED_SHAPES)
    hp = {**HP, "nesterov": nesterov}
    ref, _ = run_muon_reference(
        params,
        grads,
        [(list(range(n)), {"use_muon": True}), ([n, n + 1], {"use_muon": False})],
        {**hp, "adjust_lr_fn": adjust_lr_fn},
        ADAMW,
    )
    ours = clone_params(params)
    opt = Muon(
        [{"params": ours[:n], "use_muon": True}, {"params": ours[n:], "use_muon": False}],
        **hp,
        adjust_lr_fn=adjust_lr_fn,
        adamw_lr=ADAMW["lr"],
        ns_dtype=torch.float32,
        policy=policy,
    )
    run_optimizer(opt, ours, grads)
    for o, r in zip(ours, ref):
        assert rel_err(o.detach(), r) <= 1e-5, o.shape
    assert set(opt.state[ours[n]]) == {"step", "exp_avg", "exp_avg_sq"}
    assert opt.state[ours[n]]["step"].item() == 3


@pytest.mark.parametrize("mode", ["native", "fp32"])
def test_matches_torch_optim_muon_on_2d(mode):
    """Same maths as torch.optim.Muon, which always iterates NS in bf16, on 2D weights.

    "native": both iterate in bf16 and agree to the bit on this CPU; "fp32": our CPU fallback, where bf16 matmul is slow, iterates in fp32 and is
    closer to exact NS than torch's bf16 (checked against the fp32 reference separately).
    """
    params = make_params([(32, 64), (64, 32), (48, 48), (48, 48)])
    grads = make_grads(params, steps=3)
    theirs, ours = clone_params(params), clone_params(params)
    run_optimizer(torch.optim.Muon(theirs, **HP), theirs, grads)
    with cpu_low_precision(mode):
        run_optimizer(Muon(ours, **HP, ns_dtype=torch.bfloat16), ours, grads)
    for p, o, t in zip(params, ours, theirs):
        ours_update, their_update = (o - p).detach(), (t - p).detach()
        assert rel_err(ours_update, their_update) <= (1e-6 if mode == "native" else 5e-2)
        assert torch.allclose(ours_update.norm(), their_update.norm(), rtol=1e-2)


def test_adamw_part_matches_torch_adamw():
    params = make_params([(10,), (3, 4)])
    grads = make_grads(params, steps=4)
    theirs, ours = clone_params(params), clone_params(params)
    run_optimizer(
        torch.optim.AdamW(theirs, lr=0.01, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1), theirs, grads
    )
    with warns_no_muon():
        opt = Muon([{"params": ours, "use_muon": False}], adamw_lr=0.01, weight_decay=0.1)
    run_optimizer(opt, ours, grads)
    for o, t in zip(ours, theirs):
        assert rel_err(o.detach(), t.detach()) <= 1e-6


def test_adamw_part_is_fused_only_where_torchs_kernel_is_exact(monkeypatch):
    """fp32 tensors whose gradient shares their layout take torch's fused AdamW kernel; a
    channels_last tensor with a contiguous gradient (the kernel would walk them out of step)
    and a bf16 one take foreach. Either way torch.optim.AdamW's steps, gradients untouched."""
    fused_sizes = count_fused_tensors(monkeypatch, "_fused_adamw_")
    params = make_params([(10,), (3, 4), (4, 2, 3, 3), (4, 2, 3, 3)], channels_last=(2, 3))
    grads = make_grads(params, steps=3)
    for step in grads:  # tensor 2: a channels_last gradient, as autograd gives; tensor 3: contiguous
        step[2] = step[2].contiguous(memory_format=torch.channels_last)
    theirs, ours = clone_params(params), clone_params(params)
    run_optimizer(
        torch.optim.AdamW(theirs, lr=0.01, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1), theirs, grads
    )
    with warns_no_muon():
        opt = Muon([{"params": ours, "use_muon": False}], adamw_lr=0.01, weight_decay=0.1)
    run_checking_grads_untouched(opt, ours, grads)
    for o, t in zip(ours, theirs):
        assert rel_err(o.detach(), t.detach()) <= 1e-6
    assert sorted(fused_sizes) == sorted([10, 12, 72] * 3)  # not tensor 3
    assert all(float(opt.state[p]["step"]) == 3 for p in ours)
    low = make_params([(10,)], dtype=torch.bfloat16)
    fused_sizes.clear()
    with warns_no_muon():
        opt = Muon([{"params": low, "use_muon": False}], adamw_lr=0.01)
    run_optimizer(opt, low, make_grads(low, steps=1))
    assert fused_sizes == []


def test_use_muon_absent_splits_by_ndim_and_foreach_false_agrees():
    params = make_params([(16, 8, 3, 3), (20, 30), (30,)])
    grads = make_grads(params, steps=2)
    a, b = clone_params(params), clone_params(params)
    run_optimizer(Muon(a, **HP, ns_dtype=torch.float32), a, grads)
    run_optimizer(Muon(b, **HP, ns_dtype=torch.float32, foreach=False), b, grads)
    ref, _ = run_muon_reference(params, grads, [([0, 1, 2], {})], HP, {**ADAMW, "eps": 1e-8})
    for x, y, r in zip(a, b, ref):
        assert rel_err(x.detach(), r) <= 1e-5
        assert rel_err(y.detach(), r) <= 1e-5
