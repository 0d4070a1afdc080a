"""The optimizer-wide settings, fixed at construction in one frozen object that copies, pickles
and the step all read, so a setting cannot drift between them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..ns.planner import DEFAULT_MAX_BUCKET_BYTES, POLICIES, CostModel
from .nonfinite import DEFAULT_NONFINITE, check_mode


@dataclass(frozen=True)
class Options:
    """What applies to every param group of one optimizer: ``foreach``, None/True the batched step,
    False the per-parameter loop; ``compile`` runs each bucket's NS through ``torch.compile``;
    ``capturable`` keeps every step free of host reads (refused with ``nonfinite="raise"``);
    ``adamw_lr`` (Muon) is AdamW's learning rate in ``use_muon=False`` groups that set none;
    ``owner_group_size`` and ``max_exchange_bytes`` steer the distributed step over DTensors (see
    :mod:`fastmuon.distributed.placement`)."""

    foreach: bool | None = None
    policy: str = "auto"
    compile: bool = False
    max_bucket_bytes: int = DEFAULT_MAX_BUCKET_BYTES
    cost_model: CostModel | str | None = None
    nonfinite: str = DEFAULT_NONFINITE
    capturable: bool = False
    adamw_lr: float | None = None
    owner_group_size: int | None = None
    max_exchange_bytes: int | None = None

    def __post_init__(self) -> None:
        check_foreach(self.foreach)
        if self.policy not in POLICIES:
            raise ValueError(f"invalid policy {self.policy!r}; choose one of {POLICIES}")
        if self.max_bucket_bytes <= 0:
            raise ValueError(f"max_bucket_bytes must be positive, got {self.max_bucket_bytes}")
        cost_model = self.cost_model
        if not (cost_model is None or cost_model == "calibrate" or isinstance(cost_model, CostModel)):
            raise ValueError(f"cost_model must be None, 'calibrate' or a CostModel, got {cost_model!r}")
        check_mode(self.nonfinite)
        check_capturable(bool(self.capturable), self.nonfinite)
        for name in ("owner_group_size", "max_exchange_bytes"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(
                    f"{name} must be None (the step chooses) or a positive integer, got {value!r}"
                )
        object.__setattr__(self, "compile", bool(self.compile))
        object.__setattr__(self, "max_bucket_bytes", int(self.max_bucket_bytes))
        object.__setattr__(self, "capturable", bool(self.capturable))


class ArgumentTypeError(TypeError, ValueError):
    """A constructor argument or group value of the wrong type (a ``TypeError`` and, like
    torch's optimizers' checks, a ``ValueError``)."""


def check_foreach(foreach: Any) -> bool | None:
    """``foreach`` as torch's optimizers take it: ``None`` (pick the fast path), True or False."""
    if foreach is not None and not isinstance(foreach, bool):
        raise ArgumentTypeError(f"foreach must be None, True or False, got {foreach!r}")
    return foreach


def check_capturable(capturable: bool, nonfinite: str) -> None:
    """A captured step (a CUDA graph) cannot read on the host whether its gradients were finite."""
    if capturable and nonfinite == "raise":
        raise ValueError(
            "capturable=True cannot be combined with nonfinite='raise' (the default): raising must "
            "read on the host whether the gradients were finite, which a captured step never does; "
            "pass nonfinite='skip' (parameters with a NaN/Inf gradient keep their weights and state "
            "for the step, decided on the device) or nonfinite='ignore' (no check)"
        )
