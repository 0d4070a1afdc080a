"""AdamW for the parameters Muon does not orthogonalise (embeddings, norms, biases, heads).

Same maths and state keys as ``torch.optim.AdamW`` (``step``, ``exp_avg``, ``exp_avg_sq``): torch's
fused kernel where it is exact (:func:`~fastmuon.step.elementwise.fusable`), else a few foreach
calls per set of shared hyperparameters. Off the host, large fp32 tensors mask their own update
where their gradient is rejected (:class:`Masks`), so a skipped step copies none of them."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import Tensor

from ..ns import device
from ..ns.engine import Gather
from .elementwise import Scalar, foreach_scalar, fusable_stored, partition
from .state_dtype import arithmetic_dtype, store_, widened


@dataclass
class AdamWItem:
    param: Tensor
    grad: Tensor
    exp_avg: Tensor
    exp_avg_sq: Tensor
    step: Tensor  # a float32 scalar on the CPU, as torch keeps it: reading it never syncs a GPU
    lr: float
    betas: tuple[float, float]
    eps: float
    weight_decay: float
    group: int = 0  # the param group it belongs to (whose hyperparameters a program reads)
    index: int = 0  # its position among the step's parameters with gradients


def adamw_state(
    state: dict[str, Any], p: Tensor, capturable: bool = False, dtype: torch.dtype | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """``p``'s state, made on its first step, the moments in ``dtype`` (None: ``p``'s); the step
    count a float32 CPU scalar (reading it never syncs a GPU) or, ``capturable``, on ``p``'s device."""
    if "exp_avg" not in state:
        state["step"] = torch.tensor(0.0, dtype=torch.float32, device=p.device if capturable else None)
        state["exp_avg"] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
    return state["exp_avg"], state["exp_avg_sq"], state["step"]


def single_tensor_adamw(items: list[AdamWItem]) -> None:
    for it in items:
        beta1, beta2 = it.betas
        it.step.add_(1.0)
        s = float(it.step)
        dtype = arithmetic_dtype(it.param.dtype, it.exp_avg.dtype)
        if dtype is None:
            exp_avg, exp_avg_sq, grad = it.exp_avg, it.exp_avg_sq, it.grad
        else:
            exp_avg, exp_avg_sq, grad = (t.to(dtype) for t in (it.exp_avg, it.exp_avg_sq, it.grad))
        it.param.mul_(1 - it.lr * it.weight_decay)
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        store_([it.exp_avg, it.exp_avg_sq], [exp_avg, exp_avg_sq])
        denom = (exp_avg_sq.sqrt() / math.sqrt(1 - beta2**s)).add_(it.eps)
        it.param.addcdiv_(exp_avg, denom, value=-it.lr / (1 - beta1**s))


@dataclass
class AdamWScalars:
    """This step's AdamW hyperparameters, one entry per param group."""

    lr: Sequence[Scalar]
    betas: Sequence[tuple[float, float]]
    eps: Sequence[float]
    weight_decay: Sequence[float]


class AdamWClasses(NamedTuple):
    """Each param group's equality class of every AdamW hyperparameter: the program's partition."""

    lr: tuple[int, ...]
    betas: tuple[int, ...]
    eps: tuple[int, ...]
    weight_decay: tuple[int, ...]


@dataclass
class AdamWPart:
    """One class of AdamW's parameters stepped by one kernel call; ``dtype``: see ``arithmetic_dtype``."""

    group: int
    params: list[Tensor]
    pick: Gather
    exp_avgs: list[Tensor]
    exp_avg_sqs: list[Tensor]
    steps: list[Tensor]
    dtype: torch.dtype | None


@dataclass
class FusedAdamWPart(AdamWPart):
    """A part for torch's fused kernel, with the strides it was found exact for."""

    grad_strides: list[tuple[int, ...]]
    param_strides: list[tuple[int, ...]]


@dataclass
class ForeachAdamWPart(AdamWPart):
    """A part for the foreach kernels; ``flag_places``: its members' places in the keep vector
    where it masks its own update (None: a rejected step copies and puts it back)."""

    host: bool
    flag_places: tuple[int, ...] | None = None
    flag_index: dict[torch.device, Tensor] = field(default_factory=dict)

    def masks(self, keep: Tensor | None) -> Masks | None:
        """This step's :class:`Masks` of a masking part (None: nothing to mask)."""
        if keep is None or self.flag_places is None:
            return None
        index = self.flag_index.get(keep.device)
        if index is None:
            index = self.flag_index[keep.device] = torch.tensor(self.flag_places, device=keep.device)
        return Masks(keep.index_select(0, index))


#: From this many elements an fp32 tensor masks its own update: a few launches, not a copy and a restore.
MASK_MIN_ELEMENTS = 2**20


class Masks:
    """A masking part's keep flags (one per member, on the device) and the per-member 0-d factors
    they make: a step's own factor where kept, the neutral one where rejected. A rejected member's
    gradient is read as zeros (no NaN is ever multiplied) and its update divided by an infinite
    denominator, so it ends the step as it began (a −0.0 may come back as +0.0); a kept one gets
    the unmasked step's values, each factor the fp32 value the foreach kernels make of a number."""

    def __init__(self, flags: Tensor):
        self.flags = flags
        self.rejected = list((~flags).unbind(0))

    def factors(self, value: float | Tensor, neutral: float) -> list[Tensor]:
        return list(torch.where(self.flags, value, neutral).unbind(0))

    def scale_(self, tensors: Sequence[Tensor], factor: float | Tensor) -> None:
        """``t ← t·factor``, a rejected member's times 1."""
        for t, f in zip(tensors, self.factors(factor, 1.0)):
            t.mul_(f)

    def grads(self, grads: Sequence[Tensor]) -> list[Tensor]:
        """The gradients with a rejected one read as zeros."""
        return [g.masked_fill(r, 0) for g, r in zip(grads, self.rejected)]

    def add_eps_(self, denom: Sequence[Tensor], eps: float) -> None:
        """``d ← d + ε``, a rejected member's ``d + ∞``: its update is then exactly zero."""
        for d, e in zip(denom, self.factors(eps, math.inf)):
            d.add_(e)


def _moments_(
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    grads: list[Tensor],
    betas: tuple[float, float],
    beta2_factor: float | Tensor,
    masks: Masks | None,
) -> None:
    """``m ← lerp(m, g, 1−β1)``, ``v ← β2·v + (1−β2)·g²`` (``beta2_factor``: β2 as the foreach
    multiply takes it); masked, a rejected member's moments stay as they were."""
    beta1, beta2 = betas
    if masks is None:
        torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
        torch._foreach_mul_(exp_avg_sqs, beta2_factor)
    else:
        for m, g, w in zip(exp_avgs, grads, masks.factors(1 - beta1, 0.0)):
            m.lerp_(g, w)
        masks.scale_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1 - beta2)


def _masks_itself(item: AdamWItem) -> bool:
    """Off the host, large, fp32: only there does a masked factor round as the kernels' number does."""
    p = item.param
    return (
        not device.is_host(p.device)
        and p.dtype == torch.float32
        and item.exp_avg.dtype == p.dtype
        and item.exp_avg_sq.dtype == p.dtype
        and p.numel() >= MASK_MIN_ELEMENTS
    )


class AdamWProgram:
    """AdamW over fixed lists, prepared once, in parts per class of hyperparameters, device and
    dtypes. With ``capturable`` no kernel reads a value on the host (step counts and bias corrections
    on the device); with ``masking`` (a step may be given keep flags) the tensors that qualify
    (:func:`_masks_itself`) make parts that mask their own update."""

    def __init__(
        self, items: list[AdamWItem], classes: AdamWClasses, capturable: bool, masking: bool = False
    ):
        self.positions = frozenset(i.index for i in items)  # the step's parameters it updates
        lr_c, betas_c, eps_c, wd_c = classes.lr, classes.betas, classes.eps, classes.weight_decay
        self.capturable = capturable
        by_kernel = partition(
            items, lambda i: not capturable and fusable_stored(i.param, i.grad, [i.exp_avg, i.exp_avg_sq])
        )

        def lists(part: list[AdamWItem]) -> dict[str, Any]:
            return dict(
                group=part[0].group,
                params=[i.param for i in part],
                pick=Gather([i.index for i in part]),
                exp_avgs=[i.exp_avg for i in part],
                exp_avg_sqs=[i.exp_avg_sq for i in part],
                steps=[i.step for i in part],
                dtype=arithmetic_dtype(part[0].param.dtype, part[0].exp_avg.dtype),
            )

        fused = by_kernel.get(True, [])
        self.fused = [
            FusedAdamWPart(
                **lists(part),
                grad_strides=[i.grad.stride() for i in part],
                param_strides=[i.param.stride() for i in part],
            )
            for part in partition(
                fused,
                lambda i: (
                    lr_c[i.group],
                    betas_c[i.group],
                    eps_c[i.group],
                    wd_c[i.group],
                    i.param.dtype,
                    i.exp_avg.dtype,
                ),
            ).values()
        ]
        rest = by_kernel.get(False, [])

        def masks_itself(i: AdamWItem) -> bool:
            return masking and not capturable and _masks_itself(i)

        self.rest = [  # one learning rate per part: it may be a tensor, used as one
            ForeachAdamWPart(
                **lists(part),
                host=device.is_host(part[0].param.device),
                flag_places=tuple(i.index for i in part) if masks_itself(part[0]) else None,
            )
            for part in partition(
                rest,
                lambda i: (
                    betas_c[i.group],
                    eps_c[i.group],
                    wd_c[i.group],
                    i.param.device,
                    i.param.dtype,
                    i.exp_avg.dtype,
                    lr_c[i.group],
                    masks_itself(i),
                ),
            ).values()
        ]
        self.masked_positions = frozenset(i.index for i in rest if masks_itself(i))

    def fits(self, grads: Sequence[Tensor]) -> bool:
        """The fused kernel walks memory without looking at strides (see :func:`~fastmuon.step.elementwise.fusable`)."""
        for part in self.fused:
            if (
                list(map(Tensor.stride, part.pick(grads))) != part.grad_strides
                or list(map(Tensor.stride, part.params)) != part.param_strides
            ):
                return False
        return True

    def self_masked(self) -> frozenset[int]:
        """The parameters whose update masks itself where ``keep`` rejects their gradient."""
        return self.masked_positions

    @torch._disable_dynamo
    def _run_fused(self, grads: Sequence[Tensor], s: AdamWScalars) -> None:
        """The fused parts' calls, never traced (the kernel has no fake one), even in a compiled frame."""
        for f in self.fused:
            g = f.group
            beta1, beta2 = s.betas[g]
            avgs, avg_sqs = f.exp_avgs, f.exp_avg_sqs
            if f.dtype is not None:  # working copies in the parameters' dtype (see fusable_stored)
                avgs, avg_sqs = widened(f.exp_avgs, f.dtype), widened(f.exp_avg_sqs, f.dtype)
            torch._foreach_add_(f.steps, 1.0)
            torch._fused_adamw_(
                f.params,
                f.pick(grads),
                avgs,
                avg_sqs,
                [],  # no amsgrad
                f.steps,
                lr=s.lr[g],
                beta1=beta1,
                beta2=beta2,
                weight_decay=s.weight_decay[g],
                eps=s.eps[g],
                amsgrad=False,
                maximize=False,
            )
            if f.dtype is not None:
                store_(f.exp_avgs + f.exp_avg_sqs, avgs + avg_sqs)

    def run(self, grads: Sequence[Tensor], s: AdamWScalars, keep: Tensor | None = None) -> None:
        """One step; ``keep``: the step's keep flags (None: all kept), read by the masking parts."""
        if self.fused:
            self._run_fused(grads, s)
        for r in self.rest:
            g, lr = r.group, s.lr[r.group]
            step_grads, avgs, avg_sqs = r.pick(grads), r.exp_avgs, r.exp_avg_sqs
            if r.dtype is not None:  # moments stored narrower (or wider) than their parameters
                step_grads = widened(step_grads, r.dtype)
                avgs, avg_sqs = widened(r.exp_avgs, r.dtype), widened(r.exp_avg_sqs, r.dtype)
            masks = r.masks(keep) if r.flag_places is not None else None  # no call where none masks
            if masks is not None:
                step_grads = masks.grads(step_grads)
            args = (r.params, step_grads, avgs, avg_sqs, r.steps)
            if self.capturable or isinstance(lr, Tensor):
                _capturable_adamw(*args, lr, s.betas[g], s.eps[g], s.weight_decay[g], masks)
            else:
                _adamw(*args, lr, s.betas[g], s.eps[g], s.weight_decay[g], r.host, masks)
            if r.dtype is not None:
                store_(r.exp_avgs + r.exp_avg_sqs, avgs + avg_sqs)


def _adamw(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    steps: list[Tensor],
    lr: float,
    betas: tuple[float, float],
    eps: float,
    wd: float,
    host: bool,
    masks: Masks | None = None,
) -> None:
    """The foreach AdamW step, its step counts read on the host; ``masks``: see :class:`Masks`."""
    beta1, beta2 = betas
    torch._foreach_add_(steps, 1.0)
    counts = [float(s) for s in steps]
    if wd and masks is not None:
        masks.scale_(params, 1 - lr * wd)
    elif wd:
        torch._foreach_mul_(params, [1 - lr * wd] * len(params))
    _moments_(exp_avgs, exp_avg_sqs, grads, betas, foreach_scalar(beta2, exp_avg_sqs[0], host), masks)
    denom = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_div_(denom, [math.sqrt(1 - beta2**c) for c in counts])
    if masks is not None:
        masks.add_eps_(denom, eps)
    else:
        torch._foreach_add_(denom, eps)
    step_sizes = [-lr / (1 - beta1**c) for c in counts]
    torch._foreach_addcdiv_(params, exp_avgs, denom, step_sizes)


def _capturable_adamw(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    steps: list[Tensor],
    lr: float | Tensor,
    betas: tuple[float, float],
    eps: float,
    wd: float,
    masks: Masks | None = None,
) -> None:
    """The foreach AdamW step with nothing read on the host; ``lr``: a number or a 0-d tensor."""
    beta1, beta2 = betas
    torch._foreach_add_(steps, 1.0)
    if wd and masks is not None:
        masks.scale_(params, 1 - lr * wd)
    elif wd:
        torch._foreach_mul_(params, 1 - lr * wd)
    _moments_(exp_avgs, exp_avg_sqs, grads, betas, beta2, masks)
    correction1 = torch._foreach_pow(beta1, steps)  # β1^t
    torch._foreach_sub_(correction1, 1)
    torch._foreach_neg_(correction1)  # 1 − β1^t
    correction2 = torch._foreach_pow(beta2, steps)
    torch._foreach_sub_(correction2, 1)
    torch._foreach_neg_(correction2)
    torch._foreach_sqrt_(correction2)  # √(1 − β2^t)
    denom = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_div_(denom, correction2)
    if masks is not None:
        masks.add_eps_(denom, eps)
    else:
        torch._foreach_add_(denom, eps)
    update = torch._foreach_div(exp_avgs, denom)
    torch._foreach_div_(update, correction1)
    torch._foreach_mul_(update, lr)
    torch._foreach_sub_(params, update)
