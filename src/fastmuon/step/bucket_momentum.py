"""A bucket's momentum kept in the bucket's own layout: one ``(B, R, C)`` buffer per bucket, each
member parameter's ``momentum_buffer`` a view of its slot in the parameter's shape (the state stays
a tensor per parameter, as ``torch.optim`` keeps it; one loaded in its place is moved back into the
buffer when the step is prepared again). Off the host, a bucket that masks rejected gradients itself
would otherwise step its momentum one matrix at a time, since torch's foreach ops take per-tensor
weights only as host scalars. Laid out as the bucket's NS input, the weights are one ``(B, 1, 1)``
tensor, and the EMA and the NS input take one launch each for the whole bucket through the
per-matrix step's operations, so the values are the same. (The layout is the idea of flat
parameters, as in FSDP's ``FlatParameter``, applied to optimizer state.)"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from ..ns.engine import BucketFrame, Gather, Orthogonalizer
from .matrix_item import MatrixItem

#: the state entry a matrix's momentum lives in (see ``matrix_items``)
KEY = "momentum_buffer"


@dataclass(eq=False)
class BucketMomentum:
    """One bucket's EMA momentum step, its members' buffers views of ``buffer``."""

    frame: BucketFrame
    buffer: Tensor  # (B, R, C): every member's momentum, in slot order
    views: list[Tensor]  # each member's view of it, in slot order: what its state holds
    states: list[dict[str, Any]]  # the members' state, in slot order
    grads: Gather  # the members' gradients among the step's, in slot order
    flag_places: tuple[int, ...]  # the members' places in the step's keep vector, in slot order
    zero: Tensor  # what a rejected gradient is read as (0-d, made once: a fill is a launch)
    flag_index: dict[torch.device, Tensor] = field(default_factory=dict)

    @classmethod
    def over(
        cls, frame: BucketFrame, items: Sequence[MatrixItem], grads: Gather, flag_places: tuple[int, ...]
    ) -> BucketMomentum:
        """The step of a bucket whose members are ``items`` (slot order, each with its ``state``),
        their buffers moved into a new one: ``buf`` and the state entry become views of it."""
        buffer = torch.empty(frame.shape, dtype=items[0].buf.dtype, device=items[0].buf.device)
        views = frame.members(buffer)
        states: list[dict[str, Any]] = [it.state for it in items]  # type: ignore[misc]  # eligible ones have it
        for it, view in zip(items, views):
            view.copy_(it.buf)
            it.state[KEY] = it.buf = view  # type: ignore[index]
        return cls(frame, buffer, views, states, grads, flag_places, buffer.new_zeros(()))

    def step(
        self, grads: Sequence[Tensor], batch: Tensor, keep: Tensor, beta: float, nesterov: bool
    ) -> Tensor | None:
        """The EMA of :func:`~fastmuon.step.matrix._masked_momentum` over the whole bucket, the NS input
        written into ``batch``; a rejected member's Nesterov input is ``lerp(0, M, β)``, finite: the
        returned ``(B, 1, 1)`` flags are then the engine's ``drop``, whose normalisation zeroes it."""
        M = self.buffer
        G = torch.empty(M.shape, dtype=M.dtype, device=M.device)
        flags = self._flags(keep)
        # each gradient, zeros if rejected, straight into its slot: one pass over the gradients
        for g, rejected, slot in zip(self.grads(grads), (~flags).view(-1).unbind(0), self.frame.members(G)):
            torch.where(rejected, self.zero, g, out=slot)
        M.lerp_(G, torch.mul(flags, 1 - beta))
        ones = flags.to(M.dtype)
        if nesterov:
            torch.lerp(G, M, beta, out=batch)
            return ones
        torch.mul(M, ones, out=batch)
        return None

    def held(self) -> None:
        """Re-point each member's state entry replaced since (e.g. by a load) to its view, values copied."""
        current = [state[KEY] for state in self.states]
        if all(map(operator.is_, current, self.views)):
            return
        for state, view, now in zip(self.states, self.views, current):
            if now is not view:
                view.copy_(now)
                state[KEY] = view

    def _flags(self, keep: Tensor) -> Tensor:
        """The members' keep flags as ``(B, 1, 1)``: one index select, no host read."""
        index = self.flag_index.get(keep.device)
        if index is None:
            index = self.flag_index[keep.device] = torch.tensor(self.flag_places, device=keep.device)
        return keep.index_select(0, index).view(-1, 1, 1)


def in_layout(
    engine: Orthogonalizer,
    b: int,
    items: Sequence[MatrixItem],
    grad_positions: Sequence[int],
    keep_positions: Sequence[int],
) -> BucketMomentum | None:
    """Bucket ``b``'s momentum step in its layout, its members moved there; None where they do not
    fill the bucket, are pieces of a parameter, or a compiler traces the step."""
    frame = engine.frame(b) if not torch.compiler.is_compiling() else None
    if frame is None or any(it.state is None for it in items):
        return None
    members = engine.members(b)
    grads = Gather([grad_positions[k] for k in members])
    return BucketMomentum.over(frame, items, grads, tuple(keep_positions[k] for k in members))
