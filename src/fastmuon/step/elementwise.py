"""The elementwise steps of the update pipeline, each one fused ``torch._foreach_*`` call or two.

momentum → orthogonalise → scale → apply: the optimizers compose these over lists of tensors
(one list per set of shared hyperparameters), so the elementwise work costs a handful of
kernels per step however many parameters there are. Nothing here writes to a gradient, and a
function that returns a buffer it also modifies says so.
"""

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
