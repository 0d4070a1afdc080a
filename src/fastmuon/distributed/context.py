"""What the distributed layer does with a :class:`DistContext`: agree on which parameters step
(all ranks must step the same ones), combine the ranks' non-finite verdicts, build the step's NS
executor. Every collective goes through an :class:`~fastmuon.distributed.inflight.InFlight` and
exchange buffers persist, so no process-group thread frees a tensor a collective touched."""

from __future__ import annotations

import pickle
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from ..ns.build import plan_for, resolve_cost_model
from ..ns.engine import NSConfig, TensorLayout, spec_of
from ..ns.planner import CostModel, MatrixSpec, Plan, default_cost_model
from .dtensor import local_shard
from .exchange import ShardedOrthogonalizer, contiguous_layout, exchange_caps
from .inflight import InFlight, collective_device
from .placement import default_links, holding_of, place, ranks_per_node
from .replicated import ReplicatedOrthogonalizer
from .sharded import ShardedMatrix, SplitShardedOrthogonalizer
from .subgroups import host_twin, splits_default


@dataclass(frozen=True)
class DistContext:
    """What an optimizer hands the distributed layer instead of itself."""

    process_group: Any  # DDP: the ranks that share the NS work; None under FSDP2 (the mesh's)
    inflight: InFlight  # holds every collective's tensors until the next step settles them
    options: Any  # the optimizer's Options: cost model, compile, bucket cap
    optimizer: str  # the optimizer's class name, for errors
    name: Callable[[int], str]  # a parameter's name from its index in the step's flat list
    build_local: Callable[[Sequence[Tensor], Sequence[NSConfig], str], Any]  # an engine of this rank's own


def build_distributed(
    ctx: DistContext,
    params: Sequence[Tensor],
    configs: Sequence[NSConfig],
    wholes: Sequence[Any],
    policy: str,
    group: Any = None,
) -> ShardedOrthogonalizer | SplitShardedOrthogonalizer | ReplicatedOrthogonalizer:
    """The step's orthogonalizer: over ``group`` where ``wholes`` are :class:`ShardedMatrix`, else DDP's."""
    sharded = [isinstance(g, ShardedMatrix) for g in wholes]
    if any(sharded) and params:
        assert all(sharded), "a step over DTensors describes every matrix by its parts"
        rank = dist.get_rank(group)
        matrices: list[ShardedMatrix] = list(wholes)
        spread = [i for i, m in enumerate(matrices) if m.exchanged]
        mine = [i for i, m in enumerate(matrices) if not m.exchanged and m.held[rank] is not None]
        exchanged = None
        if spread:  # the same list on every rank: computed from every rank's boxes
            # the planner sees each matrix whole; its device and dtype are the local part's
            specs = [
                spec_of(
                    torch.empty(0, dtype=params[i].dtype, device=params[i].device),
                    configs[i],
                    contiguous_layout(matrices[i].shape),
                )
                for i in spread
            ]
            plan, cost_model, threads = _plan(ctx, specs, [configs[i] for i in spread], policy, group)
            configs_by_key: dict[Hashable, NSConfig] = {
                (params[i].dtype, configs[i]): configs[i] for i in spread
            }
            world = dist.get_world_size(group)
            ns_items = [configs[i].dtype.itemsize for i in spread]
            holdings = [holding_of(matrices[i], item) for i, item in zip(spread, ns_items)]
            device_type = params[spread[0]].device.type
            links = default_links(device_type, world, ranks_per_node())
            model = cost_model if isinstance(cost_model, CostModel) else default_cost_model(device_type)
            held = [matrices[i].held for i in spread]
            caps = exchange_caps(ctx.options.max_exchange_bytes, held, ns_items, world)
            units = place(
                plan,
                world,
                holdings,
                model,
                links,
                _owner_group_size(ctx.options.owner_group_size, group),
                threads,
                splittable=[len(matrices[i].shape) == 2 for i in spread],
                max_piece_bytes=min(caps),
            )
            exchanged = ShardedOrthogonalizer(
                plan,
                [matrices[i].shape for i in spread],
                held,
                configs_by_key,
                group,
                compile=ctx.options.compile,
                host_reads=not ctx.options.capturable,
                units=units,
                caps=caps,
                cap_given=ctx.options.max_exchange_bytes is not None,
            )
            if len(spread) == len(params):
                return exchanged
        local = (
            ctx.build_local([params[i] for i in mine], [configs[i] for i in mine], policy) if mine else None
        )
        return SplitShardedOrthogonalizer(exchanged, spread, local, mine, len(params))
    layouts = [TensorLayout.of(p) for p in params]
    specs = [spec_of(p, c, lay) for p, c, lay in zip(params, configs, layouts)]
    plan, _, _ = _plan(ctx, specs, configs, policy, ctx.process_group)
    by_key: dict[Hashable, NSConfig] = {(p.dtype, c): c for p, c in zip(params, configs)}
    return ReplicatedOrthogonalizer(
        plan,
        layouts,
        by_key,
        ctx.process_group,
        compile=ctx.options.compile,
        host_reads=not ctx.options.capturable,
    )


def _owner_group_size(asked: int | None, group: Any) -> int | None:
    """``asked``, or 1 where owner groups would split a device-bound default group (:mod:`.subgroups`)."""
    if group is not None and dist.get_world_size(group) != dist.get_world_size() and splits_default():
        return 1
    return asked


def _plan(
    ctx: DistContext,
    specs: Sequence[MatrixSpec],
    configs: Sequence[NSConfig],
    policy: str,
    group: ProcessGroup | None,
) -> tuple[Plan, Any, int]:
    """The plan every rank builds alike, from rank 0's cost model and thread count (they vary by rank)."""
    box: list[Any] = [resolve_cost_model(ctx.options.cost_model, specs), torch.get_num_threads()]
    src = 0 if group is None else dist.get_global_rank(group, 0)
    device = specs[0].device if specs else torch.device("cpu")
    cost_model, threads = _broadcast_object(box, src, group, ctx.inflight, device)
    return (
        plan_for(specs, configs, policy, cost_model, ctx.options.max_bucket_bytes, threads),
        cost_model,
        threads,
    )


def _broadcast_object(
    obj: Any, src: int, group: ProcessGroup | None, inflight: InFlight, device: torch.device
) -> Any:
    """``obj`` from global rank ``src`` on every rank, its buffers held by ``inflight``."""
    device = collective_device(device, group)
    data = pickle.dumps(obj) if dist.get_rank() == src else b""
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    inflight.issue(dist.broadcast, size, src=src, group=group)
    inflight.wait()
    payload = (
        torch.tensor(list(data), dtype=torch.uint8) if data else torch.empty(int(size), dtype=torch.uint8)
    )
    payload = payload.to(device)
    inflight.issue(dist.broadcast, payload, src=src, group=group)
    inflight.wait()
    return pickle.loads(bytes(payload.tolist()))


def agree_across_ranks(keep: Tensor, group: Any, inflight: InFlight) -> Tensor:
    """Every rank's keep flags AND-ed by one all-reduce, on ``keep``'s device (no host read)."""
    ok = keep.to(collective_device(keep.device, group), torch.float32)
    inflight.issue(dist.all_reduce, ok, op=dist.ReduceOp.MIN, group=group)
    inflight.wait()
    return (ok > 0.5).to(keep.device)


def begin_step(params: Sequence[Tensor], group: Any, inflight: InFlight) -> dict[Tensor, Tensor]:
    """Agree on which ``params`` step, returning zero gradients for the missing: a parameter steps
    everywhere if any rank has its gradient, so all ranks issue the same collectives. The flags go
    through a host group where there is one (the host waits for the ranks, never the device)."""
    if not params:
        return {}
    flags = [p.grad is not None for p in params]
    over = host_group(group)
    if over is not None:
        has = torch.tensor(flags, dtype=torch.int32)
        inflight.issue(dist.all_reduce, has, op=dist.ReduceOp.MAX, group=over)
    else:
        device = collective_device(local_shard(params[0]).device, group)
        has = torch.tensor(flags, dtype=torch.int32).to(device)
        inflight.issue(dist.all_reduce, has, op=dist.ReduceOp.MAX, group=group)
    inflight.wait()
    zeros = {}
    for p, anywhere, here in zip(params, has.tolist(), flags):
        if anywhere and not here:
            zeros[p] = torch.zeros_like(p)
    return zeros


def host_group(group: Any) -> Any | None:
    """A group over ``group``'s ranks that takes host tensors: ``group`` if its backend does (gloo,
    ``"cpu:gloo,cuda:nccl"``); over every rank, a gloo twin of the world; over some ranks, None (a
    twin made by its members alone could hang: :mod:`.subgroups`)."""
    if _takes_host_tensors(group):
        return group
    if not dist.is_gloo_available():
        return None
    if group is not None and dist.get_world_size(group) != dist.get_world_size():
        return None
    return host_twin()


def _takes_host_tensors(group: Any) -> bool:
    config = str(dist.get_backend_config(group))
    return "cpu:" in config or config in ("gloo", "mpi", "fake")
