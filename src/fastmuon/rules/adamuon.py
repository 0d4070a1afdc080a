"""The AdaMuon rule: Muon's orthogonalised momentum with an elementwise second moment, AdamW for
the rest.

Si, Zhang, Shen, "AdaMuon: Adaptive Muon Optimizer" (arXiv 2507.11005, v2), for a matrix ``W``
(``m×n``):

- ``M ← β₁·M + (1−β₁)·G``; ``O = NS(sign(M))`` (the sign-stabilised orthogonal update; with
  ``sign_momentum=False`` ``O = NS(M)``, the paper's first version and pytorch-optimizer's);
- ``v ← β₂·v + (1−β₂)·O⊙O`` (elementwise, no bias correction: the rescale removes it),
  ``Ô = O ⊘ (√v + ε)``;
- the RMS-aligned rescale ``Ô·0.2·√(mn)/‖Ô‖_F`` (``rescale="rms"``, the default; ``"norm"`` keeps
  NS's Frobenius norm and Muon's lr factor instead), then ``W ← W − η·λ·W − η·Ô``.

The state ``second_moment`` of a parameter has the parameter's shape (each matrix of a matrix map
its own part of it).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

from torch import Tensor

from ..ns.matrices import MatrixMap
from ..step.collecting import CollectEnv
from ..step.contracts import LIKE_PARAM, EngineFor, StepOptions
from ..step.matrix_item import MatrixItem
from ..step.moments import MomentStage, SecondMoment, reference_normalize
from ..step.program import Scalar, TwoHalves
from . import muon as muon_rule
from .muon import Items, is_matrix
from .roles import ELEMENT_MOMENT, MUON

family = MUON
other_update = muon_rule.other_update
MOMENT = SecondMoment("second_moment", ELEMENT_MOMENT, per_row=False)
state_keys: Mapping[str, str] = {**muon_rule.state_keys, MOMENT.key: LIKE_PARAM}

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
    """Muon's pattern, and the groups' settings of the sign and the second moment."""

    muon: muon_rule.Pattern
    moment: tuple[Any, ...]  # per group: its rescale and sign_momentum


class SignedMoment:
    """Muon's collection extended: each matrix's second moment, and the sign of its momentum
    as its NS input where the group's ``sign_momentum`` says (the stage before NS)."""

    def adjust(self, group: Mapping[str, Any]) -> str:
        return MOMENT.adjust(group)

    def attach(
        self,
        group: Mapping[str, Any],
        p: Tensor,
        m: MatrixMap,
        state: dict[str, Any],
        items: list[MatrixItem],
        env: CollectEnv,
    ) -> None:
        MOMENT.attach(group, p, m, state, items, env)
        sign = bool(group["sign_momentum"])
        for it in items:
            it.sign_input = sign


EXTENSION = SignedMoment()


def state_roles(group: dict[str, Any], p: Tensor) -> dict[str, str]:
    """Muon's buffers, and a matrix's elementwise second moment."""
    roles = muon_rule.state_roles(group, p)
    return {**roles, MOMENT.key: MOMENT.role} if is_matrix(group, p) else roles


def state_shapes(group: dict[str, Any], p: Tensor, m: MatrixMap) -> dict[str, tuple[int, ...]]:
    """The shape of each buffer the loader must check: ``second_moment``, ``p``'s own."""
    return {MOMENT.key: MOMENT.shape(p, m)} if is_matrix(group, p) else {}


def collect(groups: Sequence[dict[str, Any]], grads: Sequence[Tensor | None], env: CollectEnv) -> Items:
    return muon_rule.collect(groups, grads, env, EXTENSION)


def scalars(
    groups: Sequence[dict[str, Any]], lr_value: Callable[[Any], Scalar]
) -> tuple[Pattern, muon_rule.Scalars]:
    pattern, s = muon_rule.scalars(groups, lr_value)
    moment = tuple((g["rescale"], g["sign_momentum"]) for g in groups)
    return Pattern(pattern, moment), muon_rule.Scalars(MOMENT.scalars(groups, s.matrices), s.elementwise)


def build(items: Items, pattern: Pattern, engine_for: EngineFor, options: StepOptions) -> TwoHalves:
    return muon_rule.build(items, pattern.muon, engine_for, options, MomentStage)


def reference(items: Items) -> None:
    """The same update, one parameter at a time: the per-parameter reference path."""
    muon_rule.reference(items, reference_normalize)
