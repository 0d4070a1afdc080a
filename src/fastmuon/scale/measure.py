"""The predicted NS time of one rank against the time its work takes on this CPU.

The busiest rank's share of a plan (its work units, each one NS call, and the matrices it holds
whole alone) is run here on random matrices with fastmuon's engine, and timed; the prediction is
the same work priced by the cost model the plan was made with.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..distributed.exchange import contiguous_layout
from ..distributed.group_ns import group_newton_schulz
from ..distributed.owners import owner_plan
from ..ns.engine import Orthogonalizer
from ..ns.planner import Plan
from ..ns.timing import median_seconds
from ..tools.plan_options import ROUNDS
from .figures import Figures, Settings

CPU = torch.device("cpu")  # where the measured work runs


def _member_seconds(m: int, n_j: int, settings: Settings, rounds: int) -> float:
    """Median seconds of one owner-group member's NS on its ``m x n_j`` block (a group of one:
    the reduce adds nothing, as the plan prices the Gram sums as exchange time)."""
    config = settings.config()
    block = torch.randn(1, m, n_j, generator=torch.Generator().manual_seed(0)).to(settings.param_dtype)
    return median_seconds(lambda: group_newton_schulz(block, config, lambda t: None), CPU, rounds, 1)


def _run_seconds(plan: Plan, settings: Settings, rounds: int) -> float:
    """Median seconds of executing ``plan`` on random matrices (after one warm-up call)."""
    if not plan.buckets:
        return 0.0
    config = settings.config()
    shapes: dict[int, tuple[int, int]] = {}
    for b in plan.buckets:
        for m in b.members:
            shapes[m.index] = (m.rows, m.cols)
    gen = torch.Generator().manual_seed(0)
    sources = [torch.randn(shapes[i], generator=gen).to(settings.param_dtype) for i in range(len(shapes))]
    layouts = [contiguous_layout(s.shape) for s in sources]
    engine = Orthogonalizer(plan, layouts, {(settings.param_dtype, config): config})
    out = [settings.param_dtype] * len(sources)
    return median_seconds(lambda: engine(sources, out), CPU, rounds, 1)


def busiest_rank(fig: Figures) -> int:
    """The rank whose predicted NS takes longest (the lowest such)."""
    return int(fig.ns_seconds.argmax())


def predicted_measure_seconds(fig: Figures, rounds: int = ROUNDS) -> float:
    """How long measuring the busiest rank takes, as the prediction has it: its NS, once to
    warm up and ``rounds`` times timed."""
    return (rounds + 1) * float(fig.ns_seconds[busiest_rank(fig)])


def measure_busiest(
    fig: Figures,
    settings: Settings,
    rounds: int = ROUNDS,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, float]:
    """Measured and predicted NS seconds of the busiest rank of ``fig`` (fastmuon's figures);
    ``progress(done, total)`` hears of the rank's matrices as each NS call is timed."""
    plan, units, local_plans = fig.work
    rank = busiest_rank(fig)
    calls = [owner_plan(plan, [u for u in units if u.owner == rank and not u.group])[0]]
    groups = [u for u in units if rank in u.group]
    if rank in local_plans:
        calls.append(local_plans[rank])
    total = sum(len(b.members) for call in calls for b in call.buckets)
    done = 0
    measured = 0.0
    for call in calls:
        if progress:
            progress(done, total)
        measured += _run_seconds(call, settings, rounds)
        done += sum(len(b.members) for b in call.buckets)
    for u in groups:  # its block of an owner group's matrix: the Gram sums are not timed here
        m = plan.buckets[u.bucket].members[u.start]
        measured += _member_seconds(
            min(m.rows, m.cols), max(m.rows, m.cols) // len(u.group), settings, rounds
        )
    if progress:
        progress(done, total)
    predicted = float(fig.ns_seconds[rank])
    return {"rank": rank, "measured_seconds": measured, "predicted_seconds": predicted,
            "ratio": measured / predicted if predicted else float("nan")}  # fmt: skip
