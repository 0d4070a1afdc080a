"""One rank of the group-NS check (gloo on CPU); ``test_group_ns.py`` launches 4 of them.

Every rank builds the same matrices; the ranks form subgroups of 2 ({0, 1} and {2, 3}) and one
of 4, each member takes its (uneven) columns of the wide orientation, runs group_newton_schulz
with ``dist.all_reduce`` over its subgroup as the reduce, and compares its columns with one
process's NS of each whole matrix (fp32, 1e-5 max abs), for both forms, wide and tall stored
matrices, Frobenius and AOL starts.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from gloo_rank import run_rank

from fastmuon import newton_schulz
from fastmuon.distributed.group_ns import group_newton_schulz
from fastmuon.ns.engine import NSConfig

M, N = 20, 45
WIDTHS = {2: [30, 15], 4: [5, 19, 0, 21]}


def check(group: dist.ProcessGroup, members: list[int], rank: int, seed: int) -> None:
    widths = WIDTHS[len(members)]
    j = members.index(rank)
    lo, hi = sum(widths[:j]), sum(widths[: j + 1])

    def reduce(t: torch.Tensor) -> None:
        dist.all_reduce(t, group=group)

    g = torch.Generator().manual_seed(seed)
    for coefficients in ("jordan", "aol"):
        config = NSConfig.make(None, coefficients, 1e-7, torch.float32)
        for shape in ((2, M, N), (2, N, M)):
            W = torch.randn(shape, generator=g)
            want = torch.stack([newton_schulz(w, None, coefficients, 1e-7, torch.float32) for w in W])
            tall = shape[-2] > shape[-1]
            X, want = (W.mT, want.mT) if tall else (W, want)
            for form in ("redundant", "factored"):
                got = group_newton_schulz(X[..., lo:hi], config, reduce, form)
                err = (got - want[..., lo:hi]).abs().max().item() if hi > lo else 0.0
                assert err <= 1e-5, (len(members), coefficients, shape, form, err)


def checks(args) -> None:
    pairs = [[0, 1], [2, 3]]
    groups = [dist.new_group(p) for p in pairs]  # every rank creates every group, in one order
    everyone = list(range(args.world))
    whole = dist.new_group(everyone)
    pair = pairs[args.rank // 2]
    check(groups[args.rank // 2], pair, args.rank, seed=100 + args.rank // 2)  # each pair its own
    check(whole, everyone, args.rank, seed=200)
    print("group of 2: equal to one process", flush=True)
    print("group of 4: equal to one process", flush=True)


if __name__ == "__main__":
    run_rank(checks)
