"""Let named and unnamed param groups share an optimizer: torch requires all groups or none to
carry ``param_names``, and :func:`fastmuon.param_groups` names its groups, so the side without
names gets positional placeholders (``"param_groups[2][0]"``)."""

from __future__ import annotations

from typing import Any

from torch import Tensor


def placeholder_names(group_index: int, count: int) -> list[str]:
    return [f"param_groups[{group_index}][{j}]" for j in range(count)]


def agree_on_names(
    param_group: dict[str, Any], groups: list[dict[str, Any]]
) -> tuple[dict[str, Any], list[str] | None]:
    """``param_group`` agreeing with ``groups`` about names, and the names held back: a named
    group joining unnamed ones is added without them, and :func:`restore_names` puts them in once
    the add succeeded, so that a refused add changes nothing."""
    if not groups or not isinstance(param_group, dict) or "params" not in param_group:
        return param_group, None  # torch's own checks explain what is wrong
    params = param_group["params"]
    if isinstance(params, Tensor):
        params = [params]
    elif isinstance(params, set):
        return param_group, None
    else:
        params = list(params)
    as_pairs = bool(params) and all(isinstance(x, tuple) for x in params)
    group_named = "param_names" in param_group or as_pairs
    optimizer_named = "param_names" in groups[0]
    if optimizer_named and not group_named:
        names = placeholder_names(len(groups), len(params))
        return {**param_group, "params": params, "param_names": names}, None
    if group_named and not optimizer_named:
        names = [x[0] for x in params] if as_pairs else list(param_group["param_names"])
        tensors = [x[1] for x in params] if as_pairs else params
        unnamed = {k: v for k, v in param_group.items() if k != "param_names"}
        return {**unnamed, "params": tensors}, names
    param_group["params"] = params  # as torch's add_param_group does: a generator is read once
    return param_group, None


def restore_names(groups: list[dict[str, Any]], held: list[str] | None) -> None:
    """After a successful add: the new (last) group gets its held names, the others placeholders."""
    if held is None:
        return
    groups[-1]["param_names"] = held
    for i, group in enumerate(groups[:-1]):
        group.setdefault("param_names", placeholder_names(i, len(group["params"])))
