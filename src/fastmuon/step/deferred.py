"""``nonfinite="raise"`` on an accelerator: the verdict on a step's gradients read one call later.

Asking before the update whether every gradient is finite would make the host wait for the device
every step. So the step runs masked, as ``"skip"`` runs, and only its flags travel: a non-blocking
copy into a pinned host buffer behind an event. The next ``step()`` (before it changes anything) or
``state_dict()`` reads them, waiting for the event if need be, and raises naming the parameters that
step left untouched. It waits rather than reading the flags only once they have arrived: the ranks
of a distributed run must raise alike (the flags are agreed before their copy; whether it has
arrived differs by rank), and what the step keeps on the host (AdamW's step counts) must be put back
before the next step changes it. In a training loop the wait costs nothing: the next batch's forward
and backward are queued behind the event. ``zero_grad()`` reads nothing."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor


def host_buffer(size: int) -> Tensor:
    """A bool vector of ``size`` in pinned host memory, or in plain memory where nothing can pin it."""
    try:
        return torch.empty(size, dtype=torch.bool, pin_memory=True)
    except RuntimeError:
        return torch.empty(size, dtype=torch.bool)


def recorded_event(device: torch.device) -> Any | None:
    """A new event recorded behind the work queued on ``device``'s current stream, or None where
    none can be made (a CPU, a trace on fake tensors)."""
    if device.type == "cpu":
        return None
    event: torch.cuda.Event | torch.Event
    try:
        if device.type == "cuda":
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
        else:
            event = torch.Event(device=device)
            event.record(torch.accelerator.current_stream(device))
    except (RuntimeError, AssertionError):
        return None
    return event


class PendingFlags:
    """One step's finite flags (``flags[k]``: whether gradient ``k`` was finite, on the host once
    ``event`` has passed); ``name(k)`` names the step's ``k``-th parameter; ``finish(flags)`` puts
    back what only the host can (its tensors, such as AdamW's step counts) where a flag is False."""

    def __init__(
        self,
        flags: Tensor,
        event: Any | None,
        step: int,
        name: Callable[[int], str],
        finish: Callable[[Tensor], None],
        raises: bool = True,
    ):
        self.flags = flags
        self.event = event
        self.step = step
        self.name = name
        self.finish = finish
        self.raises = raises  # False: a "skip" step's, with only the host's restore left

    @classmethod
    def start(
        cls,
        keep: Tensor,
        buffer: Tensor,
        step: int,
        name: Callable[[int], str],
        finish: Callable[[Tensor], None],
        raises: bool = True,
    ) -> PendingFlags:
        """Copy ``keep`` (on its device) into ``buffer`` without waiting, behind an event."""
        buffer.copy_(keep, non_blocking=True)
        return cls(buffer, recorded_event(keep.device), step, name, finish, raises)

    def finished(self) -> bool:
        """Whether the flags have reached the host (asks the event; never waits)."""
        if self.event is not None and self.event.query():
            self.event = None  # passed: nothing left to wait for
        return self.event is None

    def complete(self) -> bool:
        """Wait for the flags (long since copied, normally) and, if any is False, finish the
        step's restore of those parameters (once). Returns whether every flag is True."""
        if self.event is not None:
            self.event.synchronize()
            self.event = None
        if bool(self.flags.all()):
            return True
        finish, self.finish = self.finish, nothing_to_finish
        finish(self.flags)
        return False

    def check(self) -> None:
        """:meth:`complete`, then raise if a gradient was not finite (and the verdict raises)."""
        if self.complete() or not self.raises:
            return
        bad = (~self.flags).nonzero().flatten().tolist()
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        raise FloatingPointError(
            f"{self.name(bad[0])}{more} had a non-finite gradient (NaN or Inf) in step {self.step}; "
            f"step {self.step}'s update left these parameters and their state untouched (the others "
            "were updated), and this call changed nothing. Find the cause (learning rate, loss "
            "scale, data), use torch.amp.GradScaler for fp16 training, or pass nonfinite='skip' to "
            "leave such parameters untouched without an error"
        )


def nothing_to_finish(flags: Tensor) -> None:
    """Nothing left to put back (the device did it all, or nothing was copied)."""
