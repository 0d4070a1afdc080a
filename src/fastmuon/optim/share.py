"""What Muon takes of an optimizer's parameters, and the warnings and plan notes that say it."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from ..ns.matrices import MatrixMap
from ..ns.planner import counted
from ..step.contracts import Rule

#: how to get Muon where an optimizer orthogonalises nothing
NO_MUON_FIX = (
    "To orthogonalise the matrices, put them in param groups with use_muon=True, or build the "
    "groups with fastmuon.param_groups(model)"
)


class MuonShare(NamedTuple):
    """How an optimizer's parameters split between Muon and the update of the rest (SGD, AdamW)."""

    parameters: int  # tensors Muon orthogonalises
    matrices: int  # the matrices they make (a tensor may hold several: see fastmuon.ns.matrices)
    elements: int
    others: int  # tensors that take the rule's other update alone
    other_elements: int
    other_update: str  # "SGD", "AdamW"
    all_off: bool  # every group has use_muon=False

    def why_none(self) -> str:
        if self.all_off:
            return "every param group has use_muon=False"
        return "no param group without use_muon=False holds a matrix (a non-empty tensor of 2 or more dims)"

    def describe(self) -> str:
        total = self.parameters + self.others
        rest = (
            f"{'the other ' if self.parameters else ''}{counted(self.others, 'parameter')} "
            f"({self.other_elements:,} elements) take {self.other_update}"
        )
        if not self.parameters:
            return rest
        muon = (
            f"Muon takes {self.parameters} of {total} parameters "
            f"({counted(self.matrices, 'matrix', 'matrices')}, {self.elements:,} elements)"
        )
        return f"{muon}; {rest}" if self.others else muon


def muon_share(
    groups: Sequence[dict[str, Any]], rule: Rule, maps_of: Callable[[dict[str, Any], int], list[MatrixMap]]
) -> MuonShare:
    """What ``rule`` orthogonalises and what takes ``rule.other_update``, gradients or not."""
    other_update = rule.other_update
    parameters = matrices = elements = others = other_elements = 0
    for index, group in enumerate(groups):
        maps = None
        for j, p in enumerate(group["params"]):
            if not rule.is_matrix(group, p):
                others += 1
                other_elements += p.numel()
                continue
            if maps is None:
                maps = maps_of(group, index)
            parameters += 1
            elements += p.numel()
            matrices += 1 if maps[j].is_flatten else len(maps[j].shapes(p.shape))
    all_off = all(g.get("use_muon") is False for g in groups)
    return MuonShare(parameters, matrices, elements, others, other_elements, other_update, all_off)


def steps_note(steps: int, has_state: bool) -> str:
    if steps:
        return f"{counted(steps, 'step')} taken"
    if has_state:
        return (
            "no step taken since this optimizer was made (its state was loaded, copied or made by init_state)"
        )
    return "no step taken yet"


def empty_plan_note(
    take: MuonShare, steps: int, has_state: bool, foreach_off: bool, distributed: bool
) -> str:
    """Why a plan holds no bucket."""
    taken = steps_note(steps, has_state)
    if not take.parameters:
        return f"no parameter is orthogonalised: {take.why_none()}; {take.describe()}; {taken}. {NO_MUON_FIX}"
    if foreach_off:
        return f"foreach=False runs the per-parameter loop, nothing is batched; {take.describe()}; {taken}"
    if not steps and distributed:
        return f"{taken} (a distributed plan is built by the first step); {take.describe()}"
    had = "none of them had a gradient in any step, and " if steps else ""
    return f"{taken}; {take.describe()}, but {had}none has a gradient now"
