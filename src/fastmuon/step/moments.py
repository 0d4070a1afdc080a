"""A second moment of the orthogonalised update, a stage after Newton–Schulz that a rule supplies:
for each matrix ``O`` (NS's output, ``m×n``, the other dims flattened) ``v ← β₂·v + (1−β₂)·s``,
``s`` the row mean of ``O⊙O`` (``per_row``, one value per neuron) or ``O⊙O``; ``Ô = O ⊘ (√v + ε)``,
rescaled to the Frobenius norm ``‖O‖_F`` or ``rms·√(m·n)`` (the rules and their papers:
:mod:`fastmuon.rules.second_moment`).

Statistics are taken on each matrix's own update, so a bucket's padding never enters a mean.
Matrices of one shape, dtype, device and group are stacked. The arithmetic runs in float32
(float64 where the update or ``v`` is); ``v`` is stored in its own dtype, rounded once per step."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import Tensor

from ..ns.matrices import MatrixMap
from .collecting import CollectEnv
from .contracts import LIKE_PARAM, VECTOR
from .matrix import MatrixScalars
from .matrix_item import MatrixItem
from .state_dtype import group_state_dtype

#: the RMS of an AdamW update that the RMS-matching rescale aims at (Moonlight; NorMuon's
#: Algorithm 1 and AdaMuon's RMS-aligned rescaling use the same 0.2)
ADAMW_RMS = 0.2


#: a group's ``rescale``: keep NS's Frobenius norm, or rescale to an RMS of :data:`ADAMW_RMS`
RESCALES = ("norm", "rms")


@dataclass
class MomentScalars(MatrixScalars):
    """The matrix update's scalars and the second moment's, one entry per param group."""

    beta2: Sequence[float] = ()
    moment_eps: Sequence[float] = ()


@dataclass
class Moment:
    """A matrix's second-moment state and settings (``MatrixItem.stage``): ``v`` is a view of
    its parameter's state buffer, per row ``(m,)`` or elementwise (the matrix's own shape)."""

    v: Tensor
    beta2: float
    eps: float
    rms: float | None  # None: keep NS's Frobenius norm; else rescale to this RMS
    transposed: bool = False  # stored (in, out) (a "transposed" map): its neurons are the columns


@dataclass(frozen=True)
class SecondMoment:
    """A second moment kept in the state entry ``key`` of each matrix parameter: per row (one 1-D
    buffer of each of its matrices' ``v``, in the map's order) or elementwise (the parameter's
    shape). ``role`` names what it averages in checkpoints."""

    key: str
    role: str
    per_row: bool

    @property
    def shaped(self) -> str:
        """How the entry is shaped: one entry per row of each matrix, or the parameter's own."""
        return VECTOR if self.per_row else LIKE_PARAM

    def shape(self, p: Tensor, m: MatrixMap) -> tuple[int, ...]:
        """The entry's shape for ``p`` under its map ``m``."""
        return (sum(_neurons(m, p.shape)),) if self.per_row else tuple(p.shape)

    def adjust(self, group: Mapping[str, Any]) -> str:
        """The group's lr factor mode: none where the rescale sets the update's size."""
        if group["rescale"] == "rms":
            return "none"
        return str(group["adjust_lr_fn"] or "original")

    def attach(
        self,
        group: Mapping[str, Any],
        p: Tensor,
        m: MatrixMap,
        state: dict[str, Any],
        items: list[MatrixItem],
        env: CollectEnv,
    ) -> None:
        """Give each of ``p``'s matrix items its :class:`Moment`, a view of the entry (made if missing)."""
        key = self.key
        rows = [it.param.shape[1] if m.transposed else it.param.shape[0] for it in items]
        wanted = (sum(rows),) if self.per_row else tuple(p.shape)
        buf = state.get(key)
        if buf is None:
            dtype = group_state_dtype(group, items[0].group)
            if self.per_row:
                buf = state[key] = torch.zeros(wanted, dtype=dtype or p.dtype, device=p.device)
            else:
                buf = state[key] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
        elif not isinstance(buf, Tensor) or tuple(buf.shape) != wanted:
            got = tuple(buf.shape) if isinstance(buf, Tensor) else type(buf).__name__
            raise ValueError(
                f"{env.optimizer}: the state {key!r} of a parameter of shape {tuple(p.shape)} is "
                f"{got}, not {wanted}; it was saved for another model or optimizer: delete that "
                "entry from the state (it restarts from zeros)"
            )
        views = list(torch.split(buf, rows)) if self.per_row else ([buf] if m.is_flatten else m.views(buf))
        rms = ADAMW_RMS if group["rescale"] == "rms" else None
        for it, v in zip(items, views):
            it.stage = Moment(v, group["beta2"], group["moment_eps"], rms, m.transposed)

    def pattern(self, groups: Sequence[Mapping[str, Any]]) -> tuple[Any, ...]:
        """Each group's ``rescale`` (it sets the stage's classes)."""
        return tuple((g["rescale"],) for g in groups)

    def batched(self, items: list[MatrixItem]) -> MomentStage:
        return MomentStage(items)

    def reference(self, item: MatrixItem, update: Tensor) -> Tensor:
        return reference_normalize(item, update)

    def scalars(self, groups: Sequence[Mapping[str, Any]], s: MatrixScalars) -> MomentScalars:
        """The matrix update's scalars ``s`` with the moment's ``β₂`` and ``ε``, read each step."""
        return MomentScalars(
            s.beta,
            s.nesterov,
            s.base,
            s.decay,
            [g["beta2"] for g in groups],
            [g["moment_eps"] for g in groups],
        )


def _neurons(m: MatrixMap, shape: tuple[int, ...] | torch.Size) -> list[int]:
    """Each matrix's neurons: its rows, or its stored columns where the map says (in, out)."""
    return [s[0] for s in m.shapes(shape)]


def stat_dtype(dtype: torch.dtype, moment: torch.dtype | None = None) -> torch.dtype:
    """The stage's compute dtype: float64 where the update or ``v`` is float64, else float32."""
    return torch.float64 if torch.float64 in (dtype, moment) else torch.float32


def matrix_shape(shape: Sequence[int]) -> tuple[int, int]:
    rows = shape[0]
    return rows, math.prod(shape[1:])


def normalize(
    o: Tensor, v: Tensor, beta2: float, eps: float, rms: float | None, weight: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """One stacked class: ``o`` ``(N, m, n)``, ``v`` ``(N, m)`` (per row) or ``(N, m, n)``, both in
    the compute dtype; returns ``(Ô, v_new)``. ``weight``: the EMA's weight per matrix, broadcast
    over ``v`` (default ``1−β₂``; a rejected matrix gets 0)."""
    sq = o.square()
    per_row = v.ndim == 2
    stat = sq.mean(-1) if per_row else sq
    v = torch.lerp(v, stat, 1 - beta2 if weight is None else weight)
    denom = v.sqrt().add_(eps)
    out = o / (denom.unsqueeze(-1) if per_row else denom)
    # the norm guarded from below as dion's NorMuon guards it (an all-zero update stays zero)
    new_norm = torch.linalg.vector_norm(out, dim=(-2, -1), keepdim=True).clamp_min_(max(eps, 1e-30))
    if rms is None:
        target = torch.linalg.vector_norm(o, dim=(-2, -1), keepdim=True)
    else:
        target = rms * math.sqrt(o.shape[-2] * o.shape[-1])
    out.mul_(target / new_norm)
    return out, v


class MomentClass(NamedTuple):
    """Matrices the stage stacks together: one shape, dtype, device, group and target RMS."""

    positions: list[int]  # in the program's order (first: what AfterNSStage.classes asks)
    shape: tuple[int, ...]  # the parameters'
    dtype: torch.dtype  # the parameters'
    group: int
    rms: float | None  # None: keep NS's Frobenius norm
    transposed: bool  # a per-row moment whose neurons are the stored columns
    moments: list[Tensor]  # each matrix's ``v``
    flag_places: tuple[int, ...]  # each matrix's place in the step's keep vector


class MomentStage:
    """The batched stage over a program's matrices in its order. It masks a rejected matrix itself
    (``masks_rejected``): given keep flags, :meth:`run_class` lerps its ``v`` with weight 0, and
    its update, zeros from NS, stays zeros (``0 / (√v + ε)``, rescaled)."""

    masks_rejected = True

    def __init__(self, items: list[MatrixItem]):
        classes: dict[tuple[Any, ...], list[int]] = {}
        for k, it in enumerate(items):
            m = it.stage
            per_row_t = m.transposed and m.v.ndim == 1
            key = (
                tuple(it.param.shape),
                it.param.dtype,
                it.param.device,
                it.group,
                m.rms,
                per_row_t,
                m.v.dtype,
            )
            classes.setdefault(key, []).append(k)
        self.classes = [
            MomentClass(
                idx,
                shape,
                dtype,
                group,
                rms,
                t,
                [items[k].stage.v for k in idx],
                tuple(items[k].index for k in idx),
            )
            for (shape, dtype, _device, group, rms, t, _v_dtype), idx in classes.items()
        ]
        self._flag_index: dict[tuple[int, torch.device], Tensor] = {}

    def flags(self, c: int, keep: Tensor) -> Tensor:
        """Class ``c``'s keep flags out of the step's keep vector (one index select, no host read)."""
        index = self._flag_index.get((c, keep.device))
        if index is None:
            index = self._flag_index[c, keep.device] = torch.tensor(
                self.classes[c].flag_places, device=keep.device
            )
        return keep.index_select(0, index)

    def __call__(self, updates: Sequence[Tensor], scalars: MomentScalars) -> list[Tensor]:
        """The stage over ``updates`` (NS results in the program's order, in the parameters' dtype
        or a narrower one that widens exactly); returns the updates in the parameters' dtype."""
        out = list(updates)
        for c, (idx, *_) in enumerate(self.classes):
            for k, r in zip(idx, self.run_class(c, [updates[k] for k in idx], scalars)):
                out[k] = r
        return out

    def run_class(
        self, c: int, updates: Sequence[Tensor], scalars: MomentScalars, flags: Tensor | None = None
    ) -> list[Tensor]:
        """The stage over class ``c``'s NS results, once a step has them all; ``flags``: see the class."""
        idx, shape, param_dtype, g, rms, transposed, moments, _ = self.classes[c]
        rows, cols = matrix_shape(shape)
        n = len(idx)
        u = torch.stack(list(updates))
        dtype = stat_dtype(param_dtype, moments[0].dtype)
        o = u.to(dtype).reshape(n, rows, cols)
        v = torch.stack(moments).to(dtype)  # per row: (n, rows); elementwise: (n, *shape)
        v = v if moments[0].ndim == 1 else v.reshape(n, rows, cols)
        if transposed:  # neurons along the stored columns
            o = o.transpose(-2, -1)
        weight = None
        if flags is not None:  # 1−β₂ where kept (the fp32 or fp64 value the scalar gives), 0 where not
            weight = flags.to(dtype).mul_(1 - scalars.beta2[g]).view(n, *[1] * (v.ndim - 1))
        result, v = normalize(o, v, scalars.beta2[g], scalars.moment_eps[g], rms, weight)
        if transposed:
            result = result.transpose(-2, -1)
        torch._foreach_copy_(moments, list(v.reshape(n, *moments[0].shape).unbind(0)))
        return list(result.to(param_dtype).reshape(n, *shape).unbind(0))


def reference_normalize(it: MatrixItem, o: Tensor) -> Tensor:
    """:class:`MomentStage` for one matrix (the per-parameter path)."""
    rows, cols = matrix_shape(o.shape)
    m = it.stage
    dtype = stat_dtype(o.dtype, m.v.dtype)
    moment, beta2, eps, rms = m.v, m.beta2, m.eps, m.rms
    o32 = o.to(dtype).reshape(1, rows, cols)
    if moment.ndim == 1:
        transposed = m.transposed
        v = moment.to(dtype).reshape(1, -1)
        o32 = o32.transpose(-2, -1) if transposed else o32
    else:
        transposed = False
        v = moment.to(dtype).reshape(1, rows, cols)
    result, v = normalize(o32, v, beta2, eps, rms)
    result = result.transpose(-2, -1) if transposed else result
    moment.copy_(v.reshape(moment.shape))
    return result.to(o.dtype).reshape(o.shape)
