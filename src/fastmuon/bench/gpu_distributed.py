"""A one-process world (NCCL on a GPU, gloo on a CPU): a DDP-style step and an FSDP2 step.

The world is made with ``init_process_group(rank=0, world_size=1, init_method="tcp://
127.0.0.1:<free port>")``, on a GPU with ``device_id`` (a default group bound to its device,
as multi-GPU jobs make it), and destroyed at the end. Each step is compared with the same
optimizer stepping a one-process twin from the same values and gradients, and its host syncs
are counted on a step after those: on a GPU by ``torch.cuda.set_sync_debug_mode("warn")``'s
warnings and by the profiler's host waits; on any device by the profiler's host-reading ops
(``aten::item`` and the like, :func:`.hosttime.host_syncs`).
"""

from __future__ import annotations

import copy
import datetime
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from .. import Muon
from .gpu_numerics import MIXED_MATRICES, MIXED_VECTORS, gradients, split_groups, start_values
from .gpu_shared import Recorder, rel_err, sync_warnings

#: steps compared with the one-process twin (one more is counted for host syncs)
STEPS = 3
#: fp32 NS on both sides, so that any difference is the distributed path's
MUON = dict(lr=0.02, momentum=0.95, weight_decay=0.1, adamw_lr=0.02, ns_dtype=torch.float32)
#: the suite's bound for fp32 NS
REL = 1e-5


@dataclass
class DistributedStep:
    """One distributed mode's steps: equal to the twin's, and the host syncs of one step."""

    mode: str
    backend: str
    optimizer: str
    steps: int
    worst_rel_err: float
    equals_twin: bool  # within REL
    host_sync_ops: dict[str, int] = field(default_factory=dict)  # profiler: ops reading on the host
    sync_warnings: int | None = None  # CUDA: set_sync_debug_mode("warn")
    sync_sites: list[str] | None = None  # CUDA: the line that made each of them, file:line
    host_waits: int | None = None  # CUDA: the profiler's host waits, its own left out
    event_waits: int | None = None  # CUDA: of them, waits for an event (the previous step's flags)


def distributed(rec: Recorder) -> None:
    import torch.distributed as dist

    if not dist.is_available():
        raise RuntimeError("this torch was built without torch.distributed")
    backend = "nccl" if rec.on_cuda else "gloo"
    rec.note(
        "distributed",
        f"init_process_group({backend!r}, rank=0, world_size=1, tcp://127.0.0.1)"
        + (", device_id=cuda:<current>" if rec.on_cuda else "")
        + f"; Muon (NS fp32) compared over {STEPS} steps with a one-process twin at {REL:g}; host syncs "
        "of one step after them: set_sync_debug_mode('warn') warnings and profiler host waits (CUDA), "
        "profiler host-reading ops (any device)",
    )
    options: dict[str, Any] = {}
    if rec.on_cuda:
        index = torch.cuda.current_device()
        torch.cuda.set_device(index)
        options["device_id"] = torch.device("cuda", index)
    dist.init_process_group(
        backend,
        rank=0,
        world_size=1,
        init_method=f"tcp://127.0.0.1:{free_port()}",
        timeout=datetime.timedelta(seconds=60),
        **options,
    )
    try:
        rec.attempt("steps", "DDP-style", lambda: rec.add("steps", _ddp_style(rec.device, backend)))
        rec.attempt("steps", "FSDP2", lambda: rec.add("steps", _fsdp2(rec.device, backend)))
    finally:
        dist.destroy_process_group()
    rec.note("destroyed", "destroy_process_group() returned")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _ddp_style(device: torch.device, backend: str) -> DistributedStep:
    """``process_group=`` (gradients averaged by DDP beforehand: here the same on the one rank)."""
    import torch.distributed as dist

    start = start_values(MIXED_MATRICES + MIXED_VECTORS, seed=7)
    grads = gradients(start, STEPS + 1, seed=8)
    n = len(MIXED_MATRICES)
    ours = [nn.Parameter(t.to(device, copy=True)) for t in start]
    twin = [nn.Parameter(t.to(device, copy=True)) for t in start]
    opt = Muon(split_groups(ours, n), **MUON, process_group=dist.group.WORLD)  # type: ignore[arg-type]
    twin_opt = Muon(split_groups(twin, n), **MUON)  # type: ignore[arg-type]
    for step_grads in grads[:STEPS]:
        for a, b, g in zip(ours, twin, step_grads):
            a.grad, b.grad = g.to(device, copy=True), g.to(device, copy=True)
        opt.step()
        twin_opt.step()
    worst = max(rel_err(a, b) for a, b in zip(ours, twin))
    record = DistributedStep("DDP-style (process_group=)", backend, "Muon", STEPS, worst, worst <= REL)
    for p, g in zip(ours, grads[STEPS]):
        p.grad = g.to(device, copy=True)
    _count_syncs(record, opt.step, device)
    return record


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(32, 64), nn.Linear(64, 64), nn.Linear(64, 8)])

    def forward(self, x: Tensor) -> Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x) if i == len(self.layers) - 1 else torch.relu(layer(x))
        return x


def _fsdp2(device: torch.device, backend: str) -> DistributedStep:
    """``fully_shard`` on each layer and the model; the twin is an unsharded copy stepped with
    the full gradients."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(9)
    net = _Net().to(device)
    twin = copy.deepcopy(net)
    for layer in net.layers:
        fully_shard(layer)
    fully_shard(net)
    opt, twin_opt = Muon(_by_ndim(net), **MUON), Muon(_by_ndim(twin), **MUON)  # type: ignore[arg-type]
    gen = torch.Generator().manual_seed(10)
    batches = [torch.randn(16, 32, generator=gen).to(device) for _ in range(STEPS + 1)]
    for x in batches[:STEPS]:
        opt.zero_grad()
        net(x).square().mean().backward()
        for p, q in zip(net.parameters(), twin.parameters()):
            q.grad = None if p.grad is None else _full(p.grad).clone()
        opt.step()
        twin_opt.step()
    worst = max(rel_err(_full(p.detach()), q) for p, q in zip(net.parameters(), twin.parameters()))
    record = DistributedStep("FSDP2 (fully_shard)", backend, "Muon", STEPS, worst, worst <= REL)
    opt.zero_grad()
    net(batches[STEPS]).square().mean().backward()
    _count_syncs(record, opt.step, device)
    return record


def _by_ndim(net: nn.Module) -> list[dict[str, Any]]:
    params = list(net.parameters())
    return [
        {"params": [p for p in params if p.ndim >= 2], "use_muon": True},
        {"params": [p for p in params if p.ndim < 2], "use_muon": False},
    ]


def _full(t: Tensor) -> Tensor:
    """A DTensor's full value (the tensor itself otherwise)."""
    full = getattr(t, "full_tensor", None)
    return t if full is None else full()


def _count_syncs(record: DistributedStep, step: Callable[[], object], device: torch.device) -> None:
    """Three more steps: one under set_sync_debug_mode (CUDA), one profiled for host waits
    (CUDA), one profiled for host-reading ops (any device); the gradients stay as they are."""
    from .hosttime import cuda_activity, host_syncs

    if device.type == "cuda":
        record.sync_sites = sync_warnings(step, device)
        record.sync_warnings = len(record.sync_sites)
        activity = cuda_activity(step)
        record.host_waits, record.event_waits = activity["syncs"], activity["event_waits"]
    record.host_sync_ops = host_syncs(step)
