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

from collections.abc import Mapping, Sequence
from typing import Any

from torch import Tensor

from ..ns.matrices import MatrixMap
from ..step.collecting import CollectEnv
from . import muon as muon_rule
from .muon import Items, is_matrix
from .normuon import Variant, build, elementwise, family, reference, variant_scalars

__all__ = [
    "Items",
    "is_matrix",
    "state_roles",
    "state_shapes",
    "collect",
    "scalars",
    "build",
    "reference",
    "family",
    "elementwise",
]

VARIANT = Variant(per_row=False, sign_key="sign_momentum")


def state_roles(group: dict[str, Any], p: Tensor) -> dict[str, str]:
    """Muon's buffers, and a matrix's elementwise second moment."""
    return VARIANT.roles(group, p)


def state_shapes(group: dict[str, Any], p: Tensor, m: MatrixMap) -> dict[str, tuple[int, ...]]:
    """The shape of each buffer the loader must check: ``second_moment``, ``p``'s own."""
    return VARIANT.shapes(group, p, m)


def collect(groups: Sequence[dict[str, Any]], grads: Sequence[Tensor | None], env: CollectEnv) -> Items:
    return muon_rule.collect(groups, grads, env, VARIANT)


def scalars(groups: Sequence[Mapping[str, Any]], lr_value):
    return variant_scalars(groups, lr_value, extra=("sign_momentum",))
