"""Host time of a step: the Python (and other non-operator) time a step spends around its ops.

Measured with ``torch.profiler`` (CPU activity only): each step runs inside a named region;
its host time is the region's span minus the spans of its outermost operator calls (events
named ``namespace::op``, e.g. ``aten::bmm``; annotation regions such as torch's own
``Optimizer.step#…`` are looked through, not subtracted). On a GPU it is the time the CPU
spends deciding and dispatching, which the kernels cannot hide when it exceeds theirs. The
profiler adds a little to each op call, so the figure is slightly above the unprofiled time.
"""

from __future__ import annotations

import contextlib
import functools
import os
import statistics
import sys
from collections.abc import Callable, Iterator

from torch.profiler import ProfilerActivity, profile, record_function

REGION = "fastmuon.bench.step"

#: how host time is measured, in one line (for the report)
HOW = (
    "host ms/step: torch.profiler span of the step minus its outermost operator calls "
    "(aten:: and other registered ops), i.e. the Python around the ops; median of {n} profiled steps; "
    "Python calls/step: the function calls one step makes from Python (Python functions and "
    "built-ins, torch's ops among them), the same on any device"
)


def host_ms(step: Callable[[], None], steps: int = 3) -> float:
    """Median host time of ``steps`` profiled steps, in ms (one extra step first, not counted:
    the profiler's own start-up lands in it)."""

    def steps_in_regions() -> None:
        for _ in range(steps + 1):
            with record_function(REGION):
                step()

    prof = _profiled(steps_in_regions, [ProfilerActivity.CPU])
    regions = [e for e in prof.events() if e.name == REGION and e.cpu_parent is None]
    per_step = [_outside_ops_us(e) / 1e3 for e in regions[1:]]
    return statistics.median(per_step)


def python_calls(step: Callable[[], object]) -> int:
    """How many function calls one call of ``step`` makes from Python, ``step`` itself included:
    Python functions and built-ins (each torch op called from Python is one), counted with
    :func:`sys.setprofile`.

    A count, not a time: it is the same on any machine and device, while the profiler's host
    time on a CPU also holds what long kernels leave behind (cold caches, page faults). The host
    cost of a step on a GPU grows with it, and with the launches its ops make.
    """
    calls = 0

    def count(frame, event, arg):
        nonlocal calls
        if event == "call" or event == "c_call":
            calls += 1

    previous = sys.getprofile()
    sys.setprofile(count)
    try:
        step()
    finally:
        sys.setprofile(previous)
    return calls - 1  # the profiler's own removal is reported as a call of setprofile


def _profiled(run: Callable[[], object], activities: list[ProfilerActivity]) -> profile:
    """The profiler after one call of ``run`` under it (its back end logs its start and stop on
    the native stderr, silenced)."""
    # one cycle only, so keeping events "across cycles" changes nothing; it keeps torch 2.11 from
    # warning, on the first start, that a new cycle would clear them
    prof = profile(activities=activities, acc_events=True)
    with _native_stderr_silenced():
        prof.start()
    try:
        run()
    finally:
        with _native_stderr_silenced():
            prof.stop()
    return prof


@contextlib.contextmanager
def _native_stderr_silenced() -> Iterator[None]:
    """File descriptor 2 to /dev/null for the duration (C++ logging bypasses ``sys.stderr``)."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _outside_ops_us(region) -> float:
    """The region's span less the spans of its outermost operator calls, in µs."""
    return region.cpu_time_total - sum(op.cpu_time_total for op in _outermost_ops(region))


def _outermost_ops(event):
    for child in event.cpu_children:
        if "::" in child.name:
            yield child
        else:  # an annotation region (e.g. torch's "Optimizer.step#SGD.step"): look inside
            yield from _outermost_ops(child)


#: ATen ops that copy a device value to the host and so make the host wait for the device.
SYNC_OPS = frozenset(
    {
        "aten::_local_scalar_dense",
        "aten::item",
        "aten::is_nonzero",
        "aten::equal",
        "aten::allclose",
        "aten::nonzero",
    }
)


def host_syncs(step: Callable[[], object]) -> dict[str, int]:
    """The host-synchronising ops one call of ``step`` dispatches (name -> count; empty: none).

    On a CPU nothing waits, but the same calls on a GPU would: a step that makes none here is
    sync-free there too (``Tensor.tolist`` reads memory without dispatching an op; check it apart).
    """
    counts: dict[str, int] = {}
    for event in _profiled(step, [ProfilerActivity.CPU]).events():
        if event.name in SYNC_OPS:
            counts[event.name] = counts.get(event.name, 0) + 1
    return counts


#: CUDA runtime calls that make the host wait for the device
WAITS = frozenset({"cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize"})
#: the wait for one event: what reading a previous step's flags makes (:mod:`fastmuon.step.deferred`)
EVENT_WAIT = "cudaEventSynchronize"
#: CUDA runtime calls that launch a kernel
LAUNCHES = frozenset({"cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx"})


def cuda_activity(step: Callable[[], object]) -> dict[str, int]:
    """What one call of ``step`` made a GPU do, from ``torch.profiler``'s CUDA activity: the
    measured counterpart of :mod:`.trace`'s figures (see :func:`count_activity`). Host waits are
    those beyond the profiler's own: the ones it makes around a call that does nothing."""
    counts = count_activity(_profiled(step, _CUDA_ACTIVITIES).events())
    own = _profilers_own_activity()
    for key in ("syncs", "event_waits"):
        counts[key] = max(0, counts[key] - own[key])
    return counts


_CUDA_ACTIVITIES = [ProfilerActivity.CPU, ProfilerActivity.CUDA]


@functools.cache
def _profilers_own_activity() -> dict[str, int]:
    """What the profiler counts around a call that does nothing (measured once per process)."""
    return count_activity(_profiled(lambda: None, _CUDA_ACTIVITIES).events())


def count_activity(events) -> dict[str, int]:
    """Kernels and memory copies/sets the device ran, kernel launches the host made, and host
    waits (``cudaStreamSynchronize`` and the like: a blocking copy or ``.item()`` makes one);
    ``event_waits``: those of the waits that wait for an event (``cudaEventSynchronize``)."""
    from torch.autograd import DeviceType

    counts = {"kernels": 0, "memcpy": 0, "launches": 0, "syncs": 0, "event_waits": 0}
    for e in events:
        if e.device_type == DeviceType.CUDA:
            counts["memcpy" if e.name.startswith(("Memcpy", "Memset")) else "kernels"] += 1
        elif e.name in LAUNCHES:
            counts["launches"] += 1
        elif e.name in WAITS:
            counts["syncs"] += 1
            counts["event_waits"] += e.name == EVENT_WAIT
    return counts


def _run_cli() -> None:  # pragma: no cover - a measuring tool, run by hand
    import argparse
    import time

    import torch

    from .contenders import Workbench, fastmuon_contender
    from .lineup import CLASSES
    from .manifest import materialize
    from .workloads import resolve_workload

    parser = argparse.ArgumentParser(description="Host time of fastmuon's step on a bench workload.")
    parser.add_argument("--model", default="yolo26n")
    parser.add_argument("--optimizer", default="musgd", choices=("musgd", "muon"))
    parser.add_argument("--cost-model", default="device", choices=("device", "cpu", "cuda"))
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    manifest = resolve_workload(args.model)
    params = materialize(manifest, torch.device("cpu"), seed=0)
    wb = Workbench(
        manifest,
        params,
        torch.device("cpu"),
        args.optimizer,
        torch.bfloat16,
        "auto",
        cost_model=args.cost_model,
        fastmuon=CLASSES[args.optimizer],
    )
    contender = fastmuon_contender(wb)
    contender.step()  # builds the plan and the step program
    walls = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        contender.step()
        walls.append(time.perf_counter() - t0)
    host = host_ms(contender.step, args.steps)
    calls = python_calls(contender.step)
    print(
        f"{contender.name} on {args.model} (cost model {args.cost_model}): host {host:.2f} ms/step, "
        f"{calls} Python calls/step, wall {statistics.median(walls) * 1e3:.1f} ms/step "
        f"(medians of {args.steps})"
    )


if __name__ == "__main__":  # pragma: no cover
    _run_cli()
