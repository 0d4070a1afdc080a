"""Measure the planner's cost constants on this machine: the time one more kernel and one more
FLOP cost (and eigendecompositions where the model prices them), once per (device, dtypes,
threads), cached. On a CPU fp32 is always measured (bf16 may run in it, ``device.wider_dtype``),
and a low-precision kernel's fixed cost beyond an fp32 one's is added to its launches.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

import torch

from .planner import CostModel, EighCost, default_cost_model
from .timing import matmul_flops, matmul_seconds, median_seconds


def calibrated_cost_model(device: torch.device | str, dtypes: Iterable[torch.dtype]) -> CostModel:
    """A :class:`CostModel` for ``device`` from timings of a tiny op and of NS-shaped ``bmm``."""
    device = torch.device(device)
    dtypes = set(dtypes) | ({torch.float32} if device.type == "cpu" else set())
    return _calibrate(device, tuple(sorted(dtypes, key=str)), torch.get_num_threads())


@functools.cache
def _calibrate(device: torch.device, dtypes: tuple[torch.dtype, ...], threads: int) -> CostModel:
    del threads  # part of the cache key
    fallback = default_cost_model(device)
    tiny = torch.zeros(1, device=device)
    launch = median_seconds(lambda: tiny.add_(1.0), device, rounds=5, per_round=40)
    per_flop = {}
    for dtype in dtypes:
        per_flop[dtype] = _per_flop(device, dtype, launch)
    launches = {}
    if device.type == "cpu":
        fp32_matmul = _tiny_matmul_seconds(device, torch.float32)
        for dtype in set(dtypes) & {torch.bfloat16, torch.float16}:
            launches[dtype] = launch + max(_tiny_matmul_seconds(device, dtype) - fp32_matmul, 0.0)
    eigh = _eigh_cost(device) if fallback.eigh is not None else None  # fp32, whatever NS's dtype
    return CostModel(
        launch,
        per_flop,
        fallback.default_seconds_per_flop,
        eigh,
        launches,
        fallback.low_precision_gram,
        fallback.gram_weighs_launches,
    )


def _tiny_matmul_seconds(device: torch.device, dtype: torch.dtype) -> float:
    """A matmul too small to cost FLOPs: what one kernel in ``dtype`` costs whatever its size."""
    a = torch.randn(2, 16, 16, device=device).to(dtype)
    out = torch.empty_like(a)
    return median_seconds(lambda: torch.baddbmm(a, a, a, beta=0.5, out=out), device, rounds=5, per_round=20)


def _per_flop(device: torch.device, dtype: torch.dtype, launch: float) -> float:
    b, r, c = 8, 128, 512
    seconds = matmul_seconds(b, r, c, dtype, device, rounds=5, per_round=1)
    return max(seconds - launch, 1e-9) / matmul_flops(b, r, c)


def _eigh_cost(device: torch.device, sizes: tuple[int, int] = (64, 256)) -> EighCost:
    """``(base + per_inverse_row / R)`` fitted through ``eigh`` timed at two sizes, each in FLOPs
    of ``bmm`` of the same size per ``R³`` (as ``planner.CPU_EIGH`` was measured; at this thread
    count, so no thread exponent); a constant where the two points do not fit that form (noise)."""
    per_r3 = {}
    for r in sizes:
        x = torch.randn(r, 2 * r, device=device)
        spd = x @ x.mT / (2 * r)
        a, out = torch.randn(4, r, r, device=device), torch.empty(4, r, r, device=device)
        eigh = median_seconds(functools.partial(torch.linalg.eigh, spd), device, rounds=3, per_round=1)
        bmm = median_seconds(functools.partial(torch.bmm, a, a, out=out), device, rounds=3, per_round=2)
        per_r3[r] = eigh / (bmm / (4 * 2 * r**3)) / r**3  # eigh in FLOPs of that bmm (4·2r³), per r³
    small, large = sizes
    per_inverse_row = (per_r3[small] - per_r3[large]) / (1 / small - 1 / large)
    base = per_r3[large] - per_inverse_row / large
    if per_inverse_row < 0 or base < 0:
        return EighCost(max(per_r3.values()), 0.0)
    return EighCost(base, per_inverse_row)
