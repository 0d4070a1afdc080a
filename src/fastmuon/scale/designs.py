"""Every design ``fastmuon plan`` computes, by name: fastmuon's own step
(:func:`.figures.fastmuon_figures`) and the peers' (:data:`.peers.PEERS`), priced for the
balanced ideal (:mod:`.balance`)."""

from __future__ import annotations

from typing import Any

from ..ns.planner import CostModel
from .balance import balance_summary, priced
from .figures import Figures, Settings, fastmuon_figures
from .layouts import Layout
from .models import Workload
from .peers import PEERS

#: every design the plan computes: fastmuon's, then the peers' (:data:`.peers.PEERS`)
DESIGNS = ("fastmuon", "keller", "dion", "torchtitan", "megatron", "emerging", "plain")


def figures(
    design: str,
    workload: Workload,
    layout: Layout,
    settings: Settings,
    model: CostModel,
    link: float,
    group_link: float | None = None,
) -> Figures | str:
    """``design``'s figures, priced for the balanced ideal, or why it does not apply to ``layout``
    (``link``: the exchange's bytes per second each way; ``group_link``: inside a node, where
    fastmuon's owner groups sum their Gram matrices; None: ``link``)."""
    fig = _design_figures(design, workload, layout, settings, model, link, group_link)
    return fig if isinstance(fig, str) else priced(fig, link)


def _design_figures(
    design: str,
    workload: Workload,
    layout: Layout,
    settings: Settings,
    model: CostModel,
    link: float,
    group_link: float | None,
) -> Figures | str:
    """``design``'s figures, or why it does not apply to ``layout``."""
    if design == "fastmuon":
        return fastmuon_figures(workload, layout, settings, model, link, group_link)
    if design not in PEERS:
        raise ValueError(f"unknown design {design!r}; choose one of {', '.join(DESIGNS)}")
    return PEERS[design](workload, layout, settings, model, link)


def summary(fig: Figures) -> dict[str, Any]:
    """A design's figures as the plan reports them: :meth:`Figures.summary` and its balance."""
    return {**fig.summary(), **balance_summary(fig)}
