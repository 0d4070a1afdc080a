import json
from collections import Counter
from pathlib import Path

import pytest
import torch
from helpers import make_grads, make_params, run_optimizer

import fastmuon
from fastmuon.ns.planner import (
    COST_MODELS,
    CPU_EIGH,
    EIGH_FLOPS_PER_R3,
    CostModel,
    MatrixSpec,
    kernels_per_bucket,
    ns_cost,
    ns_flops,
    plan_buckets,
)

MODELS = Path(__file__).resolve().parents[2] / "src" / "fastmuon" / "models"
#: the hyperparameters of the optimizer-level tests here
OPTIMIZER_KW = dict(lr=0.02, momentum=0.9, nesterov=True, weight_decay=1e-3, ns_dtype=torch.float32)


@pytest.fixture(autouse=True)
def _cpu_without_bf16_units(monkeypatch):
    """These tests pin the plans for CPUs without bf16 matmul units, whatever CPU runs them
    (the bf16-capable class has its own tests: test_cpu_class.py)."""
    monkeypatch.setenv("FASTMUON_CPU_CLASS", "no_bf16")


def yolo_specs(name="yolo26n", device="cpu"):
    manifest = json.loads((MODELS / f"{name}.json").read_text())
    specs = []
    for p in manifest["params"]:
        shape = p["shape"]
        if len(shape) >= 2:
            cols = 1
            for d in shape[1:]:
                cols *= d
            specs.append(MatrixSpec(shape[0], cols, torch.bfloat16, torch.device(device)))
    return specs


def members(plan):
    return [m.index for b in plan.buckets for m in b.members]


def check_invariants(plan, specs):
    assert sorted(members(plan)) == list(range(len(specs)))  # each matrix in exactly one bucket
    for b in plan.buckets:
        B, R, C = b.shape
        assert R <= C and len(b.members) == B
        assert [m.slot for m in b.members] == list(range(B))
        for m in b.members:
            s = specs[m.index]
            assert m.oriented == s.oriented and m.oriented[0] <= R and m.oriented[1] <= C
            assert s.dtype == b.dtype and s.device == b.device and s.key == b.key


@pytest.mark.parametrize("policy", ["exact", "auto", "min_launches"])
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_invariants_on_real_models(policy, device):
    for name in ("yolo26n", "yolo26m"):
        specs = yolo_specs(name, device)
        check_invariants(plan_buckets(specs, policy=policy), specs)


def test_exact_never_pads_and_groups_identical_shapes():
    specs = yolo_specs()
    plan = plan_buckets(specs, policy="exact")
    assert plan.padding_overhead() == 0
    distinct = {s.oriented for s in specs}
    assert len(plan.buckets) == len(distinct)


def test_orientation_tall_goes_wide():
    specs = [MatrixSpec(100, 20), MatrixSpec(20, 100)]
    plan = plan_buckets(specs, policy="exact")
    assert len(plan.buckets) == 1 and plan.buckets[0].shape == (2, 20, 100)
    transposed = {m.index: m.transposed for m in plan.buckets[0].members}
    assert transposed == {0: True, 1: False}


def test_min_launches_merges_and_auto_depends_on_device():
    cpu = plan_buckets(yolo_specs(device="cpu"), policy="auto")
    gpu = plan_buckets(yolo_specs(device="cuda"), policy="auto")
    fewest = plan_buckets(yolo_specs(), policy="min_launches")
    exact = plan_buckets(yolo_specs(), policy="exact")
    assert len(fewest.buckets) < len(gpu.buckets) <= len(cpu.buckets) <= len(exact.buckets)
    # a launch-bound device accepts more padding than a FLOP-bound one
    assert gpu.padding_overhead() >= cpu.padding_overhead()
    assert len(fewest.buckets) <= 3


def test_auto_merges_tiny_matrices_on_cpu_too():
    specs = [MatrixSpec(4, 9 * k) for k in range(1, 9)]
    plan = plan_buckets(specs, policy="auto")
    assert len(plan.buckets) == 1


def test_auto_keeps_big_different_shapes_apart_on_cpu():
    specs = [MatrixSpec(512, 4608), MatrixSpec(64, 576)]
    plan = plan_buckets(specs, policy="auto")
    assert len(plan.buckets) == 2


def test_memory_cap_splits_buckets():
    specs = [MatrixSpec(64, 64, torch.float32) for _ in range(10)]
    cap = 3 * 64 * 64 * 4
    plan = plan_buckets(specs, policy="min_launches", max_bucket_bytes=cap)
    check_invariants(plan, specs)
    assert [b.shape[0] for b in plan.buckets] == [3, 3, 3, 1]
    assert all(b.nbytes() <= cap for b in plan.buckets)


def test_matrix_larger_than_cap_gets_own_bucket():
    specs = [MatrixSpec(128, 128, torch.float32), MatrixSpec(8, 8, torch.float32)]
    plan = plan_buckets(specs, policy="min_launches", max_bucket_bytes=1000)
    assert sorted(b.shape[0] for b in plan.buckets) == [1, 1]


def test_dtype_device_and_key_never_mix():
    specs = [
        MatrixSpec(8, 8, torch.float32),
        MatrixSpec(8, 8, torch.bfloat16),
        MatrixSpec(8, 8, torch.float32, torch.device("meta")),
        MatrixSpec(8, 8, torch.float32, key="other-ns-config"),
    ]
    plan = plan_buckets(specs, policy="min_launches")
    assert len(plan.buckets) == 4
    check_invariants(plan, specs)


def test_identical_layouts_are_adjacent_in_a_bucket():
    specs = [
        MatrixSpec(8, 72, layout="conv"),
        MatrixSpec(8, 72, layout="linear"),
        MatrixSpec(8, 72, layout="conv"),
        MatrixSpec(8, 72, layout="linear"),
    ]
    (bucket,) = plan_buckets(specs, policy="exact").buckets
    layouts = [specs[m.index].layout for m in bucket.members]
    assert layouts in (["conv", "conv", "linear", "linear"], ["linear", "linear", "conv", "conv"])


def test_flop_accounting():
    specs = [MatrixSpec(10, 30, method="standard"), MatrixSpec(20, 40, method="standard")]
    plan = plan_buckets(specs, policy="min_launches", steps=5)
    (b,) = plan.buckets
    assert b.shape == (2, 20, 40)
    assert plan.useful_flops() == ns_flops(10, 30, 5) + ns_flops(20, 40, 5)
    assert plan.flops() == 2 * ns_flops(20, 40, 5)
    assert plan.padding_overhead() == pytest.approx(plan.flops() / plan.useful_flops() - 1)


def test_describe_is_readable():
    plan = plan_buckets(yolo_specs(), policy="auto")
    text = plan.describe()
    assert f"{plan.num_matrices} matrices in {len(plan.buckets)} buckets" in text
    assert "padding overhead" in text and "bucket 0: batch" in text
    assert Counter(line.startswith("  bucket") for line in text.splitlines())[True] == len(plan.buckets)


def test_bad_arguments():
    with pytest.raises(ValueError, match="unknown batching policy 'fast'"):
        plan_buckets([MatrixSpec(2, 2)], policy="fast")
    with pytest.raises(ValueError, match="max_bucket_bytes"):
        plan_buckets([MatrixSpec(2, 2)], max_bucket_bytes=0)
    with pytest.raises(ValueError, match="empty shape"):
        plan_buckets([MatrixSpec(0, 2)])


def test_cost_models_exist_for_cpu_and_cuda():
    assert COST_MODELS["cuda"].launch_seconds / COST_MODELS["cuda"].flop_seconds(torch.bfloat16) > (
        COST_MODELS["cpu"].launch_seconds / COST_MODELS["cpu"].flop_seconds(torch.bfloat16)
    )


def test_gram_chosen_for_wide_fp32_only():
    wide, square = MatrixSpec(64, 576), MatrixSpec(64, 64)
    assert plan_buckets([wide]).buckets[0].method == "gram"
    assert plan_buckets([square]).buckets[0].method == "standard"
    assert plan_buckets([MatrixSpec(64, 576, torch.bfloat16)]).buckets[0].method == "standard"
    assert plan_buckets([MatrixSpec(64, 576, method="standard")]).buckets[0].method == "standard"
    plan = plan_buckets([wide])
    assert plan.flops() < plan.baseline_flops() / 2
    assert ns_flops(64, 576, 5, "gram") == 4 * 64 * 64 * 576 + 34 * 64**3


def test_eigh_chosen_on_cpu_where_low_precision_was_requested_and_it_costs_less():
    asked_bf16 = dict(dtype=torch.float32, requested=torch.bfloat16)

    def method(spec, threads=1):
        return plan_buckets([spec], threads=threads).buckets[0].method

    assert method(MatrixSpec(384, 1152, **asked_bf16)) == "eigh"
    assert method(MatrixSpec(1152, 384, **asked_bf16)) == "eigh"  # oriented
    assert method(MatrixSpec(256, 384, **asked_bf16)) == "eigh"  # square-ish: 1.5x faster, measured
    assert method(MatrixSpec(512, 512, **asked_bf16)) == "eigh"
    assert method(MatrixSpec(384, 1152)) == "gram"  # fp32 asked: accuracy
    assert method(MatrixSpec(128, 1152, **asked_bf16)) == "gram"  # small: LAPACK's overheads dominate
    assert method(MatrixSpec(256, 256, **asked_bf16)) == "standard"  # a tie at 1 thread, measured
    assert method(MatrixSpec(256, 384, **asked_bf16), threads=16) == "standard"  # matmuls scale, eigh not
    on_gpu = MatrixSpec(384, 1152, device=torch.device("cuda"), **asked_bf16)
    assert method(on_gpu) == "gram"
    assert ns_flops(384, 1152, 5, "eigh") == 4 * 384 * 384 * 1152 + 11 * 384**3  # the nominal count


def test_eigh_cost_falls_with_size_and_rises_with_threads():
    costs = [CPU_EIGH.per_r3(r) for r in (64, 128, 256, 512, 1024)]
    assert costs == sorted(costs, reverse=True) and costs[-1] > EIGH_FLOPS_PER_R3
    assert CPU_EIGH.per_r3(256, threads=2) > CPU_EIGH.per_r3(256)
    eigh_cost = ns_cost(256, 384, 5, "eigh", eigh=CPU_EIGH)
    assert eigh_cost == 4 * 256 * 256 * 384 + (2 + CPU_EIGH.per_r3(256)) * 256**3
    assert ns_cost(256, 384, 5, "eigh") == ns_flops(256, 384, 5, "eigh")  # unpriced: nominal
    assert ns_cost(256, 384, 5, "gram", eigh=CPU_EIGH) == ns_flops(256, 384, 5, "gram")


def test_eigh_is_left_to_cost_models_that_price_it():
    asked_bf16 = MatrixSpec(384, 1152, torch.float32, requested=torch.bfloat16)
    assert COST_MODELS["cpu"].eigh is CPU_EIGH and COST_MODELS["cuda"].eigh is None
    assert plan_buckets([asked_bf16], cost_model=COST_MODELS["cuda"]).buckets[0].method == "gram"
    unpriced = CostModel(launch_seconds=15e-6)
    assert plan_buckets([asked_bf16], cost_model=unpriced).buckets[0].method == "gram"


def test_unknown_method_rejected():
    with pytest.raises(ValueError, match="unknown NS method 'fast'"):
        plan_buckets([MatrixSpec(2, 3, method="fast")])


def test_calibrated_cost_model_is_measured_and_usable():
    from fastmuon.ns.calibrate import calibrated_cost_model

    model = calibrated_cost_model("cpu", [torch.float32])
    assert 0 < model.launch_seconds < 1e-2
    assert 0 < model.flop_seconds(torch.float32) < 1e-8
    assert calibrated_cost_model("cpu", [torch.float32]) is model  # cached
    # eigendecompositions priced as measured here: dearer per R³ when small (LAPACK's overheads)
    assert model.eigh is not None and model.eigh.per_r3(64) >= model.eigh.per_r3(256) > 0
    specs = yolo_specs()
    check_invariants(plan_buckets(specs, cost_model=model), specs)


def test_optimizer_accepts_calibrate():
    from fastmuon import MuSGD

    p = torch.nn.Parameter(torch.randn(8, 16))
    opt = MuSGD([p], use_muon=True, cost_model="calibrate", ns_dtype=torch.float32)
    p.grad = torch.randn(8, 16)
    opt.step()
    assert opt.plan().num_matrices == 1
    with pytest.raises(ValueError, match="cost_model must be"):
        MuSGD([p], cost_model="guess")


@pytest.mark.parametrize("method", ["standard", "gram", "eigh"])
@pytest.mark.parametrize("steps", [1, 5])
def test_kernels_per_bucket_is_what_the_kernel_dispatches(method, steps):
    """The planner's launch count per bucket (what merging saves) matches the kernels' real op count."""
    from fastmuon.bench.counter import KernelCounter
    from fastmuon.ns.engine import ScratchArena
    from fastmuon.ns.newton_schulz import METHODS, resolve_coefficients

    schedule = resolve_coefficients("jordan", steps)
    X, out = torch.randn(3, 16, 64), torch.empty(3, 16, 64)
    scratch = ScratchArena(X.device).for_dtype(X.dtype)
    facts = dict(host=True, host_reads=True)  # an eager step on a CPU
    METHODS[method](X, schedule, 1e-7, scratch, out, **facts)  # the first call makes the scratch views
    with KernelCounter() as counter:
        METHODS[method](X, schedule, 1e-7, scratch, out, **facts)
    assert abs(counter.count - kernels_per_bucket(steps, method)) <= 2, counter.ops


def test_plan_cached_and_invalidated():
    params = make_params([(8, 16), (16, 8), (4, 4)])
    opt = fastmuon.MuSGD(params, **OPTIMIZER_KW, use_muon=True)
    run_optimizer(opt, params, make_grads(params, steps=1))
    plan = opt.plan()
    assert plan is not None and plan.num_matrices == 3
    run_optimizer(opt, params, make_grads(params, steps=1, seed=2))
    assert opt.plan() is plan  # same set of matrices: reused
    # a parameter without a gradient this step: a different plan
    run_optimizer(opt, params, [[torch.randn(8, 16), None, torch.randn(4, 4)]])
    assert opt.plan() is not plan and opt.plan().num_matrices == 2
    # adding a param group clears the cache
    extra = make_params([(5, 7)])
    opt.add_param_group({"params": extra})
    run_optimizer(opt, params + extra, make_grads(params + extra, steps=1))
    assert opt.plan().num_matrices == 4


def test_dtypes_bucketed_apart():
    params = [torch.nn.Parameter(torch.randn(8, 16)), torch.nn.Parameter(torch.randn(8, 16).double())]
    opt = fastmuon.MuSGD(params, **OPTIMIZER_KW, use_muon=True, policy="min_launches")
    run_optimizer(opt, params, make_grads(params, steps=1))
    plan = opt.plan()
    assert len(plan.buckets) == 2
    assert params[1].dtype == torch.float64
