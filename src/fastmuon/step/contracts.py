"""The contracts between the layers, checked by mypy: what a rule offers (:class:`Rule`), the
parts a variant supplies (a kind of stage after NS: :class:`AfterNSKind`, and the batched stage
it makes: :class:`AfterNSStage`), an update's elementwise half (:class:`HalfProgram`), what an
engine offers the matrix program (:class:`Engine`, :data:`EngineFor`). Each has several
implementations.

They live in ``step/``, the lowest layer that holds every type they name; a rule satisfies
:class:`Rule` as a module (its functions and constants are the members) or as an object
(:class:`~fastmuon.rules.second_moment.StagedRule`, one class for several optimizers).
"""

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
    """A stage after NS over a program's matrices (what :meth:`AfterNSKind.batched` makes):
    it maps their NS results, in the program's order, to the updates applied. ``classes``
    (position lists first) and ``run_class`` let a step that runs bucket by bucket run it per
    class of matrices stacked together. A stage whose class attribute ``masks_rejected`` is
    True leaves a rejected matrix's state as it was when ``run_class`` is given the class's
    keep ``flags`` (its ``flags(c, keep)``), so that its buckets need no copy; one without it
    is never given flags, and its matrices are copied and put back."""

    classes: list[Any]

    def __call__(self, updates: Sequence[Tensor], scalars: Any) -> list[Tensor]: ...
    def run_class(
        self, c: int, updates: Sequence[Tensor], scalars: Any, flags: Tensor | None = None
    ) -> list[Tensor]: ...
    def flags(self, c: int, keep: Tensor) -> Tensor: ...


class AfterNSKind(Protocol):
    """A kind of stage after NS, as a variant of Muon is made of one (``StagedRule``): what it
    adds to each matrix item, the state it keeps, its settings per step, its batched stage and
    its per-matrix reference. Implemented by the second moment of NorMuon and AdaMuon
    (``fastmuon.step.moments.SecondMoment``); a new stage implements it outside the core.

    ``key``: the state entry it keeps per matrix parameter (None: none), shaped as ``shaped``
    says (:data:`LIKE_PARAM`, or :data:`VECTOR` with :meth:`shape`) and following ``role`` in
    checkpoints (None: not carried across optimizers)."""

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
    """An update rule of :mod:`fastmuon.rules` (a module, or an object with these members), named by its optimizer class.

    ``family``: its name in checkpoints; ``other_update``: the update the parameters it does not
    orthogonalise take ("SGD", "AdamW"), as warnings and plan notes name it; ``state_keys``: each
    state entry it may keep and how it is shaped (:data:`LIKE_PARAM`, :data:`COUNT`,
    :data:`VECTOR`). ``scalars`` returns the step's pattern (the hyperparameters' equality
    classes, which decide whether a prepared program still fits) and its scalars; ``build``
    and ``reference`` take the items ``collect`` returned and that pattern.
    """

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
