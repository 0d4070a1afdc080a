"""A second moment of the orthogonalised update, after Newton–Schulz: NorMuon's and AdaMuon's stage.

For each matrix ``O`` (the NS output, ``m×n`` as NS saw it: rows first, the other dims flattened):

- ``v ← β₂·v + (1−β₂)·s`` with ``s`` the mean of ``O⊙O`` over each row (``per_row``: NorMuon,
  one value per neuron) or ``O⊙O`` itself (AdaMuon, elementwise);
- ``Ô = O ⊘ (√v + ε)`` (``v`` broadcast along the rows where it is per row);
- ``Ô ← Ô · target / ‖Ô‖_F``, with ``target`` either ``‖O‖_F`` (the norm NS gave, so Muon's
  learning rates and lr factors carry over) or ``rms·√(m·n)`` (an update of RMS ``rms``).

Statistics are taken on each matrix's own update in its parameter's shape, as the engine
returns it, so a padded bucket's padding never enters a mean. Matrices of one shape, dtype,
device and group are stacked: a fixed number of calls per such class, not per matrix. The
arithmetic runs in float32 (float64 where the update or ``v`` is float64); ``v`` is stored in
its own dtype (a group's ``state_dtype``), rounded once per step.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from .matrix import MatrixItem, MatrixScalars

#: the RMS of an AdamW update that the RMS-matching rescale aims at (Moonlight; NorMuon's
#: Algorithm 1 and AdaMuon's RMS-aligned rescaling use the same 0.2)
ADAMW_RMS = 0.2


@dataclass
class MomentScalars(MatrixScalars):
    """The matrix update's scalars and the second moment's, one entry per param group."""

    beta2: Sequence[float] = ()
    moment_eps: Sequence[float] = ()


@dataclass
class Moment:
    """A matrix's second-moment state and settings (``MatrixItem.moment``): ``v`` is a view of
    its parameter's state buffer, per row ``(m,)`` or elementwise (the matrix's own shape)."""

    v: Tensor
    beta2: float
    eps: float
    rms: float | None  # None: keep NS's Frobenius norm; else rescale to this RMS
    sign_input: bool = False  # orthogonalise the momentum's sign (AdaMuon's sign stabilisation)
    # the matrix is stored (in, out) (a "transposed" matrix map): its neurons are the columns
    transposed: bool = False


def stat_dtype(dtype: torch.dtype, moment: torch.dtype | None = None) -> torch.dtype:
    """The dtype the stage computes in: float64 where the update or the moment ``v`` is
    float64, else float32."""
    return torch.float64 if torch.float64 in (dtype, moment) else torch.float32


def matrix_shape(shape: Sequence[int]) -> tuple[int, int]:
    rows = shape[0]
    return rows, math.prod(shape[1:])


def normalize(o: Tensor, v: Tensor, beta2: float, eps: float, rms: float | None) -> tuple[Tensor, Tensor]:
    """One stacked class (or one matrix, stacked alone): ``o`` is ``(N, m, n)`` in the compute
    dtype, ``v`` ``(N, m)`` (per row) or ``(N, m, n)`` (elementwise), in the compute dtype;
    returns ``(Ô, v_new)``. The reference path runs the same function one matrix at a time."""
    sq = o.square()
    per_row = v.ndim == 2
    stat = sq.mean(-1) if per_row else sq
    v = torch.lerp(v, stat, 1 - beta2)
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


class MomentStage:
    """The batched stage over a program's matrices in its order (``items``: MatrixProgram's)."""

    def __init__(self, items: list[MatrixItem]):
        classes: dict[tuple, list[int]] = {}
        for k, it in enumerate(items):
            m = it.moment
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
        # per class: positions, parameter shape and dtype, group, target RMS, rows are columns,
        # moment views
        self.classes = [
            (idx, shape, dtype, group, rms, t, [items[k].moment.v for k in idx])
            for (shape, dtype, _device, group, rms, t, _v_dtype), idx in classes.items()
        ]

    def __call__(self, updates: Sequence[Tensor], scalars: MomentScalars) -> list[Tensor]:
        """The stage over ``updates`` (NS results in the program's order, in the parameters'
        dtype or a narrower one widened exactly: the statistics run in :func:`stat_dtype` of the
        parameters' dtype either way); returns the updates to apply, in the parameters' dtype."""
        out = list(updates)
        for c, (idx, *_) in enumerate(self.classes):
            for k, r in zip(idx, self.run_class(c, [updates[k] for k in idx], scalars)):
                out[k] = r
        return out

    def run_class(self, c: int, updates: Sequence[Tensor], scalars: MomentScalars) -> list[Tensor]:
        """The stage over class ``c``'s updates (its matrices' NS results, in its order), as in
        :meth:`__call__`: a step that has them at different times stacks them when it has all."""
        idx, shape, param_dtype, g, rms, transposed, moments = self.classes[c]
        rows, cols = matrix_shape(shape)
        n = len(idx)
        u = torch.stack(list(updates))
        dtype = stat_dtype(param_dtype, moments[0].dtype)
        o = u.to(dtype).reshape(n, rows, cols)
        v = torch.stack(moments).to(dtype)  # per row: (n, rows); elementwise: (n, *shape)
        v = v if moments[0].ndim == 1 else v.reshape(n, rows, cols)
        if transposed:  # neurons along the stored columns
            o = o.transpose(-2, -1)
        result, v = normalize(o, v, scalars.beta2[g], scalars.moment_eps[g], rms)
        if transposed:
            result = result.transpose(-2, -1)
        torch._foreach_copy_(moments, list(v.reshape(n, *moments[0].shape).unbind(0)))
        return list(result.to(param_dtype).reshape(n, *shape).unbind(0))


def reference_normalize(it: MatrixItem, o: Tensor) -> Tensor:
    """:class:`MomentStage` for one matrix (the per-parameter path)."""
    rows, cols = matrix_shape(o.shape)
    m = it.moment
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
