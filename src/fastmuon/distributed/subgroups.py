"""Process groups fastmuon makes itself (owner groups, the host twin of an NCCL world), each made
once per set of ranks and default group, never again when an engine is rebuilt. ``new_group`` over
every rank is a collective all ranks enter in one order. Under a device-bound default group
(``init_process_group(device_id=...)``) NCCL splits the default communicator, which every rank
outside the new group must enter too: a group made by its members alone would hang."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

#: id of the default group -> (that group, {global ranks (or "host"): the group made for them})
_MADE: dict[int, tuple[Any, dict[Any, Any]]] = {}


def _made() -> dict[Any, Any]:
    world = dist.group.WORLD
    kept = _MADE.get(id(world))
    if kept is None or kept[0] is not world:  # none yet, or those of a destroyed default group
        kept = _MADE[id(world)] = (world, {})
    return kept[1]


def splits_default() -> bool:
    """Whether new groups are split from a device-bound default group (every rank must enter)."""
    return getattr(dist.group.WORLD, "bound_device_id", None) is not None


def world_subgroup(ranks: tuple[int, ...], member: bool) -> Any | None:
    """The group over global ``ranks``, made once by every rank in one order; None elsewhere."""
    made = _made()
    if ranks not in made:
        made[ranks] = dist.new_group(list(ranks))
    return made[ranks] if member else None


def local_subgroup(ranks: tuple[int, ...]) -> Any:
    """The group over global ``ranks``, made once by its members alone (only where nothing splits)."""
    assert not splits_default(), "a group made by its members alone would hang a split"
    made = _made()
    if ranks not in made:
        made[ranks] = dist.new_group(list(ranks), use_local_synchronization=True)
    return made[ranks]


def host_twin() -> Any:
    """A gloo group over every rank of the job (host tensors), made once by every rank."""
    made = _made()
    if "host" not in made:
        made["host"] = dist.new_group(backend="gloo")
    return made["host"]
