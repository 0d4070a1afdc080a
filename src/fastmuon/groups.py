"""Split a model's parameters into the Muon group and the rest."""

from __future__ import annotations

from typing import Any

from torch import nn


def param_groups(model: nn.Module, **overrides: Any) -> list[dict[str, Any]]:
    """Two param groups for :class:`~fastmuon.MuSGD` or :class:`~fastmuon.Muon`.

    Matrices (>=2D weights) go to a ``use_muon=True`` group, except embedding tables and the
    final output layer (the last ``nn.Linear``), whose rows are per-token/per-class vectors that
    orthogonalisation would mix; everything else goes to a ``use_muon=False`` group. ``overrides``
    (e.g. ``lr=0.02``) are set on both groups. Shared parameters appear once; frozen ones not at
    all; empty groups are left out. Each group carries ``param_names`` for error messages.
    """
    excluded = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    if linears:
        excluded.add(id(linears[-1].weight))
    groups: dict[bool, dict[str, list]] = {
        True: {"params": [], "param_names": []},
        False: {"params": [], "param_names": []},
    }
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        is_matrix = p.ndim >= 2 and id(p) not in excluded
        groups[is_matrix]["params"].append(p)
        groups[is_matrix]["param_names"].append(name)
    return [{**g, "use_muon": use_muon, **overrides} for use_muon, g in groups.items() if g["params"]]
