"""The Muon half of a step, shared by MuSGD and Muon: momentum → orthogonalise → scale → apply.

Both optimizers update every matrix as ``p ← decay·p − scale·NS(EMA momentum)``; they differ
only in ``decay`` (Muon's decoupled weight decay; 1 for MuSGD) and in what ``scale`` holds.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ..distributed.dtensor import local_shard
from ..distributed.sharded import held_pieces
from ..matrices import MatrixMap
from ..ns.device import compute_dtype
from ..ns.engine import NSConfig, Orthogonalizer
from ..ns.gather import Gather
from ..ns.newton_schulz import newton_schulz
from .elementwise import (
    RMS_SCALE,
    ema_momentum_,
    ema_momentum_cast_,
    ema_momentum_widened_,
    lr_scale,
    partition,
)
from .program import Scalar, apply_scaled_, scale_limit
from .state_dtype import arithmetic_dtype


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
    group: int = 0  # the param group it belongs to (whose hyperparameters a program reads)
    index: int = 0  # its position among the step's parameters with gradients
    factor: float = 1.0  # the per-matrix part of ``scale`` (the optimizer's lr adjustment)
    # for one of several matrices in a tensor (see fastmuon.matrices): how a step's gradient of
    # the tensor splits into its matrices' gradients, and which of them this one is
    split: Callable[[Tensor], list[Tensor]] | None = None
    piece: int = 0
    # what the planner sees of a matrix this rank holds a shard of (a DTensor, or the
    # description of a matrix cut out of one: see fastmuon.distributed); None: ``param`` itself
    whole: Any = None
    # decay only where the update and the parameter agree in sign (cautious weight decay)
    cautious: bool = False
    # a variant's per-matrix state read after NS (see fastmuon.step.moments); None: Muon's update
    moment: Any = None


def state_buffer(state: dict[str, Any], key: str, p: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """The named momentum buffer of ``p``, created as zeros in ``p``'s memory format and in
    ``dtype`` (None: ``p``'s)."""
    buf = state.get(key)
    if buf is None:
        buf = state[key] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
    return buf


def matrix_items(
    m: MatrixMap,
    p: Tensor,
    grad: Tensor,
    state: dict[str, Any],
    *,
    beta: float,
    nesterov: bool,
    base: Any,
    adjust: str,
    config: NSConfig,
    rms_scale: float = RMS_SCALE,
    group: int,
    index: int,
    decay: Any = 1.0,
    cautious: bool = False,
    parts: Any = None,
    state_dtype: torch.dtype | None = None,
) -> list[MatrixItem]:
    """The Muon updates of ``p``, one per matrix its map ``m`` makes of it, over its EMA buffer
    ``state["momentum_buffer"]`` (made here if missing): each scaled by ``base`` times the
    learning-rate factor of its own shape (``adjust``, with ``rms_scale`` for
    "match_rms_adamw"). Views of the tensors throughout. ``parts``: in a step over DTensors,
    where each rank's part of ``p`` lies (the matrices are then this rank's parts of them).
    ``state_dtype``: the dtype a missing buffer is made in (None: ``p``'s)."""
    buf = state_buffer(state, "momentum_buffer", p, state_dtype)
    if parts is not None:
        pieces = held_pieces(m, *map(local_shard, (p, grad, buf)), parts)
    elif m.is_flatten:
        pieces = [(p, grad, buf, tuple(p.shape), None, 0, None)]
    else:
        split = m.views
        pieces = [
            (*views, shape, split, k, None)
            for k, (*views, shape) in enumerate(zip(split(p), split(grad), split(buf), m.shapes(p.shape)))
        ]
    items = []
    for view, grad_view, buf_view, shape, split, piece, whole in pieces:
        factor = lr_scale(adjust, shape, rms_scale)
        items.append(
            MatrixItem(
                view,
                grad_view,
                buf_view,
                beta,
                nesterov,
                base * factor,
                config,
                decay=decay,
                group=group,
                index=index,
                factor=factor,
                split=split,
                piece=piece,
                whole=whole,
                cautious=cautious,
            )
        )
    return items


def batch_order(items: list[MatrixItem]) -> list[list[MatrixItem]]:
    """The matrices split by what their momentum step shares (β, Nesterov, device, the dtypes
    of parameter and buffer), in the order the batched path hands them to the engine (and so to
    the planner)."""
    return list(
        partition(items, lambda i: (i.beta, i.nesterov, i.param.device, i.param.dtype, i.buf.dtype)).values()
    )


def momentum_update(it: MatrixItem) -> Tensor:
    """One matrix's EMA step ``M ← β·M + (1−β)·g`` in place, and the update NS takes (Nesterov:
    ``β·M + (1−β)·g``, else ``M``). A buffer stored in another dtype than its parameter's is
    read into the arithmetic dtype once and written back rounded once; the update is computed
    from the unrounded ``M`` (see :mod:`fastmuon.step.state_dtype`)."""
    dtype = arithmetic_dtype(it.param.dtype, it.buf.dtype)
    if dtype is None:
        it.buf.lerp_(it.grad, 1 - it.beta)
        return it.grad.lerp(it.buf, it.beta) if it.nesterov else it.buf
    m, g = it.buf.to(dtype), it.grad.to(dtype)
    m.lerp_(g, 1 - it.beta)
    if m is not it.buf:
        it.buf.copy_(m)
    return g.lerp(m, it.beta) if it.nesterov else m


def single_tensor_matrix_update(
    items: list[MatrixItem],
    after_ns: Callable[[MatrixItem, Tensor], Tensor] | None = None,
) -> None:
    """The same update, one parameter at a time: the per-parameter reference path.

    ``after_ns(item, o)`` (a variant's) maps a matrix's orthogonalised update, in the
    parameter's shape and dtype, to the update applied. A matrix whose ``moment`` says
    ``sign_input`` orthogonalises the sign of its momentum instead of the momentum."""
    for it in items:
        u = momentum_update(it)
        if getattr(it.moment, "sign_input", False):
            u = u.sign()
        c = it.config
        dtype = compute_dtype(c.dtype, u.device)  # the precision the batched path runs in too
        o = newton_schulz(
            u.reshape(u.shape[0], -1),
            c.steps,
            list(c.coefficients),
            c.eps,
            dtype,
            preconditioning=c.preconditioning,
        )
        o = o.reshape(it.param.shape).to(it.param.dtype)
        if after_ns is not None:
            o = after_ns(it, o)
        if it.cautious:
            if it.decay != 1:
                it.param.sub_(cautious_decay(it.param, o) * (1 - it.decay))
        elif it.decay != 1:
            it.param.mul_(it.decay)
        it.param.sub_(o * it.scale)


def cautious_decay(p: Tensor, update: Tensor) -> Tensor:
    """``p`` where it and ``update`` (the direction subtracted from it) agree in sign, or either
    is zero, else 0: the decayed part under cautious weight decay (Chen et al., "Cautious
    Weight Decay", arXiv 2510.12402, eq. for CWD: ``x ← x − η(u + λ·𝟙[u⊙x ≥ 0]⊙x)``)."""
    return torch.where(update * p >= 0, p, 0)


@dataclass
class MatrixScalars:
    """This step's hyperparameters of the matrix update, one entry per param group."""

    beta: Sequence[float]
    nesterov: Sequence[bool]
    base: Sequence[Scalar]  # scale = base · factor (lr·muon for MuSGD, lr for Muon)
    decay: Sequence[Scalar] | None = None  # 1 − lr·wd (Muon); None: no decay


#: ``(params, configs, wholes) -> engine``: the executor of the plan over these matrices.
EngineFor = Callable[[list, list, list], Any]


def orthogonalize_step(
    engine: Any,
    sources: Sequence[Tensor],
    dtypes: Sequence[torch.dtype],
    keep: Tensor | None,
    keep_positions: tuple[int, ...],
) -> list[Tensor]:
    """The plan's NS over a step's sources, into ``dtypes``. ``keep`` (one bool per gradient of
    the step, on the device; source ``i``'s at ``keep_positions[i]``) zeroes the rejected
    sources first: inside their bucket where the engine packs them, else before it."""
    if keep is None:
        return engine(sources, dtypes)
    if isinstance(engine, Orthogonalizer):
        return engine(sources, dtypes, keep=keep, keep_positions=keep_positions)
    flags = keep.unbind(0)
    flags = [flags[k] for k in keep_positions]
    return engine([torch.where(k, s, 0) for k, s in zip(flags, sources)], dtypes)


class MatrixProgram:
    """The batched matrix update prepared once for a fixed set of matrices.

    Built from one step's items; each later step with the same equality classes of
    hyperparameters (see :mod:`fastmuon.step.program`) runs the same calls with that step's values:
    one ``lerp`` per momentum part, the plan's NS, one decay call, one ``add_`` per scale class.
    Where the engine offers its input buffers (a CPU) the momentum step writes each matrix's NS
    input straight into its bucket slot, rounded to the bucket's NS dtype on the store: one pass
    over the matrices and no packing copy.
    """

    def __init__(
        self,
        items: list[MatrixItem],
        base_class: Sequence[int],
        engine_for: EngineFor | None = None,
        variant: Callable[[list[MatrixItem]], Any] | None = None,
    ):
        parts = batch_order(items)
        ordered = [i for part in parts for i in part]  # not kept: the items hold this step's gradients
        self.params = [i.param for i in ordered]
        self.configs = [i.config for i in ordered]
        self.dtypes = [p.dtype for p in self.params]
        self.keep_positions = tuple(i.index for i in ordered)  # among the step's gradients
        # tensors holding several matrices: their gradients split into the matrices' ones each
        # step, placed before the step's gradients in the list the parts pick from
        # (every piece a split returns has an item: the items were made from the same split)
        splits: dict[int, Callable[[Tensor], list[Tensor]]] = {}
        pieces: dict[int, int] = {}
        for i in ordered:
            if i.split is not None:
                splits.setdefault(i.index, i.split)
                pieces[i.index] = max(pieces.get(i.index, 0), i.piece + 1)
        self.splits = list(splits.items())
        starts, count = {}, 0
        for index, _ in self.splits:
            starts[index], count = count, count + pieces[index]
        position = {
            id(i): starts[i.index] + i.piece if i.split is not None else count + i.index for i in ordered
        }
        # the plan's executor, and where it reads each source from (momentum is written there)
        wholes = [i.param if i.whole is None else i.whole for i in ordered]
        self.engine = (
            engine_for(self.params, self.configs, wholes) if engine_for is not None and ordered else None
        )
        views = getattr(self.engine, "input_views", None)
        inputs = views() if views is not None else None
        # per part: buffers, gradient picks, group, NS input views (or None), and the momentum
        # step that writes them (casting where a view's dtype is not the buffers')
        self.parts: list[tuple[list[Tensor], Gather, int, list[Tensor] | None, Callable]] = []
        start = 0
        for part in parts:
            out = inputs[start : start + len(part)] if inputs is not None else None
            bufs = [i.buf for i in part]
            work = arithmetic_dtype(part[0].param.dtype, part[0].buf.dtype)  # one per part
            if work is not None:
                momentum = functools.partial(ema_momentum_widened_, dtype=work)
            elif out is not None and any(o.dtype != b.dtype for o, b in zip(out, bufs)):
                momentum = ema_momentum_cast_
            else:
                momentum = ema_momentum_
            self.parts.append((bufs, Gather([position[id(i)] for i in part]), part[0].group, out, momentum))
            start += len(part)
        self.item_groups = [i.group for i in ordered]
        self.groups = sorted(set(self.item_groups))
        # a variant's stage after NS (``variant(ordered)``: see fastmuon.step.moments), or None
        self.variant = variant(ordered) if variant is not None and ordered else None
        # the matrices whose NS input is the sign of their momentum (AdaMuon's), if any
        self.signed = [k for k, i in enumerate(ordered) if getattr(i.moment, "sign_input", False)]
        self.signed_pick = Gather(self.signed)
        self.owned_inputs = all(out is not None for *_, out, _ in self.parts)
        # cautious weight decay: the matrices it applies to, apart (None: none)
        cautious = [k for k, i in enumerate(ordered) if i.cautious]
        self.cautious: tuple[Gather, list[Tensor], list[int]] | None = None
        if cautious:
            plain = [k for k in range(len(ordered)) if not ordered[k].cautious]
            self.cautious = (
                Gather(cautious),
                [self.params[k] for k in cautious],
                [self.item_groups[k] for k in cautious],
            )
            self.plain = ([self.params[k] for k in plain], [self.item_groups[k] for k in plain])
        # scale = base · factor: one class per (class of the group's base, factor)
        by_scale = partition(range(len(ordered)), lambda k: (base_class[ordered[k].group], ordered[k].factor))
        self.scale_keys = [(ordered[idx[0]].group, ordered[idx[0]].factor) for idx in by_scale.values()]
        self.scale_params = [[self.params[k] for k in idx] for idx in by_scale.values()]
        self.scale_updates = [Gather(idx) for idx in by_scale.values()]
        self.limit = scale_limit(self.params[0].device) if ordered else 0

    def fits(self, grads: Sequence[Tensor]) -> bool:
        return True

    @property
    def plan(self) -> Any:
        return self.engine.plan if self.engine is not None else None

    def run(
        self, grads: Sequence[Tensor], scalars: MatrixScalars, keep: Tensor | None, hooks: Mapping[int, Any]
    ) -> None:
        """One step over this step's ``grads``; ``hooks`` (see
        ``MatrixOptimizer.register_orthogonalize_hook``) wrap its Newton–Schulz call."""
        if not self.params:
            return
        if self.splits:
            grads = [g for index, split in self.splits for g in split(grads[index])] + list(grads)
        # 1. momentum, one foreach call per (β, nesterov, device, dtype)
        sources: list[Tensor] = []
        for bufs, pick, g, out, momentum in self.parts:
            sources += momentum(bufs, pick(grads), scalars.beta[g], scalars.nesterov[g], out=out)
        if self.signed:  # in place where the momentum step wrote into NS input buffers
            if self.owned_inputs:
                torch._foreach_sign_(self.signed_pick(sources))
            else:
                for k, t in zip(self.signed, torch._foreach_sign(self.signed_pick(sources))):
                    sources[k] = t
        # 2. orthogonalise, one NS call per bucket of the cached plan
        args = (self.engine, sources, self.dtypes, keep, self.keep_positions)
        if hooks:
            call = functools.partial(orthogonalize_step, *args)
            for hook in hooks.values():
                call = functools.partial(hook, call)
            updates = call()
        else:
            updates = orthogonalize_step(*args)
        if self.variant is not None:
            updates = self.variant(updates, scalars)
        # 3-4. decay, scale and apply
        decay = scalars.decay
        if decay is not None:
            if self.cautious is not None:
                self._cautious_decay(updates, decay)
                params, item_groups = self.plain
            else:
                params, item_groups = self.params, self.item_groups
            if any(isinstance(decay[g], Tensor) for g in self.groups):
                for g in self.groups:
                    torch._foreach_mul_([p for p, h in zip(params, item_groups) if h == g], decay[g])
            elif any(decay[g] != 1 for g in self.groups) and params:
                torch._foreach_mul_(params, [decay[g] for g in item_groups])
        scales = [scalars.base[g] * f for g, f in self.scale_keys]
        apply_scaled_(
            self.scale_params,
            [pick(updates) for pick in self.scale_updates],
            scales,
            owned=True,
            limit=self.limit,
        )

    def _cautious_decay(self, updates: Sequence[Tensor], decay: Sequence[Scalar]) -> None:
        """``p ← p − lr·wd·𝟙[u⊙p ≥ 0]⊙p`` over the cautious matrices, in a fixed number of foreach
        calls (see :func:`cautious_decay`): the mask from the product's sign (+1 clamped at 1)."""
        pick, params, item_groups = self.cautious  # type: ignore[misc]
        masked = torch._foreach_mul(pick(updates), params)
        torch._foreach_sign_(masked)
        torch._foreach_add_(masked, 1)
        torch._foreach_clamp_max_(masked, 1)  # 1 where u·p ≥ 0, else 0
        torch._foreach_mul_(masked, params)
        rates = [1 - decay[g] for g in item_groups]  # lr·wd
        if any(isinstance(r, Tensor) for r in rates):
            for m, r in zip(masked, rates):
                m.mul_(r)
        else:
            torch._foreach_mul_(masked, rates)
        torch._foreach_sub_(params, masked)
