"""The distributed step at scale, computed: ``fastmuon plan`` (see docs/scale.md).

- :mod:`.models`: the workloads' orthogonalised tensors (bundled and public configurations);
- :mod:`.layouts`: every rank's box of every tensor under DDP, FSDP, HSDP, FSDP + TP and EP;
- :mod:`.figures`: per-rank NS FLOPs, bytes, collectives and buffers, fastmuon's and any design's;
- :mod:`.peers`: the peers' designs, each modelled from its code;
- :mod:`.balance`: a design's step against the balanced ideal, its buffers against their bound;
- :mod:`.targets`: the at-scale targets' configurations, judged (``fastmuon plan --targets``);
- :mod:`.devices`: the devices' constants and their sources; :mod:`.measure`: this CPU, timed.
"""

from .designs import DESIGNS, figures
from .figures import Figures, Settings, matrices
from .layouts import Layout, parse_layout, rank_regions, regions
from .models import WORKLOADS, Workload, workload

__all__ = [
    "DESIGNS", "WORKLOADS", "Figures", "Layout", "Settings", "Workload", "figures", "matrices",
    "parse_layout", "rank_regions", "regions", "workload",
]  # fmt: skip
