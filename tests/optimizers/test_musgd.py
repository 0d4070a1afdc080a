import pytest
import torch
from conftest import MIXED_SHAPES, rel_err
from helpers import (
    by_ndim,
    clone_params,
    count_fused_tensors,
    make_grads,
    make_params,
    run_checking_grads_untouched,
    run_musgd_reference,
    run_optimizer,
    warns_no_muon,
)

from fastmuon import MuSGD
from fastmuon.step.elementwise import foreach_scalar

HP = dict(lr=0.02, momentum=0.9, nesterov=True, weight_decay=5e-4, muon=0.3, sgd=0.7)
VECTORS = [(32,), (16,), (100,)]


def build(shapes_muon, shapes_sgd, channels_last=()):
    params = make_params(shapes_muon + shapes_sgd, channels_last)
    n = len(shapes_muon)
    return params, list(range(n)), list(range(n, n + len(shapes_sgd)))


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("policy", ["exact", "auto", "min_launches"])
@pytest.mark.parametrize(
    "adjust_lr", ["ultralytics", "original", "match_rms_adamw", "spectral_unclamped", "none"]
)
def test_matches_reference(nesterov, policy, adjust_lr):
    params, muon_idx, sgd_idx = build(MIXED_SHAPES, VECTORS, channels_last=(1, 9))
    grads = make_grads(params, steps=3)
    hp = {**HP, "nesterov": nesterov}
    groups = [(muon_idx, {"use_muon": True}), (sgd_idx, {"use_muon": False, "lr": 0.05})]
    ref, _ = run_musgd_reference(params, grads, groups, {**hp, "adjust_lr": adjust_lr})
    ours = clone_params(params)
    opt = MuSGD(
        [
            {"params": [ours[i] for i in muon_idx], "use_muon": True},
            {"params": [ours[i] for i in sgd_idx], "use_muon": False, "lr": 0.05},
        ],
        **hp,
        ns_dtype=torch.float32,
        policy=policy,
        adjust_lr=adjust_lr,
    )
    run_optimizer(opt, ours, grads)
    for o, r in zip(ours, ref):
        assert rel_err(o.detach(), r) <= 1e-5, o.shape


def test_groups_without_use_muon_take_the_constructor_default_and_mixed_groups_share_buckets():
    """As in Ultralytics, a group that does not set use_muon takes the constructor's; two Muon
    groups with different lr and momentum share buckets and keep their own values."""
    params = make_params([(16, 8, 3, 3), (16, 8, 3, 3), (24, 40), (16,), (40,)])
    grads = make_grads(params, steps=2)
    ref, ref_states = run_musgd_reference(
        params,
        grads,
        [([0, 2, 3], {"use_muon": True}), ([1, 4], {"use_muon": True, "lr": 0.005, "momentum": 0.5})],
        {**HP, "adjust_lr": "ultralytics"},
    )
    ours = clone_params(params)
    opt = MuSGD(
        [
            {"params": [ours[i] for i in (0, 2, 3)]},
            {"params": [ours[1], ours[4]], "lr": 0.005, "momentum": 0.5},
        ],
        **HP,
        use_muon=True,
        ns_dtype=torch.float32,
    )
    run_optimizer(opt, ours, grads)
    for o, r in zip(ours, ref):
        assert rel_err(o.detach(), r) <= 1e-5
    assert set(opt.state[ours[0]]) == {"momentum_buffer", "momentum_buffer_SGD"}
    assert set(opt.state[ours[3]]) == {"momentum_buffer_SGD"}
    assert rel_err(opt.state[ours[0]]["momentum_buffer_SGD"], ref_states[0]["momentum_buffer_SGD"]) <= 1e-5


def test_vector_in_muon_group_takes_sgd_lines_at_lr_sgd():
    params = make_params([(12, 20), (7,)])
    grads = make_grads(params, steps=2)
    ref, _ = run_musgd_reference(params, grads, [([0, 1], {"use_muon": True})], HP)
    ours = clone_params(params)
    opt = MuSGD([{"params": ours, "use_muon": True}], **HP, ns_dtype=torch.float32)
    run_optimizer(opt, ours, grads)
    for o, r in zip(ours, ref):
        assert rel_err(o.detach(), r) <= 1e-5
    assert "momentum_buffer_SGD" in opt.state[ours[1]]


def test_channels_last_twin_gets_exactly_the_same():
    a = make_params([(32, 16, 3, 3), (8, 1, 3, 3)])
    b = [torch.nn.Parameter(p.detach().clone().to(memory_format=torch.channels_last)) for p in a]
    grads = make_grads(a, steps=3)
    for params in (a, b):
        run_optimizer(MuSGD(params, **HP, use_muon=True, ns_dtype=torch.float32), params, grads)
    for x, y in zip(a, b):
        assert torch.equal(x.detach(), y.detach())
        assert y.is_contiguous(memory_format=torch.channels_last)


def test_foreach_false_is_the_per_parameter_path():
    params = make_params(MIXED_SHAPES + VECTORS)
    grads = make_grads(params, steps=2)
    fast, slow = clone_params(params), clone_params(params)
    run_optimizer(MuSGD(by_ndim(fast), **HP, ns_dtype=torch.float32), fast, grads)
    run_optimizer(MuSGD(by_ndim(slow), **HP, ns_dtype=torch.float32, foreach=False), slow, grads)
    for f, s in zip(fast, slow):
        assert rel_err(f.detach(), s.detach()) <= 1e-5


def test_grads_never_modified_and_bf16_buffers_not_aliased():
    params = make_params([(16, 32), (32, 16), (8,)], dtype=torch.bfloat16)
    opt = MuSGD(by_ndim(params), **HP)
    grads = make_grads(params, steps=1)[0]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    opt.step()
    for p, g in zip(params, grads):
        assert torch.equal(p.grad, g)
    # non-nesterov: the NS input is the momentum buffer itself; it must keep its EMA value
    p = make_params([(16, 32)], dtype=torch.bfloat16)[0]
    g = torch.randn(16, 32, dtype=torch.bfloat16)
    opt = MuSGD([p], lr=0.1, momentum=0.5, nesterov=False, use_muon=True)
    p.grad = g
    opt.step()
    assert torch.equal(opt.state[p]["momentum_buffer"], (0.5 * g.float()).to(torch.bfloat16))


def test_bf16_params_close_to_reference():
    params = make_params([(16, 32, 3, 3), (64, 48), (48,)], dtype=torch.bfloat16)
    grads = make_grads(params, steps=2)
    ref, _ = run_musgd_reference(
        [p.float() for p in params],
        [[g.float() for g in s] for s in grads],
        [([0, 1, 2], {"use_muon": None})],
        HP,
    )
    run_optimizer(MuSGD(by_ndim(params), **HP, ns_dtype=torch.float32), params, grads)
    for o, r in zip(params, ref):
        assert o.dtype == torch.bfloat16
        assert rel_err(o.detach().float(), r) <= 2e-2


def test_zero_momentum_and_zero_weight_decay():
    params = make_params([(10, 20), (5,)])
    grads = make_grads(params, steps=2)
    hp = dict(lr=0.1, momentum=0.0, nesterov=False, weight_decay=0.0, muon=0.5, sgd=0.5)
    ref, _ = run_musgd_reference(params, grads, [([0, 1], {"use_muon": None})], hp)
    ours = clone_params(params)
    run_optimizer(MuSGD(by_ndim(ours), **hp, ns_dtype=torch.float32), ours, grads)
    for o, r in zip(ours, ref):
        assert rel_err(o.detach(), r) <= 1e-5


def test_defaults_match_ultralytics_signature():
    p = torch.nn.Parameter(torch.randn(4, 4))
    with warns_no_muon():  # the default use_muon=False
        d = MuSGD([p]).defaults
    assert (d["lr"], d["momentum"], d["nesterov"], d["weight_decay"], d["use_muon"], d["muon"], d["sgd"]) == (
        1e-3,
        0.0,
        False,
        0.0,
        False,
        0.5,
        0.5,
    )
    assert (d["ns_steps"], d["ns_coefficients"], d["ns_dtype"], d["eps"], d["adjust_lr_fn"]) == (
        5,
        "jordan",
        torch.bfloat16,
        1e-7,
        "ultralytics",
    )


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
def test_foreach_scalar_multiplies_bit_for_bit_like_a_python_number(dtype):
    """The CPU shortcut for foreach multiplies (a 0-d tensor instead of a number) changes no bit."""
    x = torch.randn(1000, dtype=torch.float64).to(dtype)
    by_number, by_tensor = [x.clone()], [x.clone()]
    torch._foreach_mul_(by_number, 0.937)
    torch._foreach_mul_(by_tensor, foreach_scalar(0.937, x, host=True))
    assert isinstance(foreach_scalar(0.937, x, host=True), torch.Tensor)
    assert torch.equal(by_number[0], by_tensor[0])


def test_sgd_half_is_fused_only_where_torchs_kernel_is_exact(monkeypatch):
    """fp32 tensors whose gradient and buffer share their layout take torch's fused SGD kernel
    (one pass); a channels_last weight with a contiguous gradient (the kernel would walk them
    out of step) and bf16 tensors (its low-precision path misreads the buffer) take foreach.
    Either way: the reference's steps, and the gradients untouched."""
    from fastmuon.step import elementwise

    fused_sizes = count_fused_tensors(monkeypatch, "_fused_sgd_")
    shapes = [(8, 4, 3, 3), (8, 4, 3, 3), (24, 40), (40,)]
    params = make_params(shapes, channels_last=(0, 1))
    grads = make_grads(params, steps=2)
    for step in grads:  # weight 0: a channels_last gradient, as autograd gives; weight 1: contiguous
        step[0] = step[0].contiguous(memory_format=torch.channels_last)
    ref, _ = run_musgd_reference(params, grads, [([0, 1, 2, 3], {"use_muon": None})], HP)
    ours = clone_params(params)
    run_checking_grads_untouched(MuSGD(by_ndim(ours), **HP, ns_dtype=torch.float32), ours, grads)
    for o, r in zip(ours, ref):
        assert rel_err(o.detach(), r) <= 1e-5, o.shape
    assert sorted(fused_sizes) == sorted([40, 24 * 40, 8 * 4 * 3 * 3] * 2)  # not weight 1
    assert elementwise.fusable(*[torch.zeros(4)] * 3)
    assert not elementwise.fusable(*[torch.zeros(4, dtype=torch.bfloat16)] * 3)
