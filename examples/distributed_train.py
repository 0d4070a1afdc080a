"""Train a small CNN with fastmuon's MuSGD on several ranks, under DDP, FSDP2 or HSDP.

    torchrun --nproc_per_node 2 examples/distributed_train.py            # DDP, gloo on CPU
    torchrun --nproc_per_node 2 examples/distributed_train.py --fsdp     # FSDP2 (fully_shard)
    torchrun --nproc_per_node 4 examples/distributed_train.py --hsdp     # HSDP on a 2×2 mesh

On GPUs (one per rank) the same commands use NCCL. With DDP the optimizer gets the process
group and each rank orthogonalises only its share of the matrices; with FSDP2 nothing extra
is needed: the optimizer sees the DTensor parameters and gathers each matrix to one owner.
The run ends with a torch.distributed.checkpoint save and a resume into a fresh optimizer.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

import fastmuon


def make_model() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.BatchNorm2d(16),
        nn.SiLU(),
        nn.Conv2d(16, 32, 3, stride=2, padding=1),
        nn.SiLU(),
        nn.Conv2d(32, 32, 3, padding=1),
        nn.SiLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(32, 10),
    )


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor: the shard of an FSDP2 DTensor, else the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--fsdp", action="store_true", help="shard with FSDP2 instead of DDP")
    ap.add_argument("--hsdp", action="store_true", help="HSDP: replicate over 2 groups, shard within")
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()

    cuda = torch.cuda.is_available()
    # the GPU index within this node (torchrun's LOCAL_RANK), not the rank in the job
    local_rank = int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    torch.manual_seed(0)  # the same initial weights on every rank
    model = make_model().to(device)

    opt_kwargs = dict(lr=0.02, momentum=0.9, nesterov=True, weight_decay=5e-4, muon=0.2, sgd=1.0)
    sharded = args.fsdp or args.hsdp
    if sharded:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        world = dist.get_world_size()
        replicas = 2 if args.hsdp and world % 2 == 0 else 1
        shape, names = (replicas, world // replicas), ("replicate", "shard")
        mesh = init_device_mesh(device.type, shape, mesh_dim_names=names) if args.hsdp else None
        for layer in model:
            if isinstance(layer, (nn.Conv2d, nn.Linear)):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        net = model
        # DTensor parameters are detected: no process group argument needed
        opt = fastmuon.MuSGD(fastmuon.param_groups(model), **opt_kwargs)
    else:
        net = nn.parallel.DistributedDataParallel(model, device_ids=[local_rank] if cuda else None)
        # the process group makes each rank orthogonalise only its share of the matrices
        opt = fastmuon.MuSGD(fastmuon.param_groups(model), process_group=dist.group.WORLD, **opt_kwargs)

    gen = torch.Generator().manual_seed(1 + dist.get_rank())  # each rank its own data
    for step in range(args.steps):
        x = torch.randn(16, 3, 16, 16, generator=gen).to(device)
        y = torch.randint(0, 10, (16,), generator=gen).to(device)
        loss = nn.functional.cross_entropy(net(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        if dist.get_rank() == 0 and step % 5 == 0:
            print(f"step {step:3d}  loss {total.item() / dist.get_world_size():.4f}")

    # checkpoint with torch.distributed.checkpoint, then resume into a fresh optimizer
    path = os.path.join(
        tempfile.gettempdir(), f"fastmuon_example_{'hsdp' if args.hsdp else 'fsdp' if args.fsdp else 'ddp'}"
    )
    dcp.save({"model": model.state_dict(), "optim": opt.state_dict()}, checkpoint_id=path)
    fresh = fastmuon.MuSGD(
        fastmuon.param_groups(model), process_group=None if sharded else dist.group.WORLD, **opt_kwargs
    )
    fresh.init_state()  # the state tensors dcp.load fills in place
    state = {"model": model.state_dict(), "optim": fresh.state_dict()}
    dcp.load(state, checkpoint_id=path)
    fresh.load_state_dict(state["optim"])
    same = all(
        torch.equal(local(a["momentum_buffer"]), local(b["momentum_buffer"]))
        for a, b in zip(opt.state_dict()["state"].values(), fresh.state_dict()["state"].values())
    )
    if dist.get_rank() == 0:
        print(f"checkpoint saved to {path} and resumed: momentum identical = {same}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
