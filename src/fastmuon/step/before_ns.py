"""The stage before Newton–Schulz a rule may ask of a matrix: orthogonalise the sign of its
momentum instead of the momentum (AdaMuon's sign stabilisation), one foreach call per step."""

from __future__ import annotations

import torch
from torch import Tensor

from ..ns.engine import Gather


class SignInputs:
    """The matrices of a program (its ``positions``) whose NS input is the sign of their momentum."""

    def __init__(self, positions: list[int]):
        self.positions = positions
        self.pick = Gather(positions)

    def run(self, sources: list[Tensor], owned: bool) -> None:
        """Take the sign of those ``sources``: in place where ``owned`` (the program's own NS inputs)."""
        if owned:
            torch._foreach_sign_(self.pick(sources))
        else:
            for k, t in zip(self.positions, torch._foreach_sign(self.pick(sources))):
                sources[k] = t
