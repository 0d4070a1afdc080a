"""What every rule's ``collect`` reads: the parameters with a gradient this step, group by group.
The optimizer hands a rule a :class:`CollectEnv`, so a rule never reaches into the optimizer."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

from torch import Tensor

from ..ns.matrices import MatrixMap


class CollectEnv(NamedTuple):
    """What a rule's ``collect`` needs of the optimizer it serves."""

    state: Any  # the optimizer's ``state``: per-parameter dicts, created on first use
    lr_value: Callable[[Any], Any]  # a group's ``lr`` as the step uses it (host number or tensor)
    check_grad: Callable[[dict[str, Any], int, Tensor], None]  # raises naming the parameter
    maps: Callable[[dict[str, Any], int], list[MatrixMap]]  # (group, index) -> its maps, shapes checked
    capturable: bool  # state lives where a captured step can update it
    optimizer: str  # the optimizer's class name, for errors
    parts: Callable[[Tensor], Any] | None = None  # over DTensors: every rank's part of a parameter

    def parts_of(self, p: Tensor) -> Any:
        """Where each rank's part of ``p`` lies, in a step over DTensors; None otherwise."""
        return None if self.parts is None else self.parts(p)


class Member(NamedTuple):
    """A parameter with a gradient this step; ``position``: its place among the step's live ones."""

    j: int
    param: Tensor
    grad: Tensor
    position: int


class LiveGroup(NamedTuple):
    """A param group's parameters with a gradient this step, in order."""

    number: int  # the group's place among the optimizer's groups
    group: dict[str, Any]
    members: list[Member]


def live_params(
    groups: Sequence[dict[str, Any]], grads: Sequence[Tensor | None], env: CollectEnv
) -> Iterator[LiveGroup]:
    """Each group's parameters with a gradient (``grads`` runs over every group's parameters)."""
    flat = 0
    live = 0
    for gi, group in enumerate(groups):
        members = []
        for j, p in enumerate(group["params"]):
            grad = grads[flat]
            flat += 1
            if grad is None:
                continue
            env.check_grad(group, j, grad)
            members.append(Member(j, p, grad, live))
            live += 1
        yield LiveGroup(gi, group, members)
