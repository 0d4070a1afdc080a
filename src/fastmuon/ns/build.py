"""From matrices and settings to a ready engine: the planner's specs, the plan, the executor.

A single process and every rank of a distributed step plan alike; in a distributed step only
who decides the cost constants differs (rank 0's are sent to all, see fastmuon.distributed).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import Tensor

from .calibrate import calibrated_cost_model
from .engine import NSConfig, Orthogonalizer, TensorLayout, spec_of
from .planner import CostModel, MatrixSpec, Plan, plan_buckets


def resolve_cost_model(cost_model: CostModel | str | None, specs: Sequence[MatrixSpec]) -> Any:
    """``"calibrate"``: the constants measured on this machine for the specs' device and dtypes
    (once per process); a :class:`CostModel` or None (the device type's built-in one) as given."""
    if cost_model == "calibrate" and specs:
        return calibrated_cost_model(specs[0].device, {s.dtype for s in specs})
    return cost_model


def plan_for(
    specs: Sequence[MatrixSpec],
    configs: Sequence[NSConfig],
    policy: str,
    cost_model: Any,
    max_bucket_bytes: int,
    threads: int | None = None,
) -> Plan:
    """The plan for ``specs``, NS run for as many steps as the longest config asks."""
    return plan_buckets(
        specs,
        policy=policy,
        steps=max((c.steps for c in configs), default=5),
        max_bucket_bytes=max_bucket_bytes,
        cost_model=cost_model if isinstance(cost_model, CostModel) else None,
        threads=threads,
    )


def build_orthogonalizer(
    params: Sequence[Tensor],
    configs: Sequence[NSConfig],
    policy: str,
    *,
    cost_model: CostModel | str | None,
    max_bucket_bytes: int,
    compile: bool,
    host_reads: bool,
) -> Orthogonalizer:
    """The engine for matrices this process orthogonalises alone, for a step that applies its
    results at once (so they may be views into buffers the next call reuses)."""
    layouts = [TensorLayout.of(p) for p in params]
    specs = [spec_of(p, c, lay) for p, c, lay in zip(params, configs, layouts)]
    plan = plan_for(specs, configs, policy, resolve_cost_model(cost_model, specs), max_bucket_bytes)
    configs_by_key = {(p.dtype, c): c for p, c in zip(params, configs)}
    return Orthogonalizer(
        plan, layouts, configs_by_key, compile=compile, result_views=True, host_reads=host_reads
    )
