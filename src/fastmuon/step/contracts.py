"""The contracts between the layers, checked by mypy and, for a rule, when its optimizer class
is made: what a rule offers (:class:`Rule`), what its prepared update offers the driver
(its elementwise half: :class:`HalfProgram`; a stage after NS: :class:`AfterNSStage`), what an engine offers the matrix program
(:class:`Engine`, :data:`EngineFor`; one that runs bucket by bucket is ``fastmuon.ns.engine.Orthogonalizer`` itself) and what the step reads of an
optimizer's options (:class:`StepOptions`).

They live in ``step/``, the lowest layer that holds every type they name; a rule satisfies
:class:`Rule` as a module (its functions and constants are the members) or as an object
(one parametrised class for several optimizers).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, ClassVar, Protocol, runtime_checkable

import torch
from torch import Tensor

from ..ns.engine import NSConfig
from ..ns.matrices import MatrixMap
from ..ns.planner import CostModel, Plan
from .collecting import CollectEnv
from .matrix_item import MatrixItem

#: How a saved state entry is shaped (a rule's ``state_keys``; see :mod:`fastmuon.optim.state`).
LIKE_PARAM = "like_param"  # its parameter's shape
COUNT = "count"  # one number (AdamW's step count)
VECTOR = "vector"  # one dim, its length set by the group's matrix maps (``state_shapes``)


class StepOptions(Protocol):
    """What the step reads of an optimizer's options (:class:`fastmuon.optim.options.Options`)."""

    @property
    def foreach(self) -> bool | None: ...
    @property
    def policy(self) -> str: ...
    @property
    def compile(self) -> bool: ...
    @property
    def max_bucket_bytes(self) -> int: ...
    @property
    def cost_model(self) -> CostModel | str | None: ...
    @property
    def nonfinite(self) -> str: ...
    @property
    def capturable(self) -> bool: ...
    @property
    def owner_group_size(self) -> int | None: ...
    @property
    def max_exchange_bytes(self) -> int | None: ...


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
    """A rule's stage after NS over a program's matrices (``fastmuon.step.moments.MomentStage``):
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
        self, items: Any, pattern: Any, engine_for: EngineFor, options: StepOptions
    ) -> Any: ...  # a fastmuon.step.driver.TwoHalves
    def reference(self, items: Any) -> None: ...


def missing_members(rule: object) -> list[str]:
    """The members of :class:`Rule` that ``rule`` lacks (none: it is a rule)."""
    members = {*Rule.__annotations__, *(n for n, v in vars(Rule).items() if callable(v) and n[0] != "_")}
    return sorted(n for n in members if not hasattr(rule, n))


def check_rule(owner: str, rule: object | None) -> None:
    """Refuse, naming ``owner`` (an optimizer class) and what is missing, a ``rule`` that lacks a
    member of :class:`Rule` (None: the class names no rule of its own)."""
    missing = missing_members(rule) if rule is not None else []
    if missing:
        raise TypeError(
            f"{owner}._rule ({getattr(rule, '__name__', rule)!r}) is not an update rule: it lacks "
            f"{', '.join(missing)}; define them in the rule (see fastmuon.step.contracts.Rule)"
        )


class RuleHolder:
    """A class that names its update rule as ``_rule`` (the optimizers): a rule lacking a member
    of :class:`Rule` is refused when the class is made, not at its first step."""

    #: the update rule, one of :mod:`fastmuon.rules`
    _rule: ClassVar[Rule]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        check_rule(cls.__name__, cls.__dict__.get("_rule"))
