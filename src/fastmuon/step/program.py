"""The pieces of a step program: what is prepared once per plan and what is read every step.

A step's lists (parameters, state buffers, NS input views, foreach partitions) depend only on
which parameters have gradients, their layouts, and which hyperparameters are *equal* across
param groups; the hyperparameter values themselves may change every step (learning-rate
schedules, momentum warm-up). So a program is built from one step's values, partitioned by the
equality classes of those values, and reused while the classes stay the same: each step reads
the values once per param group and runs a fixed sequence of foreach and NS calls.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from ..distributed.dtensor import LocalShards
from ..ns import device
from ..ns.gather import Gather
from ..ns.planner import Plan
from .contracts import HalfProgram, MatrixHalf, UpdateProgram
from .nonfinite import NonFiniteGuard

#: A learning rate or a product of one: a Python number, or a 0-d tensor (used as a tensor).
Scalar = Any


def classes_each(*values: Sequence[Hashable]) -> list[tuple[int, ...]]:
    """Each value's class in each sequence: the index of its first equal value (equality of
    floats, identity of tensors). Two steps with equal classes partition the parameters alike.
    One call for all of a step's sequences."""
    out: list[tuple[int, ...]] = []
    for vs in values:
        first: dict[Hashable, int] = {}
        out += (tuple(first.setdefault(v, i) for i, v in enumerate(vs)),)  # no call per sequence
    return out


def strides_of(tensors: Sequence[Tensor]) -> list[tuple[int, ...]]:
    """Each tensor's strides (read every step by the fused paths' layout checks: ``map`` over the
    method runs no Python frame per tensor)."""
    return list(map(Tensor.stride, tensors))


def scale_limit(on: torch.device) -> int:
    """How many distinct scales take one fused ``add_`` each before one scaling pass and one
    subtracting pass over all of them cost less: every call is a launch on a GPU."""
    return 8 if device.is_host(on) else 1


def apply_scaled_(
    params: Sequence[list[Tensor]],
    updates: Sequence[list[Tensor]],
    scales: Sequence[Scalar],
    *,
    owned: bool,
    limit: int | None = None,
    one_pass: bool | None = None,
) -> None:
    """``p ← p − scale·u`` for each class of (params, updates, scale).

    Few classes (at most ``limit``) take one fused ``add_`` each (one pass); many take one
    scaling pass and one subtracting pass over all of them. ``one_pass`` makes that choice
    instead of ``limit`` (a caller applying a set of classes in parts keeps its whole set's). A
    tensor scale is used as a tensor (no host read): a scaling pass and a subtracting pass for
    its class. With ``owned`` the updates may be scaled in place.
    """
    if any(isinstance(s, Tensor) for s in scales):
        for ps, us, s in zip(params, updates, scales):
            if not ps:
                continue
            if owned:
                torch._foreach_mul_(us, s)
                torch._foreach_sub_(ps, us)
            else:
                torch._foreach_sub_(ps, torch._foreach_mul(us, s))
        return
    if one_pass is None:
        one_pass = len(scales) <= limit  # type: ignore[operator]
    if one_pass:
        for ps, us, s in zip(params, updates, scales):
            if ps:
                torch._foreach_add_(ps, us, alpha=-s)
        return
    all_params = [p for ps in params for p in ps]
    all_updates = [u for us in updates for u in us]
    per_item = [s for ps, s in zip(params, scales) for _ in ps]
    if not all_params:
        return
    if owned:
        torch._foreach_mul_(all_updates, per_item)
        torch._foreach_sub_(all_params, all_updates)
    else:
        torch._foreach_sub_(all_params, torch._foreach_mul(all_updates, per_item))


class TwoHalves:
    """A rule's update prepared once as its two halves: the matrices' (see
    :class:`~fastmuon.step.matrix.MatrixProgram`), then the elementwise one (SGD, AdamW) on the
    parameters after it. It reads the step's scalars as their fields ``matrices`` and
    ``elementwise``."""

    def __init__(self, matrices: MatrixHalf, elementwise: HalfProgram):
        self.matrices = matrices
        self.elementwise = elementwise

    def fits(self, grads: Sequence[Tensor]) -> bool:
        return self.elementwise.fits(grads)

    def run(self, grads: Sequence[Tensor], s: Any, keep: Tensor | None, hooks: Mapping[int, Any]) -> None:
        self.matrices.run(grads, s.matrices, keep, hooks)
        self.elementwise.run(grads, s.elementwise, keep)

    def self_masked(self) -> frozenset[int]:
        """The parameters (places among the step's gradients) whose update leaves them and all
        their device state as they were where ``keep`` rejects their gradient, with nothing put
        back: those that every half stepping them masks (MuSGD's large matrices are stepped and
        masked by both)."""
        matrices, elementwise = self.matrices.self_masked(), self.elementwise.self_masked()
        on_matrices, on_elementwise = self.matrices.positions, self.elementwise.positions
        return frozenset(
            i
            for i in matrices | elementwise
            if (i in matrices or i not in on_matrices) and (i in elementwise or i not in on_elementwise)
        )


class StepProgram:
    """One step, prepared: the update's program and what every step around it needs.

    ``live`` picks the parameters with gradients out of the optimizer's flat parameter list;
    ``guard`` (:class:`~fastmuon.step.nonfinite.NonFiniteGuard`) handles NaN/Inf gradients;
    ``owners`` (``(group, j)`` each) name the parameters in errors; ``shards`` (sharded
    parameters: :class:`~fastmuon.distributed.dtensor.LocalShards`) the local tensors the
    program updates, whose gradients a step takes as local shards too.
    """

    def __init__(
        self,
        update: UpdateProgram,
        live: Gather,
        guard: NonFiniteGuard,
        owners: list[tuple[dict[str, Any], int]],
        shards: LocalShards | None = None,
    ):
        self.update = update
        self.matrices = update.matrices
        self.live_pick = live
        self.guard = guard
        self.owners = owners
        self.shards = shards

    @property
    def plan(self) -> Plan | None:
        """The batching plan the program's Newton–Schulz runs (None: no matrix)."""
        return self.matrices.plan if self.matrices is not None else None

    def live(self, grads: Sequence[Any]) -> list[Tensor]:
        """This step's gradients of the parameters the program updates (local shards if sharded)."""
        picked = self.live_pick(grads)
        if self.shards is not None:
            picked = [g.to_local() if hasattr(g, "to_local") else g for g in picked]
        return picked

    def fits(self, grads: list[Tensor]) -> bool:
        """Whether this step's gradients have the layouts the program was built for (and the
        sharded parameters still the local tensors it updates)."""
        return self.update.fits(grads) and (self.shards is None or self.shards.current())

    def name_of(self, param_name: Callable[[dict[str, Any], int], str]) -> Callable[[int], str]:
        """Names the ``k``-th parameter of the program, through ``param_name(group, j)``."""
        return lambda k: param_name(*self.owners[k])
