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
    # one of several matrices in a tensor: how the tensor's gradient splits, and which is this one
    split: Callable[[Tensor], list[Tensor]] | None = None
    piece: int = 0
    # what the planner sees of a matrix held in shards (see fastmuon.distributed); None: ``param``
    whole: Any = None
    # decay only where the update and the parameter agree in sign (cautious weight decay)
    cautious: bool = False
    # orthogonalise the sign of the momentum instead (a rule's stage before NS: see before_ns.py)
    sign_input: bool = False
    # the per-matrix state the rule's stage after NS reads (e.g. fastmuon.step.moments.Moment)
    stage: Any = None
    # the parameter's state where ``buf`` is its whole ``"momentum_buffer"`` (None: a piece of it),
    # for a bucket that re-points the entry (see fastmuon.step.bucket_momentum)
    state: dict[str, Any] | None = None
