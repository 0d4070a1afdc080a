"""From matrices and settings to a ready engine (specs, plan, executor), and :func:`orthogonalize`,
which builds one and runs it once. A single process and every rank of a distributed step plan
alike; there only the cost constants come from rank 0, sent to all (see fastmuon.distributed).
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Sequence

import torch
from torch import Tensor

from .calibrate import calibrated_cost_model
from .engine import NSConfig, Orthogonalizer, TensorLayout, spec_of
from .matrices import MatrixMapSpec, maps_of
from .newton_schulz import CoefficientSpec
from .planner import DEFAULT_MAX_BUCKET_BYTES, CostModel, MatrixSpec, Plan, plan_buckets


def resolve_cost_model(
    cost_model: CostModel | str | None, specs: Sequence[MatrixSpec]
) -> CostModel | str | None:
    """``"calibrate"``: the constants measured on this machine (:mod:`.calibrate`); else as given."""
    if cost_model == "calibrate" and specs:
        return calibrated_cost_model(specs[0].device, {s.dtype for s in specs})
    return cost_model


def plan_for(
    specs: Sequence[MatrixSpec],
    configs: Sequence[NSConfig],
    policy: str,
    cost_model: CostModel | str | None,
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
    compile: bool = False,
    host_reads: bool = True,
    result_views: bool = True,
) -> Orthogonalizer:
    """The engine for the matrices this process orthogonalises alone (see :class:`Orthogonalizer`)."""
    layouts = [TensorLayout.of(p) for p in params]
    specs = [spec_of(p, c, lay) for p, c, lay in zip(params, configs, layouts)]
    plan = plan_for(specs, configs, policy, resolve_cost_model(cost_model, specs), max_bucket_bytes)
    configs_by_key: dict[Hashable, NSConfig] = {(p.dtype, c): c for p, c in zip(params, configs)}
    return Orthogonalizer(
        plan, layouts, configs_by_key, compile=compile, result_views=result_views, host_reads=host_reads
    )


def orthogonalize(
    tensors: Sequence[Tensor],
    steps: int | None = None,
    coefficients: CoefficientSpec = "jordan",
    eps: float = 1e-7,
    dtype: torch.dtype = torch.bfloat16,
    policy: str = "auto",
    max_bucket_bytes: int = DEFAULT_MAX_BUCKET_BYTES,
    cost_model: CostModel | None = None,
    method: str = "auto",
    matrices: MatrixMapSpec | list[MatrixMapSpec] = None,
    *,
    preconditioning: str | None = None,
) -> list[Tensor]:
    """Orthogonalise a list of >=2D tensors through the planner; results keep shapes, in ``dtype``.

    Each tensor is the matrix ``t.flatten(1)``, or the matrices its ``matrices`` map says (one for
    all or one each; :mod:`fastmuon.ns.matrices`), all batched alike. ``method``: "standard",
    "gram", "eigh", or "auto": per bucket the cheapest accurate one (``planner.choose_method``).
    ``preconditioning`` and ``steps=None`` as in :func:`fastmuon.newton_schulz`. Plans afresh each
    call; an optimizer caches its plan.
    """
    tensors = list(tensors)
    maps = maps_of(matrices, len(tensors))
    for i, (t, m) in enumerate(zip(tensors, maps)):
        if t.ndim < 2:
            raise ValueError(f"tensor {i} has shape {tuple(t.shape)}; orthogonalize needs >=2D tensors")
        if t.is_complex():
            raise ValueError(f"tensor {i} is complex; only real tensors can be orthogonalised")
        try:
            m.check(t.shape)
        except ValueError as e:
            raise ValueError(f"tensor {i} (shape {tuple(t.shape)}): {e}") from None
    if any(not m.is_flatten for m in maps):
        pieces = [m.views(t) for t, m in zip(tensors, maps)]
        flat = orthogonalize(
            [v for vs in pieces for v in vs],
            steps,
            coefficients,
            eps,
            dtype,
            policy,
            max_bucket_bytes,
            cost_model,
            method,
            preconditioning=preconditioning,
        )
        starts = [0, *itertools.accumulate(map(len, pieces))]
        return [
            flat[a] if m.is_flatten else m.assemble(t.shape, flat[a:b], dtype, t.device)
            for t, m, a, b in zip(tensors, maps, starts, starts[1:])
        ]
    config = NSConfig.make(steps, coefficients, eps, dtype, method, preconditioning)
    live = [i for i, t in enumerate(tensors) if t.numel() > 0]
    inputs = [tensors[i] for i in live]
    engine = build_orthogonalizer(
        inputs,
        [config] * len(inputs),
        policy,
        cost_model=cost_model,
        max_bucket_bytes=max_bucket_bytes,
        result_views=False,
    )
    outputs = engine(inputs, [dtype] * len(inputs))
    results = [torch.empty_like(t, dtype=dtype) for t in tensors]
    for i, out in zip(live, outputs):
        results[i] = out
    return results
