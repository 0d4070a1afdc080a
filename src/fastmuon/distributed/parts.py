"""Where each rank's part of every parameter lies, in the whole tensor's coordinates.

A DTensor with ``Shard``/``Replicate`` placements on any mesh leaves each rank one box of the whole
tensor; two ranks' boxes are equal (replicas) or disjoint. A rank knows its own
(``__create_chunk_list__``, the protocol ``torch.distributed.checkpoint`` reads), so one
``all_gather``, repeated only when layouts change, tells every rank all of them; what each sends,
receives or orthogonalises alone follows. A plain tensor beside DTensors is whole on every rank.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from .dtensor import is_dtensor
from .inflight import InFlight, collective_device

#: A box of a tensor: ``(start, stop)`` per dimension.
Region = tuple[tuple[int, int], ...]


def whole_region(shape: Sequence[int]) -> Region:
    return tuple((0, int(n)) for n in shape)


def region_numel(region: Region | None) -> int:
    return 0 if region is None else math.prod(b - a for a, b in region)


def region_sizes(region: Region) -> tuple[int, ...]:
    return tuple(b - a for a, b in region)


@dataclass(frozen=True)
class Parts:
    """A tensor's whole shape and the box of it each rank of the exchange holds (None: none)."""

    shape: tuple[int, ...]
    regions: tuple[Region | None, ...]
    rank: int  # this rank's place in ``regions``

    @property
    def mine(self) -> Region | None:
        return self.regions[self.rank]

    @classmethod
    def replicated(cls, shape: Sequence[int], world: int, rank: int) -> Parts:
        """A plain tensor every rank holds whole."""
        whole = whole_region(shape)
        return cls(tuple(shape), (whole,) * world, rank)


def own_region(p: Any) -> Region | None:
    """The box of DTensor ``p`` this rank holds (None if none), as DCP's chunk protocol says."""
    chunks = p.__create_chunk_list__()
    if not chunks:
        return None
    if len(chunks) != 1:
        raise ValueError(f"a DTensor of shape {tuple(p.shape)} holds {len(chunks)} boxes on one rank")
    offsets, sizes = tuple(chunks[0].offsets), tuple(chunks[0].sizes)
    if 0 in sizes:
        return None
    return tuple((int(o), int(o) + int(s)) for o, s in zip(offsets, sizes))


def check_placements(name: str, optimizer: str, p: Any) -> None:
    """Refuse a ``Partial`` placement (checked when a group is added and again at the first step:
    accelerate swaps parameters in after construction)."""
    if is_dtensor(p) and any(pl.is_partial() for pl in p.placements):
        raise ValueError(
            f"{name} is a DTensor with a partial placement {tuple(p.placements)}; {optimizer} "
            "steps parameters that are sharded or replicated (redistribute it to Shard or "
            "Replicate first)"
        )


def exchange_group(
    params: Sequence[Any], name: Callable[[int], str], optimizer: str
) -> dist.ProcessGroup | None:
    """The group of the ranks the DTensors' meshes span: None (the default group) where they
    span every rank, else the one 1-D mesh's group over them (a pipeline stage's FSDP2)."""
    ranks: set[int] = set()
    one_d: dict[Any, None] = {}
    for k, p in enumerate(params):
        if not is_dtensor(p):
            continue
        check_placements(name(k), optimizer, p)
        mesh = p.device_mesh
        ranks.update(mesh.mesh.flatten().tolist())
        if mesh.ndim == 1:
            one_d[mesh] = None
    if ranks == set(range(dist.get_world_size())):
        return None
    spanning = [m for m in one_d if set(m.mesh.flatten().tolist()) == ranks]
    if spanning:
        group: dist.ProcessGroup = spanning[0].get_group()
        return group
    raise ValueError(
        f"the parameters' device meshes span ranks {sorted(ranks)} of {dist.get_world_size()}; "
        f"{optimizer} exchanges over every rank or over one 1-D mesh spanning its parameters' "
        "ranks (give a pipeline stage's parameters one mesh over its ranks, 1-D, or mesh every rank)"
    )


class PartsTable:
    """Every parameter's :class:`Parts` and the exchange's group, kept while the parameters are the
    same objects (fixed layouts): rebuilt, one collective on every rank, only when they change."""

    def __init__(self) -> None:
        self.group: dist.ProcessGroup | None = None
        self.checked = False  # whether the plain tensors' gradients were found replicated
        self._params: list[Any] | None = None
        self._by_id: dict[int, Parts] = {}

    def fits(self, params: list[Any]) -> bool:
        """Whether the table was built over these very parameters, in this order."""
        kept = self._params
        if kept is params:
            return True
        if kept is None or len(kept) != len(params) or not all(map(operator.is_, kept, params)):
            return False
        self._params = params
        return True

    def build(
        self, params: list[Any], inflight: InFlight, name: Callable[[int], str], optimizer: str
    ) -> None:
        self.group = exchange_group(params, name, optimizer)
        parts = gather_parts(params, self.group, inflight, name, optimizer)
        self._by_id = {id(p): part for p, part in zip(params, parts)}
        self._params, self.checked = params, False

    def check_plain(
        self,
        params: Sequence[Any],
        grads: Sequence[Tensor | None],
        inflight: InFlight,
        name: Callable[[int], str],
        optimizer: str,
    ) -> None:
        """:func:`check_replicated` over the plain tensors, once: ``checked`` says it passed."""
        plain = [k for k, p in enumerate(params) if not is_dtensor(p)]
        check_replicated([grads[k] for k in plain], [name(k) for k in plain], self.group, inflight, optimizer)
        self.checked = True

    def __call__(self, p: Any) -> Parts:
        """The parts of ``p``, one of the parameters the table was built over."""
        return self._by_id[id(p)]


def provisional_parts(p: Any) -> Parts:
    """``p``'s parts as this rank alone knows them: for state made before the first step, never a step."""
    group = None
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if not is_dtensor(p):
        return Parts.replicated(tuple(p.shape), world, rank)
    regions: list[Region | None] = [None] * world
    regions[rank] = own_region(p)
    return Parts(tuple(p.shape), tuple(regions), rank)


def gather_parts(
    params: Sequence[Any], group: Any, inflight: InFlight, name: Callable[[int], str], optimizer: str
) -> list[Parts]:
    """Every parameter's parts: DTensors' boxes by one ``all_gather``, plain tensors whole."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    sharded = [k for k, p in enumerate(params) if is_dtensor(p)]
    mine: list[int] = []
    for k in sharded:
        region = own_region(params[k])
        mine += [-1] * (2 * params[k].ndim) if region is None else [x for ab in region for x in ab]
    device = collective_device(params[sharded[0]].to_local().device, group)
    send = torch.tensor(mine, dtype=torch.int64, device=device)
    gathered = [torch.empty_like(send) for _ in range(world)]
    inflight.issue(dist.all_gather, gathered, send, group=group)
    inflight.wait()
    table = [t.tolist() for t in gathered]
    parts = [Parts.replicated(tuple(p.shape), world, rank) for p in params]
    offset = 0
    for k in sharded:
        p = params[k]
        n = 2 * p.ndim
        regions = tuple(_region(row[offset : offset + n]) for row in table)
        offset += n
        held = sum(region_numel(r) for r in dict.fromkeys(regions) if r is not None)
        if held != p.numel():
            raise ValueError(
                f"{name(k)}: the ranks' boxes of a DTensor of shape {tuple(p.shape)} with "
                f"placements {tuple(p.placements)} hold {held} distinct elements, not "
                f"{p.numel()}; {optimizer} needs each element in one box (Shard or Replicate)"
            )
        parts[k] = Parts(tuple(p.shape), regions, rank)
    return parts


def _region(row: list[int]) -> Region | None:
    if row and row[0] < 0:
        return None
    return tuple((row[i], row[i + 1]) for i in range(0, len(row), 2))


#: Random directions a gradient is projected on to compare it across ranks (see replica_sketch)
SKETCH_DIRECTIONS = 8
_SKETCH_CHUNK = 1 << 20  # elements projected at a time


def replica_sketch(grad: Tensor) -> Tensor:
    """What ranks compare of a gradient that should be equal everywhere, in float64: its
    projections on :data:`SKETCH_DIRECTIONS` random directions (seeded alike on every rank) and
    its norm. Different gradients differ in a projection by about the norm of their difference,
    rounding by a few ulps of the norm; a sum could not tell them apart (it can be near zero)."""
    flat = grad.detach().reshape(-1)
    generator = torch.Generator(flat.device).manual_seed(0)
    sketch = torch.zeros(SKETCH_DIRECTIONS + 1, dtype=torch.float64, device=flat.device)
    for start in range(0, flat.numel(), _SKETCH_CHUNK):  # bounded memory for a large tensor
        chunk = flat[start : start + _SKETCH_CHUNK].to(torch.float64)
        directions = torch.randn(
            SKETCH_DIRECTIONS, chunk.numel(), generator=generator, dtype=torch.float64, device=flat.device
        )
        sketch[:-1] += directions @ chunk
        sketch[-1] += chunk.square().sum()
    sketch[-1] = sketch[-1].sqrt()
    return sketch


def replica_tolerance(dtype: torch.dtype) -> float:
    """How far, relative to the gradient's norm, replicas' sketches may differ: 32 ulps of
    ``dtype`` (at least 1e-4), far above rounding, far below different gradients' distance."""
    return max(1e-4, 32 * torch.finfo(dtype).eps)


def replica_floor(grad: Tensor) -> float:
    """The least norm a tolerance is relative to, ``sqrt(numel)`` smallest normals of the dtype:
    subnormal entries are zeros rounding left or took away, not a different gradient."""
    return float(torch.finfo(grad.dtype).smallest_normal) * math.sqrt(max(grad.numel(), 1))


def replicas_differ(high: Tensor, low: Tensor, tolerance: float, floors: Sequence[float] = ()) -> Tensor:
    """Per gradient, whether the ranks' sketches (``high``/``low``: their elementwise max and min,
    norm last) differ by more than ``tolerance`` times the largest norm, or its ``floors`` entry."""
    scale = high[:, -1:].abs()
    if floors:
        scale = scale.clamp_min(torch.tensor(floors, dtype=scale.dtype).view(-1, 1))
    return ((high - low).abs() > tolerance * scale).any(dim=1)


def check_replicated(
    grads: Sequence[Tensor | None], names: Sequence[str], group: Any, inflight: InFlight, optimizer: str
) -> None:
    """Refuse, by name, a plain tensor beside DTensors whose gradient differs across ranks (a
    module left out of ``fully_shard``): its update is computed once for all ranks."""
    live = [(g, n) for g, n in zip(grads, names) if g is not None]
    if not live:
        return
    sketches = torch.stack([replica_sketch(g) for g, _ in live])
    both = torch.cat([sketches, -sketches]).to(collective_device(sketches.device, group))
    inflight.issue(dist.all_reduce, both, op=dist.ReduceOp.MAX, group=group)
    inflight.wait()
    high, low = both[: len(live)].cpu(), -both[len(live) :].cpu()
    tolerance = max(replica_tolerance(g.dtype) for g, _ in live)
    floors = [replica_floor(g) for g, _ in live]
    for (_, n), bad in zip(live, replicas_differ(high, low, tolerance, floors).tolist()):
        if bad:
            raise ValueError(
                f"{n} is a plain tensor beside DTensors and its gradient differs across ranks; "
                f"{optimizer} takes such a tensor as replicated (as tensor parallelism leaves "
                "unsharded layers) and would apply one rank's update everywhere: shard it too "
                "(fully_shard the module holding it, or the root module) or average its gradient "
                "across ranks"
            )
