"""DTensor facts the step needs: local shards, whether a program's are still current, and
work items on local shards."""

from __future__ import annotations

import operator
import sys
from collections.abc import Sequence
from dataclasses import fields
from typing import TYPE_CHECKING, Any, TypeGuard

from torch import Tensor

if TYPE_CHECKING:  # imported only where DTensor support is (see is_dtensor)
    from torch.distributed.tensor import DTensor


def is_dtensor(t: object) -> TypeGuard[DTensor]:
    """Whether ``t`` is a DTensor, without importing DTensor support when nobody has."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def local_shard(t: Tensor) -> Tensor:
    """A DTensor's local shard (a view: writing to it writes the DTensor), else ``t``."""
    return t.to_local() if is_dtensor(t) else t


#: A DTensor's own local tensor: ``to_local()`` makes a new view each call, so identity is read here.
_local_tensor = operator.attrgetter("_local_tensor")


class LocalShards:
    """A step program's DTensor parameters' local tensors as built: FSDP2 gives a parameter a new
    one when it re-pads (``nn.Module._apply``, ``load_state_dict(assign=True)``), and views of the
    old one would update memory no longer the parameter's; :meth:`current` checks for that."""

    def __init__(self, params: Sequence[Any]):
        self._params = [p for p in params if is_dtensor(p)]
        self._locals = list(map(_local_tensor, self._params))

    def current(self) -> bool:
        return all(map(operator.is_, map(_local_tensor, self._params), self._locals))


def localize(items: Sequence[Any], optimizer: str) -> None:
    """Swap items' DTensor fields (except ``whole``) for local shards: per-op dispatch outcosts the maths."""
    for item in items:
        param: Any = getattr(item, "param", None)  # a work item's own parameter
        for f in fields(item):
            value = getattr(item, f.name)
            if f.name == "whole" or not is_dtensor(value):
                continue
            if f.name == "grad" and tuple(value.placements) != tuple(param.placements):
                raise ValueError(
                    f"a gradient has placements {tuple(value.placements)} but its parameter "
                    f"{tuple(param.placements)}; {optimizer} needs gradients sharded "
                    "like their parameters (as FSDP2 leaves them after backward)"
                )
            setattr(item, f.name, value.to_local())
