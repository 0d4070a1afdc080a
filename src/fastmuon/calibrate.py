"""Measure the planner's cost constants on this machine instead of assuming them.

Two numbers decide whether padding two groups into one bucket pays: the time one more kernel
costs and the time one more FLOP costs. Both are measured once per (device, dtypes, threads)
and cached; a few hundred milliseconds on a CPU, less on a GPU. What an eigendecomposition
costs against matmuls is kept from the device type's built-in model (``planner.CPU_EIGH``).
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Iterable

import torch

from .compute import synchronize
from .planner import COST_MODELS, CostModel


def calibrated_cost_model(device: torch.device | str, dtypes: Iterable[torch.dtype]) -> CostModel:
    """A :class:`CostModel` for ``device`` from timings of a tiny op and of NS-shaped ``bmm``."""
    device = torch.device(device)
    return _calibrate(device, tuple(sorted(set(dtypes), key=str)), torch.get_num_threads())


@functools.cache
def _calibrate(device: torch.device, dtypes: tuple[torch.dtype, ...], threads: int) -> CostModel:
    del threads  # part of the cache key
    fallback = COST_MODELS.get(device.type, COST_MODELS["cuda"])
    tiny = torch.zeros(1, device=device)
    launch = _median_seconds(lambda: tiny.add_(1.0), device, rounds=5, per_round=40)
    per_flop = {}
    for dtype in dtypes:
        b, r, c = 8, 128, 512
        x = torch.randn(b, r, c, device=device).to(dtype)
        a = torch.randn(b, r, r, device=device).to(dtype)
        seconds = _median_seconds(lambda x=x, a=a: torch.baddbmm(x, a, x, beta=0.5), device, 5, 1)
        per_flop[dtype] = max(seconds - launch, 1e-9) / (2 * b * r * r * c)
    return CostModel(launch, per_flop, fallback.default_seconds_per_flop, fallback.eigh)


def _median_seconds(fn, device: torch.device, rounds: int, per_round: int) -> float:
    """Median over ``rounds`` of the mean time of ``per_round`` back-to-back calls."""
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
