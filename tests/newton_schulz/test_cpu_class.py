"""Plans on CPUs with bf16 matmul units: the class is detected, its constants are used, and the
routes they choose stay accurate against the fp32 per-parameter reference."""

import pytest
import torch
from conftest import rel_err
from reference_impl import ns_reference

from fastmuon import orthogonalize
from fastmuon.ns import device as ns_device
from fastmuon.ns.planner import (
    COST_MODELS,
    CPU_COST_MODELS,
    MatrixSpec,
    choose_method,
    default_cost_model,
    plan_buckets,
)


@pytest.fixture
def bf16_cpu(monkeypatch):
    """A CPU whose matmul units take bf16, whatever CPU runs the test."""
    monkeypatch.setenv("FASTMUON_CPU_CLASS", "avx512_bf16")
    monkeypatch.setattr(ns_device, "_native_is_fast", lambda dtype, threads: dtype == torch.bfloat16)


@pytest.mark.parametrize(
    "flags, expected",
    [
        ({"avx2", "fma"}, "no_bf16"),
        ({"avx2", "avx512f", "avx512_bf16"}, "avx512_bf16"),
        ({"avx512_bf16", "amx_tile", "amx_bf16"}, "amx_bf16"),
    ],
)
def test_cpu_class_is_read_from_the_flags(monkeypatch, flags, expected):
    monkeypatch.delenv("FASTMUON_CPU_CLASS", raising=False)
    monkeypatch.setattr(ns_device, "cpu_flags", lambda: flags)
    ns_device._hardware_cpu_class.cache_clear()
    try:
        assert ns_device.cpu_class() == expected
        assert default_cost_model("cpu") is CPU_COST_MODELS[expected]
    finally:
        ns_device._hardware_cpu_class.cache_clear()


@pytest.mark.parametrize(
    "cap, expected",
    [
        ("AVX2", "no_bf16"),
        ("avx512_core", "no_bf16"),
        ("AVX512_CORE_BF16", "avx512_bf16"),
        ("ALL", "amx_bf16"),
    ],
)
def test_a_onednn_isa_cap_lowers_the_class_and_where_bf16_runs(monkeypatch, cap, expected):
    """Capping oneDNN below bf16 instructions (``ONEDNN_MAX_CPU_ISA``) makes bf16 matmuls emulated,
    so the CPU plans, and runs bf16 requests, as one without them."""
    monkeypatch.delenv("FASTMUON_CPU_CLASS", raising=False)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", cap)
    monkeypatch.setattr(ns_device, "cpu_flags", lambda: {"avx512_bf16", "amx_tile", "amx_bf16"})
    ns_device._hardware_cpu_class.cache_clear()
    ns_device._hardware_native.cache_clear()
    try:
        assert ns_device.cpu_class() == expected
        native = expected != "no_bf16"
        assert ns_device.compute_dtype(torch.bfloat16, "cpu") == (torch.bfloat16 if native else torch.float32)
    finally:
        ns_device._hardware_cpu_class.cache_clear()
        ns_device._hardware_native.cache_clear()


def test_forcing_the_class_without_bf16_runs_bf16_requests_in_fp32(monkeypatch):
    monkeypatch.setenv("FASTMUON_CPU_CLASS", "no_bf16")
    assert ns_device.compute_dtype(torch.bfloat16, "cpu") == torch.float32
    assert ns_device.compute_dtype(torch.bfloat16, "cuda") == torch.bfloat16


def test_each_class_has_its_constants(monkeypatch):
    monkeypatch.setenv("FASTMUON_CPU_CLASS", "no_bf16")
    assert default_cost_model("cpu") is COST_MODELS["cpu"]  # the constants measured without bf16 units
    monkeypatch.setenv("FASTMUON_CPU_CLASS", "avx512_bf16")
    model = default_cost_model("cpu")
    assert model.flop_seconds(torch.bfloat16) < model.flop_seconds(torch.float32)
    assert model.launch_cost(torch.bfloat16) > model.launch_cost(torch.float32)
    assert default_cost_model("cuda") is COST_MODELS["cuda"]  # the CPU class leaves GPUs alone
    monkeypatch.setenv("FASTMUON_CPU_CLASS", "sse2")
    with pytest.raises(ValueError, match="FASTMUON_CPU_CLASS='sse2'.*choose one of"):
        default_cost_model("cpu")


def test_fp32_fallback_is_offered_only_where_bf16_runs_natively(monkeypatch):
    monkeypatch.setattr(ns_device, "_native_is_fast", lambda dtype, threads: False)
    assert ns_device.wider_dtype(torch.bfloat16, "cpu") is None  # bf16 runs in fp32 already
    monkeypatch.setattr(ns_device, "_native_is_fast", lambda dtype, threads: True)
    assert ns_device.wider_dtype(torch.bfloat16, "cpu") == torch.float32
    assert ns_device.wider_dtype(torch.float32, "cpu") is None
    assert ns_device.wider_dtype(torch.bfloat16, "cuda") is None
    with ns_device.cpu_low_precision("native"):  # the caller insists on bf16
        assert ns_device.wider_dtype(torch.bfloat16, "cpu") is None


def test_bf16_class_runs_each_shape_in_the_faster_dtype(bf16_cpu):
    specs = [
        MatrixSpec(256, 1152, torch.bfloat16, fallback=torch.float32),  # large: bf16 (Gram space)
        MatrixSpec(256, 256, torch.bfloat16, fallback=torch.float32),  # large square: bf16 standard
        MatrixSpec(32, 288, torch.bfloat16, fallback=torch.float32),  # small: fp32 Gram space
        MatrixSpec(16, 144, torch.bfloat16, fallback=torch.float32),
    ]
    plan = plan_buckets(specs, threads=1)
    routes = {(m.rows, m.cols): (b.dtype, b.method) for b in plan.buckets for m in b.members}
    assert routes[(256, 1152)] == (torch.bfloat16, "gram")
    assert routes[(256, 256)] == (torch.bfloat16, "standard")
    assert routes[(32, 288)][0] == routes[(16, 144)][0] == torch.float32
    assert {m.index for b in plan.buckets for m in b.members} == set(range(len(specs)))
    # without a fallback the request is kept, as before
    plan = plan_buckets([MatrixSpec(32, 288, torch.bfloat16)], threads=1)
    assert plan.buckets[0].dtype == torch.bfloat16


def test_bf16_gram_needs_the_class_and_a_wide_enough_bucket():
    args = dict(steps=5, dtype=torch.bfloat16)
    assert choose_method("auto", 256, 1152, narrowest=4.5, low_precision_gram=True, **args) == "gram"
    assert choose_method("auto", 256, 768, narrowest=3, low_precision_gram=True, **args) == "gram"
    assert choose_method("auto", 256, 384, narrowest=1.5, low_precision_gram=True, **args) == "standard"
    assert choose_method("auto", 256, 1152, narrowest=4.5, **args) == "standard"  # other classes


def test_default_routes_on_the_bf16_class_match_the_fp32_reference(bf16_cpu):
    """orthogonalize at the bf16 default on the bf16 class: every route it picks (bf16 standard,
    bf16 Gram space with restarts, fp32 Gram space / eigh) within bf16 NS's error of the fp32
    per-parameter reference, and the fp32 routes far closer than that."""
    shapes = [(256, 128, 3, 3), (192, 192), (32, 32, 3, 3), (16, 16, 3, 3), (64, 64, 3, 3), (128, 96)]
    tensors = [torch.randn(s) for s in shapes]
    specs = [
        MatrixSpec(s[0], t[0].numel(), torch.bfloat16, fallback=torch.float32)
        for s, t in zip(shapes, tensors)
    ]
    plan = plan_buckets(specs)
    dtypes = {b.dtype for b in plan.buckets}
    methods = {b.method for b in plan.buckets}
    assert dtypes == {torch.bfloat16, torch.float32} and "gram" in methods
    fp32_routed = {m.index for b in plan.buckets if b.dtype == torch.float32 for m in b.members}
    outputs = orthogonalize(tensors, dtype=torch.bfloat16)
    for i, (t, out) in enumerate(zip(tensors, outputs)):
        expected = ns_reference(t.flatten(1)).view(t.shape)
        assert out.dtype == torch.bfloat16 and out.shape == t.shape
        assert rel_err(out, expected) < (1e-2 if i in fp32_routed else 0.1), shapes[i]


def test_calibration_measures_fp32_and_the_low_precision_launch_cost(bf16_cpu):
    from fastmuon.ns.calibrate import calibrated_cost_model

    model = calibrated_cost_model("cpu", [torch.bfloat16])
    assert 0 < model.flop_seconds(torch.float32) < 1e-8  # measured: a bf16 request may run in fp32
    assert 0 < model.flop_seconds(torch.bfloat16) < 1e-8
    assert model.launch_cost(torch.bfloat16) >= model.launch_cost(torch.float32) > 0
    assert model.low_precision_gram  # the class's choice of routes carries over
    specs = [
        MatrixSpec(16, 144, torch.bfloat16, fallback=torch.float32),
        MatrixSpec(256, 1152, torch.bfloat16),
    ]
    assert len(plan_buckets(specs, cost_model=model).buckets) == 2


def test_musgd_at_the_bf16_default_on_the_bf16_class_tracks_the_fp32_reference(bf16_cpu):
    """The optimizer's plan mixes bf16 and fp32 buckets there; every parameter's update stays
    within bf16 NS's error of the fp32 per-parameter reference, the fp32-routed ones far closer."""
    from helpers import clone_params, make_grads, make_params, run_musgd_reference, run_optimizer

    from fastmuon import MuSGD

    shapes = [(256, 128, 3, 3), (192, 192), (32, 32, 3, 3), (16, 16, 3, 3), (8, 1, 3, 3)]
    hp = dict(lr=0.02, momentum=0.9, nesterov=True, weight_decay=5e-4, muon=0.3, sgd=0.7)
    params = make_params(shapes)
    grads = make_grads(params, steps=2)
    ref, _ = run_musgd_reference(params, grads, [(list(range(len(shapes))), {"use_muon": True})], hp)
    ours = clone_params(params)
    opt = MuSGD(ours, **hp, use_muon=True)  # ns_dtype: bf16, ns_method: auto
    run_optimizer(opt, ours, grads)
    plan = opt.plan()
    assert {b.dtype for b in plan.buckets} == {torch.bfloat16, torch.float32}
    fp32_routed = {m.index for b in plan.buckets if b.dtype == torch.float32 for m in b.members}
    for i, (p0, o, r) in enumerate(zip(params, ours, ref)):
        err = rel_err(o.detach() - p0.detach(), r - p0.detach())
        assert err < (1e-3 if i in fp32_routed else 0.1), (shapes[i], err)
