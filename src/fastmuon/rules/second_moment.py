"""NorMuon and AdaMuon: one rule, Muon's orthogonalised momentum divided by a second moment of
itself, AdamW for the rest. For a matrix ``W`` (``m×n``, rows the output neurons) both take
``M ← β₁·M + (1−β₁)·G`` (Muon's, here with its Nesterov option), ``Ô = O ⊘ (√v + ε)``, a rescale of
``Ô``, then ``W ← W − η·λ·W − η̂·Ô`` (decoupled weight decay); they differ in what NS sees and in
how the moment averages:

- NorMuon (Li, Liu, Liang, Chen, Zhao, arXiv 2510.05491, Algorithm 1): ``O = NS(M)``,
  ``v ← β₂·v + (1−β₂)·mean_cols(O⊙O)`` (``v ∈ ℝᵐ``, one entry per neuron);
- AdaMuon (Si, Zhang, Shen, arXiv 2507.11005, v2): ``O = NS(sign(M))`` (the sign-stabilised
  orthogonal update; with ``sign_momentum=False`` ``O = NS(M)``, the paper's first version and
  pytorch-optimizer's), ``v ← β₂·v + (1−β₂)·O⊙O`` (elementwise, no bias correction: the rescale
  removes it).

The rescale is ``rescale`` per group: ``"norm"`` keeps the Frobenius norm NS gave,
``Ô·‖O‖_F/‖Ô‖_F``, and then takes Muon's lr factor (``adjust_lr_fn``), as NorMuon's authors'
code, dion's NorMuon (``normuon_normalization``) and modded-nanogpt's NorMuon records do, so
Muon's learning rates carry over; ``"rms"`` is ``η̂ = 0.2·η·√(mn)/‖Ô‖_F``: an update of RMS 0.2,
AdamW's, with no lr factor (NorMuon's paper, AdaMuon's RMS-aligned rescale)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Any, NamedTuple

from torch import Tensor

from ..ns.matrices import MatrixMap
from ..step.collecting import CollectEnv
from ..step.contracts import AfterNSKind, EngineFor
from ..step.driver import TwoHalves
from ..step.elementwise import Scalar
from ..step.moments import SecondMoment
from ..step.options import Options
from . import muon as muon_rule
from .muon import Items
from .roles import ELEMENT_MOMENT, MUON, ROW_MOMENT


class Pattern(NamedTuple):
    """Muon's pattern, and the groups' second-moment settings that shape the program."""

    muon: muon_rule.Pattern
    stage: tuple[Any, ...]  # per group: the stage's settings (and, where the rule signs, sign_momentum)


class StagedRule:
    """Muon with a stage after NS: the rule of NorMuon, AdaMuon and any variant made of an
    :class:`~fastmuon.step.contracts.AfterNSKind`; ``signed``: groups carry ``sign_momentum``.
    Its state dicts are Muon's plus the stage's entry, carried from the same variant only."""

    family = MUON
    other_update = muon_rule.other_update  # Muon's AdamW
    is_matrix = staticmethod(muon_rule.is_matrix)

    def __init__(self, name: str, stage: AfterNSKind, *, signed: bool = False):
        self.__name__ = name
        self.stage = stage
        self.signed = signed
        own = {stage.key: stage.shaped} if stage.key is not None else {}
        self.state_keys: Mapping[str, str] = MappingProxyType({**muon_rule.state_keys, **own})

    def __repr__(self) -> str:
        return f"<update rule {self.__name__}>"

    def state_roles(self, group: dict[str, Any], p: Tensor) -> dict[str, str]:
        """Muon's buffers, and a matrix's entry of the stage."""
        roles = muon_rule.state_roles(group, p)
        key, role = self.stage.key, self.stage.role
        if key is None or not muon_rule.is_matrix(group, p):
            return roles
        return {**roles, key: role or key}  # no role: state that only this rule's steps read

    def state_shapes(self, group: dict[str, Any], p: Tensor, m: MatrixMap) -> dict[str, tuple[int, ...]]:
        """The shape of the stage's entry of a matrix parameter ``p`` under its map ``m``."""
        key = self.stage.key
        return {key: self.stage.shape(p, m)} if key is not None and muon_rule.is_matrix(group, p) else {}

    def collect(
        self, groups: Sequence[dict[str, Any]], grads: Sequence[Tensor | None], env: CollectEnv
    ) -> Items:
        items = muon_rule.collect(groups, grads, env, self.stage)
        if self.signed:  # the stage before NS: NS of the momentum's sign where the group says
            for it in items.matrices:
                it.sign_input = bool(groups[it.group]["sign_momentum"])
        return items

    def scalars(
        self, groups: Sequence[dict[str, Any]], lr_value: Callable[[Any], Scalar]
    ) -> tuple[Pattern, muon_rule.Scalars]:
        pattern, s = muon_rule.scalars(groups, lr_value)
        stage = self.stage.pattern(groups)
        if self.signed:
            stage = tuple((*own, g["sign_momentum"]) for own, g in zip(stage, groups))
        matrices = self.stage.scalars(groups, s.matrices)
        return Pattern(pattern, stage), muon_rule.Scalars(matrices, s.elementwise)

    def build(self, items: Items, pattern: Pattern, engine_for: EngineFor, options: Options) -> TwoHalves:
        return muon_rule.build(items, pattern.muon, engine_for, options, self.stage.batched)

    def reference(self, items: Items) -> None:
        """The same update, one parameter at a time."""
        muon_rule.reference(items, self.stage.reference)


#: NorMuon's: per-row second moment; ``β₂ = 0.95`` and ``ε = 1e-8`` are the paper's and dion's
ROW = SecondMoment("second_moment", ROW_MOMENT, per_row=True)
#: AdaMuon's: elementwise second moment of NS of the momentum's sign (``sign_momentum``)
ELEMENTWISE = SecondMoment("second_moment", ELEMENT_MOMENT, per_row=False)
NORMUON = StagedRule("normuon", ROW)
ADAMUON = StagedRule("adamuon", ELEMENTWISE, signed=True)
#: each second moment by the role it has in checkpoints
MOMENTS: dict[str, SecondMoment] = {m.role: m for m in (ROW, ELEMENTWISE)}
