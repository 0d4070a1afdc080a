"""DTensor facts the step needs: is a tensor sharded, its local shard, whether a program's
local tensors are still the parameters' own, and a step's work items on local shards."""

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


#: A DTensor's own local tensor. ``to_local()`` of a parameter returns a new view at every call
#: (one that is a Parameter too), so the tensor's identity is read from this field.
_local_tensor = operator.attrgetter("_local_tensor")


class LocalShards:
    """The local tensors of a step program's DTensor parameters, as they were when it was built.

    The program updates views of them. FSDP2 gives a parameter a new local tensor when it
    re-pads one (after ``nn.Module._apply`` or ``load_state_dict(assign=True)``), and views of
    the old one would then update memory that is no longer the parameter's: :meth:`current`
    tells whether each parameter still holds the tensor the program was built over.
    """

    def __init__(self, params: Sequence[Any]):
        self._params = [p for p in params if is_dtensor(p)]
        self._locals = list(map(_local_tensor, self._params))

    def current(self) -> bool:
        return all(map(operator.is_, map(_local_tensor, self._params), self._locals))


def localize(items: Sequence[Any], optimizer: str) -> None:
    """Swap every DTensor field of the step's items for its local shard, in place.

    The elementwise maths is then plain foreach work on local tensors (DTensor dispatch per op
    would cost more than the maths). A matrix item's ``whole`` describes its matrix across
    ranks (see :mod:`fastmuon.distributed.sharded`).
    """
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
