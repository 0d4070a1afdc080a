"""The distributed step at scale, computed: ``fastmuon plan`` (see docs/scale.md).

- :mod:`.models`: the workloads' orthogonalised tensors (bundled and public configurations);
- :mod:`.layouts`: every rank's box of every tensor under DDP, FSDP, HSDP, FSDP + TP and EP;
- :mod:`.figures`: per-rank NS FLOPs, bytes, collectives and buffers, fastmuon's and any design's;
- :mod:`.peers`: the peers' designs, each modelled from its code;
- :mod:`.balance`: a design's step against the balanced ideal, its buffers against their bound;
- :mod:`.targets`: the at-scale targets' configurations, judged (``fastmuon plan --targets``);
- :mod:`.devices`: the devices' constants and their sources; :mod:`.measure`: this CPU, timed.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

#: each public name -> the module that defines it, imported on first use, so that
#: ``fastmuon plan --help`` (which reads :mod:`.options`) imports no torch
_PUBLIC = {
    "DESIGNS": "designs",
    "figures": "designs",
    "Figures": "figures",
    "Settings": "figures",
    "matrices": "figures",
    "Layout": "layouts",
    "parse_layout": "layouts",
    "rank_regions": "layouts",
    "regions": "layouts",
    "WORKLOADS": "models",
    "Workload": "models",
    "workload": "models",
}

if TYPE_CHECKING:
    from .designs import DESIGNS, figures
    from .figures import Figures, Settings, matrices
    from .layouts import Layout, parse_layout, rank_regions, regions
    from .models import WORKLOADS, Workload, workload


def __getattr__(name: str) -> Any:
    if name not in _PUBLIC:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_PUBLIC[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_PUBLIC})


__all__ = [
    "DESIGNS", "WORKLOADS", "Figures", "Layout", "Settings", "Workload", "figures", "matrices",
    "parse_layout", "rank_regions", "regions", "workload",
]  # fmt: skip
