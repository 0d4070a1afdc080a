"""One rank of the distributed ``state_dtype`` checks (gloo on CPU); ``test_state_dtype_distributed.py``
launches a world of them.

DDP and FSDP2 steps with bf16 state, each against the same optimizer on one process with bf16
state (fp32 rounding apart: the matrices are batched and exchanged differently), the state held
in bf16 on every rank (FSDP2: as bf16 DTensors, sharded like the parameters), and a
``torch.distributed.checkpoint`` round trip under FSDP2 that resumes bitwise.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from dist_worker import (
    MUON_KW,
    MUSGD_KW,
    check_close,
    ddp_shapes,
    fsdp_step,
    log,
    make_params,
    set_grads,
    sharded_net,
)
from gloo_rank import run_rank

import fastmuon
from fastmuon.distributed.dtensor import is_dtensor, local_shard

F32, BF16 = torch.float32, torch.bfloat16


def buffers(opt) -> list[torch.Tensor]:
    return [
        v for s in opt.state.values() for k, v in s.items() if k != "step" and isinstance(v, torch.Tensor)
    ]


def check_ddp(group) -> None:
    for cls, kwargs in ((fastmuon.MuSGD, MUSGD_KW), (fastmuon.Muon, MUON_KW)):
        runs = []
        for process_group in (group, None):
            params = make_params(ddp_shapes(), 1)
            groups = [
                {"params": [p for p in params if p.ndim >= 2], "use_muon": True},
                {"params": [p for p in params if p.ndim < 2], "use_muon": False},
            ]
            opt = cls(groups, ns_dtype=F32, process_group=process_group, state_dtype=BF16, **kwargs)
            for t in range(3):
                set_grads(params, 200 + t)
                opt.step()
            runs.append((params, opt))
        (dist_params, opt), (local_params, _) = runs
        bitwise = check_close(f"DDP {cls.__name__} bf16 state", dist_params, local_params)
        assert all(b.dtype == BF16 for b in buffers(opt)), "a buffer left bf16"
        if dist.get_rank() == 0:
            log(f"DDP {cls.__name__} with bf16 state: equal to one process (bitwise={bitwise})")


def check_fsdp(workdir: str) -> None:
    import torch.distributed.checkpoint as dcp

    for cls, kwargs in ((fastmuon.MuSGD, MUSGD_KW), (fastmuon.Muon, MUON_KW)):
        net, twin = sharded_net(5)
        opt = cls(fastmuon.param_groups(net), ns_dtype=F32, state_dtype=BF16, **kwargs)
        twin_opt = cls(fastmuon.param_groups(twin), ns_dtype=F32, state_dtype=BF16, **kwargs)
        for t in range(3):
            grads = fsdp_step(net, opt, t)
            for p, g in zip(twin.parameters(), grads):
                p.grad = g
            twin_opt.step()
        full = [p.full_tensor() for p in net.parameters()]
        bitwise = check_close(
            f"FSDP2 {cls.__name__} bf16 state", full, [p.detach() for p in twin.parameters()]
        )
        for p in net.parameters():
            for key, value in opt.state[p].items():
                if key == "step":
                    continue
                assert is_dtensor(value) and value.dtype == BF16, (key, type(value), value.dtype)
                assert value.placements == p.placements and local_shard(value).shape == local_shard(p).shape
        if dist.get_rank() == 0:
            log(
                f"FSDP2 {cls.__name__} with bf16 state: equal to one process (bitwise={bitwise}); state bf16 DTensors"
            )

        path = os.path.join(workdir, f"bf16_ckpt_{cls.__name__}")
        dcp.save({"model": net.state_dict(), "optim": opt.state_dict()}, checkpoint_id=path)
        for t in range(3, 5):
            fsdp_step(net, opt, t)
        expected = [p.full_tensor() for p in net.parameters()]
        net2, _ = sharded_net(99)
        opt2 = cls(fastmuon.param_groups(net2), ns_dtype=F32, state_dtype=BF16, **kwargs)
        opt2.init_state()
        state = {"model": net2.state_dict(), "optim": opt2.state_dict()}
        dcp.load(state, checkpoint_id=path)
        net2.load_state_dict(state["model"])
        opt2.load_state_dict(state["optim"])
        assert all(b.dtype == BF16 for b in buffers(opt2))
        for t in range(3, 5):
            fsdp_step(net2, opt2, t)
        resumed = [p.full_tensor() for p in net2.parameters()]
        assert all(torch.equal(a, b) for a, b in zip(resumed, expected)), "resume differs"
        if dist.get_rank() == 0:
            log(f"FSDP2 {cls.__name__} with bf16 state: checkpoint save/load/resume identical")


def checks(args) -> None:
    check_ddp(dist.group.WORLD)
    check_fsdp(args.dir)


if __name__ == "__main__":
    run_rank(checks)
