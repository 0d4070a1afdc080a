"""What a batched step keeps between calls: its prepared programs and Newton–Schulz executors.

A program depends on which parameters have gradients and on the equality classes of the
groups' hyperparameters (see :mod:`fastmuon.step.program`); an executor on the matrices'
layouts and NS settings. Both are kept for a few keys, the oldest forgotten first. The cache
also holds the flat parameter list the step reads gradients from, and the plan the last step
ran (what ``optimizer.plan()`` reports).
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any

from torch import Tensor

from ..distributed.dtensor import is_dtensor
from ..distributed.parts import PartsTable
from ..ns.planner import Plan

#: How many programs (and executors) are kept: a run alternates between a few step shapes at most
#: (e.g. with and without a frozen part), and each holds buffers as large as its matrices.
CACHE_SIZE = 4


class StepCache:
    """Programs by step key, executors by matrix key, the flat parameters (and, over DTensors,
    every rank's part of each), the last plan."""

    def __init__(self, last_plan: Plan | None = None):
        self.programs: dict[Hashable, Any] = {}
        self.engines: OrderedDict[Hashable, Any] = OrderedDict()
        self.last_plan = last_plan
        self._noted: tuple[Plan, str, Plan] | None = None
        self._params: tuple[list[Tensor], bool] | None = None
        self.parts = PartsTable()  # where each rank's part of every parameter lies (DTensors)

    def params(self, groups: list[dict[str, Any]]) -> tuple[list[Tensor], bool]:
        """Every group's parameters in order, as a step reads their gradients, and whether any
        is a DTensor (FSDP2: the step is then a distributed one)."""
        if self._params is None:
            flat = [p for g in groups for p in g["params"]]
            self._params = (flat, any(map(is_dtensor, flat)))
        return self._params

    def program(self, key: Hashable) -> Any:
        return self.programs.get(key)

    def remember(self, key: Hashable, program: Any) -> None:
        """Keep ``program`` for later steps with ``key`` (the oldest goes past a few). A program
        replacing a misfit one takes its place in the order, so the programs a distributed run
        keeps, and which it forgets, are the same on every rank."""
        self.programs[key] = program
        if len(self.programs) > CACHE_SIZE:
            del self.programs[next(iter(self.programs))]

    def engine(self, key: Hashable, build: Callable[[], Any]) -> Any:
        """The executor for ``key``, built on first sight; the most recently used is kept longest."""
        engine = self.engines.get(key)
        if engine is None:
            engine = build()
            self.engines[key] = engine
            if len(self.engines) > CACHE_SIZE:
                self.engines.popitem(last=False)
        else:
            self.engines.move_to_end(key)
        self.last_plan = engine.plan
        return engine

    def noted(self, plan: Plan, note: str) -> Plan:
        """``plan`` with ``note`` added: the same object while neither changes (a reused plan is
        the same plan to whoever asks for it twice)."""
        kept = self._noted
        if kept is not None and kept[0] is plan and kept[1] == note:
            return kept[2]
        noted = dataclasses.replace(plan, note=f"{plan.note}; {note}" if plan.note else note)
        self._noted = (plan, note, noted)
        return noted

    def forget_programs(self) -> None:
        """After the groups, their ``params`` or the state changed: programs are rebuilt."""
        self.programs.clear()
        self._params = None

    def clear(self) -> None:
        """Programs and executors both (new parameters or a loaded state)."""
        self.forget_programs()
        self.engines.clear()
