"""The ``qk-clip`` contender: fastmuon with QK-clip (``qk_clip_tau``) on a workload's attention
queries and keys, every head over ``τ`` in every step, so that its row beside plain fastmuon's
shows what the clip costs at most (every query and key row scaled).

The queries and keys are named in the group key ``attention`` (one part per parameter, see
:mod:`fastmuon.optim.qk_clip`), taken from the manifest's groups where they carry that key (a
manifest written from ``fastmuon.param_groups(model, attention=True)``), else, for a generated
workload (:data:`.workloads.GENERATED`), from its attention modules as
:mod:`fastmuon.optim.qk_clip` recognises Llama-family ones (``q_proj``/``k_proj`` with the
head counts in the layer's ``config``: rows per head on dim 0, grouped-query keys).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ..optim.qk_clip import detected_parts, parse_part
from .contenders import Contender, Unavailable, Workbench, fastmuon_variant
from .manifest import Manifest
from .workloads import GENERATED

#: the τ the row clips at (Kimi K2's, arXiv 2507.20534)
TAU = 100.0
#: every head's synthetic maximum, in units of ``τ``: each head's ``γ = τ/S`` is ``1/OVER``
OVER = 2.0


def manifest_parts(manifest: Manifest) -> dict[str, dict[str, Any]]:
    """``param name -> part`` from the manifest groups' ``attention`` lists (in ``params`` order)."""
    parts: dict[str, dict[str, Any]] = {}
    seen = [0] * len(manifest.param_groups)
    for spec in manifest.params:
        entries = manifest.param_groups[spec.group].get("attention")
        j = seen[spec.group]
        seen[spec.group] += 1
        if isinstance(entries, list) and j < len(entries) and entries[j] is not None:
            parts[spec.name] = entries[j]
    return parts


def workload_parts(manifest: Manifest) -> dict[str, dict[str, Any]]:
    """The attention parts of ``manifest``'s parameters, by name (empty: none are known)."""
    parts = manifest_parts(manifest)
    workload = GENERATED.get(manifest.model)
    if parts or workload is None:
        return parts
    with torch.device("meta"):
        model = workload.build()
    found, names = detected_parts(model), {p.name for p in manifest.params}
    return {name: found[id(p)] for name, p in model.named_parameters() if id(p) in found and name in names}


def synthetic_maxima(parts: dict[str, dict[str, Any]], device: torch.device) -> dict[str, Tensor]:
    """Every layer's per-query-head maxima, all ``OVER·τ`` (a layer's count: its query part's
    heads, or its key part's where it has no query part)."""
    heads: dict[str, int] = {}
    for spec in parts.values():
        part = parse_part(spec)
        if part is not None and (part.is_query or part.layer not in heads):
            heads[part.layer] = part.heads
    return {layer: torch.full((n,), OVER * TAU, device=device) for layer, n in heads.items()}


def qk_clip_contender(wb: Workbench) -> Contender:
    """fastmuon with ``qk_clip_tau`` on the workload's queries and keys, each step handed maxima
    over ``τ`` for every head (made once, outside the timed step)."""
    if wb.optimizer == "musgd":
        raise Unavailable("MuSGD takes no QK-clip: run with --optimizer muon, normuon or adamuon")
    parts = workload_parts(wb.manifest)
    if not parts:
        raise Unavailable(
            f"{wb.manifest.model} has no attention queries and keys that QK-clip knows: it needs "
            "Llama-style q_proj/k_proj (e.g. --model llama-1b) or a manifest whose groups carry "
            "'attention' parts (written from fastmuon.param_groups(model, attention=True))"
        )
    groups = wb.groups()
    for g in groups:
        entries = [parts.get(name) for name in g["param_names"]]
        if any(e is not None for e in entries):
            g["attention"] = entries
        else:
            g.pop("attention", None)
    maxima = synthetic_maxima(parts, wb.device)
    heads = sum(m.numel() for m in maxima.values())
    note = (
        f"qk_clip_tau={TAU:g}; every step's maxima {OVER * TAU:g} for all {heads} query heads of "
        f"{len(maxima)} layers (every head clipped, γ = 1/{OVER:g}), made once outside the timed step"
    )
    contender = fastmuon_variant(wb, wb.fastmuon_class, "qk-clip", note, groups=groups, qk_clip_tau=TAU)
    contender.step_kwargs = {"logit_maxima": maxima}
    return contender
