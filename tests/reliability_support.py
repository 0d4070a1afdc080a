"""Shared pieces of the reliability tests: parameter sets and per-parameter reference runs."""

from __future__ import annotations

import weakref

import torch
from reference_impl import adamw_reference_step, muon_reference_step, musgd_reference_step
from torch.utils._python_dispatch import TorchDispatchMode


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


class AllocationTracker(TorchDispatchMode):
    """Live bytes of the tensors created by the ops run under it, and their peak.

    A new storage (one that no input of the op shares) counts from the op that makes it until
    the last tensor viewing it is garbage collected; storages that existed before (parameters,
    state, persistent bucket buffers) and kernels' private scratch space are not counted.
    """

    def __init__(self):
        super().__init__()
        self.live = 0
        self.peak = 0
        self._refs: dict[int, list] = {}  # data_ptr -> [nbytes, live tensor count]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {
            t.untyped_storage().data_ptr()
            for t in torch.utils._pytree.tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor)
        }
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes() > 0:
                self._track(t, inputs)
        return out

    def _track(self, t: torch.Tensor, inputs: set[int]) -> None:
        ptr = t.untyped_storage().data_ptr()
        entry = self._refs.get(ptr)
        if entry is None:
            if ptr in inputs:
                return  # an in-place result or a view of something that predates the tracker
            entry = self._refs[ptr] = [t.untyped_storage().nbytes(), 0]
            self.live += entry[0]
            self.peak = max(self.peak, self.live)
        entry[1] += 1
        weakref.finalize(t, self._release, ptr)

    def _release(self, ptr: int) -> None:
        entry = self._refs[ptr]
        entry[1] -= 1
        if entry[1] == 0:
            self.live -= entry[0]
            del self._refs[ptr]


def nonfinite_worker(rank: int, world: int, init_file: str, mode: str, out_dir: str) -> None:
    """One rank of a replicated (DDP-style) MuSGD whose rank 1 alone sees a NaN gradient."""
    import torch.distributed as dist

    import fastmuon

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        params = make_params([(6, 4), (6, 4), (5,)])
        opt = fastmuon.MuSGD(
            params,
            lr=0.1,
            momentum=0.9,
            ns_dtype=torch.float32,
            process_group=dist.group.WORLD,
            nonfinite=mode,
        )
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
