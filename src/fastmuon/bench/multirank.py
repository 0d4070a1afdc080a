"""The multi-rank benchmark (``fastmuon bench --nproc N``): each rank's share of the NS work.

Spawns ``nproc`` processes (gloo on CPU, nccl on CUDA), each stepping one fastmuon optimizer
(MuSGD, Muon, NorMuon or AdaMuon: ``--optimizer``) on a model's parameters
(from a bundled manifest: yolo26n..x) either replicated (``ddp``: every rank orthogonalises
its share of the buckets and broadcasts the results) or sharded (``fsdp``: Shard(0) DTensors;
``hsdp``: replicated over two groups, Shard(0) within each, on a 2-D mesh; matrices gathered to
their owners and scattered back). Every rank reports the seconds its NS
share took, the seconds and bytes of the exchange per step; then every rank times the step
without sharing (every rank orthogonalising every matrix, as a plain Muon does under DDP,
same threads per process) for the speedup of NS work per rank. NorMuon and AdaMuon refuse
sharded matrices (their statistics of the whole update are not computed across shards), so
they run replicated (``ddp``) only.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..ns.planner import counted
from ..ns.timing import synchronize
from .contenders import accepted_kwargs
from .lineup import CLASSES
from .workloads import bundled_data

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}
MODES = ("ddp", "fsdp", "hsdp")
#: the update rules whose optimizers refuse sharded (DTensor) matrices
REPLICATED_ONLY = ("normuon", "adamuon")


def setup_problem(optimizer: str, mode: str, nproc: int) -> str | None:
    """Why the benchmark cannot run ``optimizer`` in ``mode`` on ``nproc`` ranks, as the command
    line's options would fix it (None: it can)."""
    if optimizer not in CLASSES:
        return f"unknown optimizer {optimizer!r}; choose one of {', '.join(CLASSES)}"
    if mode not in MODES:
        return f"unknown mode {mode!r}; choose one of {', '.join(MODES)}"
    if optimizer in REPLICATED_ONLY and mode != "ddp":
        name = CLASSES[optimizer].__name__
        return (
            f"--optimizer {optimizer} with --dist-mode {mode}: {name} refuses sharded (DTensor) matrices; "
            f"run it with --dist-mode ddp, or benchmark {mode} with --optimizer muon or musgd"
        )
    if mode == "hsdp" and (nproc < 2 or nproc % 2):
        return f"--dist-mode hsdp replicates over 2 groups: give an even --nproc, not {nproc}"
    return None


def load_manifest(model: str) -> dict[str, Any]:
    """A bundled model manifest: ``params`` [{name, shape, group}], ``param_groups``, ``optimizer_kwargs``."""
    return bundled_data(model)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_multirank_bench(
    model: str = "yolo26n",
    nproc: int = 2,
    device: str = "cpu",
    ns_dtype: torch.dtype = torch.bfloat16,
    steps: int = 5,
    mode: str = "ddp",
    warmup: int = 2,
    optimizer: str = "musgd",
) -> dict[str, Any]:
    """Run the benchmark of ``optimizer`` (a key of :data:`.lineup.CLASSES`); returns its
    figures (times in seconds, medians over ``steps`` steps)."""
    problem = setup_problem(optimizer, mode, nproc)
    if problem:
        raise ValueError(problem)
    if nproc < 1 or steps < 1:
        raise ValueError("nproc and steps must be >= 1")
    if device == "cuda" and torch.cuda.device_count() < nproc:
        raise ValueError(
            f"--nproc {nproc} needs {nproc} GPUs (NCCL: one per rank); found {torch.cuda.device_count()}"
        )
    load_manifest(model)  # fail early on a bad name
    threads = max(1, (os.cpu_count() or 1) // nproc) if device == "cpu" else 1
    with tempfile.TemporaryDirectory() as out:
        config = dict(
            model=model, device=device, ns_dtype=str(ns_dtype).removeprefix("torch."), steps=steps,
            warmup=warmup, mode=mode, threads=threads, port=_free_port(), out=out, optimizer=optimizer,
        )  # fmt: skip
        mp.start_processes(_worker, args=(nproc, config), nprocs=nproc, start_method="spawn")
        ranks = []
        for r in range(nproc):
            with open(os.path.join(out, f"rank{r}.json")) as f:
                ranks.append(json.load(f))
    single = max(r.pop("single_ns_seconds") for r in ranks)
    slowest = max(r["ns_seconds"] for r in ranks)
    (stepped,) = {r.pop("optimizer") for r in ranks}  # the class every rank stepped
    return dict(
        model=model,
        optimizer=stepped,
        mode=mode,
        nproc=nproc,
        device=device,
        backend="nccl" if device == "cuda" else "gloo",
        ns_dtype=config["ns_dtype"],
        threads_per_rank=threads,
        steps=steps,
        single_process_ns_seconds=single,
        ranks=ranks,
        ns_speedup=single / slowest if slowest > 0 else float("nan"),
        ideal_ns_speedup=1 / max(r["flop_share"] for r in ranks),
        bytes_per_step=sum(r["bytes_received"] for r in ranks),
    )


def _worker(rank: int, world: int, config: dict[str, Any]) -> None:
    torch.set_num_threads(config["threads"])
    cuda = config["device"] == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    dist.init_process_group(
        "nccl" if cuda else "gloo",
        init_method=f"tcp://127.0.0.1:{config['port']}",
        rank=rank,
        world_size=world,
        device_id=device if cuda else None,
    )
    try:
        manifest = load_manifest(config["model"])
        ns_dtype = DTYPES[config["ns_dtype"]]
        params, grads = _tensors(manifest, device)
        mesh = None
        if config["mode"] in ("fsdp", "hsdp"):
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.tensor import Placement, Replicate, Shard, distribute_tensor

            placements: list[Placement]
            if config["mode"] == "fsdp":
                mesh, placements = init_device_mesh(device.type, (world,)), [Shard(0)]
            else:
                names = ("replicate", "shard")
                mesh = init_device_mesh(device.type, (2, world // 2), mesh_dim_names=names)
                placements = [Replicate(), Shard(0)]
            params = [distribute_tensor(p, mesh, placements) for p in params]
            grads = [distribute_tensor(g, mesh, placements) for g in grads]
        opt = _optimizer(
            config["optimizer"],
            manifest,
            params,
            ns_dtype,
            process_group=dist.group.WORLD if mesh is None else None,
        )
        for p, g in zip(params, grads):
            p.grad = g
        # The baseline: the same step without sharing (every rank orthogonalises every matrix, as
        # a plain Muon under DDP does), interleaved step by step with the shared one so both see
        # the same contention for cores.
        unshared, unshared_ns = _unshared_optimizer(config["optimizer"], manifest, device, ns_dtype)
        figures: dict[str, list[float]] = {k: [] for k in ("ns", "comm", "step", "sent", "received")}
        for t in range(config["warmup"] + config["steps"]):
            for engine in opt.orthogonalizers():
                engine.profile = True
            dist.barrier()
            synchronize(device)
            t0 = time.perf_counter()
            opt.step()
            synchronize(device)
            step_seconds = time.perf_counter() - t0
            dist.barrier()
            unshared.step()
            if t < config["warmup"]:
                unshared_ns.clear()
                continue
            stats = opt.orthogonalizers()[0].stats
            figures["step"].append(step_seconds)
            figures["ns"].append(stats.ns_seconds)
            figures["comm"].append(stats.comm_seconds)
            figures["sent"].append(stats.bytes_sent)
            figures["received"].append(stats.bytes_received)
        stats = opt.orthogonalizers()[0].stats
        result = dict(
            rank=rank,
            optimizer=type(opt).__name__,
            ns_seconds=statistics.median(figures["ns"]),
            comm_seconds=statistics.median(figures["comm"]),
            step_seconds=statistics.median(figures["step"]),
            bytes_sent=int(statistics.median(figures["sent"])),
            bytes_received=int(statistics.median(figures["received"])),
            flop_share=stats.owned_flops / stats.total_flops,
            single_ns_seconds=statistics.median(unshared_ns),
        )
        with open(os.path.join(config["out"], f"rank{rank}.json"), "w") as f:
            json.dump(result, f)
    finally:
        dist.destroy_process_group()


def _tensors(manifest, device) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Parameters and gradients from the manifest's shapes, equal on every rank (fixed seed)."""
    gen = torch.Generator().manual_seed(0)
    params = [(torch.randn(s["shape"], generator=gen) * 0.02).to(device) for s in manifest["params"]]
    grads = [torch.randn(s["shape"], generator=gen).to(device) for s in manifest["params"]]
    return params, grads


def _groups(manifest, params) -> list[dict[str, Any]]:
    groups = [dict(g, params=[]) for g in manifest["param_groups"]]
    for p, spec in zip(params, manifest["params"]):
        groups[spec["group"]]["params"].append(p)
    return [g for g in groups if g["params"]]


def _optimizer(
    optimizer: str, manifest: dict[str, Any], params: list[torch.Tensor], ns_dtype: torch.dtype, **extra: Any
) -> Any:
    """The fastmuon optimizer of the update rule ``optimizer`` on the manifest's groups, with the
    manifest's optimizer kwargs that it takes (MuSGD's ``muon`` and ``sgd`` mean nothing to the others)."""
    cls = CLASSES[optimizer]
    kwargs, _ = accepted_kwargs(cls, manifest["optimizer_kwargs"])
    return cls(_groups(manifest, params), ns_dtype=ns_dtype, **kwargs, **extra)


def _unshared_optimizer(optimizer: str, manifest, device, ns_dtype) -> tuple[Any, list[float]]:
    """The same optimizer, unshared, on a copy of the workload, and the list its NS seconds go to."""
    params, grads = _tensors(manifest, device)
    opt = _optimizer(optimizer, manifest, params, ns_dtype)
    for p, g in zip(params, grads):
        p.grad = g
    times: list[float] = []

    def timed(run: Callable[[], list[torch.Tensor]]) -> list[torch.Tensor]:
        synchronize(device)
        t0 = time.perf_counter()
        out = run()
        synchronize(device)
        times.append(time.perf_counter() - t0)
        return out

    opt.register_orthogonalize_hook(timed)
    return opt, times


# ----- CLI ------------------------------------------------------------------------------------
def format_table(r: dict[str, Any], width: int | None = None) -> str:
    """The report, its prose wrapped to ``width`` columns (default: the terminal's)."""
    from ..tools.tables import terminal_width, wrapped

    width = width or terminal_width()
    lines = wrapped(
        f"{r['model']} {r['optimizer']}, {r['mode']}: {r['nproc']} ranks on {r['device']} ({r['backend']}), "
        f"ns_dtype={r['ns_dtype']}, {counted(r['threads_per_rank'], 'thread')} per rank, "
        f"median of {counted(r['steps'], 'step')}",
        width,
    )
    lines.append(
        f"{'rank':>4} {'NS share':>9} {'NS ms':>8} {'exchange ms':>12} {'step ms':>8} {'sent MB':>8} {'recv MB':>8}"
    )
    for x in r["ranks"]:
        lines.append(
            f"{x['rank']:>4} {100 * x['flop_share']:>8.1f}% {1e3 * x['ns_seconds']:>8.2f} "
            f"{1e3 * x['comm_seconds']:>12.2f} {1e3 * x['step_seconds']:>8.2f} "
            f"{x['bytes_sent'] / 1e6:>8.3f} {x['bytes_received'] / 1e6:>8.3f}"
        )
    prose = [
        f"unshared NS (every rank does every matrix): {1e3 * r['single_process_ns_seconds']:.2f} ms/step",
        f"NS speedup per rank: {r['ns_speedup']:.2f}x (FLOP-balance bound {r['ideal_ns_speedup']:.2f}x)",
    ]
    if r["ns_speedup"] > 1.05 * r["ideal_ns_speedup"]:
        prose.append(
            "the speedup is above the bound, which splitting the FLOPs alone cannot give: the unshared NS "
            "was timed on every rank at once, the ranks competing for the same cores, caches and memory, "
            "and a rank's smaller share fits its caches better; read it as this machine's figure, not "
            "as less work"
        )
    prose.append(f"bytes communicated per step (all ranks receiving): {r['bytes_per_step'] / 1e6:.3f} MB")
    for text in prose:
        lines += wrapped(text, width)
    return "\n".join(lines)
