"""Count the ATen ops a step dispatches: on a GPU each one is (at least) a kernel launch.

Views and allocations are left out: they change metadata or reserve memory but launch no
kernel, and counting them would reward code that merely reshapes less. So are the profiler's
``record_function`` markers that ``torch.optim`` emits around each step.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

#: Ops that only reserve memory or touch metadata (no kernel runs), besides the view ops.
NON_KERNEL_OPS = frozenset(
    {
        aten.empty.memory_format,
        aten.empty_like.default,
        aten.empty_strided.default,
        aten.new_empty.default,
        aten.new_empty_strided.default,
        aten.resize_.default,
        aten.set_.source_Storage,
        aten.set_.source_Storage_storage_offset,
        aten.set_.source_Tensor,
        aten.lift_fresh.default,
    }
)


def is_kernel(func: torch._ops.OpOverload) -> bool:
    """Whether dispatching ``func`` runs a kernel (not a view, not a bare allocation)."""
    return not func.is_view and func not in NON_KERNEL_OPS and func.namespace != "profiler"


class KernelCounter(TorchDispatchMode):
    """``with KernelCounter() as kc: step()`` leaves ``kc.count`` and ``kc.ops`` (op name -> count)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if is_kernel(func):
            self.count += 1
            self.ops[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))
