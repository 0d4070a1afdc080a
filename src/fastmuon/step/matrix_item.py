"""One matrix's share of a step: what the matrix program and the stages a rule supplies read of it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from ..ns.engine import NSConfig


@dataclass
class MatrixItem:
    """One matrix's Muon update: ``p ← decay·p − scale·NS(momentum)``."""

    param: Tensor
    grad: Tensor
    buf: Tensor  # the EMA momentum M
    beta: float
    nesterov: bool
    scale: float  # lr times the optimizer's factors
    config: NSConfig
    decay: float = 1.0  # 1 − lr·wd for decoupled weight decay
    group: int = 0  # the param group it belongs to (whose hyperparameters a program reads)
    index: int = 0  # its position among the step's parameters with gradients
    factor: float = 1.0  # the per-matrix part of ``scale`` (the optimizer's lr adjustment)
    split: Callable[[Tensor], list[Tensor]] | None = None  # one of a tensor's matrices: how its grad splits
    piece: int = 0  # and which of them this is
    whole: Any = None  # what the planner sees of a matrix held in shards; None: ``param``
    cautious: bool = False  # decay only where the update and the parameter agree in sign
    sign_input: bool = False  # orthogonalise the momentum's sign instead (a stage before NS: before_ns.py)
    stage: Any = None  # the per-matrix state the rule's stage after NS reads (e.g. moments.Moment)
    state: dict[str, Any] | None = None  # state holding ``buf`` whole (None: a piece), for bucket_momentum
