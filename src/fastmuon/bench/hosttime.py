"""Host time of an optimizer step: the Python it runs outside ATen ops, and the host syncs it makes.

On a GPU a step whose kernels are queued faster than they run costs what its kernels cost; one
whose Python takes longer than its kernels costs its Python. The profiler separates the two on
any device: the self time of the ``Optimizer.step#...`` range that ``torch.optim`` records
around every step is the time spent in that range outside the ATen ops it called.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch
from torch.profiler import ProfilerActivity, profile

#: ATen ops that copy a device value to the host and so make the host wait for the device.
SYNC_OPS = frozenset(
    {
        "aten::_local_scalar_dense",
        "aten::item",
        "aten::is_nonzero",
        "aten::equal",
        "aten::allclose",
        "aten::nonzero",
        "aten::tolist",
    }
)


def python_self_times(step: Callable[[], object], steps: int = 10) -> list[float]:
    """Per step, the seconds ``step`` spent in Python outside ATen ops (self CPU time of the
    ``Optimizer.step`` ranges it recorded; one range per optimizer stepped)."""
    times = []
    for _ in range(steps):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            step()
        self_us = sum(
            e.self_cpu_time_total for e in prof.key_averages() if e.key.startswith("Optimizer.step#")
        )
        times.append(self_us / 1e6)
    return times


def python_self_time(step: Callable[[], object], steps: int = 10) -> float:
    """The median of :func:`python_self_times`, in seconds."""
    return statistics.median(python_self_times(step, steps))


def host_syncs(step: Callable[[], object]) -> dict[str, int]:
    """The host-synchronising ops one call of ``step`` dispatches (name -> count; empty: none)."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    counts: dict[str, int] = {}
    for event in prof.events():
        if event.name in SYNC_OPS:
            counts[event.name] = counts.get(event.name, 0) + 1
    return counts


def _run_cli() -> None:  # pragma: no cover - a measuring tool, run by hand
    import argparse
    import time

    from .contenders import Workbench, fastmuon_contender
    from .runner import materialize
    from .workloads import resolve_workload

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="yolo26n")
    parser.add_argument("--optimizer", default="musgd", choices=("musgd", "muon"))
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    manifest = resolve_workload(args.model)
    params = materialize(manifest, torch.device("cpu"), seed=0)
    wb = Workbench(manifest, params, torch.device("cpu"), args.optimizer, torch.bfloat16, "auto")
    contender = fastmuon_contender(wb)
    contender.step()  # builds the plan
    walls = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        contender.step()
        walls.append(time.perf_counter() - t0)
    host = python_self_time(contender.step, args.steps)
    print(
        f"{contender.name} on {args.model}: Python self time {host * 1e3:.2f} ms/step, "
        f"wall {statistics.median(walls) * 1e3:.1f} ms/step (medians of {args.steps})"
    )


if __name__ == "__main__":  # pragma: no cover
    _run_cli()
