"""The elementwise steps of the update pipeline, each one fused ``torch._foreach_*`` call or two.

momentum → orthogonalise → scale → apply: the optimizers compose these over lists of tensors
(one list per set of shared hyperparameters), so the elementwise work costs a handful of
kernels per step however many parameters there are. Nothing here writes to a gradient, and a
function that returns a buffer it also modifies says so.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import TypeVar

import torch
from torch import Tensor

ADJUST_LR = ("ultralytics", "original", "match_rms_adamw", "spectral_unclamped", "none")

T = TypeVar("T")


def ema_momentum_(
    bufs: list[Tensor], grads: list[Tensor], beta: float, nesterov: bool, out: list[Tensor] | None = None
) -> list[Tensor]:
    """``M ← β·M + (1−β)·g`` in place; returns the update ``β·M + (1−β)·g`` (Nesterov) or ``M``.

    Without ``out`` the Nesterov update is new tensors and the plain one is ``M`` itself; with
    ``out`` (tensors of the same shapes, e.g. views into the NS engine's input buffers) the
    update is written there and ``out`` returned, computed by the same operations.
    """
    torch._foreach_lerp_(bufs, grads, 1 - beta)
    if out is None:
        return torch._foreach_lerp(grads, bufs, beta) if nesterov else bufs
    torch._foreach_copy_(out, grads if nesterov else bufs)
    if nesterov:
        torch._foreach_lerp_(out, bufs, beta)  # g + β·(M − g), as the out-of-place lerp computes it
    return out


def sgd_momentum_step_(
    params: list[Tensor],
    grads: list[Tensor],
    bufs: list[Tensor],
    lrs: Sequence[float],
    beta: float,
    nesterov: bool,
    weight_decay: float,
) -> None:
    """SGD with heavy-ball momentum and coupled weight decay, in place: with ``g' = g + wd·p``,
    ``B ← β·B + g'`` and ``p ← p − lr·u``, ``u = g' + β·B`` (Nesterov) or ``B``.

    Where torch's fused SGD kernel computes this exactly (:func:`fusable`), one pass per tensor
    reads ``p``, ``g``, ``B`` and writes ``p``, ``B`` (it writes the gradients only when given a
    grad scale, which it never is here); the rest takes :func:`_foreach_sgd_momentum_step_`.
    """
    by_kernel = partition(range(len(params)), lambda i: bool(beta) and fusable(params[i], grads[i], bufs[i]))
    for lr, idx in partition(by_kernel.get(True, []), lambda i: lrs[i]).items():
        torch._fused_sgd_(
            [params[i] for i in idx],
            [grads[i] for i in idx],
            [bufs[i] for i in idx],
            weight_decay=weight_decay,
            momentum=beta,
            lr=lr,
            dampening=0.0,
            nesterov=nesterov,
            maximize=False,
            is_first_step=False,  # B starts at zeros, so β·B + g' is g' on the first step anyway
        )
    rest = by_kernel.get(False)
    if rest:
        _foreach_sgd_momentum_step_(
            [params[i] for i in rest],
            [grads[i] for i in rest],
            [bufs[i] for i in rest],
            [lrs[i] for i in rest],
            beta,
            nesterov,
            weight_decay,
        )


def fusable(p: Tensor, *others: Tensor) -> bool:
    """Whether torch's fused CPU optimizer kernels (``_fused_sgd_``, ``_fused_adamw_``) get ``p``
    and its gradient and state (``others``) right. They walk the tensors' memory in step without
    looking at strides, so all must share one dense layout (a channels_last weight with a
    contiguous gradient: errors of 0.1 for SGD, 2e-3 for AdamW at lr 1e-3, measured); the SGD
    kernel's bf16/fp16 path misreads the momentum buffer (errors of 4-31 in torch 2.13,
    measured), so fp32/fp64 only. Not under ``torch.compile`` (the ops have no fake kernel),
    and not on GPUs, where we could not test them."""
    return (
        p.device.type == "cpu"
        and p.dtype in (torch.float32, torch.float64)
        and all(t.dtype == p.dtype and t.device == p.device and t.stride() == p.stride() for t in others)
        and (p.is_contiguous() or p.is_contiguous(memory_format=torch.channels_last))
        and not torch.compiler.is_compiling()
    )


def _foreach_sgd_momentum_step_(
    params: list[Tensor],
    grads: list[Tensor],
    bufs: list[Tensor],
    lrs: Sequence[float],
    beta: float,
    nesterov: bool,
    weight_decay: float,
) -> None:
    """:func:`sgd_momentum_step_` with foreach ops, a few passes over the data.

    Written to allocate at most one list, the decayed gradients, which then take the Nesterov
    update in place; without decay the Nesterov update is applied as two passes over ``p``.
    A fresh list as large as the model costs more than a pass over it on a CPU (yolo26n, 1
    thread: 17 ms for this step against 27 ms with two fresh lists, measured).
    """
    if not params:
        return
    owned = bool(weight_decay)
    if owned:  # g' as new tensors: the gradients themselves are never touched
        grads = torch._foreach_add(grads, params, alpha=weight_decay)
    if beta == 0:  # B = g' exactly (a stale buffer must not leak in)
        torch._foreach_copy_(bufs, grads)
    else:
        torch._foreach_mul_(bufs, foreach_scalar(beta, bufs[0]))
        torch._foreach_add_(bufs, grads)
    if not nesterov:
        apply_updates_(params, bufs, lrs, owned=False)
    elif owned:
        torch._foreach_add_(grads, bufs, alpha=beta)
        apply_updates_(params, grads, lrs, owned=True)
    else:
        apply_updates_(params, grads, lrs, owned=False)
        apply_updates_(params, bufs, [lr * beta for lr in lrs], owned=False)


def foreach_scalar(value: float, like: Tensor) -> float | Tensor:
    """``value`` for a foreach multiply: on a CPU a 0-d tensor, since there each tensor's ``mul_``
    by a Python number first wraps the number in a new tensor (five extra ops per tensor:
    2.6 vs 1.4 ms per call over yolo26n's 366 tensors, measured). It takes ``like``'s dtype, as
    that wrapping does, so the products are bit for bit the same (any other dtype rounds differently)."""
    return torch.tensor(value, dtype=like.dtype) if like.device.type == "cpu" else value


def apply_updates_(
    params: list[Tensor], updates: list[Tensor], scales: Sequence[float], *, owned: bool
) -> None:
    """``p ← p − scale·u``. With ``owned`` the updates are ours and may be scaled in place.

    Few distinct scales (typically one per learning rate) take one fused ``add_`` each, a single
    pass over the data; many take a scaling pass and a subtracting pass over all of them. On a
    GPU every call is a launch, so there "few" means at most two.
    """
    if not params:
        return
    by_scale = partition(range(len(params)), lambda i: scales[i])
    limit = 8 if params[0].device.type == "cpu" else 2
    if len(by_scale) <= limit:
        for scale, idx in by_scale.items():
            torch._foreach_add_([params[i] for i in idx], [updates[i] for i in idx], alpha=-scale)
        return
    if owned:
        torch._foreach_mul_(updates, list(scales))
        scaled = updates
    else:
        scaled = torch._foreach_mul(updates, list(scales))
    torch._foreach_sub_(params, scaled)


def lr_scale(mode: str, shape: Sequence[int]) -> float:
    """The per-matrix factor on the orthogonalised update (``s`` in the README's table)."""
    rows, cols = shape[0], math.prod(shape[1:])
    if mode == "ultralytics":  # on the raw tensor's last two dims: 1 for square conv kernels
        return math.sqrt(max(1.0, shape[-2] / shape[-1]))
    if mode == "original":
        return math.sqrt(max(1.0, rows / cols))
    if mode == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    if mode == "spectral_unclamped":  # keeps the update's spectral norm at sqrt(rows/cols), wide ones too
        return math.sqrt(rows / cols)
    if mode == "none":
        return 1.0
    raise ValueError(f"unknown adjust_lr {mode!r}; choose one of {ADJUST_LR}")


def partition(items: Iterable[T], key: Callable[[T], Hashable]) -> dict[Hashable, list[T]]:
    """Group items by key, keeping first-seen order (one foreach call per group)."""
    groups: dict[Hashable, list[T]] = {}
    for item in items:
        groups.setdefault(key(item), []).append(item)
    return groups
