"""The elementwise steps of the update pipeline, each one fused ``torch._foreach_*`` call or two, over
lists of tensors that share hyperparameters: a handful of kernels per step however many parameters
there are. Nothing here writes to a gradient."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any, TypeVar

import torch
from torch import Tensor

from ..ns import device
from .state_dtype import arithmetic_dtype

ADJUST_LR = ("ultralytics", "original", "match_rms_adamw", "spectral_unclamped", "none")

#: the update RMS "match_rms_adamw" aims at unless a group sets ``rms_scale``: Moonlight's 0.2
#: (an AdamW update's typical RMS); DeepSeek-V4 reports 0.18
RMS_SCALE = 0.2

#: MuSGD's second name for the lr-factor option ``adjust_lr_fn`` (a keyword and a group key)
ADJUST_LR_ALIAS = "adjust_lr"

T = TypeVar("T")


def fusable(p: Tensor, *others: Tensor, cuda: bool = False) -> bool:
    """Whether torch's fused optimizer kernels (``_fused_sgd_``, ``_fused_adamw_``) get ``p`` and
    its gradient and state (``others``) right: on the host's CPU, and with ``cuda`` on CUDA (the
    SGD kernel only: the AdamW one wants its step counts on the device). They walk memory without
    looking at strides, so all must share one dense layout; the SGD kernel's bf16/fp16 path
    misreads the momentum buffer in torch 2.13, so fp32/fp64 only. Not under ``torch.compile``."""
    return fused_kernel_on(p.device, cuda) and (
        p.dtype in (torch.float32, torch.float64)
        and all(t.dtype == p.dtype and t.device == p.device and t.stride() == p.stride() for t in others)
        and (p.is_contiguous() or p.is_contiguous(memory_format=torch.channels_last))
        and not torch.compiler.is_compiling()
    )


def fused_kernel_on(where: torch.device, cuda: bool = False) -> bool:
    """Whether :func:`fusable` takes torch's fused kernels on ``where``."""
    return device.is_host(where) or (cuda and where.type == "cuda")


def fusable_stored(p: Tensor, grad: Tensor, buffers: Sequence[Tensor], cuda: bool = False) -> bool:
    """:func:`fusable` for ``p``'s state ``buffers`` in any dtype: working copies of ones in another
    dtype take the arithmetic dtype and the buffers' strides, so that must be ``p``'s dtype."""
    if all(b.dtype == p.dtype for b in buffers):
        return fusable(p, grad, *buffers, cuda=cuda)
    return (
        all(arithmetic_dtype(p.dtype, b.dtype) == p.dtype for b in buffers)
        and all(b.device == p.device and b.stride() == p.stride() for b in buffers)
        and fusable(p, grad, cuda=cuda)
    )


def foreach_scalar(value: float, like: Tensor, host: bool) -> float | Tensor:
    """``value`` for a foreach multiply of tensors like ``like``: on the host's CPU a 0-d tensor of
    its dtype, which ``mul_`` otherwise makes of a number per tensor (products bit for bit alike)."""
    return torch.tensor(value, dtype=like.dtype) if host else value


def partition(items: Iterable[T], key: Callable[[T], Hashable]) -> dict[Hashable, list[T]]:
    """Group items by key, keeping first-seen order (one foreach call per group)."""
    groups: dict[Hashable, list[T]] = {}
    for item in items:
        groups.setdefault(key(item), []).append(item)
    return groups


#: A learning rate or a product of one: a Python number, or a 0-d tensor (used as a tensor).
Scalar = Any


def scale_limit(on: torch.device) -> int:
    """How many distinct scales take one fused ``add_`` each before one scaling pass and one
    subtracting pass over all of them cost less: every call is a launch on a GPU."""
    return 8 if device.is_host(on) else 1
