"""Checks a saved optimizer state against the parameters it is about to be loaded into.

``torch.optim.Optimizer.load_state_dict`` pairs saved buffers with parameters by position
alone, so a checkpoint from another model, or from the same model with its groups built in
another order, loads "successfully" and then mixes up momenta (or fails much later with a
shape error deep in a foreach call). Every saved tensor must have its parameter's shape.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from torch import Tensor

from ..step.contracts import COUNT, LIKE_PARAM, VECTOR, Rule


def state_kinds(rules: Iterable[Rule]) -> dict[str, frozenset[str]]:
    """Each state entry the ``rules`` declare (their ``state_keys``), with every shape kind any
    of them gives it: a state dict may come from any of them."""
    kinds: dict[str, set[str]] = {}
    for rule in rules:
        for key, kind in rule.state_keys.items():
            kinds.setdefault(key, set()).add(kind)
    return {key: frozenset(k) for key, k in kinds.items()}


_FIX = (
    "the state dict was saved for a different parameter layout; build the optimizer over the "
    "same parameters, in the same groups and order, as the run that saved it"
)


def check_state_layout(
    groups: list[dict[str, Any]],
    param_name: Callable[[dict[str, Any], int], str],
    state_dict: dict[str, Any],
    kinds: Mapping[str, frozenset[str]],
) -> None:
    """Raise ``ValueError`` naming (by ``param_name(group, j)``) the first parameter of ``groups``
    whose saved state does not fit it. ``kinds`` (see :func:`state_kinds`): how each known entry
    may be shaped; any other tensor must have its parameter's shape. An entry of its own shape
    (:data:`~fastmuon.step.contracts.VECTOR`) is checked here for its dimension only: its length
    depends on the group's matrix maps, which the loader checks once the groups are adapted."""
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
                fits, want = _fits(value, p, kinds.get(key, _LIKE_PARAM))
                if not fits:
                    raise ValueError(
                        f"{param_name(group, j)}: saved state {key!r} has shape "
                        f"{tuple(value.shape)} but needs {want}; {_FIX}"
                    )


_LIKE_PARAM = frozenset({LIKE_PARAM})


def _fits(value: Tensor, p: Tensor, kinds: frozenset[str]) -> tuple[bool, str]:
    """Whether a saved entry fits one of its ``kinds`` for ``p``, and what they want."""
    fits = False
    wants = []
    if COUNT in kinds:
        fits |= value.numel() == 1
        wants.append("a single number")
    if LIKE_PARAM in kinds:
        fits |= value.shape == p.shape
        wants.append(f"shape {tuple(p.shape)}")
    if VECTOR in kinds:
        fits |= value.ndim == 1
        wants.append("one dim")
    return fits, " or ".join(wants)
