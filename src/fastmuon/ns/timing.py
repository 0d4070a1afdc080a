"""Timing on a device, in one place so that every measurement times alike: the planner's
calibration, the CPU's native-bf16 check where its flags cannot be read, and the benchmark's probes.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def synchronize(device: torch.device | str) -> None:
    """Wait for the device's queued work (a no-op on a CPU): what every timing here needs."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(fn: Callable[[], object], device: torch.device, rounds: int, per_round: int) -> float:
    """Median over ``rounds`` of the mean time of ``per_round`` calls (after one warm-up call)."""
    fn()
    synchronize(device)
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(per_round):
            fn()
        synchronize(device)
        times.append((time.perf_counter() - start) / per_round)
    return statistics.median(times)


def best_seconds(
    fn: Callable[[], object], device: torch.device, min_seconds: float, min_repeats: int = 3
) -> float:
    """Best time of ``fn()`` over >= ``min_repeats`` calls and >= ``min_seconds`` (after a warm-up)."""
    fn()
    synchronize(device)
    best, spent, repeats = float("inf"), 0.0, 0
    while spent < min_seconds or repeats < min_repeats:
        repeats += 1
        start = time.perf_counter()
        fn()
        synchronize(device)
        elapsed = time.perf_counter() - start
        best, spent = min(best, elapsed), spent + elapsed
    return best


def matmul_flops(batch: int, rows: int, cols: int) -> int:
    """The FLOPs of the product :func:`matmul_seconds` times."""
    return 2 * batch * rows * rows * cols


def matmul_seconds(
    batch: int,
    rows: int,
    cols: int,
    dtype: torch.dtype,
    device: torch.device | str,
    *,
    rounds: int = 5,
    per_round: int = 1,
) -> float:
    """Median seconds of one ``baddbmm(X, A, X)`` in ``dtype``, ``X`` of shape ``(batch, rows,
    cols)`` and ``A`` of ``(batch, rows, rows)``: the product NS spends its FLOPs on, one launch."""
    device = torch.device(device)
    x = torch.randn(batch, rows, cols, device=device).to(dtype)
    a = torch.randn(batch, rows, rows, device=device).to(dtype)
    return median_seconds(lambda: torch.baddbmm(x, a, x, beta=0.5), device, rounds, per_round)
