"""Newton–Schulz shared across ranks that hold the same gradients (DDP): each rank orthogonalises
its FLOP-balanced units (:mod:`.owners`), and one broadcast per unit hands each result on."""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from ..ns.engine import NSConfig, Orthogonalizer, TensorLayout
from ..ns.planner import Plan
from .inflight import InFlight
from .owners import WorkUnit, assign_work, sub_plan
from .stats import CommStats, Timer


class ReplicatedOrthogonalizer:
    """Every rank visits the units in one order, so the collectives match; an owner starts its
    broadcast right after its NS, so earlier units' exchange overlaps later units' NS. Results
    travel as one flat buffer per unit in the NS dtype, which every rank, owner included, casts and
    views per matrix, so all ranks apply bit-identical updates (views valid until the next call)."""

    def __init__(
        self,
        plan: Plan,
        layouts: Sequence[TensorLayout],
        configs: dict[Hashable, NSConfig],
        group: dist.ProcessGroup | None,
        compile: bool = False,
        host_reads: bool = True,
        units: Sequence[WorkUnit] | None = None,
    ):
        self.plan, self.layouts, self.group = plan, list(layouts), group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.units = list(units) if units is not None else assign_work(plan, self.world)
        assert not any(u.group for u in self.units), "replicated NS keeps whole-matrix owners"
        self._unit_members: list[list[int]] = []
        self._engines: list[Orthogonalizer | None] = []  # one per owned unit, with its own buffers
        for u in self.units:
            unit_plan, members = sub_plan(plan, [u])
            self._unit_members.append(members)
            owned = u.owner == self.rank
            engine = Orthogonalizer(
                unit_plan, [self.layouts[i] for i in members], configs, compile=compile, host_reads=host_reads
            )
            self._engines.append(engine if owned else None)
        self._src = [u.owner if group is None else dist.get_global_rank(group, u.owner) for u in self.units]
        self._numel = [
            sum(math.prod(self.layouts[i].shape) for i in members) for members in self._unit_members
        ]
        self._flats: list[Tensor | None] = [None] * len(self.units)
        self._inflight = InFlight()
        self.profile = False
        owned_flops = sum(u.flops for u in self.units if u.owner == self.rank)
        self.stats = CommStats(total_flops=plan.flops(), owned_flops=owned_flops)

    def __call__(self, sources: Sequence[Tensor], out_dtypes: Sequence[torch.dtype]) -> list[Tensor]:
        self._inflight.settle()  # the last call's broadcasts (finished long ago)
        device = sources[0].device
        timer = Timer(self.profile, device)
        start = timer.now()
        ns_seconds = 0.0
        flats = []
        sent = received = 0
        for k, (unit, members, src, engine) in enumerate(
            zip(self.units, self._unit_members, self._src, self._engines)
        ):
            flat = self._flat(k, self.plan.buckets[unit.bucket].dtype, device)
            if engine is not None:
                t0 = timer.now()
                outs = engine([sources[i] for i in members], [flat.dtype] * len(members))
                ns_seconds += timer.now() - t0
                torch.cat([_memory_order(o, self.layouts[i]) for o, i in zip(outs, members)], out=flat)
                sent += flat.numel() * flat.element_size() * (self.world - 1)
            else:
                received += flat.numel() * flat.element_size()
            self._inflight.issue(dist.broadcast, flat, src=src, group=self.group)
            flats.append(flat)
        self._inflight.wait()
        results: list[Tensor | None] = [None] * len(sources)
        for flat, members in zip(flats, self._unit_members):
            _views(flat, members, self.layouts, out_dtypes, results)
        total = timer.now() - start
        self.stats.ns_seconds, self.stats.comm_seconds = ns_seconds, total - ns_seconds
        self.stats.bytes_sent, self.stats.bytes_received = sent, received
        return results  # type: ignore[return-value]

    def _flat(self, k: int, dtype: torch.dtype, device: torch.device) -> Tensor:
        """Unit ``k``'s exchange buffer: its matrices back to back, made once."""
        flat = self._flats[k]
        if flat is None or flat.device != device:
            flat = self._flats[k] = torch.empty(self._numel[k], dtype=dtype, device=device)
        return flat

    def workspaces(self) -> list[Tensor]:
        """Every tensor kept between steps: exchange buffers and the owned units' engines'."""
        kept = [f for f in self._flats if f is not None]
        return kept + [t for e in self._engines if e is not None for t in e.workspaces()]


def _memory_order(t: Tensor, layout: TensorLayout) -> Tensor:
    """``t`` (with ``layout``'s strides) flattened in memory order: a view, no copy."""
    return t.permute(layout.perm).reshape(-1)


def _views(
    flat: Tensor,
    members: Sequence[int],
    layouts: Sequence[TensorLayout],
    out_dtypes: Sequence[torch.dtype],
    results: list[Tensor | None],
) -> None:
    """Split a unit's flat buffer back into per-matrix tensors with their layouts' strides."""
    by_dtype: dict[torch.dtype, Tensor] = {}
    offset = 0
    for i in members:
        dtype = out_dtypes[i]
        cast = by_dtype.get(dtype)
        if cast is None:
            cast = by_dtype[dtype] = flat if flat.dtype == dtype else flat.to(dtype)
        layout = layouts[i]
        results[i] = torch.as_strided(cast, layout.shape, layout.stride, offset)
        offset += math.prod(layout.shape)
