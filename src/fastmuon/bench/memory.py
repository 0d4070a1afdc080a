"""Peak memory a step allocates on top of what already existed.

On CUDA the caching allocator keeps the books (``max_memory_allocated``). On a CPU there is no
such counter, so :class:`AllocationTracker` watches every tensor the step's ops return: a
result whose storage is new adds its bytes while any tensor (the result or a later view of it)
still refers to that storage; the largest running total is the step's peak.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class AllocationTracker(TorchDispatchMode):
    """``with AllocationTracker() as mem: step()`` leaves ``mem.peak_bytes`` and ``mem.retained_bytes``.

    ``retained_bytes`` is what the step allocated and still holds afterwards (e.g. state created
    on a first step, or persistent workspaces); ``peak_bytes`` is the high-water mark.
    """

    def __init__(self) -> None:
        super().__init__()
        self.live_bytes = 0
        self.peak_bytes = 0
        self._storages: dict[int, list[int]] = {}  # storage data_ptr -> [nbytes, live tensor refs]
        self._known: set[int] = set()

    def __enter__(self):
        self.live_bytes = self.peak_bytes = 0
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = {_storage_key(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        out = func(*args, **kwargs)
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self._track(t, inputs)
        return out

    def _track(self, t: torch.Tensor, inputs: set[int]) -> None:
        key = _storage_key(t)
        entry = self._storages.get(key)
        if entry is None:
            if key in inputs or key == 0:
                return  # an in-place result or a view of memory that predates the step
            entry = self._storages[key] = [t.untyped_storage().nbytes(), 0]
            self.live_bytes += entry[0]
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        entry[1] += 1
        weakref.finalize(t, self._release, key)

    def _release(self, key: int) -> None:
        entry = self._storages.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            self.live_bytes -= entry[0]
            del self._storages[key]

    @property
    def retained_bytes(self) -> int:
        return self.live_bytes


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def peak_extra_bytes(step: Callable[[], object], device: torch.device) -> tuple[int, int]:
    """(peak, retained) bytes that one call of ``step`` allocates beyond what was live before it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        step()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before, torch.cuda.memory_allocated(device) - before
    with AllocationTracker() as mem:
        step()
    return mem.peak_bytes, mem.retained_bytes
