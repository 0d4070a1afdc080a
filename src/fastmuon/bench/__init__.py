"""``fastmuon bench``: fastmuon against the optimizers you would otherwise use, on one machine.

Public pieces for benchmarking your own model::

    from fastmuon.bench import manifest_from_module, run_benchmark, Settings
    manifest_from_module(model).save("my_model.json")   # then: fastmuon bench --model my_model.json
"""

from .counter import KernelCounter
from .manifest import Manifest, ManifestError, ParamSpec, load_manifest, manifest_from_module
from .memory import AllocationTracker
from .runner import Result, Settings, run_benchmark, speedups
from .workloads import WORKLOADS, resolve_workload

__all__ = [
    "AllocationTracker",
    "KernelCounter",
    "Manifest",
    "ManifestError",
    "ParamSpec",
    "Result",
    "Settings",
    "WORKLOADS",
    "load_manifest",
    "manifest_from_module",
    "resolve_workload",
    "run_benchmark",
    "speedups",
]
