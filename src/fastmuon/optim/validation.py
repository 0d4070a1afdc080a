"""Checks of arguments, group values, parameters and gradients, each naming what is wrong and the fix."""

from __future__ import annotations

import math
import warnings
from collections.abc import Collection
from numbers import Integral
from typing import Any

import torch
from torch import Tensor

from ..distributed.dtensor import is_dtensor
from ..distributed.parts import check_placements
from ..ns.newton_schulz import default_steps
from ..rules.roles import ADAM_AVG, ADAM_AVG_SQ, ELEMENT_MOMENT, EMA, HEAVY_BALL, ROW_MOMENT
from ..step.elementwise import ADJUST_LR_ALIAS, RMS_SCALE
from ..step.options import ArgumentTypeError
from ..step.state_dtype import lost_decays


class UnsupportedOptionError(TypeError, ValueError):
    """An option this optimizer does not take: a ``TypeError`` as a keyword (as Python's for an
    unexpected keyword), a ``ValueError`` as a group key (as other refused group values)."""


def check_flag(name: str, value: Any, where: str) -> None:
    """A switch such as ``nesterov``: True or False, or an integer read as its truth value, as
    ``torch.optim``'s optimizers take it (a string is refused: ``"False"`` would read as True)."""
    if not isinstance(value, (bool, Integral)):
        raise ArgumentTypeError(
            f"{name} in {where} must be True or False (or an integer, read as its truth value), got {value!r}"
        )


def is_number(value: Any) -> bool:
    """A finite int or float (a bool is no number here: ``True`` would read as 1)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def check_nonnegative(name: str, value: Any, where: str) -> None:
    if isinstance(value, Tensor):
        value = value.item() if value.numel() == 1 else math.nan
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not value >= 0:
        raise ValueError(f"invalid {name} {value!r} in {where}: it must be a number >= 0")


def check_fraction(name: str, value: Any, where: str) -> None:
    """Momentum-like coefficients live in [0, 1)."""
    check_nonnegative(name, value, where)
    if not value < 1:
        raise ValueError(f"invalid {name} {value!r} in {where}: it must be in [0, 1)")


def check_capturable_setup(
    capturable: bool, process_group: Any, lr: Any, params: list[Tensor], where: str
) -> None:
    """Refuse what a captured step could not replay: a distributed step's host agreement with the
    other ranks, and a host ``lr`` tensor beside accelerator parameters (read once, at capture)."""
    if not capturable:
        return
    distributed = "a process_group (DDP)" if process_group is not None else None
    if any(map(is_dtensor, params)):
        distributed = "DTensor parameters (FSDP2)"
    if distributed is not None:
        raise ValueError(
            f"capturable=True cannot be combined with {distributed}: every distributed step "
            "agrees with the other ranks on the host (which gradients exist) and waits for their "
            "collectives, which a captured step cannot replay; pass capturable=False, or step "
            "one process's parameters without a process group or DTensors"
        )
    on_device = [p for p in params if p.device.type != "cpu"]
    if isinstance(lr, Tensor) and lr.device.type == "cpu" and on_device:
        raise ValueError(
            f"capturable=True cannot be combined with a CPU tensor lr beside {on_device[0].device} "
            f"parameters in {where}: a captured step would keep the value the lr had at capture; "
            f"put the lr tensor on {on_device[0].device} (lr=torch.tensor(..., "
            f"device='{on_device[0].device}')) or pass capturable=False"
        )


def check_tensor_lr(lr: Any, where: str) -> None:
    """A tensor learning rate holds one number (torch.optim's wording)."""
    if isinstance(lr, Tensor) and lr.numel() != 1:
        raise ValueError(
            f"Tensor lr must be 1-element, got shape {tuple(lr.shape)} in {where} "
            "(pass a float or a one-element tensor)"
        )


def param_name(groups: list[dict[str, Any]], group: dict[str, Any], j: int) -> str:
    """How errors name parameter ``j`` of ``group``: by name if the group has names, else by position."""
    names = group.get("param_names")
    p = group["params"][j]
    if names is not None and j < len(names):
        return f"parameter {names[j]!r} (shape {tuple(p.shape)})"
    index = next((i for i, g in enumerate(groups) if g is group), len(groups))
    return f"parameter {j} of param group {index} (shape {tuple(p.shape)})"


def check_param(name: str, optimizer: str, p: Tensor) -> None:
    """A parameter the optimizer can update: real and floating-point, not a partial DTensor."""
    check_placements(name, optimizer, p)
    if p.is_complex():
        raise ValueError(
            f"{name} is complex; {optimizer} supports real "
            "parameters only (view it as real with torch.view_as_real and optimise that)"
        )
    if not p.is_floating_point():
        raise ValueError(
            f"{name} has dtype {p.dtype}; {optimizer} optimises "
            "floating-point parameters only (convert it, e.g. with .float(), or leave it out "
            "of the optimizer)"
        )


def check_grad(name: str, optimizer: str, grad: Tensor) -> None:
    if grad.is_sparse:
        raise RuntimeError(
            f"{name} has a sparse gradient; {optimizer} needs "
            "dense gradients (use a dense nn.Embedding or a sparse optimizer such as SparseAdam)"
        )


def resolve_alias(value: Any, alias_value: Any, name: str, alias: str, default: Any) -> Any:
    """A constructor option given under its name or its alias (``alias_value`` None: not given)."""
    if alias_value is None:
        return value
    if value != default and value != alias_value:
        raise ValueError(f"{name}={value!r} and its alias {alias}={alias_value!r} disagree; pass {name} only")
    return alias_value


def group_without_alias(param_group: dict[str, Any], name: str, alias: str, where: str) -> dict[str, Any]:
    """``param_group`` with ``alias`` stored as ``name``, in a new dict (the caller's is kept as given)."""
    if not isinstance(param_group, dict) or alias not in param_group:
        return param_group
    group = dict(param_group)
    value = group.pop(alias)
    if name in group and group[name] != value:
        raise ValueError(
            f"{where} sets both {name}={group[name]!r} and its alias {alias}={value!r}; set {name} only"
        )
    group[name] = value
    return group


def group_lr_factor(param_group: Any, alias: str | None, optimizer: str, where: str) -> Any:
    """``param_group`` with the lr factor stored as ``adjust_lr_fn``; without an ``alias``, a
    group's ``adjust_lr`` is refused (stored, it would never be read)."""
    if alias is not None:
        return group_without_alias(param_group, "adjust_lr_fn", alias, where)
    if isinstance(param_group, dict) and ADJUST_LR_ALIAS in param_group:
        raise ValueError(
            f"{where} sets {ADJUST_LR_ALIAS}={param_group[ADJUST_LR_ALIAS]!r}, which {optimizer} does "
            f"not read; its lr factor is adjust_lr_fn: set adjust_lr_fn={param_group[ADJUST_LR_ALIAS]!r}"
        )
    return param_group


def check_rms_scale(group: dict[str, Any], where: str) -> None:
    """``rms_scale``: a positive number, and set only where the group's lr factor reads it."""
    rms_scale = group.get("rms_scale", RMS_SCALE)
    if not isinstance(rms_scale, (int, float)) or isinstance(rms_scale, bool) or not 0 < rms_scale < math.inf:
        raise ValueError(
            f"invalid rms_scale {rms_scale!r} in {where}: it must be a finite number > 0 (the update RMS "
            f"adjust_lr_fn='match_rms_adamw' aims at, {RMS_SCALE} by default)"
        )
    mode = group.get("adjust_lr_fn")
    if rms_scale != RMS_SCALE and mode != "match_rms_adamw":
        raise ValueError(
            f"rms_scale={rms_scale!r} in {where} is read by adjust_lr_fn='match_rms_adamw' only, "
            f"and this group's adjust_lr_fn is {mode!r}: set adjust_lr_fn='match_rms_adamw' "
            f"(the update's RMS becomes rms_scale) or leave rms_scale at {RMS_SCALE}"
        )


def implied_ns_steps(ns_steps: Any, coefficients: Any) -> Any:
    """``ns_steps``, or for None the count ``coefficients`` were published for."""
    return default_steps(coefficients) if ns_steps is None else ns_steps


def with_implied_ns_steps(param_group: Any, defaults: dict[str, Any]) -> Any:
    """A group setting ``ns_coefficients`` but no ``ns_steps`` runs their count, not the constructor's."""
    if not isinstance(param_group, dict):
        return param_group
    steps = param_group.get("ns_steps")
    if steps is None and ("ns_coefficients" in param_group or "ns_steps" in param_group):
        coefficients = param_group.get("ns_coefficients", defaults["ns_coefficients"])
        return {**param_group, "ns_steps": default_steps(coefficients)}
    return param_group


def state_betas(group: dict[str, Any], roles: Collection[str]) -> dict[str, Any]:
    """The β of each recurrence among ``roles``, by the option that sets it."""
    betas = group.get("betas")
    pair = tuple(betas) if isinstance(betas, (tuple, list)) and len(betas) == 2 else (None, None)
    named = {
        EMA: ("momentum", group.get("momentum")),
        HEAVY_BALL: ("momentum", group.get("momentum")),
        ADAM_AVG: ("betas[0]", pair[0]),
        ADAM_AVG_SQ: ("betas[1]", pair[1]),
        ROW_MOMENT: ("beta2", group.get("beta2")),
        ELEMENT_MOMENT: ("beta2", group.get("beta2")),
    }
    return dict(named[role] for role in sorted(roles) if role in named)


def warn_lost_decays(group: dict[str, Any], where: str, roles: Collection[str]) -> None:
    """Warn where ``state_dtype`` is too coarse for a β of the group's buffers (rounding undoes decay)."""
    dtype = group.get("state_dtype")
    betas = state_betas(group, roles)
    lost = lost_decays(dtype, betas)
    if not lost or dtype is None:
        return
    u = torch.finfo(dtype).eps / 2
    named = ", ".join(f"{name}={betas[name]!r}" for name in lost)
    warnings.warn(
        f"state_dtype={dtype} in {where} with {named}: 1 − β is below {dtype}'s relative rounding "
        f"error ({u:.2g}), so rounding the buffer to nearest undoes its decay and it stops "
        f"shrinking; use a β of at most {1 - u:.4g} or state_dtype=torch.float32 for this group",
        UserWarning,
        stacklevel=2,
    )
