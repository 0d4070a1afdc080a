"""One rank of the at-scale plan's check against real runs (gloo on CPU); ``test_scale.py``
launches them. For each case of :func:`cases`, torch's own APIs lay a small model out on the
ranks (expert stacks sharded on the dim the case names, through ``fully_shard``'s
``shard_placement_fn`` where that is 1), Muon takes one step at fp32 NS (with the defaults, and
for the plain layouts again with owner groups and capped rounds), and the rank prints (one
``SCALE`` JSON line per run) every parameter's box as DCP's chunk protocol gives it, the bytes,
NS FLOPs and exchange buffers its step counted, and how far its parts are from the same model
stepped in one process. A ``SCALE-UNEVEN`` line says what ``fully_shard`` does with
an expert dim 1 that does not divide over the ranks."""

from __future__ import annotations

import copy
import json

import torch
import torch.distributed as dist
from gloo_rank import run_rank
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import fastmuon

UP = 128  # up_proj's rows
D, FFN, EXPERTS, ROUTER = 16, 24, 4, 6  # the router's 6 rows leave a rank an empty shard at 4 ranks
EXPERT_ROWS = 8  # dim 1 of the expert stack: FSDP2 shards it only evenly
UNEVEN_ROWS = 7  # an expert dim 1 that 2 and 4 ranks do not divide


def cases(world: int) -> list[tuple[str, int, int, bool]]:
    """(layout, experts, the dim FSDP2 shards them on, whether torchtitan's rule picks that dim)
    at ``world`` ranks: the layouts as plain FSDP2 leaves experts, then on dim 1 by hand (4
    experts, which 2 or 4 ranks do not outnumber) and where the rule picks it (world / 2 experts);
    ``ep:N`` FSDP2-shards the experts over the (world / N) dp dim, as torchtitan does."""
    half = world // 2
    ep = min(world, EXPERTS)  # EP ranks beyond the experts would hold none (FSDP2 cannot run that)
    # dim 0 is torchtitan's rule's choice while the ranks it weighs do not outnumber the experts
    # (fsdp+tp weighs only its dp dim, 2): past that the plain layouts force it
    plain = [
        (name, EXPERTS, 0, world <= EXPERTS or name in ("ddp", "fsdp+tp"))
        for name in ("ddp", "fsdp", "hsdp", "fsdp+tp", f"ep:{ep}")
    ]
    forced = [(name, EXPERTS, 1, False) for name in ("fsdp", "hsdp", "fsdp+tp", f"ep:{half}")]
    ruled = [("fsdp", half, 1, True), ("hsdp", half, 1, True)]  # hsdp: R·S weighed, not S
    ruled += [(f"ep:{half}", EXPERTS, 0, True), (f"ep:{half}", half, 1, True)]
    unique: dict[tuple[str, int, int], bool] = {}
    for name, experts, dim, by_rule in plain + forced + ruled:  # at 8 ranks ep:4 comes twice
        unique.setdefault((name, experts, dim), by_rule)
    return [(*case, by_rule) for case, by_rule in unique.items()]


class Net(nn.Module):
    """Attention-like and MLP-like pairs (tensor parallel column- then row-wise), a router, and
    a stack of ``experts`` experts."""

    def __init__(self, experts: int = EXPERTS):
        super().__init__()
        self.q_proj = nn.Linear(D, D, bias=False)
        self.o_proj = nn.Linear(D, D, bias=False)
        self.gate_proj = nn.Linear(D, FFN, bias=False)
        self.down_proj = nn.Linear(FFN, D, bias=False)
        self.router = nn.Linear(D, ROUTER, bias=False)
        self.up_proj = nn.Linear(D, UP, bias=False)  # the one matrix above a rank's share of NS
        self.experts = nn.Parameter(torch.randn(experts, EXPERT_ROWS, D) * 0.3)

    def forward(self, x):
        h = self.o_proj(torch.relu(self.q_proj(x))) + self.down_proj(torch.relu(self.gate_proj(x)))
        w = self.experts
        if isinstance(w, DTensor):  # expert parallel: this rank's experts only
            w = w.to_local()
        experts = torch.tanh(torch.einsum("bi,eoi->ebo", x, w)).pow(2).sum()
        return h.pow(2).sum() + self.router(x).pow(2).sum() + self.up_proj(x).pow(2).sum() + experts


def placement_fn(net: Net, dim: int):
    """``fully_shard``'s ``shard_placement_fn``: the experts on ``dim`` (None: FSDP2's Shard(0))."""
    if dim == 0:
        return None
    return lambda p: Shard(dim) if p is net.experts else None


def lay_out(net: Net, layout: str, world: int, dim: int) -> Net:
    dense = (net.q_proj, net.o_proj, net.gate_proj, net.down_proj, net.router, net.up_proj)
    if layout == "ddp":
        return net
    if layout == "fsdp":
        for m in dense:
            fully_shard(m)
        fully_shard(net, shard_placement_fn=placement_fn(net, dim))
        return net
    if layout == "hsdp":
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
        for m in dense:
            fully_shard(m, mesh=mesh)
        fully_shard(net, mesh=mesh, shard_placement_fn=placement_fn(net, dim))
        return net
    if layout == "fsdp+tp":
        dp = 2 if world >= 4 else 1
        mesh = init_device_mesh("cpu", (dp, world // dp), mesh_dim_names=("dp", "tp"))
        plan = {"q_proj": ColwiseParallel(), "o_proj": RowwiseParallel()}
        plan |= {"gate_proj": ColwiseParallel(), "down_proj": RowwiseParallel()}
        parallelize_module(net, mesh["tp"], plan)
        for m in dense:
            fully_shard(m, mesh=mesh["dp"])
        fully_shard(net, mesh=mesh["dp"], shard_placement_fn=placement_fn(net, dim))
        return net
    if layout.startswith("ep:"):  # experts over "ep", FSDP2 over "dp"; the rest FSDP2 over all
        ep = int(layout[3:])
        mesh = init_device_mesh("cpu", (world // ep, ep), mesh_dim_names=("dp", "ep"))
        net.experts = nn.Parameter(distribute_tensor(net.experts.detach(), mesh["ep"], [Shard(0)]))
        for m in dense:
            fully_shard(m)
        fully_shard(net, mesh=mesh["dp"], shard_placement_fn=placement_fn(net, dim))
        return net
    raise AssertionError(layout)


def box(p) -> list | None:
    if not isinstance(p, DTensor):
        return [[0, n] for n in p.shape]
    chunks = p.__create_chunk_list__()
    if not chunks or 0 in chunks[0].sizes:
        return None
    return [[int(o), int(o) + int(s)] for o, s in zip(chunks[0].offsets, chunks[0].sizes)]


#: the step's settings a case runs with: the defaults, and every matrix above a rank's share of
#: NS split over owner groups of 2 with the exchange in rounds of at most 32 KiB per rank (FSDP:
#: the least its largest piece needs at 8, 4 and 2 ranks, so that it takes several rounds)
STEERS = {"default": {}, "groups-rounds": {"owner_group_size": 2, "max_exchange_bytes": 32768}}
FSDP_CAP = {8: 9216, 4: 12288, 2: 20480}


def steer_options(steer: str, layout: str, world: int) -> dict:
    options = dict(STEERS[steer])
    if layout == "fsdp" and "max_exchange_bytes" in options:
        options["max_exchange_bytes"] = FSDP_CAP[world]
    return options


def local_tensor(t) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def groups_of(params: dict) -> list[dict]:
    return [
        {"params": [p for n, p in params.items() if n != "experts"]},
        {"params": [params["experts"]], "matrices": "experts"},
    ]


def one_process(net: Net, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """The same model stepped alone (no process group): what every layout must equal."""
    opt = fastmuon.Muon(groups_of(dict(net.named_parameters())), ns_dtype=torch.float32, lr=0.02)
    net(x).backward()
    opt.step()
    return {n: p.detach() for n, p in net.named_parameters()}


def check(layout: str, experts: int, dim: int, world: int, steer: str = "default") -> None:
    torch.manual_seed(0)
    whole = Net(experts)
    x = torch.randn(5, D, generator=torch.Generator().manual_seed(1))
    alone = one_process(copy.deepcopy(whole), x)
    net = lay_out(whole, layout, world, dim)
    params = dict(net.named_parameters())
    group = dist.group.WORLD if layout == "ddp" else None
    opt = fastmuon.Muon(
        groups_of(params),
        ns_dtype=torch.float32,
        lr=0.02,
        process_group=group,
        **steer_options(steer, layout, world),
    )
    net(x).backward()
    opt.step()
    engine = opt.orthogonalizers()[-1]
    exchanged = getattr(engine, "exchanged", engine)
    local = getattr(engine, "local", None)
    stats = exchanged.stats if exchanged is not None else None
    diff = 0.0  # this rank's part of every parameter against the one-process step's
    for n, p in params.items():
        region = box(p)
        if region is not None:
            want = alone[n][tuple(slice(a, b) for a, b in region)]
            diff = max(diff, float((local_tensor(p).detach() - want).abs().max()))
    routes = getattr(exchanged, "routes", None)
    out = {
        "layout": layout,
        "experts": experts,
        "dim": dim,
        "steer": steer,
        "diff": diff,
        "groups": 0 if routes is None else sum(1 for u in routes.units if u.group),
        "rounds": 0 if routes is None else sum(len(r) for r in routes.rounds.values()),
        "buffers": 0 if routes is None else routes.buffer_bytes(dist.get_rank()),
        "rank": dist.get_rank(),
        "boxes": {n: box(p) for n, p in params.items()},
        "sent": stats.bytes_sent if stats else 0,
        "received": stats.bytes_received if stats else 0,
        "flops": (stats.owned_flops if stats else 0) + (local.plan.flops() if local is not None else 0),
    }
    print("SCALE " + json.dumps(out), flush=True)


def check_uneven() -> None:
    """What ``fully_shard`` does with experts on a dim 1 the ranks do not divide: it raises."""
    holder = nn.Module()
    holder.experts = nn.Parameter(torch.randn(EXPERTS, UNEVEN_ROWS, D))
    try:
        fully_shard(holder, shard_placement_fn=lambda p: Shard(1))
        what = "sharded"
    except NotImplementedError as e:
        what = f"raised NotImplementedError: {e}"
    print(f"SCALE-UNEVEN {json.dumps({'rows': UNEVEN_ROWS, 'what': what})}", flush=True)


def checks(args) -> None:
    for layout, experts, dim, _ in cases(args.world):
        check(layout, experts, dim, args.world)
        if layout != "ddp" and experts == EXPERTS and dim == 0:  # DDP keeps whole-matrix owners
            check(layout, experts, dim, args.world, "groups-rounds")
    check_uneven()


if __name__ == "__main__":
    run_rank(checks)
