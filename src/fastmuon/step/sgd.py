"""The SGD half of MuSGD (and plain SGD): heavy-ball momentum with coupled weight decay.

``g' = g + wd·p``, ``B ← β·B + g'``, ``p ← p − lr·u`` with ``u = g' + β·B`` (Nesterov) or ``B``:
torch's fused SGD kernel where it is exact (:func:`~fastmuon.step.elementwise.fusable`), else
foreach calls with one scale class per learning rate."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ..ns import device
from ..ns.engine import Gather
from .elementwise import Scalar, foreach_scalar, fusable_stored, partition, scale_limit
from .matrix import apply_scaled_
from .state_dtype import arithmetic_dtype, store_, widened

_Strides = list[tuple[int, ...]]  # each tensor's strides
_ByScale = list[tuple[Gather, list[Tensor]]]  # the (pick, parameters) of each learning-rate class


@dataclass
class SGDItem:
    """One tensor's SGD step with coupled weight decay: ``p ← p − lr·(heavy-ball momentum)``."""

    param: Tensor
    grad: Tensor
    buf: Tensor
    beta: float
    nesterov: bool
    weight_decay: float
    lr: float
    group: int = 0  # the param group it belongs to (whose hyperparameters a program reads)
    index: int = 0  # its position among the step's parameters with gradients
    lr_slot: int = 0  # which of the step's SGD learning rates it takes (see SGDScalars.lr)


@dataclass
class SGDScalars:
    """This step's SGD hyperparameters, one entry per param group; ``lr``: indexed by ``lr_slot``."""

    beta: list[float]
    nesterov: list[bool]
    weight_decay: list[float]
    lr: list[Scalar]


@dataclass
class SGDPart:
    """One class of SGD's parameters stepped together; ``dtype``: see ``arithmetic_dtype``."""

    group: int
    params: list[Tensor]
    pick: Gather
    bufs: list[Tensor]
    dtype: torch.dtype | None


@dataclass
class FusedSGDPart(SGDPart):
    """A part for torch's fused kernel: one learning-rate class and the strides it was found exact
    for; ``flag_place``: a one-tensor part that masks its own step, its place in the keep vector."""

    lr_class: int
    grad_strides: _Strides
    param_strides: _Strides
    flag_place: int | None = None


#: Off the host, a tensor of this many elements that the fused kernel steps masks its own step: a call
#: of its own whose ``found_inf`` is its rejection (then nothing is written), not a copy and a restore.
MASK_MIN_ELEMENTS = 2**20


@dataclass
class ForeachSGDPart(SGDPart):
    """A part for the foreach kernels; ``lr_classes``: each ``by_lr`` class's index among the step's."""

    by_lr: _ByScale
    lr_classes: list[int]


def _part_lists(items: list[SGDItem], group: int, dtype: torch.dtype | None) -> dict[str, Any]:
    return dict(
        group=group,
        params=[i.param for i in items],
        pick=Gather([i.index for i in items]),
        bufs=[i.buf for i in items],
        dtype=dtype,
    )


class SGDProgram:
    """The SGD step prepared once: per (β, nesterov, wd, device, dtypes), torch's fused kernel per
    learning rate where it is exact, else foreach calls; ``lr_class``: one class per ``lr_slot``."""

    def __init__(self, items: list[SGDItem], lr_class: Sequence[int], fused_ok: bool, masking: bool = False):
        self.positions = frozenset(i.index for i in items)  # the step's parameters it updates

        def lr_key(i: SGDItem) -> int:
            return lr_class[i.lr_slot]

        self.fused: list[FusedSGDPart] = []
        self.rest: list[ForeachSGDPart] = []
        parts = partition(
            items, lambda i: (i.beta, i.nesterov, i.weight_decay, i.param.device, i.param.dtype, i.buf.dtype)
        )
        for part in parts.values():
            dtype = arithmetic_dtype(part[0].param.dtype, part[0].buf.dtype)  # one pair of dtypes per part
            by_kernel = partition(
                part,
                lambda i: fused_ok and bool(i.beta) and fusable_stored(i.param, i.grad, [i.buf], cuda=True),
            )
            g = part[0].group  # the part shares its scalars: any member's group gives them
            fused = by_kernel.get(True, [])
            if masking and dtype is None:  # a step may be given keep flags (see MASK_MIN_ELEMENTS)
                large = [
                    i
                    for i in fused
                    if not device.is_host(i.param.device) and i.param.numel() >= MASK_MIN_ELEMENTS
                ]
                for i in large:
                    self.fused.append(
                        FusedSGDPart(
                            **_part_lists([i], g, dtype),
                            lr_class=lr_key(i),
                            grad_strides=[i.grad.stride()],
                            param_strides=[i.param.stride()],
                            flag_place=i.index,
                        )
                    )
                fused = [
                    i for i in fused if i.param.numel() < MASK_MIN_ELEMENTS or device.is_host(i.param.device)
                ]
            for by_lr in partition(fused, lr_key).values():
                first = by_lr[0]
                self.fused.append(
                    FusedSGDPart(
                        **_part_lists(by_lr, g, dtype),
                        lr_class=lr_key(first),
                        grad_strides=[i.grad.stride() for i in by_lr],
                        param_strides=[i.param.stride() for i in by_lr],
                    )
                )
            rest = by_kernel.get(False, [])
            if rest:
                rest_keys = [lr_key(i) for i in rest]
                lr_classes = partition(range(len(rest)), rest_keys.__getitem__)
                self.rest.append(
                    ForeachSGDPart(
                        **_part_lists(rest, g, dtype),
                        by_lr=[(Gather(idx), [rest[k].param for k in idx]) for idx in lr_classes.values()],
                        lr_classes=[lr_key(rest[idx[0]]) for idx in lr_classes.values()],
                    )
                )
        self.limit = scale_limit(items[0].param.device) if items else 0
        self.host = device.is_host(items[0].param.device) if items else True
        self.masked_places = [f.flag_place for f in self.fused if f.flag_place is not None]
        self._flag_index: dict[torch.device, Tensor] = {}

    def fits(self, grads: Sequence[Tensor]) -> bool:
        """The fused kernel walks memory without looking at strides: the layouts must be unchanged."""
        for part in self.fused:
            if (
                list(map(Tensor.stride, part.pick(grads))) != part.grad_strides
                or list(map(Tensor.stride, part.params)) != part.param_strides
            ):
                return False
        return True

    def self_masked(self) -> frozenset[int]:
        """The parameters whose SGD step masks itself where ``keep`` rejects their gradient."""
        return frozenset(self.masked_places)

    def _rejections(self, keep: Tensor) -> dict[int, Tensor]:
        """Per masking part's flag place, its ``found_inf``: 1.0 where rejected (0-d fp32, no host read)."""
        index = self._flag_index.get(keep.device)
        if index is None:
            index = self._flag_index[keep.device] = torch.tensor(self.masked_places, device=keep.device)
        found = (~keep.index_select(0, index)).to(torch.float32)
        return dict(zip(self.masked_places, found.unbind(0)))

    @torch._disable_dynamo
    def _run_fused(self, grads: Sequence[Tensor], s: SGDScalars, rejected: dict[int, Tensor]) -> None:
        """The fused parts' calls, never traced (the kernel has no fake one), even in a compiled frame."""
        lr_of = s.lr
        for f in self.fused:
            g = f.group
            work = f.bufs if f.dtype is None else widened(f.bufs, f.dtype)
            found_inf = rejected.get(f.flag_place) if f.flag_place is not None else None
            torch._fused_sgd_(
                f.params,
                f.pick(grads),
                work,
                weight_decay=s.weight_decay[g],
                momentum=s.beta[g],
                lr=lr_of[f.lr_class],
                dampening=0.0,
                nesterov=s.nesterov[g],
                maximize=False,
                is_first_step=False,  # B starts at zeros, so β·B + g' is g' on the first step anyway
                found_inf=found_inf,
            )
            if f.dtype is not None:
                store_(f.bufs, work)

    def run(self, grads: Sequence[Tensor], s: SGDScalars, keep: Tensor | None = None) -> None:
        """One step; ``keep``: the step's keep flags (None: all kept), read by the masking parts."""
        lr_of = s.lr  # a class is the index of its first member's value
        if self.fused:
            rejected = self._rejections(keep) if keep is not None and self.masked_places else {}
            self._run_fused(grads, s, rejected)
        for r in self.rest:
            g = r.group
            step_grads, work = r.pick(grads), r.bufs
            if r.dtype is not None:  # buffers stored narrower (or wider) than their parameters
                step_grads, work = widened(step_grads, r.dtype), widened(r.bufs, r.dtype)
            foreach_sgd_step_(
                r.params,
                step_grads,
                work,
                r.by_lr,
                [lr_of[c] for c in r.lr_classes],
                s.beta[g],
                s.nesterov[g],
                s.weight_decay[g],
                self.limit,
                self.host,
            )
            if r.dtype is not None:
                store_(r.bufs, work)


def foreach_sgd_step_(
    params: list[Tensor],
    grads: list[Tensor],
    bufs: list[Tensor],
    by_lr: list[tuple[Gather, list[Tensor]]],
    lrs: list[Scalar],
    beta: float,
    nesterov: bool,
    weight_decay: float,
    limit: int,
    host: bool,
) -> None:
    """The module's SGD step in place, by foreach ops; ``by_lr`` picks each learning rate's tensors,
    ``host``: on the host's CPU. It allocates at most one list, the decayed gradients, which then
    take the Nesterov update in place; without decay Nesterov is two passes over ``p``."""
    owned = bool(weight_decay)
    if owned:  # g' as new tensors: the gradients themselves are never touched
        grads = torch._foreach_add(grads, params, alpha=weight_decay)  # type: ignore[assignment]
    if beta == 0:  # B = g' exactly (a stale buffer must not leak in)
        torch._foreach_copy_(bufs, grads)
    else:
        torch._foreach_mul_(bufs, foreach_scalar(beta, bufs[0], host))
        torch._foreach_add_(bufs, grads)
    class_params = [ps for _, ps in by_lr]

    def apply(updates: list[Tensor], scales: list[Scalar], owned: bool) -> None:
        apply_scaled_(class_params, [pick(updates) for pick, _ in by_lr], scales, owned=owned, limit=limit)

    if not nesterov:
        apply(bufs, lrs, False)
    elif owned:
        torch._foreach_add_(grads, bufs, alpha=beta)
        apply(grads, lrs, True)
    else:
        apply(grads, lrs, False)
        apply(bufs, [lr * beta for lr in lrs], False)


def single_tensor_sgd(items: list[SGDItem]) -> None:
    """The same update, one parameter at a time: the per-parameter reference path."""
    for it in items:
        dtype = arithmetic_dtype(it.param.dtype, it.buf.dtype)
        buf, grad = (it.buf, it.grad) if dtype is None else (it.buf.to(dtype), it.grad.to(dtype))
        g = grad + it.weight_decay * it.param if it.weight_decay else grad
        if it.beta == 0:
            buf.copy_(g)
        else:
            buf.mul_(it.beta).add_(g)
        if buf is not it.buf:
            it.buf.copy_(buf)
        u = g + it.beta * buf if it.nesterov else buf
        it.param.sub_(u * it.lr)
