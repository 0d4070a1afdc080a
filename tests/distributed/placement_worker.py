"""One rank of the distributed placement's refusals (gloo on CPU); ``test_placement.py``
launches two. Under FSDP2 a Muon step whose ``owner_group_size`` does not divide the ranks or a
large matrix, or whose ``max_exchange_bytes`` is below what one matrix's exchange needs, is
refused at the first step, naming the option and the fix, and leaves parameters and state as
they were; the same optimizer options then step."""

from __future__ import annotations

import json

import torch
from gloo_rank import run_rank
from torch import nn
from torch.distributed.fsdp import fully_shard

import fastmuon

REFUSED = {
    "owner_group_size=3": {"owner_group_size": 3},  # 2 ranks
    "owner_group_size=2 on 63 rows": {"owner_group_size": 2},  # the big matrix is 63 x 16
    "max_exchange_bytes=64": {"max_exchange_bytes": 64},
}


def model() -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 16, bias=False), nn.Linear(16, 64, bias=False))
    for m in net:
        fully_shard(m)
    return fully_shard(net)


def odd_model() -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 63, bias=False), nn.Linear(63, 4, bias=False))
    for m in net:
        fully_shard(m)
    return fully_shard(net)


def attempt(name: str, options: dict) -> dict:
    net = odd_model() if "63 rows" in name else model()
    opt = fastmuon.Muon(net.parameters(), lr=0.02, ns_dtype=torch.float32, **options)
    x = torch.randn(4, net[0].in_features, generator=torch.Generator().manual_seed(1))
    net(x).sum().backward()
    before = [p.to_local().clone() for p in net.parameters()]
    try:
        opt.step()
        message = ""
    except ValueError as e:
        message = str(e)
    unchanged = all(torch.equal(b, p.to_local()) for b, p in zip(before, net.parameters()))
    return {"case": name, "message": message, "unchanged": unchanged, "state": len(opt.state)}


def checks(args) -> None:
    for name, options in REFUSED.items():
        print("PLACEMENT " + json.dumps(attempt(name, options)), flush=True)
    print(
        "PLACEMENT " + json.dumps(attempt("accepted", {"owner_group_size": 2, "max_exchange_bytes": 2**20}))
    )


if __name__ == "__main__":
    run_rank(checks)
