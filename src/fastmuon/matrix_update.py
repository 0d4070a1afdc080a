"""The Muon half of a step, shared by MuSGD and Muon: momentum → orthogonalise → scale → apply.

Both optimizers update every matrix as ``p ← decay·p − scale·NS(EMA momentum)``; they differ
only in ``decay`` (Muon's decoupled weight decay; 1 for MuSGD) and in what ``scale`` holds.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from .compute import compute_dtype
from .engine import NSConfig
from .newton_schulz import newton_schulz
from .transforms import apply_updates_, ema_momentum_, partition

#: ``(sources, params, configs) -> updates``: how a step hands its matrices to the engine.
Orthogonalize = Callable[[Sequence[Tensor], Sequence[Tensor], Sequence[NSConfig]], list[Tensor]]
#: ``(params, configs) -> views or None``: where the engine will read each source from, so the
#: momentum step can write it there (``MatrixOptimizer.ns_inputs``).
NSInputs = Callable[[Sequence[Tensor], Sequence[NSConfig]], "list[Tensor] | None"]


@dataclass
class MatrixItem:
    """One matrix's Muon update: ``p ← decay·p − scale·NS(momentum)``."""

    param: Tensor
    grad: Tensor
    buf: Tensor  # the EMA momentum M
    beta: float
    nesterov: bool
    scale: float  # lr times the optimizer's factors
    config: NSConfig
    decay: float = 1.0  # 1 − lr·wd for decoupled weight decay


def batch_order(items: list[MatrixItem]) -> list[list[MatrixItem]]:
    """The matrices split by what their momentum step shares (β, Nesterov, device, dtype), in
    the order the batched path hands them to the engine (and so to the planner)."""
    return list(partition(items, lambda i: (i.beta, i.nesterov, i.param.device, i.param.dtype)).values())


def multi_tensor_matrix_update(
    items: list[MatrixItem], orthogonalize: Orthogonalize, ns_inputs: NSInputs | None = None
) -> None:
    """The batched path: one foreach call per set of shared scalars, one NS call per bucket.

    With ``ns_inputs`` the momentum step writes its result straight into the NS engine's input
    buffers where the engine offers them (a CPU), instead of into fresh tensors that the engine
    then copies in: one pass over the matrices and an allocation fewer.
    """
    parts = batch_order(items)
    ordered = [i for part in parts for i in part]
    if not ordered:
        return
    params, configs = [i.param for i in ordered], [i.config for i in ordered]
    inputs = ns_inputs(params, configs) if ns_inputs is not None else None
    # 1. momentum, one foreach call per (β, nesterov, device, dtype)
    sources: list[Tensor] = []
    for part in parts:
        out = inputs[len(sources) : len(sources) + len(part)] if inputs is not None else None
        bufs, grads = [i.buf for i in part], [i.grad for i in part]
        sources += ema_momentum_(bufs, grads, part[0].beta, part[0].nesterov, out=out)
    # 2. orthogonalise, one NS call per bucket of the cached plan
    updates = orthogonalize(sources, params, configs)
    # 3-4. decay, scale and apply
    decays = [i.decay for i in ordered]
    if any(d != 1 for d in decays):
        torch._foreach_mul_(params, decays)
    apply_updates_(params, updates, [i.scale for i in ordered], owned=True)


def single_tensor_matrix_update(items: list[MatrixItem]) -> None:
    """The same update, one parameter at a time: the per-parameter reference path."""
    for it in items:
        it.buf.lerp_(it.grad, 1 - it.beta)
        u = it.grad.lerp(it.buf, it.beta) if it.nesterov else it.buf
        c = it.config
        dtype = compute_dtype(c.dtype, u.device)  # the precision the batched path runs in too
        o = newton_schulz(u.reshape(u.shape[0], -1), c.steps, list(c.coefficients), c.eps, dtype)
        if it.decay != 1:
            it.param.mul_(it.decay)
        it.param.sub_(o.reshape(it.param.shape).to(it.param.dtype) * it.scale)
