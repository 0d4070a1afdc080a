"""Picking fixed positions out of a per-step list: how a prepared step finds its tensors among
a step's gradients without a Python loop per tensor."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any


class Gather:
    """Picks fixed positions out of a per-step list (e.g. the gradients of one foreach call)."""

    __slots__ = ("indices", "_pick")

    def __init__(self, indices: Sequence[int]):
        self.indices = list(indices)
        self._pick: Callable[[Sequence[Any]], list[Any]]
        if len(self.indices) == 1:
            (only,) = self.indices
            self._pick = lambda seq: [seq[only]]
        elif self.indices:
            indices = self.indices  # map over a bound __getitem__: one C loop, and dynamo traces it
            self._pick = lambda seq: list(map(seq.__getitem__, indices))
        else:
            self._pick = lambda seq: []

    def __call__(self, seq: Sequence[Any]) -> list[Any]:
        return self._pick(seq)

    def __len__(self) -> int:
        return len(self.indices)

    def __bool__(self) -> bool:
        """Always true, empty or not (a picker is a callable, not a container): torch.compile
        tests a callable's truth before calling it, and torch 2.11's Dynamo does so on a Gather
        built inside the traced step before its ``__init__`` has run (no ``indices`` yet)."""
        return True
