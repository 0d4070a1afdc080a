"""The contracts between the layers, checked by mypy: what a rule offers (:class:`Rule`), the stage
after NS a variant supplies (:class:`AfterNSKind`, :class:`AfterNSStage`), an update's elementwise
half (:class:`HalfProgram`) and what an engine offers the matrix program (:class:`Engine`,
:data:`EngineFor`). They live in ``step/``, the lowest layer that holds every type they name."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor

from ..ns.engine import NSConfig
from ..ns.matrices import MatrixMap
from ..ns.planner import Plan
from .collecting import CollectEnv
from .matrix_item import MatrixItem
from .options import Options

#: How a saved state entry is shaped (a rule's ``state_keys``; see :mod:`fastmuon.optim.state`).
LIKE_PARAM = "like_param"  # its parameter's shape
COUNT = "count"  # one number (AdamW's step count)
VECTOR = "vector"  # one dim, its length set by the group's matrix maps (``state_shapes``)


class Engine(Protocol):
    """An executor of a plan's Newton–Schulz over fixed matrices (local or distributed)."""

    @property
    def plan(self) -> Plan | None: ...
    def __call__(self, sources: Sequence[Tensor], out_dtypes: Sequence[torch.dtype]) -> list[Tensor]: ...
    def workspaces(self) -> list[Tensor]: ...


#: ``(params, configs, wholes) -> engine``: the executor of the plan over these matrices
#: (``wholes``: what the planner sees of each, a tensor or a sharded matrix's description).
EngineFor = Callable[[list[Tensor], list[NSConfig], list[Any]], Engine]


class AfterNSStage(Protocol):
    """A stage after NS over a program's matrices: maps their NS results, in the program's order, to the
    updates applied; ``classes`` and ``run_class`` let a bucket-by-bucket step run it per class. One
    whose ``masks_rejected`` is True leaves a rejected matrix's state as it was given the class's keep
    ``flags``; one without it is never given flags (its matrices are copied and put back)."""

    classes: list[Any]

    def __call__(self, updates: Sequence[Tensor], scalars: Any) -> list[Tensor]: ...
    def run_class(
        self, c: int, updates: Sequence[Tensor], scalars: Any, flags: Tensor | None = None
    ) -> list[Tensor]: ...
    def flags(self, c: int, keep: Tensor) -> Tensor: ...


class AfterNSKind(Protocol):
    """A kind of stage after NS, of which a variant of Muon is made (``StagedRule``; e.g.
    ``fastmuon.step.moments.SecondMoment``). ``key``: the state entry it keeps per matrix parameter
    (None: none), shaped as ``shaped`` says and following ``role`` in checkpoints."""

    @property
    def key(self) -> str | None: ...
    @property
    def shaped(self) -> str: ...
    @property
    def role(self) -> str | None: ...
    def shape(self, p: Tensor, m: MatrixMap) -> tuple[int, ...]: ...
    def adjust(self, group: Mapping[str, Any]) -> str:
        """The group's lr factor mode (``adjust_lr_fn``, resolved)."""
        ...

    def attach(
        self,
        group: Mapping[str, Any],
        p: Tensor,
        m: MatrixMap,
        state: dict[str, Any],
        items: list[MatrixItem],
        env: CollectEnv,
    ) -> None:
        """Give ``p``'s matrix items (one per matrix of its map ``m``) what the stage reads."""
        ...

    def pattern(self, groups: Sequence[Mapping[str, Any]]) -> tuple[Any, ...]:
        """The groups' settings that shape the batched stage (a program is rebuilt when they change)."""
        ...

    def scalars(self, groups: Sequence[Mapping[str, Any]], s: Any) -> Any:
        """The matrix update's scalars ``s`` (``MatrixScalars``) with the stage's own, read each step."""
        ...

    def batched(self, items: list[MatrixItem]) -> AfterNSStage:
        """The stage over a program's matrices (``items``, in its order)."""
        ...

    def reference(self, item: MatrixItem, update: Tensor) -> Tensor:
        """The stage over one matrix's NS result (the per-parameter path)."""
        ...


class HalfProgram(Protocol):
    """The elementwise half of an update (SGD's, AdamW's), prepared once."""

    positions: frozenset[int]  # the step's parameters (their places among its gradients) it updates

    def fits(self, grads: Sequence[Tensor]) -> bool: ...
    def run(self, grads: Sequence[Tensor], scalars: Any, keep: Tensor | None = None) -> None: ...
    def self_masked(self) -> frozenset[int]: ...


class RuleItems(Protocol):
    """A step's work items (a rule's ``Items``): one list per half, the matrices first."""

    @property
    def matrices(self) -> list[MatrixItem]: ...
    @property
    def elementwise(self) -> Sequence[Any]: ...
    def __iter__(self) -> Iterator[Sequence[Any]]: ...


@runtime_checkable
class Rule(Protocol):
    """An update rule of :mod:`fastmuon.rules` (a module, or an object with these members):
    ``family``, its name in checkpoints; ``other_update``, the update of the parameters it does not
    orthogonalise ("SGD", "AdamW"); ``state_keys``, each state entry's shape kind. ``scalars``
    returns the step's pattern (the hyperparameters' equality classes, which decide whether a
    prepared program still fits) and its scalars."""

    family: str
    other_update: str
    state_keys: Mapping[str, str]

    def is_matrix(self, group: dict[str, Any], p: Tensor) -> bool: ...
    def state_roles(self, group: dict[str, Any], p: Tensor) -> dict[str, str]: ...
    def state_shapes(self, group: dict[str, Any], p: Tensor, m: MatrixMap) -> dict[str, tuple[int, ...]]: ...
    def collect(
        self, groups: Sequence[dict[str, Any]], grads: Sequence[Tensor | None], env: CollectEnv
    ) -> RuleItems: ...
    def scalars(
        self, groups: Sequence[dict[str, Any]], lr_value: Callable[[Any], Any]
    ) -> tuple[Any, Any]: ...
    def build(
        self, items: Any, pattern: Any, engine_for: EngineFor, options: Options
    ) -> Any: ...  # a fastmuon.step.driver.TwoHalves
    def reference(self, items: Any) -> None: ...
