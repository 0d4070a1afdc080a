"""Shared pieces of the reliability tests: parameter sets and per-parameter reference runs."""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterator

import torch
from reference_impl import adamw_reference_step, muon_reference_step, musgd_reference_step


def make_params(shapes, *, dtype=torch.float32, channels_last=(), seed=0) -> list[torch.nn.Parameter]:
    """Random parameters; indices in ``channels_last`` get that memory format (4D only)."""
    gen = torch.Generator().manual_seed(seed)
    params = []
    for i, shape in enumerate(shapes):
        t = torch.randn(shape, generator=gen).to(dtype)
        if i in channels_last:
            t = t.to(memory_format=torch.channels_last)
        params.append(torch.nn.Parameter(t))
    return params


def random_grads(params, seed: int, scale: float = 1.0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(p.shape, generator=gen) * scale).to(p.dtype) for p in params]


def reference_musgd_step(params, grads, states, group: dict) -> None:
    """The plain fp32 per-parameter MuSGD step on (copies of) the parameters with a gradient."""
    for p, g in zip(params, grads):
        if g is None or p.numel() == 0:  # nothing to update in an empty tensor
            continue
        musgd_reference_step(
            p,
            g,
            states.setdefault(p, {}),
            lr=group["lr"],
            momentum=group["momentum"],
            nesterov=group["nesterov"],
            weight_decay=group["weight_decay"],
            muon=group["muon"],
            sgd=group["sgd"],
            use_muon=group.get("use_muon"),
        )


def reference_muon_step(params, grads, states, group: dict) -> None:
    """Muon on >=2D parameters, AdamW (betas (0.9, 0.95), eps 1e-8) on the others."""
    for p, g in zip(params, grads):
        if g is None or p.numel() == 0:  # nothing to update in an empty tensor
            continue
        state = states.setdefault(p, {})
        if p.ndim >= 2 and p.numel() > 0:
            muon_reference_step(
                p,
                g,
                state,
                lr=group["lr"],
                momentum=group["momentum"],
                nesterov=group["nesterov"],
                weight_decay=group["weight_decay"],
            )
        else:
            adamw_reference_step(p, g, state, lr=group["lr"], weight_decay=group["weight_decay"])


def _replicated_musgd(rank: int, world: int, init_file: str, **options):
    """This rank joined to a gloo world, and a replicated MuSGD over three small parameters."""
    import torch.distributed as dist

    import fastmuon

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    params = make_params([(6, 4), (6, 4), (5,)])
    opt = fastmuon.MuSGD(
        params,
        use_muon=True,
        lr=0.1,
        momentum=0.9,
        ns_dtype=torch.float32,
        process_group=dist.group.WORLD,
        **options,
    )
    return params, opt


def nonfinite_worker(rank: int, world: int, init_file: str, mode: str, out_dir: str) -> None:
    """One rank of a replicated (DDP-style) MuSGD whose rank 1 alone sees a NaN gradient."""
    import torch.distributed as dist

    params, opt = _replicated_musgd(rank, world, init_file, nonfinite=mode)
    try:
        for step in range(2):
            for p, g in zip(params, random_grads(params, step)):
                p.grad = g
            if step == 1 and rank == 1:
                params[0].grad[0, 0] = float("nan")
            before = [p.detach().clone() for p in params]
            try:
                opt.step()
                outcome = "stepped"
            except FloatingPointError:
                outcome = "raised"
        torch.save(
            {"outcome": outcome, "before": before, "after": [p.detach() for p in params]},
            f"{out_dir}/{rank}.pt",
        )
    finally:
        dist.destroy_process_group()


def deferred_raise_worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    """One rank of a replicated MuSGD on the accelerator's paths (``is_host`` answering "no")
    whose rank 1 alone sees a NaN gradient at step 1: each step's outcome, and the weights."""
    import torch.distributed as dist

    from fastmuon.ns import device as ns_device

    ns_device.is_host = lambda device: False
    params, opt = _replicated_musgd(rank, world, init_file)
    try:
        outcomes, weights = [], []
        for step in range(4):
            for p, g in zip(params, random_grads(params, min(step, 2))):
                p.grad = g
            if step == 1 and rank == 1:
                params[0].grad[0, 0] = float("nan")
            try:
                opt.step()
                outcomes.append("stepped")
            except FloatingPointError as e:
                outcomes.append(str(e))
            weights.append([p.detach().clone() for p in params])
        torch.save({"outcomes": outcomes, "weights": weights}, f"{out_dir}/{rank}.pt")
    finally:
        dist.destroy_process_group()


def _own_threads() -> set[str]:
    return set(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else set()


def exit_worker(index: int, world: int, init_dir: str) -> None:
    """One rank of a DDP-style MuSGD (``nonfinite="skip"``, a NaN on rank 1) that returns right
    after its last step, as a user's script does; processes ``index`` form worlds of ``world``.

    To make a late process-group thread likely (it is what turns a tensor freed by that thread
    into an abort at interpreter exit), each process is pinned to one CPU and the threads the
    process group starts run at idle priority: they get the CPU mostly while the main thread waits.
    """
    import torch.distributed as dist

    import fastmuon

    rank, world_id = index % world, index // world
    torch.set_num_threads(1)
    if hasattr(os, "sched_setaffinity"):
        cpus = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cpus[index % len(cpus)]})
    before = _own_threads()
    init = f"file://{init_dir}/world{world_id}"
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    for tid in _own_threads() - before:
        with contextlib.suppress(OSError, AttributeError):
            os.sched_setscheduler(int(tid), os.SCHED_IDLE, os.sched_param(0))
    params = make_params([(6, 4), (6, 4), (8, 3), (4, 5, 2, 2), (7, 2), (5,)])
    opt = fastmuon.MuSGD(
        params, lr=0.1, momentum=0.9, ns_dtype=torch.float32, process_group=dist.group.WORLD, nonfinite="skip"
    )
    for step in range(2):
        for p, g in zip(params, random_grads(params, step)):
            p.grad = g
        if step == 1 and rank == 1:
            params[0].grad[0, 0] = float("nan")
        opt.step()


@contextlib.contextmanager
def cuda_syncs_raise() -> Iterator[None]:
    """CUDA's sync debug mode at "error" for the duration: any call that makes the host wait for
    the device raises. torch warns, once per process, that the mode is a prototype; that notice
    is not let through as an error (it would leave the mode set for every later test), and the
    mode is set back whatever happens."""
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Synchronization debug mode is a prototype")
            torch.cuda.set_sync_debug_mode("error")
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")
