"""Collectives whose tensors outlive every C++ reference to them, so no helper thread frees them.

A process group's own threads (gloo's workers, NCCL's watchdog) drop a finished work object,
which holds the collective's tensors, a moment *after* the waiting thread wakes. If Python has
let go of a tensor by then, that thread must take the GIL to free it, which it cannot while the
interpreter shuts down (a rank returning right after its last step): the process aborts with
``terminate called without an active exception``. So :class:`InFlight` keeps the work objects and
tensors referenced from Python until :meth:`InFlight.settle` sees, by torch's reference counts,
that the helper threads have let go, and drops them on the calling thread.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor


def collective_device(device: torch.device, group: Any) -> torch.device:
    """``device``, or the current CUDA device where ``group``'s backend (NCCL) takes only CUDA tensors."""
    if dist.get_backend(group) == "nccl" and device.type != "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return device


#: How long :meth:`InFlight.settle` waits for helper threads to let go (normally microseconds).
SETTLE_TIMEOUT_S = 5.0


def _refs(t: Tensor) -> int:
    """References to ``t``'s tensor object (C++ ones included; views count too)."""
    # older torch's stubs omit it (newer ones have it: the ignore is unused there)
    return int(t._use_count())  # type: ignore[attr-defined, unused-ignore]


def _tensors(args: tuple[Any, ...]) -> list[Tensor]:
    found: list[Tensor] = []
    for a in args:
        if isinstance(a, Tensor):
            found.append(a)
        elif isinstance(a, (list, tuple)):
            found += [t for t in a if isinstance(t, Tensor)]
    return found


class InFlight:
    """The work objects and tensors of one exchange's collectives, kept until settled."""

    def __init__(self) -> None:
        self._works: list[Any] = []
        self._pending: dict[int, tuple[Tensor, int]] = {}  # id -> (tensor, references before)
        self._held: dict[int, tuple[Tensor, int]] = {}  # id -> (tensor, references the works hold)

    def issue(self, collective: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        """Start ``collective(*args, async_op=True, **kwargs)``; hold its work and tensors until settled."""
        for t in _tensors(args):
            if id(t) not in self._pending:
                _, held = self._held.pop(id(t), (t, 0))
                self._pending[id(t)] = (t, _refs(t) - held)
        work = collective(*args, async_op=True, **kwargs)
        if work is not None:
            self._works.append(work)

    def wait(self) -> None:
        """Wait for every collective issued so far, then count the references their work
        objects hold to each tensor (all taken by now, the result included)."""
        for w in self._works:
            w.wait()
        for key, (t, before) in self._pending.items():
            self._held[key] = (t, _refs(t) - before)
        self._pending.clear()

    def settle(
        self,
        timeout: float = SETTLE_TIMEOUT_S,
        _now: Callable[[], float] = time.monotonic,
        _sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        """Drop the work objects, wait (sleeping, so the GIL is free) until no other thread
        references the tensors, then drop them here. An unfinished collective (a failed step, a
        lost peer) is not waited for: there is no telling when its thread will let go."""
        works, self._works = self._works, []
        finished = not self._pending and all(w.is_completed() for w in works)
        # each tensor's references once the work objects are gone (callers' views included)
        targets = [(t, _refs(t) - held) for t, held in self._held.values()]
        self._pending, self._held = {}, {}
        del works  # a work object dies here, unless a helper thread still holds it
        if not finished:
            return
        deadline = _now() + timeout
        while any(_refs(t) > target for t, target in targets) and _now() < deadline:
            _sleep(1e-4)

    def __del__(self) -> None:
        self.settle()

    def __reduce__(self) -> tuple[type[InFlight], tuple[()]]:
        """A copy holds nothing: collectives belong to the process group that ran them."""
        return (InFlight, ())
