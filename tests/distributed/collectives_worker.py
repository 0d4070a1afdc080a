"""One rank of ``test_collectives.py``: DDP-style MuSGD steps on gloo with every collective and
every ``new_group`` this process enters logged, written to ``<dir>/log<rank>.json``.

The steps: plain ones; one where rank 1 alone has a NaN gradient (``nonfinite="raise"``, caught
by the loop); steps over more gradient patterns than the engine cache keeps (engines evicted
and rebuilt); and the same with the deferred verdict of an accelerator's path, where
``zero_grad`` comes between the bad step and the raising one.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.distributed as dist
from gloo_rank import rank_args, run_rank

import fastmuon
from fastmuon.distributed import subgroups
from fastmuon.ns import device as ns_device
from fastmuon.step.driver import CACHE_SIZE

LOGGED = (
    "all_reduce",
    "broadcast",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "all_to_all_single",
    "barrier",
    "new_group",
)


def logging_collectives(log: list[str]) -> None:
    for name in LOGGED:
        real = getattr(dist, name)

        def logged(*args, _real=real, _name=name, **kwargs):
            group = kwargs.get("group")
            size = None if group is None else dist.get_world_size(group)
            log.append(
                f"{_name} group_size={size} ranks={kwargs.get('ranks', args[0] if _name == 'new_group' and args else '')}"
            )
            return _real(*args, **kwargs)

        setattr(dist, name, logged)


def params_and_grads(seed: int, shapes, rank: int, nan: bool):
    gen = torch.Generator().manual_seed(seed)
    ps = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
    grads = [torch.randn(s, generator=gen) for s in shapes]
    if nan and rank == 1:
        grads[0].view(-1)[0] = math.nan
    return ps, grads


def body(args) -> None:
    log: list[str] = []
    logging_collectives(log)
    shapes = [(16, 8), (16, 8), (12, 20), (6,), (9, 9), (4, 4, 3, 3)]
    outcomes = []
    for deferred in (False, True):
        if deferred:  # the accelerator's path: "raise" runs masked, the next step raises
            ns_device.is_host = lambda device: False
        ps, _ = params_and_grads(0, shapes, args.rank, False)
        opt = fastmuon.MuSGD(
            [{"params": ps[:3] + ps[4:], "use_muon": True}, {"params": [ps[3]], "use_muon": False}],
            lr=0.02,
            momentum=0.9,
            process_group=dist.group.WORLD,
            ns_dtype=torch.float32,
        )
        patterns = [None, None, "nan", None] + [k for k in range(CACHE_SIZE + 2)] + [None]
        for step, pattern in enumerate(patterns):
            log.append(f"-- step {step} deferred={deferred} pattern={pattern}")
            _, grads = params_and_grads(100 + step, shapes, args.rank, pattern == "nan")
            for k, (p, g) in enumerate(zip(ps, grads)):
                dropped = isinstance(pattern, int) and k == pattern % len(ps) and args.rank == 0
                p.grad = None if dropped else g
            try:
                opt.step()
                outcomes.append("stepped")
            except FloatingPointError as e:
                outcomes.append("raised: " + str(e).split(";")[0])
            opt.zero_grad()
    # owner groups as engines ask for them, each rank set twice (a rebuilt engine asks again):
    # every rank enters each new_group once, members or not
    log.append("-- owner groups")
    for ranks in ((0,), (1,), (0, 1), (0,), (0, 1), (1,)):
        group = subgroups.world_subgroup(ranks, member=args.rank in ranks)
        assert (group is not None) == (args.rank in ranks), (ranks, args.rank)
    Path(args.dir, f"log{args.rank}.json").write_text(json.dumps({"log": log, "outcomes": outcomes}))


if __name__ == "__main__":
    run_rank(body, rank_args())
