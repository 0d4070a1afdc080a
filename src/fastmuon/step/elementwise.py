"""The elementwise steps of the update pipeline, each one fused ``torch._foreach_*`` call or two.

momentum → orthogonalise → scale → apply: the optimizers compose these over lists of tensors
(one list per set of shared hyperparameters), so the elementwise work costs a handful of
kernels per step however many parameters there are. Nothing here writes to a gradient, and a
function that returns a buffer it also modifies says so.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

import torch
from torch import Tensor

from ..ns import device
from .state_dtype import arithmetic_dtype, store_, widened

ADJUST_LR = ("ultralytics", "original", "match_rms_adamw", "spectral_unclamped", "none")

#: the update RMS "match_rms_adamw" aims at unless a group sets ``rms_scale``: Moonlight's 0.2
#: (an AdamW update's typical RMS); DeepSeek-V4 reports 0.18
RMS_SCALE = 0.2

#: MuSGD's second name for the lr-factor option ``adjust_lr_fn`` (a keyword and a group key)
ADJUST_LR_ALIAS = "adjust_lr"

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
        # the foreach ops return a list (torch's stub says a tuple)
        return torch._foreach_lerp(grads, bufs, beta) if nesterov else bufs  # type: ignore[return-value]
    torch._foreach_copy_(out, grads if nesterov else bufs)
    if nesterov:
        torch._foreach_lerp_(out, bufs, beta)  # g + β·(M − g), as the out-of-place lerp computes it
    return out


def ema_momentum_cast_(
    bufs: list[Tensor], grads: list[Tensor], beta: float, nesterov: bool, out: list[Tensor]
) -> list[Tensor]:
    """:func:`ema_momentum_` writing the update into ``out`` of other dtypes (e.g. bf16 views of
    NS input buffers for fp32 momentum): each value is computed in the buffers' dtype and
    rounded once on the store, as computing it and then casting does, in one pass instead of
    a fresh tensor and a casting copy."""
    torch._foreach_lerp_(bufs, grads, 1 - beta)
    if nesterov:
        for g, m, o in zip(grads, bufs, out):
            torch.lerp(g, m, beta, out=o)
    else:
        torch._foreach_copy_(out, bufs)
    return out


def ema_momentum_widened_(
    bufs: list[Tensor],
    grads: list[Tensor],
    beta: float,
    nesterov: bool,
    out: list[Tensor] | None = None,
    *,
    dtype: torch.dtype,
) -> list[Tensor]:
    """:func:`ema_momentum_` for buffers stored in another dtype than the arithmetic's ``dtype``
    (see :mod:`fastmuon.step.state_dtype`): ``M`` is read into ``dtype`` once, stepped there and
    written back rounded once; the update (``out`` if given, else fresh tensors in ``dtype``) is
    computed from the unrounded ``M``, rounded once on the store into an ``out`` of another dtype."""
    m, g = widened(bufs, dtype), widened(grads, dtype)
    if out is not None and any(o.dtype != dtype for o in out):
        update = ema_momentum_cast_(m, g, beta, nesterov, out)
    else:
        update = ema_momentum_(m, g, beta, nesterov, out)
    store_(bufs, m)
    return update


def fusable(p: Tensor, *others: Tensor, cuda: bool = False) -> bool:
    """Whether torch's fused optimizer kernels (``_fused_sgd_``, ``_fused_adamw_``) get ``p``
    and its gradient and state (``others``) right: on the host's CPU, and with ``cuda`` on CUDA
    too, where ``torch.optim``'s ``fused=True`` runs them (one launch per call there, where the
    foreach path takes several; the SGD kernel only: the AdamW one wants its step counts on the
    device, and ours stay on the host as torch's unfused AdamW keeps them). They walk the
    tensors' memory in step without looking at strides, so all must share one dense layout (a
    channels_last weight with a contiguous gradient gets a wrong update); the SGD kernel's
    bf16/fp16 path misreads the momentum buffer in torch 2.13, so fp32/fp64 only. Not under
    ``torch.compile`` (the ops have no fake kernel)."""
    return fused_kernel_on(p.device, cuda) and (
        p.dtype in (torch.float32, torch.float64)
        and all(t.dtype == p.dtype and t.device == p.device and t.stride() == p.stride() for t in others)
        and (p.is_contiguous() or p.is_contiguous(memory_format=torch.channels_last))
        and not torch.compiler.is_compiling()
    )


def fused_kernel_on(where: torch.device, cuda: bool = False) -> bool:
    """Whether :func:`fusable` takes torch's fused kernels on ``where``: the host's CPU, and with
    ``cuda`` a CUDA device."""
    return device.is_host(where) or (cuda and where.type == "cuda")


def fusable_stored(p: Tensor, grad: Tensor, buffers: Sequence[Tensor], cuda: bool = False) -> bool:
    """:func:`fusable` for ``p``'s state ``buffers`` wherever they are stored (see
    :mod:`fastmuon.step.state_dtype`): in ``p``'s dtype the kernel steps them as they are; in
    another it steps their working copies, which take the arithmetic dtype and the buffers'
    strides, so that dtype must be ``p``'s (fp32 parameters, narrower state)."""
    if all(b.dtype == p.dtype for b in buffers):
        return fusable(p, grad, *buffers, cuda=cuda)
    return (
        all(arithmetic_dtype(p.dtype, b.dtype) == p.dtype for b in buffers)
        and all(b.device == p.device and b.stride() == p.stride() for b in buffers)
        and fusable(p, grad, cuda=cuda)
    )


def foreach_scalar(value: float, like: Tensor, host: bool) -> float | Tensor:
    """``value`` for a foreach multiply of tensors like ``like``: on the host's CPU (``host``) a
    0-d tensor, since there each tensor's ``mul_`` by a Python number first wraps the number in a
    new tensor (five extra ops per tensor). It takes ``like``'s dtype, as that wrapping does, so
    the products are bit for bit the same (any other dtype rounds differently)."""
    return torch.tensor(value, dtype=like.dtype) if host else value


def lr_factor(group: Mapping[str, Any], index: int, default: str) -> tuple[str, float]:
    """A group's per-matrix learning-rate factor: its ``adjust_lr_fn`` (``default`` where it is
    None) and its ``rms_scale``. An ``adjust_lr`` key (MuSGD's alias, read where a group is
    added) set on a group afterwards would be ignored, so it is refused here, before anything
    changes."""
    if ADJUST_LR_ALIAS in group:
        raise ValueError(
            f"param group {index} has {ADJUST_LR_ALIAS}={group[ADJUST_LR_ALIAS]!r}, set after the group "
            "was added, which the step does not read; set group['adjust_lr_fn'] instead and delete "
            "the adjust_lr entry"
        )
    mode = group["adjust_lr_fn"]
    return (default if mode is None else mode), group.get("rms_scale", RMS_SCALE)


def lr_scale(mode: str, shape: Sequence[int], rms_scale: float = RMS_SCALE) -> float:
    """The per-matrix factor on the orthogonalised update (``s`` in "Update rules" in
    docs/optimizers.md); ``rms_scale`` is the update RMS "match_rms_adamw" aims at."""
    rows, cols = shape[0], math.prod(shape[1:])
    if mode == "ultralytics":  # on the raw tensor's last two dims: 1 for square conv kernels
        return math.sqrt(max(1.0, shape[-2] / shape[-1]))
    if mode == "original":
        return math.sqrt(max(1.0, rows / cols))
    if mode == "match_rms_adamw":
        return rms_scale * math.sqrt(max(rows, cols))
    if mode == "spectral_unclamped":  # keeps the update's spectral norm at sqrt(rows/cols), wide ones too
        return math.sqrt(rows / cols)
    if mode == "none":
        return 1.0
    raise ValueError(f"unknown adjust_lr_fn {mode!r}; choose one of {ADJUST_LR}")


def partition(items: Iterable[T], key: Callable[[T], Hashable]) -> dict[Hashable, list[T]]:
    """Group items by key, keeping first-seen order (one foreach call per group)."""
    groups: dict[Hashable, list[T]] = {}
    for item in items:
        groups.setdefault(key(item), []).append(item)
    return groups
