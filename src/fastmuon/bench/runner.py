"""Run the contenders side by side: same tensors, same gradients, interleaved rounds.

Order of work per contender: ``warmup`` timed steps (state and plans get built in the first;
the last one sets how many steps a round gets within the time budget, so with one warm-up a
plan-building step would set it and leave a median of a handful of steps), one probe step
under the kernel counter and the allocation tracker and a few under the profiler for the host
time (not timed: all add overhead), then
``rounds`` rounds of ``steps`` timed steps, the contenders taking turns (A B C A B C …) so
that drifts of the machine (clock, other load) hit every contender alike. A contender with a
batching plan has its NS floor measured in the same rounds (see :mod:`.probe`): the plan's
products run back to back right before each of its steps, and each product's best time once.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from ..ns.timing import synchronize
from .contenders import (
    Contender,
    Unavailable,
    Workbench,
    dtype_label,
    dtype_name,
)
from .counter import KernelCounter
from .hosttime import cuda_activity, host_ms, python_calls
from .lineup import CLASSES, CONTENDER_LABELS, CONTENDERS
from .manifest import Manifest, materialize
from .memory import peak_extra_bytes
from .options import COMPILE_MODE
from .probe import FloorRun, matmul_rate, ns_floor_seconds

#: profiled steps per contender for its host time (not timed: the profiler adds overhead)
HOST_STEPS = 3


@dataclass
class Settings:
    optimizer: str = "musgd"
    device: str = "cpu"
    ns_dtype: torch.dtype = torch.float32
    policy: str = "auto"
    ns_method: str = "auto"
    cost_model: str = "device"
    steps: int | None = None  # None: as many as fit the budget, at most ``max_steps``
    rounds: int = 3
    warmup: int = 2
    budget_s: float = 3.0  # timed seconds per contender, all rounds together
    max_steps: int = 20
    max_step_s: float | None = (
        15.0  # skip a contender whose one step is estimated to take longer (None: no limit)
    )
    seed: int = 0
    step_mode: str = "eager"  # or "compiled": see STEP_MODES
    contenders: tuple[str, ...] | None = None  # label prefixes to run (None: the whole lineup)
    nonfinite: str | None = None  # fastmuon's rows' ``nonfinite=`` (None: the class default)


@dataclass
class Result:
    """Every figure for one contender (``skipped`` set instead when it did not run)."""

    name: str
    note: str = ""
    ns_dtype: str = "-"
    label: str = ""  # the lineup's name for the contender (lineup.CONTENDER_LABELS), e.g. "Ultralytics MuSGD"
    skipped: str | None = None
    times_ms: list[float] = field(default_factory=list)
    kernels_per_step: int | None = None
    host_ms: float | None = None  # Python time per step outside operator calls (see .hosttime)
    python_calls: int | None = None  # function calls one step makes from Python (see .hosttime)
    top_ops: dict[str, int] = field(default_factory=dict)
    ns_flops: int | None = None
    ns_useful_flops: int | None = None
    padding_overhead: float | None = None
    buckets: int | None = None
    plan: str | None = None
    state_bytes: int | None = None
    workspace_bytes: int | None = None
    peak_extra_bytes: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def median_ms(self) -> float | None:
        return statistics.median(self.times_ms) if self.times_ms else None

    def summary(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        times = self.times_ms
        d.update(
            median_ms=self.median_ms,
            min_ms=min(times) if times else None,
            max_ms=max(times) if times else None,
            steps_timed=len(times),
        )
        return d


#: (event, contender name, done, total): what the progress display is told
Progress = Callable[[str, str, int, int], None]


def selected(label: str, chosen: tuple[str, ...] | None) -> bool:
    """Is the contender called ``label`` among ``chosen`` (label prefixes, any case; None: all)?"""
    return chosen is None or any(label.lower().startswith(c.strip().lower()) for c in chosen)


def build_contenders(
    wb: Workbench, chosen: tuple[str, ...] | None = None
) -> tuple[list[Contender], list[Result]]:
    contenders, skipped = [], []
    for factory in CONTENDERS[wb.optimizer]:
        label = CONTENDER_LABELS.get(factory, factory.__name__)
        if not selected(label, chosen):
            continue
        try:
            contenders.append(factory(wb))
            contenders[-1].label = label
        except Unavailable as e:
            skipped.append(Result(label, label=label, skipped=str(e)))
        except Exception as e:  # e.g. a manifest group an optimizer rejects: report it, run the rest
            skipped.append(Result(label, label=label, skipped=f"failed to build: {type(e).__name__}: {e}"))
    return contenders, skipped


class Timer:
    """Wall time of a step: CUDA events on a GPU (after synchronising), ``perf_counter`` on a CPU."""

    def __init__(self, device: torch.device):
        self.device = device

    def time_steps(self, step: Callable[[], None], n: int) -> list[float]:
        return self.time_alternating([step], n)[0]

    def time_alternating(self, calls: Sequence[Callable[[], None]], n: int) -> list[list[float]]:
        """``n`` rounds of every call in turn (A B A B …); each call's times, in ms."""
        if self.device.type == "cuda":
            events = [
                [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in calls]
                for _ in range(n)
            ]
            torch.cuda.synchronize(self.device)
            for pairs in events:
                for call, (start, end) in zip(calls, pairs):
                    start.record()
                    call()
                    end.record()
            torch.cuda.synchronize(self.device)
            return [[pairs[k][0].elapsed_time(pairs[k][1]) for pairs in events] for k in range(len(calls))]
        times: list[list[float]] = [[] for _ in calls]
        for _ in range(n):
            for call, kept in zip(calls, times):
                t0 = time.perf_counter()
                call()
                kept.append(1e3 * (time.perf_counter() - t0))
        return times


def run_benchmark(
    manifest: Manifest, settings: Settings, progress: Progress | None = None
) -> tuple[list[Result], dict[str, Any]]:
    """Measure every contender; returns their results (in report order) and run facts."""
    progress = progress or (lambda *a: None)
    device = torch.device(settings.device)
    torch.manual_seed(settings.seed)
    params = materialize(manifest, device, settings.seed)
    grads_before = [_copy(p.grad) for p in params] if len(params) < 5000 else None
    wb = Workbench(
        manifest,
        params,
        device,
        settings.optimizer,
        settings.ns_dtype,
        settings.policy,
        settings.ns_method,
        settings.cost_model,
        settings.step_mode,
        CLASSES[settings.optimizer],
        settings.nonfinite,
    )
    contenders, unavailable = build_contenders(wb, settings.contenders)
    if settings.step_mode == "compiled":
        for c in contenders:
            compile_step(c)
    results = {
        c.name: Result(c.name, c.note, dtype_label(c), c.label, extra=dict(c.extra)) for c in contenders
    }

    rates: dict[torch.dtype, float] = {}
    for c in contenders:
        if c.compute_dtype is not None and c.ns_useful_flops and c.compute_dtype not in rates:
            rates[c.compute_dtype] = matmul_rate(device, c.compute_dtype)

    timer = Timer(device)
    active: list[tuple[Contender, int]] = []
    for c in contenders:
        r = results[c.name]
        if c.compute_dtype is not None and c.ns_useful_flops:
            rate = rates[c.compute_dtype]
            estimate = c.ns_useful_flops / rate
            if settings.max_step_s is not None and estimate > settings.max_step_s:
                r.skipped = (
                    f"one step would take ~{estimate:.0f} s ({c.ns_useful_flops / 1e9:.0f} GFLOP of NS at "
                    f"{rate / 1e9:.1f} GFLOP/s in {dtype_name(c.compute_dtype)}); "
                    "raise --max-step-seconds (0: no limit) or give --steps to run it"
                )
                continue
        progress("warmup", c.name, 0, 1)
        try:
            calibration = timer.time_steps(c.step, max(1, settings.warmup))[-1]
        except Exception as e:  # a third-party optimizer failing on this workload, or on capture
            why = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
            r.skipped = (
                f"not supported with torch.compile(mode={COMPILE_MODE!r}) of its step: {why}"
                if settings.step_mode == "compiled"
                else f"failed on its first step: {why}"
            )
            continue
        steps = settings.steps or max(
            1, min(settings.max_steps, math.floor(1e3 * settings.budget_s / (settings.rounds * calibration)))
        )
        synchronize(device)
        if settings.step_mode == "compiled":  # a dispatch mode would change what runs: not counted
            counter = None
            peak, _ = peak_extra_bytes(c.step, device)
        else:
            with KernelCounter() as counter:
                peak, _ = peak_extra_bytes(c.step, device)
        _fill_static_figures(r, c, counter, peak)
        r.host_ms = round(host_ms(c.step, HOST_STEPS), 3)
        r.python_calls = python_calls(c.step)
        if device.type == "cuda" and settings.step_mode == "eager":
            try:  # what the GPU ran, beside what fastmuon.bench.trace predicts for it
                r.extra["cuda_activity"] = cuda_activity(c.step)
            except Exception as e:  # a profiler without CUDA activity: the run goes on
                r.extra["cuda_activity"] = {"error": f"{type(e).__name__}: {e}"[:200]}
        active.append((c, steps))
        progress("ready", c.name, 1, 1)

    total = sum(steps for _, steps in active) * settings.rounds
    done = 0
    # The floors, measured next to the steps in every round so that the machine's drifts hit
    # both alike: the plan's products run back to back, timed right before each step (the
    # floor measured as a step is), and the ideal floor (each product's best time, summed).
    floor_plans = {c.name: plan for c, _ in active if (plan := c.plan()) is not None}
    floor_runs = {name: FloorRun(plan) for name, plan in floor_plans.items()}
    for run in floor_runs.values():
        run()  # warm-up: first touches of its buffers
    run_ms: dict[str, list[float]] = {name: [] for name in floor_runs}
    ideal_ms: dict[str, list[float]] = {name: [] for name in floor_runs}
    for _ in range(settings.rounds):
        for c, steps in active:
            progress("step", c.name, done, total)
            if c.name in floor_runs:
                ideal_ms[c.name].append(1e3 * ns_floor_seconds(floor_plans[c.name]))
                floor_times, step_times = timer.time_alternating([floor_runs[c.name], c.step], steps)
                run_ms[c.name] += floor_times
                results[c.name].times_ms += step_times
            else:
                results[c.name].times_ms += timer.time_steps(c.step, steps)
            done += steps
    progress("done", "", total, total)
    del floor_runs
    for name in run_ms:
        results[name].extra.update(
            ns_floor_run_ms=round(statistics.median(run_ms[name]), 3),
            ns_floor_run_ms_best=round(min(run_ms[name]), 3),
            ns_floor_ms=round(statistics.median(ideal_ms[name]), 3),
            ns_floor_ms_best=round(min(ideal_ms[name]), 3),
        )

    facts: dict[str, Any] = {
        "matmul_gflops": {dtype_name(d): round(v / 1e9, 2) for d, v in rates.items()},
        "params_finite": all(bool(torch.isfinite(p).all()) for p in params),
    }
    if grads_before is not None:
        facts["grads_unchanged"] = all(_unchanged(p.grad, g) for p, g in zip(params, grads_before))
    return [*results.values(), *unavailable], facts


def _copy(grad: Tensor | None) -> Tensor | None:
    return None if grad is None else grad.clone()


def _unchanged(now: Tensor | None, before: Tensor | None) -> bool:
    if now is None or before is None:
        return now is before
    return torch.equal(now, before)


def compile_step(c: Contender) -> None:
    """Replace ``c``'s step with ``torch.compile(step, mode=COMPILE_MODE)`` (compiled on first call)."""
    # an instance attribute shadows the method: the bench calls ``c.step``, now the compiled one
    c.step = torch.compile(c.step, mode=COMPILE_MODE)  # type: ignore[method-assign]
    c.note = f"step in torch.compile(mode={COMPILE_MODE!r}); " + c.note


def _fill_static_figures(r: Result, c: Contender, counter: KernelCounter | None, peak: int) -> None:
    if counter is not None:
        r.kernels_per_step = counter.count
        r.top_ops = dict(counter.ops.most_common(8))
    r.peak_extra_bytes = peak
    r.state_bytes = c.state_bytes()
    r.workspace_bytes = c.workspace_bytes()
    plan = c.plan()
    if plan is not None:
        r.ns_flops, r.ns_useful_flops = plan.flops(), plan.useful_flops()
        r.padding_overhead = plan.padding_overhead()
        r.buckets = len(plan.buckets)
        r.plan = plan.describe()
        r.extra["ns_baseline_flops"] = plan.baseline_flops()
    elif c.ns_useful_flops:
        r.ns_useful_flops = c.ns_useful_flops
        r.ns_flops = c.ns_flops
        r.padding_overhead = c.ns_flops / c.ns_useful_flops - 1 if c.ns_flops is not None else None
    elif c.ns_dtype is None:
        r.ns_flops = r.ns_useful_flops = 0


def speedups(results: list[Result]) -> dict[str, dict[str, float]]:
    """``out[a][b]``: how many times faster ``a``'s median step is than ``b``'s."""
    timed = [(r, m) for r in results if (m := r.median_ms)]
    return {a.name: {b.name: mb / ma for b, mb in timed if b is not a} for a, ma in timed}
