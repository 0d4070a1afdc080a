"""Checks a saved optimizer state against the parameters it is about to be loaded into.

``torch.optim.Optimizer.load_state_dict`` pairs saved buffers with parameters by position
alone, so a checkpoint from another model, or from the same model with its groups built in
another order, loads "successfully" and then mixes up momenta (or fails much later with a
shape error deep in a foreach call). Every saved tensor must have its parameter's shape.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor

#: State entries that are counters, not buffers shaped like the parameter.
SCALAR_KEYS = frozenset({"step"})
# per-row statistics (NorMuon's ``second_moment``): a 1-D tensor, its length checked by the step
ROW_KEYS = frozenset({"second_moment"})

_FIX = (
    "the state dict was saved for a different parameter layout; build the optimizer over the "
    "same parameters, in the same groups and order, as the run that saved it"
)


def check_state_layout(
    groups: list[dict[str, Any]], param_name: Callable[[dict[str, Any], int], str], state_dict: dict[str, Any]
) -> None:
    """Raise ``ValueError`` naming (by ``param_name(group, j)``) the first parameter of ``groups``
    whose saved state does not fit it."""
    saved_groups = state_dict.get("param_groups")
    saved_state = state_dict.get("state")
    if not isinstance(saved_groups, list) or not isinstance(saved_state, dict):
        raise ValueError("not an optimizer state dict: expected 'state' and 'param_groups' entries")
    if len(saved_groups) != len(groups):
        raise ValueError(
            f"the state dict has {len(saved_groups)} param groups, this optimizer {len(groups)}; {_FIX}"
        )
    for index, (saved, group) in enumerate(zip(saved_groups, groups)):
        if not isinstance(saved, dict) or not isinstance(saved.get("params"), list):
            raise ValueError(f"param group {index} of the state dict has no 'params' list; {_FIX}")
        ids, params = saved["params"], group["params"]
        if len(ids) != len(params):
            raise ValueError(
                f"param group {index} has {len(ids)} parameters in the state dict and "
                f"{len(params)} in this optimizer; {_FIX}"
            )
        for j, (pid, p) in enumerate(zip(ids, params)):
            saved_buffers = saved_state.get(pid, {})
            for key, value in saved_buffers.items() if isinstance(saved_buffers, dict) else ():
                if not isinstance(value, Tensor):
                    continue
                if key in SCALAR_KEYS:
                    fits = value.numel() == 1
                    want = "a single number"
                elif key in ROW_KEYS:
                    fits = value.shape == p.shape or value.ndim == 1
                    want = f"shape {tuple(p.shape)} or one dim"
                else:
                    fits = value.shape == p.shape
                    want = f"shape {tuple(p.shape)}"
                if not fits:
                    raise ValueError(
                        f"{param_name(group, j)}: saved state {key!r} has shape "
                        f"{tuple(value.shape)} but needs {want}; {_FIX}"
                    )
