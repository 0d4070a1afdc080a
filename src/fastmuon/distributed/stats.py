"""What a distributed step cost one rank, and its clock (opt-in: an executor's ``profile``)."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..ns.timing import synchronize


@dataclass
class CommStats:
    """What the last step cost this rank: NS seconds, exchange seconds, bytes in and out."""

    ns_seconds: float = 0.0
    comm_seconds: float = 0.0
    bytes_sent: int = 0
    bytes_received: int = 0
    owned_flops: int = 0
    total_flops: int = 0


class Timer:
    """Wall time of a region, synchronising CUDA first so queued kernels are counted (opt-in)."""

    def __init__(self, enabled: bool, device: torch.device):
        self.enabled, self.device = enabled, device

    def now(self) -> float:
        if not self.enabled:
            return 0.0
        synchronize(self.device)
        return time.perf_counter()
