"""The NorMuon rule: Muon's orthogonalised momentum normalised per neuron, AdamW for the rest.

Li, Liu, Liang, Chen, Zhao, "NorMuon: Making Muon more efficient and scalable" (arXiv
2510.05491), Algorithm 1, for a matrix ``W`` (``m×n``, rows the output neurons):

- ``M ← β₁·M + (1−β₁)·G``, ``O = NS(M)`` (Muon's, here with its Nesterov option);
- ``v ← β₂·v + (1−β₂)·mean_cols(O⊙O)`` (``v ∈ ℝᵐ``), ``Ô = O ⊘ (√v + ε)``;
- a rescale of ``Ô``, then ``W ← W − η·λ·W − η̂·Ô`` (decoupled weight decay).

The rescale is ``rescale`` per group: ``"norm"`` (the default) keeps the Frobenius norm NS gave,
``Ô·‖O‖_F/‖Ô‖_F``, and then takes Muon's lr factor (``adjust_lr_fn``), as the authors' code, dion's
NorMuon (``normuon_normalization``) and modded-nanogpt's NorMuon records do, so Muon's learning
rates carry over; ``"rms"`` is the paper's ``η̂ = 0.2·η·√(mn)/‖Ô‖_F``: an update of RMS 0.2, AdamW's,
with no lr factor. ``β₂ = 0.95`` and ``ε = 1e-8`` are the paper's and dion's defaults.

Each matrix of a matrix map (experts, fused parts, heads) has its own row statistics: the state
``second_moment`` of a parameter is one 1-D tensor holding each of its matrices' ``v`` in turn
(``m`` entries per matrix, in the map's order), in the group's ``state_dtype`` (None: the
parameter's dtype).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from ..ns.matrices import MatrixMap
from ..step.adamw import AdamWClasses, AdamWProgram, single_tensor_adamw
from ..step.collecting import CollectEnv
from ..step.matrix import EngineFor, MatrixItem, MatrixProgram, single_tensor_matrix_update
from ..step.moments import ADAMW_RMS, Moment, MomentScalars, MomentStage, reference_normalize
from ..step.program import TwoHalves
from ..step.state_dtype import group_state_dtype
from . import muon as muon_rule
from .muon import Items, is_matrix
from .roles import ELEMENT_MOMENT, MUON, ROW_MOMENT

# its state dicts are Muon's (the same group keys and buffers) plus ``second_moment``, which
# loading carries from a state dict of the same variant only (see fastmuon.optim.checkpoint) and
# a fresh step makes as zeros
family = MUON
elementwise = muon_rule.elementwise  # the parameters it does not orthogonalise take Muon's AdamW
MOMENT = "second_moment"
RESCALES = ("norm", "rms")

__all__ = ["Items", "is_matrix", "state_roles", "state_shapes", "collect", "scalars", "build", "reference"]


def state_roles(group: dict[str, Any], p: Tensor) -> dict[str, str]:
    """Muon's buffers, and a matrix's per-row second moment."""
    return VARIANT.roles(group, p)


def state_shapes(group: dict[str, Any], p: Tensor, m: MatrixMap) -> dict[str, tuple[int, ...]]:
    """The shape of each buffer not simply shaped like ``p``: ``second_moment``, one entry per
    row of each of ``p``'s matrices under its map ``m``."""
    return VARIANT.shapes(group, p, m)


class Variant:
    """What a second-moment variant adds to Muon's collection: its lr factor mode and each
    matrix's :class:`~fastmuon.step.moments.Moment`."""

    def __init__(self, per_row: bool, sign_key: str | None = None):
        self.per_row = per_row
        self.sign_key = sign_key  # the group key saying whether NS takes the momentum's sign
        self.role = ROW_MOMENT if per_row else ELEMENT_MOMENT

    def roles(self, group: dict[str, Any], p: Tensor) -> dict[str, str]:
        """Muon's buffers, and ``second_moment`` for a matrix."""
        roles = muon_rule.state_roles(group, p)
        return {**roles, MOMENT: self.role} if is_matrix(group, p) else roles

    def shapes(self, group: dict[str, Any], p: Tensor, m: MatrixMap) -> dict[str, tuple[int, ...]]:
        """``second_moment``'s shape for a matrix: one entry per neuron, or the parameter's."""
        if not is_matrix(group, p):
            return {}
        return {MOMENT: (sum(_neurons(m, p.shape)),) if self.per_row else tuple(p.shape)}

    def adjust(self, group: Mapping[str, Any]) -> str:
        if group["rescale"] == "rms":
            return "none"  # the rescale sets the update's size
        return group["adjust_lr_fn"] or "original"

    def attach(
        self,
        group: Mapping[str, Any],
        p: Tensor,
        m: MatrixMap,
        state: dict[str, Any],
        items: list[MatrixItem],
        env: CollectEnv,
    ) -> None:
        # the neurons: a matrix's rows, or its stored columns where the map says (in, out)
        rows = [it.param.shape[1] if m.transposed else it.param.shape[0] for it in items]
        wanted = (sum(rows),) if self.per_row else tuple(p.shape)
        buf = state.get(MOMENT)
        if buf is None:
            dtype = group_state_dtype(group, items[0].group)
            if self.per_row:
                buf = state[MOMENT] = torch.zeros(wanted, dtype=dtype or p.dtype, device=p.device)
            else:
                buf = state[MOMENT] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
        elif not isinstance(buf, Tensor) or tuple(buf.shape) != wanted:
            got = tuple(buf.shape) if isinstance(buf, Tensor) else type(buf).__name__
            raise ValueError(
                f"{env.optimizer}: the state {MOMENT!r} of a parameter of shape {tuple(p.shape)} is "
                f"{got}, not {wanted}; it was saved for another model or optimizer: delete that "
                "entry from the state (it restarts from zeros)"
            )
        views = list(buf.split(rows)) if self.per_row else ([buf] if m.is_flatten else m.views(buf))
        rms = ADAMW_RMS if group["rescale"] == "rms" else None
        sign = bool(group[self.sign_key]) if self.sign_key else False
        for it, v in zip(items, views):
            it.moment = Moment(v, group["beta2"], group["moment_eps"], rms, sign, m.transposed)


def _neurons(m: MatrixMap, shape: tuple[int, ...] | torch.Size) -> list[int]:
    """Each matrix's neurons: its rows, or its stored columns where the map says (in, out)."""
    return [s[0] for s in m.shapes(shape)]


VARIANT = Variant(per_row=True)


def collect(groups: Sequence[dict[str, Any]], grads: Sequence[Tensor | None], env: CollectEnv) -> Items:
    return muon_rule.collect(groups, grads, env, VARIANT)


def variant_scalars(groups: Sequence[Mapping[str, Any]], lr_value, extra: tuple[str, ...] = ()):
    """Muon's pattern and scalars with the second moment's: its settings' structure in the
    pattern, its β₂ and ε among the matrix scalars (read each step, as every hyperparameter)."""
    pattern, s = muon_rule.scalars(groups, lr_value)
    structure = tuple((g["rescale"], *(g[k] for k in extra)) for g in groups)
    m = s.matrices
    matrices = MomentScalars(
        m.beta, m.nesterov, m.base, m.decay, [g["beta2"] for g in groups], [g["moment_eps"] for g in groups]
    )
    return (pattern, structure), muon_rule.Scalars(matrices, s.elementwise)


def scalars(groups: Sequence[Mapping[str, Any]], lr_value):
    return variant_scalars(groups, lr_value)


def build(items: Items, pattern: Any, engine_for: EngineFor, options: Any) -> TwoHalves:
    muon_pattern = pattern[0]
    adamw_classes = AdamWClasses(
        muon_pattern.lr, muon_pattern.betas, muon_pattern.eps, muon_pattern.weight_decay
    )
    return TwoHalves(
        MatrixProgram(items.matrices, muon_pattern.lr, engine_for, variant=MomentStage),
        AdamWProgram(items.adamw, adamw_classes, options.capturable),
    )


def reference(items: Items) -> None:
    """The same update, one parameter at a time: the per-parameter reference path."""
    single_tensor_matrix_update(items.matrices, reference_normalize)
    single_tensor_adamw(items.adamw)
