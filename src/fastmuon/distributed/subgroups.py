"""Process groups fastmuon makes itself (owner groups, the host-side twin of an NCCL world):
each made once per set of ranks and default group, never again when an engine is rebuilt.

torch's ``new_group`` is a collective: over every rank of the job, every rank must enter it, in
one order. Under a default group bound to a device (``init_process_group(device_id=...)``) NCCL
makes a subgroup by splitting the default communicator, and every rank outside the new group
must enter the split too; a group made by its members alone would hang the job there.
"""

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
    """Whether a new group is split from a default group bound to a device (every rank of the
    job must then enter its creation)."""
    return getattr(dist.group.WORLD, "bound_device_id", None) is not None


def world_subgroup(ranks: tuple[int, ...], member: bool) -> Any | None:
    """The group over global ``ranks``, made (once) by every rank of the job: call it on every
    rank, in the same order; returns the group on its members, None elsewhere."""
    made = _made()
    if ranks not in made:
        made[ranks] = dist.new_group(list(ranks))
    return made[ranks] if member else None


def local_subgroup(ranks: tuple[int, ...]) -> Any:
    """The group over global ``ranks``, made (once) by its members alone: only where no split of
    the default group is involved (see :func:`splits_default`)."""
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
