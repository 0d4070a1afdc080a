"""Checks a saved optimizer state against the parameters it is loaded into: torch pairs saved
buffers with parameters by position alone, so another model's checkpoint, or groups built in
another order, would load and then mix up momenta (or fail much later, deep in a foreach call)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from torch import Tensor

from ..step.contracts import COUNT, LIKE_PARAM, VECTOR, Rule


def state_kinds(rules: Iterable[Rule]) -> dict[str, frozenset[str]]:
    """Each entry of the ``rules``' ``state_keys``, with every shape kind any gives it: a state
    dict may come from any of them."""
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
    """Raise ``ValueError`` naming the first parameter whose saved state does not fit it. A
    :data:`~fastmuon.step.contracts.VECTOR` entry is checked for its dimension only: its length
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
