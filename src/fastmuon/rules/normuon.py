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
parameter's dtype). The stage is :mod:`fastmuon.step.moments`'; this module says how NorMuon uses
it: per row, on Muon's collection, pattern and program.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

from torch import Tensor

from ..ns.matrices import MatrixMap
from ..step.collecting import CollectEnv
from ..step.contracts import VECTOR, EngineFor, StepOptions
from ..step.moments import MomentStage, SecondMoment, reference_normalize
from ..step.program import Scalar, TwoHalves
from . import muon as muon_rule
from .muon import Items, is_matrix
from .roles import MUON, ROW_MOMENT

# its state dicts are Muon's (the same group keys and buffers) plus ``second_moment``, which
# loading carries from a state dict of the same variant only (see fastmuon.optim.checkpoint) and
# a fresh step makes as zeros
family = MUON
other_update = muon_rule.other_update  # the parameters it does not orthogonalise take Muon's AdamW
MOMENT = SecondMoment("second_moment", ROW_MOMENT, per_row=True)
state_keys: Mapping[str, str] = {**muon_rule.state_keys, MOMENT.key: VECTOR}

# the Rule contract (fastmuon.step.contracts), some of it Muon's
__all__ = [
    "family",
    "other_update",
    "state_keys",
    "Items",
    "is_matrix",
    "state_roles",
    "state_shapes",
    "collect",
    "scalars",
    "build",
    "reference",
]


class Pattern(NamedTuple):
    """Muon's pattern, and the groups' second-moment settings that shape the program."""

    muon: muon_rule.Pattern
    moment: tuple[Any, ...]  # per group: its rescale


def state_roles(group: dict[str, Any], p: Tensor) -> dict[str, str]:
    """Muon's buffers, and a matrix's per-row second moment."""
    roles = muon_rule.state_roles(group, p)
    return {**roles, MOMENT.key: MOMENT.role} if is_matrix(group, p) else roles


def state_shapes(group: dict[str, Any], p: Tensor, m: MatrixMap) -> dict[str, tuple[int, ...]]:
    """The shape of each buffer not simply shaped like ``p``: ``second_moment``, one entry per
    row of each of ``p``'s matrices under its map ``m``."""
    return {MOMENT.key: MOMENT.shape(p, m)} if is_matrix(group, p) else {}


def collect(groups: Sequence[dict[str, Any]], grads: Sequence[Tensor | None], env: CollectEnv) -> Items:
    return muon_rule.collect(groups, grads, env, MOMENT)


def scalars(
    groups: Sequence[dict[str, Any]], lr_value: Callable[[Any], Scalar]
) -> tuple[Pattern, muon_rule.Scalars]:
    pattern, s = muon_rule.scalars(groups, lr_value)
    moment = tuple((g["rescale"],) for g in groups)
    return Pattern(pattern, moment), muon_rule.Scalars(MOMENT.scalars(groups, s.matrices), s.elementwise)


def build(items: Items, pattern: Pattern, engine_for: EngineFor, options: StepOptions) -> TwoHalves:
    return muon_rule.build(items, pattern.muon, engine_for, options, MomentStage)


def reference(items: Items) -> None:
    """The same update, one parameter at a time: the per-parameter reference path."""
    muon_rule.reference(items, reference_normalize)
