"""Quick measurements of the machine that the benchmark's choices and estimates rest on."""

from __future__ import annotations

import time

import torch

from ..compute import compute_dtype, synchronize
from ..planner import Plan

_RATES: dict[tuple[str, torch.dtype], float] = {}


def matmul_rate(device: torch.device, dtype: torch.dtype, min_seconds: float = 0.05) -> float:
    """FLOP/s of one Newton–Schulz iteration on a (4, 128, 512) batch in ``dtype`` (measured once).

    Small enough to finish in a fraction of a second even where a dtype is emulated (bf16 on a
    CPU without bf16 instructions runs ~100x slower than fp32), large enough to be FLOP-bound.
    """
    key = (str(device), dtype)
    if key not in _RATES:
        _RATES[key] = _measure_rate(device, dtype, min_seconds)
    return _RATES[key]


def _measure_rate(device: torch.device, dtype: torch.dtype, min_seconds: float) -> float:
    b, r, c = 4, 128, 512
    X = torch.randn(b, r, c, device=device).to(dtype) / c**0.5

    def iteration():
        A = torch.bmm(X, X.mT)
        B = torch.baddbmm(A, A, A, beta=-4.775, alpha=2.0315)
        return torch.baddbmm(X, B, X, beta=3.4445)

    iteration()  # warm-up
    synchronize(device)
    reps, start = 0, time.perf_counter()
    while True:
        iteration()
        reps += 1
        synchronize(device)
        elapsed = time.perf_counter() - start
        if elapsed >= min_seconds or (reps >= 1 and elapsed > 10 * min_seconds):
            break
    flops = b * (4 * r * r * c + 2 * r * r * r)
    return reps * flops / elapsed


def ns_floor_seconds(plan: Plan, min_seconds: float = 0.01) -> float:
    """Our own floor for a step's NS: every matrix product the plan's buckets perform, each
    timed as a bare ``bmm`` at its own shape on this machine (and the eigendecompositions of
    ``method="eigh"`` buckets, timed alone likewise), added up. What a step costs
    beyond it is normalisation, packing, the elementwise work and Python."""
    total = 0.0
    for bucket in plan.buckets:
        b, r, c = bucket.shape
        X = torch.randn(bucket.shape, device=bucket.device).to(bucket.dtype)
        A = torch.randn(b, r, r, device=bucket.device).to(bucket.dtype)
        gram_xt, small, wide = (
            _seconds(X, X.mT, min_seconds),
            _seconds(A, A, min_seconds),
            _seconds(A, X, min_seconds),
        )
        steps = plan.steps
        if bucket.method == "eigh":  # X·Xᵀ, the eigendecomposition, V·h·Vᵀ and Q·X
            total += gram_xt + _eigh_seconds(X, min_seconds) + small + wide
        elif bucket.method == "gram":  # X·Xᵀ and Q·X once, then R×R products only
            total += gram_xt + wide + (4 * steps - 3) * small
        else:  # X·Xᵀ, A·A, B·X every step
            total += steps * (gram_xt + small + wide)
    return total


def _seconds(left: torch.Tensor, right: torch.Tensor, min_seconds: float) -> float:
    """Best time of ``bmm(left, right)`` into a kept output (as the engine runs them: a fresh
    85 MB output page-faults in every call) over repeats filling ``min_seconds``."""
    out = torch.empty(left.size(0), left.size(1), right.size(2), dtype=left.dtype, device=left.device)
    return _best_seconds(lambda: torch.bmm(left, right, out=out), left.device, min_seconds)


def _best_seconds(run, device: torch.device, min_seconds: float, min_repeats: int = 3) -> float:
    """Best time of ``run()`` over at least ``min_repeats`` repeats, and ``min_seconds`` of them."""
    run()
    synchronize(device)
    best, spent, repeats = float("inf"), 0.0, 0
    while spent < min_seconds or repeats < min_repeats:
        repeats += 1
        start = time.perf_counter()
        run()
        synchronize(device)
        elapsed = time.perf_counter() - start
        best, spent = min(best, elapsed), spent + elapsed
    return best


def _eigh_seconds(X: torch.Tensor, min_seconds: float) -> float:
    """Best time of ``eigh`` on the Gram matrices of ``X`` (in fp32 at least, as the kernel runs it)."""
    S = X.float() @ X.float().mT
    S = S.double() if X.dtype == torch.float64 else S
    return _best_seconds(lambda: torch.linalg.eigh(S), S.device, min_seconds)


def choose_ns_dtype(device: torch.device) -> tuple[torch.dtype, str]:
    """``--ns-dtype auto``: the optimizers' default, bfloat16, unless on this CPU it would really
    run in emulated bf16 (native mode forced) and float32 multiplies faster."""
    if device.type != "cpu":
        return torch.bfloat16, "bfloat16 on an accelerator"
    computed = compute_dtype(torch.bfloat16, device)
    if computed != torch.bfloat16:
        return torch.bfloat16, (
            "the optimizers' default; this CPU has no native bf16 matmul, so fastmuon runs its NS "
            f"in {str(computed).removeprefix('torch.')} (see fastmuon.compute)"
        )
    bf16 = matmul_rate(device, torch.bfloat16)
    fp32 = matmul_rate(device, torch.float32)
    chosen = torch.bfloat16 if bf16 >= fp32 else torch.float32
    why = f"CPU batched matmul: bfloat16 {bf16 / 1e9:.1f} GFLOP/s, float32 {fp32 / 1e9:.1f} GFLOP/s"
    return chosen, why
