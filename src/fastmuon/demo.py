"""``fastmuon demo``: one look at the step on yolo26n's real shapes (time and kernels)."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from importlib import resources

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from . import MuSGD
from .reference import ReferenceMuSGD


class _OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="yolo26n", help="bundled manifest name (yolo26n..x)")
    p.add_argument("--steps", type=int, default=5)


def run(args: argparse.Namespace) -> int:
    manifest = json.loads(resources.files("fastmuon").joinpath(f"models/{args.model}.json").read_text())
    torch.manual_seed(0)
    for name, cls in (("fastmuon MuSGD", MuSGD), ("per-parameter", ReferenceMuSGD)):
        params = [torch.zeros(p["shape"], requires_grad=True) for p in manifest["params"]]
        for p in params:
            p.grad = torch.randn_like(p)
        groups = [dict(g, params=[]) for g in manifest["param_groups"]]
        for p, spec in zip(params, manifest["params"]):
            groups[spec["group"]]["params"].append(p)
        opt = cls([g for g in groups if g["params"]], **manifest["optimizer_kwargs"])
        opt.step()
        with _OpCounter() as counter:
            opt.step()
        times = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            opt.step()
            times.append(time.perf_counter() - t0)
        print(f"{name:16s} {1e3 * statistics.median(times):8.1f} ms/step  {counter.count:6d} ops/step")
    return 0
