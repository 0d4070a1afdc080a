"""The bench's probes: the NS floor runs exactly the products the plan's NS computes, and the
matmul rate is measured where it is FLOP-bound."""

from __future__ import annotations

import pytest
import torch

from fastmuon.bench.gpu_cost import GpuModel
from fastmuon.bench.probe import FloorRun, floor_products, ns_floor_seconds, rate_shape
from fastmuon.ns.planner import EIGH_FLOPS_PER_R3, MatrixSpec, plan_buckets
from fastmuon.ns.timing import matmul_flops

SHAPES = [(64, 576), (64, 576), (32, 288), (48, 48), (96, 40), (16, 2304)]


def _plan(method: str, dtype: torch.dtype = torch.float32, steps: int = 5):
    specs = [MatrixSpec(r, c, dtype, method=method) for r, c in SHAPES]
    return plan_buckets(specs, policy="exact", steps=steps)


def _flops(plan) -> int:
    """FLOPs of the floor's products, counted from their shapes (eigh as the planner models it)."""
    total = 0
    for b, kind in floor_products(plan):
        n, r, c = plan.buckets[b].shape
        total += {"gram": 2 * n * r * r * c, "wide": 2 * n * r * r * c, "square": 2 * n * r**3}.get(kind, 0)
        total += EIGH_FLOPS_PER_R3 * n * r**3 if kind == "eigh" else 0
    return total


@pytest.mark.parametrize(
    "method, dtype, steps",
    [
        ("standard", torch.float32, 5),
        ("gram", torch.float32, 5),
        ("gram", torch.bfloat16, 5),  # restarts after 3 steps: two runs from a fresh A
        ("gram", torch.bfloat16, 8),  # then every 2: four runs
        ("gram", torch.bfloat16, 4),
        ("eigh", torch.float32, 5),
        ("standard", torch.float32, 1),
    ],
)
def test_floor_products_are_the_plans_flops(method, dtype, steps):
    plan = _plan(method, dtype, steps)
    assert {b.method for b in plan.buckets} == {method}
    assert _flops(plan) == plan.flops()


def test_gram_restarts_touch_x_once_per_run():
    plan = _plan("gram", torch.bfloat16)
    kinds = [k for b, k in floor_products(plan) if b == 0]
    assert kinds.count("gram") == kinds.count("wide") == 2  # runs of 3 and 2 steps
    assert kinds.count("square") == 4 * 5 - 3 * 2


def test_floor_run_calls_each_product_once_in_order(monkeypatch):
    plan = _plan("gram")
    run = FloorRun(plan)
    seen = []
    real = torch.bmm

    def counting_bmm(a, b, *, out):
        seen.append((tuple(a.shape), tuple(b.shape)))
        return real(a, b, out=out)

    monkeypatch.setattr(torch, "bmm", counting_bmm)
    FloorRun(plan)()  # partials bind torch.bmm when built: build one under the counter
    expected = []
    for b, kind in floor_products(plan):
        n, r, c = plan.buckets[b].shape
        shapes = {"gram": ((n, r, c), (n, c, r)), "square": ((n, r, r),) * 2, "wide": ((n, r, r), (n, r, c))}
        expected.append(shapes[kind])
    assert seen == expected
    run()  # the one built before runs too


def test_floor_runs_eigh_and_empty_plans():
    FloorRun(_plan("eigh"))()
    FloorRun(plan_buckets([], policy="auto"))()
    assert ns_floor_seconds(_plan("eigh"), min_seconds=0.0) > 0


def test_an_accelerators_rate_is_measured_on_a_batch_that_outlasts_its_launch():
    """On a GPU the rate sets whether a big model's step is skipped as too slow: measured on a
    batch over in less time than a launch, it would be the launch's rate, not the tensor cores'."""
    gpu = GpuModel()
    seconds = matmul_flops(*rate_shape(torch.device("cuda"))) / gpu.matmul_rate(torch.bfloat16)
    assert seconds > 10 * gpu.launch_us * 1e-6
    cpu_flops = matmul_flops(*rate_shape(torch.device("cpu")))
    assert cpu_flops / 1e11 < 0.01  # a CPU emulating bf16 (~1e11 FLOP/s at best) still takes < 10 ms
