"""NorMuon and AdaMuon: one rule, Muon's orthogonalised momentum divided by a second moment of
itself, AdamW for the rest. The two differ only in how the moment averages and what NS sees.

NorMuon (Li, Liu, Liang, Chen, Zhao, arXiv 2510.05491, Algorithm 1), for a matrix ``W``
(``m×n``, rows the output neurons):

- ``M ← β₁·M + (1−β₁)·G``, ``O = NS(M)`` (Muon's, here with its Nesterov option);
- ``v ← β₂·v + (1−β₂)·mean_cols(O⊙O)`` (``v ∈ ℝᵐ``, one entry per neuron), ``Ô = O ⊘ (√v + ε)``;
- a rescale of ``Ô``, then ``W ← W − η·λ·W − η̂·Ô`` (decoupled weight decay).

AdaMuon (Si, Zhang, Shen, arXiv 2507.11005, v2):

- ``M ← β₁·M + (1−β₁)·G``; ``O = NS(sign(M))`` (the sign-stabilised orthogonal update; with
  ``sign_momentum=False`` ``O = NS(M)``, the paper's first version and pytorch-optimizer's);
- ``v ← β₂·v + (1−β₂)·O⊙O`` (elementwise, no bias correction: the rescale removes it),
  ``Ô = O ⊘ (√v + ε)``; the rescale, then ``W ← W − η·λ·W − η·Ô``.

The rescale is ``rescale`` per group: ``"norm"`` keeps the Frobenius norm NS gave,
``Ô·‖O‖_F/‖Ô‖_F``, and then takes Muon's lr factor (``adjust_lr_fn``), as NorMuon's authors'
code, dion's NorMuon (``normuon_normalization``) and modded-nanogpt's NorMuon records do, so
Muon's learning rates carry over; ``"rms"`` is ``η̂ = 0.2·η·√(mn)/‖Ô‖_F``: an update of RMS 0.2,
AdamW's, with no lr factor (NorMuon's paper, AdaMuon's RMS-aligned rescale).

The state ``second_moment`` of a matrix parameter is NorMuon's one 1-D tensor holding each of its
matrices' ``v`` in turn (``m`` entries per matrix, in the map's order) or AdaMuon's tensor of the
parameter's shape, in the group's ``state_dtype`` (None: the parameter's dtype). The stage is
:mod:`fastmuon.step.moments`'; the momentum's sign is :mod:`fastmuon.step.before_ns`'. Everything
else is Muon's collection, pattern and program.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Any, NamedTuple

from torch import Tensor

from ..ns.matrices import MatrixMap
from ..step.collecting import CollectEnv
from ..step.contracts import LIKE_PARAM, VECTOR, EngineFor, StepOptions
from ..step.driver import TwoHalves
from ..step.elementwise import Scalar
from ..step.matrix_item import MatrixItem
from ..step.moments import MomentStage, SecondMoment, reference_normalize
from . import muon as muon_rule
from .muon import Extension, Items
from .roles import ELEMENT_MOMENT, MUON, ROW_MOMENT


class Pattern(NamedTuple):
    """Muon's pattern, and the groups' second-moment settings that shape the program."""

    muon: muon_rule.Pattern
    moment: tuple[Any, ...]  # per group: its rescale (and, where the rule signs, sign_momentum)


class SignedMoment:
    """A moment's collection extended: each matrix's NS input is its momentum's sign where the
    group's ``sign_momentum`` says (the stage before NS)."""

    def __init__(self, moment: SecondMoment):
        self.moment = moment

    def adjust(self, group: Mapping[str, Any]) -> str:
        return self.moment.adjust(group)

    def attach(
        self,
        group: Mapping[str, Any],
        p: Tensor,
        m: MatrixMap,
        state: dict[str, Any],
        items: list[MatrixItem],
        env: CollectEnv,
    ) -> None:
        self.moment.attach(group, p, m, state, items, env)
        sign = bool(group["sign_momentum"])
        for it in items:
            it.sign_input = sign


class SecondMomentRule:
    """The rule of a Muon with a second moment (satisfies :class:`fastmuon.step.contracts.Rule`).

    ``moment`` says how ``v`` averages and where it is kept; ``signed``, whether groups carry
    ``sign_momentum`` (AdaMuon's: NS of the momentum's sign). Its state dicts are Muon's (the
    same group keys and buffers) plus ``second_moment``, which loading carries from a state dict
    of the same variant only (see :mod:`fastmuon.optim.checkpoint`) and a fresh step makes as
    zeros.
    """

    family = MUON
    other_update = muon_rule.other_update  # the parameters it does not orthogonalise take Muon's AdamW
    is_matrix = staticmethod(muon_rule.is_matrix)

    def __init__(self, name: str, moment: SecondMoment, *, signed: bool):
        self.__name__ = name
        self.moment = moment
        self.signed = signed
        shaped = VECTOR if moment.per_row else LIKE_PARAM
        self.state_keys: Mapping[str, str] = MappingProxyType({**muon_rule.state_keys, moment.key: shaped})
        self._extension: Extension = SignedMoment(moment) if signed else moment

    def __repr__(self) -> str:
        return f"<update rule {self.__name__}>"

    def state_roles(self, group: dict[str, Any], p: Tensor) -> dict[str, str]:
        """Muon's buffers, and a matrix's second moment."""
        roles = muon_rule.state_roles(group, p)
        return {**roles, self.moment.key: self.moment.role} if muon_rule.is_matrix(group, p) else roles

    def state_shapes(self, group: dict[str, Any], p: Tensor, m: MatrixMap) -> dict[str, tuple[int, ...]]:
        """The shape of each buffer the loader must check: ``second_moment``, one entry per row of
        each of ``p``'s matrices under its map ``m`` (per row) or ``p``'s own (elementwise)."""
        return {self.moment.key: self.moment.shape(p, m)} if muon_rule.is_matrix(group, p) else {}

    def collect(
        self, groups: Sequence[dict[str, Any]], grads: Sequence[Tensor | None], env: CollectEnv
    ) -> Items:
        return muon_rule.collect(groups, grads, env, self._extension)

    def scalars(
        self, groups: Sequence[dict[str, Any]], lr_value: Callable[[Any], Scalar]
    ) -> tuple[Pattern, muon_rule.Scalars]:
        pattern, s = muon_rule.scalars(groups, lr_value)
        moment: tuple[tuple[Any, ...], ...]
        if self.signed:
            moment = tuple((g["rescale"], g["sign_momentum"]) for g in groups)
        else:
            moment = tuple((g["rescale"],) for g in groups)
        matrices = self.moment.scalars(groups, s.matrices)
        return Pattern(pattern, moment), muon_rule.Scalars(matrices, s.elementwise)

    def build(self, items: Items, pattern: Pattern, engine_for: EngineFor, options: StepOptions) -> TwoHalves:
        return muon_rule.build(items, pattern.muon, engine_for, options, MomentStage)

    def reference(self, items: Items) -> None:
        """The same update, one parameter at a time: the per-parameter reference path."""
        muon_rule.reference(items, reference_normalize)


#: NorMuon's: per-row second moment; ``β₂ = 0.95`` and ``ε = 1e-8`` are the paper's and dion's
NORMUON = SecondMomentRule("normuon", SecondMoment("second_moment", ROW_MOMENT, per_row=True), signed=False)
#: AdaMuon's: elementwise second moment of NS of the momentum's sign (``sign_momentum``)
ADAMUON = SecondMomentRule(
    "adamuon", SecondMoment("second_moment", ELEMENT_MOMENT, per_row=False), signed=True
)
#: each second moment by the role it has in checkpoints
MOMENTS = {r.moment.role: r.moment for r in (NORMUON, ADAMUON)}
