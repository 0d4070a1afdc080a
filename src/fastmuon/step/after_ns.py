"""The matrix update's stages after Newton–Schulz, over a set of a program's matrices.

A variant's stage, cautious or plain decay, then scale and apply: ``p ← decay·p − scale·u``.
Every stage but the variant's is elementwise, so running it over all of a program's matrices
at once, over one bucket's at a time or over one class's gives the same values; a variant's
statistics are per matrix but stacked per class of equal shapes, so a step that runs bucket by
bucket runs the variant's stage per class, as one call over all matrices does (see
``MatrixProgram._run_bucketwise``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import Tensor

from ..ns.gather import Gather
from .program import Scalar, apply_scaled_


class Decayed(NamedTuple):
    """Matrices that take one kind of decay: their parameters and param groups."""

    params: list[Tensor]
    groups: list[int]


class Cautious(NamedTuple):
    """The cautious matrices: where their updates sit, their parameters and param groups."""

    pick: Gather
    params: list[Tensor]
    groups: list[int]


class ScaleClass(NamedTuple):
    """A scale class of the program with matrices here, and where they sit among them."""

    scale: int  # the class's place among the program's scales
    pick: Gather


@dataclass
class AfterNS:
    """The stages after NS over some matrices of a program, listed in the program's order.

    ``scale_classes``: per class of the program's scales (see ``MatrixProgram.scale_keys``) that
    has matrices here, its index and where its matrices sit in this set.
    """

    params: list[Tensor]
    item_groups: list[int]
    variant: Callable[[list[Tensor], Any], list[Tensor]] | None
    cautious: Cautious | None  # the cautious matrices, apart
    plain: Decayed  # the others
    scale_classes: list[ScaleClass]
    scale_params: list[list[Tensor]]

    @classmethod
    def over(
        cls,
        items: Sequence[Any],
        params: Sequence[Tensor],
        item_groups: Sequence[int],
        scale_class: Sequence[int],
        variant: Callable[[list[Tensor], Any], list[Tensor]] | None,
    ) -> AfterNS:
        """The stages over ``items`` (MatrixItems, with their ``params``, groups and scale
        classes, in the program's order); ``variant``: the variant's stage over them, or None."""
        n = len(items)
        cautious = [k for k in range(n) if items[k].cautious]
        plain = [k for k in range(n) if not items[k].cautious]
        by_class: dict[int, list[int]] = {}
        for k in range(n):
            by_class.setdefault(scale_class[k], []).append(k)
        classes = sorted(by_class)
        return cls(
            params=list(params),
            item_groups=list(item_groups),
            variant=variant,
            cautious=(
                Cautious(Gather(cautious), [params[k] for k in cautious], [item_groups[k] for k in cautious])
                if cautious
                else None
            ),
            plain=Decayed([params[k] for k in plain], [item_groups[k] for k in plain]),
            scale_classes=[ScaleClass(c, Gather(by_class[c])) for c in classes],
            scale_params=[[params[k] for k in by_class[c]] for c in classes],
        )

    def run(
        self,
        updates: list[Tensor],
        scalars: Any,
        scales: Sequence[Scalar],
        groups: Sequence[int],
        one_pass: bool,
        owned: bool = True,
        keep: Tensor | None = None,
    ) -> None:
        """Apply ``updates`` (NS results of these matrices, in their order); ``scales``: the
        program's, one per scale class; ``groups``: the program's param groups; ``one_pass``:
        whether the program applies with one ``add_`` per scale class (see ``apply_scaled_``).
        ``keep``: one bool per matrix on the device, False where its gradient was rejected (its
        update is then zero): its decay factor is masked to 1 (``where(keep, decay, 1)``, the
        same fp32 value a Python factor gives where kept), one multiply per matrix."""
        if self.variant is not None:
            updates = self.variant(updates, scalars)
        decay = scalars.decay
        if decay is not None and keep is not None:
            factors: dict[int, list[Tensor]] = {}
            for g in sorted(set(self.item_groups)):
                if isinstance(decay[g], Tensor) or decay[g] != 1:
                    factors[g] = list(torch.where(keep, decay[g], 1.0).unbind(0))
            for j, (p, g) in enumerate(zip(self.params, self.item_groups)):
                if g in factors:
                    p.mul_(factors[g][j])
        elif decay is not None:
            if self.cautious is not None:
                cautious_decay_(updates, decay, *self.cautious)
            params, item_groups = self.plain
            if any(isinstance(decay[g], Tensor) for g in groups):
                for g in groups:
                    mine = [p for p, h in zip(params, item_groups) if h == g]
                    if mine:
                        torch._foreach_mul_(mine, decay[g])
            elif any(decay[g] != 1 for g in groups) and params:
                torch._foreach_mul_(params, [decay[g] for g in item_groups])
        apply_scaled_(
            self.scale_params,
            [pick(updates) for _, pick in self.scale_classes],
            [scales[c] for c, _ in self.scale_classes],
            owned=owned,
            one_pass=one_pass,
        )


def cautious_decay_(
    updates: Sequence[Tensor],
    decay: Sequence[Scalar],
    pick: Gather,
    params: list[Tensor],
    item_groups: list[int],
) -> None:
    """``p ← p − lr·wd·𝟙[u⊙p ≥ 0]⊙p`` over the cautious matrices (``pick`` finds their updates),
    in a fixed number of foreach calls (see ``matrix.cautious_decay``): the mask from the
    product's sign (+1 clamped at 1)."""
    masked = torch._foreach_mul(pick(updates), params)
    torch._foreach_sign_(masked)
    torch._foreach_add_(masked, 1)
    torch._foreach_clamp_max_(masked, 1)  # 1 where u·p ≥ 0, else 0
    torch._foreach_mul_(masked, params)
    rates = [1 - decay[g] for g in item_groups]  # lr·wd
    if any(isinstance(r, Tensor) for r in rates):
        for m, r in zip(masked, rates):
            m.mul_(r)
    else:
        torch._foreach_mul_(masked, rates)
    torch._foreach_sub_(params, masked)
