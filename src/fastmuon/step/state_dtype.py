"""State buffers stored in a dtype other than their parameter's (a group's ``state_dtype``).

Such a buffer is read once per step into the step's arithmetic dtype (float32, or float64 where
the parameter or the buffer is float64), updated there, and written back rounded to nearest
once; the parameter's update is computed from the unrounded values. A buffer in its
parameter's dtype takes the arithmetic torch's optimizers use, untouched by any of this."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

#: the dtypes a group's ``state_dtype`` may name (float8 formats need scaling: not plain storage)
STATE_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def check_state_dtype(value: Any, where: str) -> None:
    """``state_dtype``: None (each buffer in its parameter's dtype) or one of :data:`STATE_DTYPES`."""
    if value is None or value in STATE_DTYPES:
        return
    names = ", ".join(str(d) for d in STATE_DTYPES)
    hint = " (a torch.dtype, not its name)" if isinstance(value, str) else ""
    raise ValueError(
        f"invalid state_dtype {value!r} in {where}: it must be None (each buffer in its parameter's "
        f"dtype) or a floating torch.dtype, one of {names}{hint}; pass e.g. state_dtype=torch.bfloat16"
    )


def group_state_dtype(group: Mapping[str, Any], index: int) -> torch.dtype | None:
    """The dtype group ``index`` makes its buffers in (None: each parameter's own),
    checked where a step reads it: a value may have been set on the group since it was added."""
    value = group.get("state_dtype")
    check_state_dtype(value, f"param group {index}")
    return value


def arithmetic_dtype(param_dtype: torch.dtype, buf_dtype: torch.dtype) -> torch.dtype | None:
    """What a buffer's update is computed in (see the module); None: stored in its parameter's dtype."""
    if buf_dtype == param_dtype:
        return None
    return torch.float64 if torch.float64 in (param_dtype, buf_dtype) else torch.float32


def widened(tensors: Sequence[Tensor], dtype: torch.dtype) -> list[Tensor]:
    """Each tensor in ``dtype``: itself where it is already, else a fresh copy in its memory format
    (a gradient is never written through one), all made by one foreach copy."""
    work = [t if t.dtype == dtype else torch.empty_like(t, dtype=dtype) for t in tensors]
    fresh = [(w, t) for w, t in zip(work, tensors) if w is not t]
    if fresh:
        torch._foreach_copy_([w for w, _ in fresh], [t for _, t in fresh])
    return work


def store_(bufs: Sequence[Tensor], work: Sequence[Tensor]) -> None:
    """Write working copies back into their buffers, rounded to nearest (skipping a buffer itself)."""
    pairs = [(b, w) for b, w in zip(bufs, work) if w is not b]
    if pairs:
        torch._foreach_copy_([b for b, _ in pairs], [w for _, w in pairs])


def cast_state(state: Any, names: Sequence[str], dtype: torch.dtype) -> None:
    """Cast the floating buffers ``names`` of one parameter's state (if a dict) to ``dtype``."""
    if not isinstance(state, dict):
        return
    for name in names:
        value = state.get(name)
        if isinstance(value, Tensor) and value.is_floating_point() and value.dtype != dtype:
            state[name] = value.to(dtype)


def cast_groups_state(
    groups: Sequence[Mapping[str, Any]],
    state: Mapping[Any, Any],
    state_roles: Callable[[Any, Tensor], Mapping[str, str]],
) -> None:
    """Every buffer (``state_roles``' names but AdamW's ``step`` count) of each group that sets a
    ``state_dtype`` in that dtype: torch's loader casts saved state to the parameter's dtype."""
    for group in groups:
        dtype = group.get("state_dtype")
        if dtype is None:
            continue
        for p in group["params"]:
            buffers = [name for name in state_roles(group, p) if name != "step"]
            cast_state(state.get(p), buffers, dtype)


def lost_decays(dtype: torch.dtype | None, betas: Mapping[str, Any]) -> list[str]:
    """The coefficients among ``betas`` (name -> β of a recurrence ``x ← β·x + …``) whose decay
    a buffer stored in ``dtype`` loses: where ``1 − β`` is below half of ``dtype``'s relative
    precision, ``β·x`` rounds to nearest back to ``x`` for some values, so the buffer stops
    decaying (bf16: ``β > 1 − 2⁻⁸ ≈ 0.996``, e.g. AdamW's usual ``β₂ = 0.999``)."""
    if dtype is None:
        return []
    half_ulp = torch.finfo(dtype).eps / 2
    return [
        name for name, beta in betas.items() if isinstance(beta, (int, float)) and 0 < 1 - beta < half_ulp
    ]
