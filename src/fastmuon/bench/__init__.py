"""``fastmuon bench``: fastmuon against the optimizers you would otherwise use, on one machine.

Public pieces for benchmarking your own model::

    from fastmuon.bench import manifest_from_module, run_benchmark, Settings
    manifest_from_module(model).save("my_model.json")   # then: fastmuon bench --model my_model.json
"""

from __future__ import annotations

import importlib
from typing import Any

#: each public name -> the module that defines it, imported on first use: importing the package
#: then loads none of them, so ``python -m fastmuon.bench.hosttime`` (or any of its modules) runs
#: that module once, as ``__main__``, rather than beside a copy the package had imported
_PUBLIC = {
    "KernelCounter": "counter",
    "fake_cuda_problem": "fake_cuda",
    "GpuModel": "gpu_cost",
    "Trace": "trace",
    "TraceCounter": "trace",
    "trace_contender": "trace",
    "trace_step": "trace",
    "Manifest": "manifest",
    "ManifestError": "manifest",
    "ParamSpec": "manifest",
    "load_manifest": "manifest",
    "manifest_from_module": "manifest",
    "AllocationTracker": "memory",
    "Result": "runner",
    "Settings": "runner",
    "run_benchmark": "runner",
    "speedups": "runner",
    "WORKLOADS": "workloads",
    "resolve_workload": "workloads",
}


def __getattr__(name: str) -> Any:
    if name not in _PUBLIC:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_PUBLIC[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_PUBLIC})


__all__ = [
    "AllocationTracker",
    "GpuModel",
    "KernelCounter",
    "Trace",
    "TraceCounter",
    "Manifest",
    "ManifestError",
    "ParamSpec",
    "Result",
    "Settings",
    "WORKLOADS",
    "fake_cuda_problem",
    "load_manifest",
    "manifest_from_module",
    "resolve_workload",
    "run_benchmark",
    "speedups",
    "trace_contender",
    "trace_step",
]
