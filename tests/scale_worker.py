"""One rank of the at-scale plan's check against real runs (gloo on CPU); ``test_scale.py``
launches them. For each layout, torch's own APIs lay a small model out on the ranks, Muon takes
one step at fp32 NS, and the rank prints (one ``SCALE`` JSON line per layout) every parameter's
box as DCP's chunk protocol gives it, and the bytes and NS FLOPs its step counted."""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import fastmuon

D, FFN, EXPERTS, ROUTER = 16, 24, 4, 6  # the router's 6 rows leave a rank an empty shard at 4 ranks


class Net(nn.Module):
    """Attention-like and MLP-like pairs (tensor parallel column- then row-wise), a router, and
    a stack of experts."""

    def __init__(self):
        super().__init__()
        self.q_proj = nn.Linear(D, D, bias=False)
        self.o_proj = nn.Linear(D, D, bias=False)
        self.gate_proj = nn.Linear(D, FFN, bias=False)
        self.down_proj = nn.Linear(FFN, D, bias=False)
        self.router = nn.Linear(D, ROUTER, bias=False)
        self.experts = nn.Parameter(torch.randn(EXPERTS, 8, D) * 0.3)

    def forward(self, x):
        h = self.o_proj(torch.relu(self.q_proj(x))) + self.down_proj(torch.relu(self.gate_proj(x)))
        w = self.experts
        if isinstance(w, DTensor):  # expert parallel: this rank's experts only
            w = w.to_local()
        experts = torch.tanh(torch.einsum("bi,eoi->ebo", x, w)).pow(2).sum()
        return h.pow(2).sum() + self.router(x).pow(2).sum() + experts


def lay_out(net: Net, layout: str, world: int) -> Net:
    if layout == "ddp":
        return net
    if layout == "fsdp":
        for m in (net.q_proj, net.o_proj, net.gate_proj, net.down_proj, net.router):
            fully_shard(m)
        fully_shard(net)
        return net
    if layout == "hsdp":
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
        for m in (net.q_proj, net.o_proj, net.gate_proj, net.down_proj, net.router):
            fully_shard(m, mesh=mesh)
        fully_shard(net, mesh=mesh)
        return net
    if layout == "fsdp+tp":
        dp = 2 if world >= 4 else 1
        mesh = init_device_mesh("cpu", (dp, world // dp), mesh_dim_names=("dp", "tp"))
        plan = {"q_proj": ColwiseParallel(), "o_proj": RowwiseParallel()}
        plan |= {"gate_proj": ColwiseParallel(), "down_proj": RowwiseParallel()}
        parallelize_module(net, mesh["tp"], plan)
        for m in (net.q_proj, net.o_proj, net.gate_proj, net.down_proj, net.router):
            fully_shard(m, mesh=mesh["dp"])
        fully_shard(net, mesh=mesh["dp"])
        return net
    if layout == "ep":  # experts over "ep" (all ranks), replicated over nothing; the rest FSDP2
        ep = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "ep"))
        net.experts = nn.Parameter(distribute_tensor(net.experts.detach(), ep, [Replicate(), Shard(0)]))
        for m in (net.q_proj, net.o_proj, net.gate_proj, net.down_proj, net.router):
            fully_shard(m)
        return net
    raise AssertionError(layout)


def box(p) -> list | None:
    if not isinstance(p, DTensor):
        return [[0, n] for n in p.shape]
    chunks = p.__create_chunk_list__()
    if not chunks or 0 in chunks[0].sizes:
        return None
    return [[int(o), int(o) + int(s)] for o, s in zip(chunks[0].offsets, chunks[0].sizes)]


#: the step's settings each layout runs with: the defaults, and every matrix larger than a fair
#: share split over owner groups of 2 with the exchange in rounds of at most 5.25 KiB
STEERS = {"default": {}, "groups-rounds": {"owner_group_size": 2, "max_exchange_bytes": 5376}}


def local_tensor(t) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def check(layout: str, world: int, steer: str, reference: dict | None) -> dict:
    torch.manual_seed(0)
    net = lay_out(Net(), layout, world)
    params = dict(net.named_parameters())
    groups = [
        {"params": [p for n, p in params.items() if n != "experts"]},
        {"params": [params["experts"]], "matrices": "experts"},
    ]
    group = dist.group.WORLD if layout == "ddp" else None
    opt = fastmuon.Muon(groups, ns_dtype=torch.float32, lr=0.02, process_group=group, **STEERS[steer])
    x = torch.randn(5, D, generator=torch.Generator().manual_seed(1))
    net(x).backward()
    opt.step()
    engine = opt.orthogonalizers()[-1]
    exchanged = getattr(engine, "exchanged", engine)
    local = getattr(engine, "local", None)
    stats = exchanged.stats if exchanged is not None else None
    after = {n: local_tensor(p).detach().clone() for n, p in params.items()}
    diff = 0.0
    if reference is not None:
        diff = max(float((after[n] - reference[n]).abs().max()) if after[n].numel() else 0.0 for n in after)
    units = getattr(exchanged, "units", [])
    out = {
        "layout": layout,
        "steer": steer,
        "diff": diff,
        "groups": sum(1 for u in units if getattr(u, "group", ())),
        "rounds": sum(len(r) for r in exchanged.routes.rounds.values())
        if hasattr(exchanged, "routes")
        else 0,
        "buffers": exchanged.routes.buffer_bytes(dist.get_rank()) if hasattr(exchanged, "routes") else 0,
        "rank": dist.get_rank(),
        "boxes": {n: box(p) for n, p in params.items()},
        "sent": stats.bytes_sent if stats else 0,
        "received": stats.bytes_received if stats else 0,
        "flops": (stats.owned_flops if stats else 0) + (local.plan.flops() if local is not None else 0),
    }
    print("SCALE " + json.dumps(out), flush=True)
    return after


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--dir", required=True)
    args = parser.parse_args()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=args.rank, world_size=args.world)
    try:
        for layout in ("ddp", "fsdp", "hsdp", "fsdp+tp", "ep"):
            reference = check(layout, args.world, "default", None)
            if layout != "ddp":  # DDP keeps whole-matrix owners and one round
                check(layout, args.world, "groups-rounds", reference)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
