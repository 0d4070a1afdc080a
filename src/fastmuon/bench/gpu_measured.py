"""What a step costs on the GPU, measured, beside what the trace on fake tensors predicted.

Per workload (:func:`.gpu_parts.workloads`), in one process: fastmuon's step is first traced
on fake cuda tensors (:func:`.trace.trace_lineup`, the bench's default options), then built
alike on the device and stepped: after two steps (the trace's figures are its third), the
allocator's peak over one step less what was allocated before it is the *measured peak extra*,
set beside the trace's ``peak_extra_bytes``. Host syncs are counted two ways: the warnings of
``torch.cuda.set_sync_debug_mode("warn")`` (blocking copies, ``.item()``, synchronize calls)
and the profiler's host waits (``cudaStreamSynchronize``, ``cudaEventSynchronize``, …).

Bytes moved cannot be measured without a profiler of DRAM traffic: the trace's modelled time
(a roofline over its bytes and FLOPs, labelled "modelled") is shown beside the measured step
time (CUDA events) instead, and beside the same steps with ``nonfinite="ignore"`` (what the
default's masking and its wait for the previous step's flags cost in a loop of steps alone).
The machine's own rates are measured once (:func:`machine_rates`): the wall time of a launch
when the host launches tiny kernels back to back, which the model takes as 4 µs, and the bf16
matmul rate.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .gpu_shared import (
    Recorder,
    Workload,
    bench_workbench,
    device_ms,
    device_params,
    sync_warnings,
    workloads,
)

if TYPE_CHECKING:
    from .contenders import Contender

#: the steps before the measured one: the trace counts its third step
WARMUP = 2
#: above this many parameter elements, fewer steps are timed (Llama's layers: a step is NS-bound)
LARGE_NUMEL = 100_000_000


@dataclass
class StepCost:
    """One workload's step: predicted by the trace, measured on the device (None: not there)."""

    workload: str
    optimizer: str
    ns_dtype: str
    predicted_peak_extra_bytes: int | None = None
    measured_peak_extra_bytes: int | None = None
    predicted_host_syncs: int | None = None
    measured_sync_warnings: int | None = None  # set_sync_debug_mode("warn") over one step
    measured_sync_sites: list[str] | None = None  # the line that made each of them, file:line
    measured_host_waits: int | None = None  # the profiler's host waits over one step, its own left out
    measured_event_waits: int | None = None  # of them, waits for an event (the previous step's flags)
    modelled_ms: float | None = None  # the trace's roofline: modelled, not measured
    measured_ms: float | None = None  # CUDA events, mean over the timed steps
    measured_ms_ignore: float | None = None  # the same with nonfinite="ignore": no masking, no flags
    timed_steps: int | None = None
    modelled_bytes_moved: int | None = None
    state_bytes: int | None = None
    trace_problem: str | None = None  # why there is no prediction
    measured_problem: str | None = None  # why there is no measurement


def memory(rec: Recorder) -> None:
    rec.note(
        "memory",
        "predicted: fastmuon.bench.trace on fake cuda tensors (the bench's default options, NS in bf16), "
        "its third step; measured: the same step built on the device, after "
        f"{WARMUP} steps, torch.cuda.max_memory_allocated over one step less memory_allocated before it. "
        "Bytes moved are not measured (that needs a profiler of DRAM traffic): the trace's modelled "
        "time stands beside the measured ms/step instead",
    )
    if rec.on_cuda:
        rec.attempt("machine", "rates", lambda: rec.add("machine", machine_rates(rec.device)))
    for workload in workloads(rec.quick):
        rec.attempt("workloads", workload.name, functools.partial(_add_step_cost, rec, workload))


@dataclass
class MachineRates:
    """What the model's constants are on this machine (:class:`.gpu_cost.GpuModel`: 4 µs a
    launch, 790 TFLOP/s bf16)."""

    launch_us: float  # wall µs per launch, tiny kernels launched back to back from Python
    bf16_tflops: float  # :func:`.probe.matmul_rate`, a FLOP-bound batch


#: tiny kernels timed back to back for :attr:`MachineRates.launch_us`
LAUNCHES = 2000


def machine_rates(device: torch.device) -> MachineRates:
    from .probe import matmul_rate

    x = torch.zeros(1, device=device)
    launch_ms = device_ms(lambda: x.add_(1.0), LAUNCHES, device)
    return MachineRates(round(launch_ms * 1e3, 2), round(matmul_rate(device, torch.bfloat16) / 1e12, 1))


def _add_step_cost(rec: Recorder, workload: Workload) -> None:
    rec.add("workloads", step_cost(rec, workload))


def step_cost(rec: Recorder, workload: Workload) -> StepCost:
    cost = StepCost(workload.name, workload.optimizer, "bfloat16")
    _predict(cost, workload)
    if rec.on_cuda:
        _measure(cost, workload, rec.device, steps=3 if rec.quick else _timed_steps(workload))
    else:
        cost.measured_problem = "the allocator's counters and CUDA events need a CUDA device"
    return cost


def _timed_steps(workload: Workload) -> int:
    return 3 if workload.manifest.numel() > LARGE_NUMEL else 10


def _predict(cost: StepCost, workload: Workload) -> None:
    from .contenders import fastmuon_contender
    from .fake_cuda import fake_cuda_problem
    from .manifest import materialize
    from .trace import trace_lineup

    problem = fake_cuda_problem()
    if problem:
        cost.trace_problem = problem
        return
    cuda = torch.device("cuda")
    [trace] = trace_lineup(
        lambda: bench_workbench(
            workload.manifest,
            materialize(workload.manifest, cuda, 0),
            cuda,
            workload.optimizer,
            torch.bfloat16,
        ),
        [("fastmuon", fastmuon_contender)],
    )
    if trace.error:
        cost.trace_problem = trace.error
        return
    cost.predicted_peak_extra_bytes, cost.predicted_host_syncs = trace.peak_extra_bytes, trace.host_syncs
    cost.modelled_ms, cost.modelled_bytes_moved = trace.modelled_ms, trace.bytes_moved
    cost.state_bytes = trace.state_bytes


def _measure(cost: StepCost, workload: Workload, device: torch.device, steps: int) -> None:
    params = device_params(workload.manifest, device, seed=0)
    try:
        _measure_default(cost, workload, params, device, steps)
        cost.measured_ms_ignore = round(_step_ms(workload, params, device, steps, nonfinite="ignore"), 4)
    finally:
        del params
        torch.cuda.empty_cache()


def _measure_default(
    cost: StepCost, workload: Workload, params: list[torch.nn.Parameter], device: torch.device, steps: int
) -> None:
    """The default step's peak extra memory, host syncs and ms/step."""
    from .hosttime import cuda_activity

    contender = _warmed(workload, params, device)
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    contender.step()
    torch.cuda.synchronize(device)
    cost.measured_peak_extra_bytes = torch.cuda.max_memory_allocated(device) - before
    cost.measured_sync_sites = sync_warnings(contender.step, device)
    cost.measured_sync_warnings = len(cost.measured_sync_sites)
    activity = cuda_activity(contender.step)
    cost.measured_host_waits, cost.measured_event_waits = activity["syncs"], activity["event_waits"]
    cost.measured_ms = round(device_ms(contender.step, steps, device), 4)
    cost.timed_steps = steps


def _step_ms(
    workload: Workload, params: list[torch.nn.Parameter], device: torch.device, steps: int, **options: str
) -> float:
    """ms/step of fastmuon's step with ``options`` (e.g. ``nonfinite``), after the warm-up steps."""
    return device_ms(_warmed(workload, params, device, **options).step, steps, device)


def _warmed(
    workload: Workload, params: list[torch.nn.Parameter], device: torch.device, **options: str
) -> Contender:
    """fastmuon's contender on ``params`` with the bench's options (and ``options``), after
    :data:`WARMUP` steps."""
    from .contenders import fastmuon_contender

    contender = fastmuon_contender(
        bench_workbench(workload.manifest, params, device, workload.optimizer, torch.bfloat16, **options)
    )
    for _ in range(WARMUP):
        contender.step()
    return contender
