"""Quick measurements of the machine that the benchmark's choices and estimates rest on."""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from ..ns.device import compute_dtype
from ..ns.newton_schulz import gram_runs
from ..ns.planner import Plan
from ..ns.timing import best_seconds, matmul_flops, matmul_seconds

_RATES: dict[tuple[str, torch.dtype], float] = {}

#: the batch the rate is measured on: small enough to finish in a fraction of a second even
#: where a dtype is emulated (bf16 on a CPU without bf16 instructions runs ~100x slower than
#: fp32), large enough to be FLOP-bound
RATE_SHAPE = (4, 128, 512)
#: on an accelerator :data:`RATE_SHAPE` is over in a few microseconds, so its rate is the launch
#: cost's, hundreds of times below the matmul units' (a step would be estimated at minutes and
#: skipped); this batch (69 GFLOP) keeps a GPU's tensor cores busy for a fraction of a millisecond
ACCELERATOR_RATE_SHAPE = (8, 1024, 4096)


def rate_shape(device: torch.device) -> tuple[int, int, int]:
    """The batch :func:`matmul_rate` measures on ``device``: FLOP-bound there, and quick."""
    return RATE_SHAPE if device.type == "cpu" else ACCELERATOR_RATE_SHAPE


def matmul_rate(device: torch.device, dtype: torch.dtype, min_seconds: float = 0.05) -> float:
    """FLOP/s of Newton–Schulz's product (:func:`fastmuon.ns.timing.matmul_seconds`) on a
    :func:`rate_shape` batch in ``dtype``, back to back for about ``min_seconds`` (measured once)."""
    device = torch.device(device)
    key = (str(device), dtype)
    if key not in _RATES:
        shape = rate_shape(device)
        once = matmul_seconds(*shape, dtype, device, rounds=1)
        per_round = max(1, int(min_seconds / 3 / max(once, 1e-9)))
        seconds = matmul_seconds(*shape, dtype, device, rounds=3, per_round=per_round)
        _RATES[key] = matmul_flops(*shape) / seconds
    return _RATES[key]


#: One step of a floor sequence: ``(bucket index, kind)``, kind one of "gram" (``X·Xᵀ``),
#: "square" (an ``R×R`` product), "wide" (``R×R`` times ``R×C``) and "eigh" (``R×R``).
FloorOp = tuple[int, str]


def floor_products(plan: Plan) -> list[FloorOp]:
    """Every matrix product (and eigendecomposition) the plan's NS performs, in the order a
    step runs them: a pure function of the plan, so its FLOPs can be checked against
    :meth:`Plan.flops`."""
    ops: list[FloorOp] = []
    for b, bucket in enumerate(plan.buckets):
        steps = plan.steps
        if bucket.method == "eigh":  # X·Xᵀ, the eigendecomposition, V·h·Vᵀ and Q·X
            ops += [(b, "gram"), (b, "eigh"), (b, "square"), (b, "wide")]
        elif bucket.method == "gram":  # per run from a fresh A: X·Xᵀ, 4L−3 R×R products, Q·X
            for length in gram_runs(steps, bucket.dtype, bucket.gram_first_run):
                ops += [(b, "gram"), *[(b, "square")] * (4 * length - 3), (b, "wide")]
        else:  # X·Xᵀ, A·A, B·X every step
            ops += [(b, "gram"), (b, "square"), (b, "wide")] * steps
    return ops


def ns_floor_seconds(plan: Plan, min_seconds: float = 0.01) -> float:
    """The ideal floor for a step's NS: each of :func:`floor_products` timed alone as a bare
    ``bmm`` at its shape (eigendecompositions likewise), best of at least 3 repeats, added up.
    A sum of per-product minima, which no real run of the sum reaches: see :class:`FloorRun`
    for the floor measured the way steps are."""
    total = 0.0
    for b, kinds in _by_bucket(floor_products(plan)).items():
        bucket = plan.buckets[b]
        bsz, r, _ = bucket.shape
        X = torch.randn(bucket.shape, device=bucket.device).to(bucket.dtype)
        A = torch.randn(bsz, r, r, device=bucket.device).to(bucket.dtype)
        seconds = {kind: _kind_seconds(kind, X, A, min_seconds) for kind in set(kinds)}
        total += sum(seconds[kind] for kind in kinds)
    return total


def _kind_seconds(kind: str, X: Tensor, A: Tensor, min_seconds: float) -> float:
    if kind == "gram":
        return _seconds(X, X.mT, min_seconds)
    if kind == "square":
        return _seconds(A, A, min_seconds)
    if kind == "wide":
        return _seconds(A, X, min_seconds)
    return _eigh_seconds(X, min_seconds)


def _by_bucket(ops: list[FloorOp]) -> dict[int, list[str]]:
    out: dict[int, list[str]] = {}
    for b, kind in ops:
        out.setdefault(b, []).append(kind)
    return out


class FloorRun:
    """The plan's NS products run back to back, in a step's order, as one call to time.

    The floor measured the way a step is: the bench times it as often as the steps, each run
    right before a step, and compares medians (and best against best). The operands live in one
    set of buffers sized to the largest bucket and shared by all (as the engine's scratch is),
    made once: fresh outputs would be page-faulted in on every call. Products go into kept
    outputs as bare ``bmm`` (no additive input, no normalisation): what is left of a step beyond
    this is NS overhead, packing, the elementwise work and Python.
    """

    def __init__(self, plan: Plan):
        self.ops = floor_products(plan)
        self._calls: list = []
        arenas: dict[tuple[torch.dtype, torch.device], tuple[Tensor, ...]] = {}
        for dtype, device in {(b.dtype, b.device) for b in plan.buckets}:
            shapes = [k.shape for k in plan.buckets if (k.dtype, k.device) == (dtype, device)]
            wide = max(b * r * c for b, r, c in shapes)
            square = max(b * r * r for b, r, _ in shapes)
            arenas[dtype, device] = tuple(_operand(n, dtype, device) for n in (wide, wide, square, square))
        for b, kind in self.ops:
            bucket = plan.buckets[b]
            bsz, r, c = bucket.shape
            X_, Y_, A_, O_ = arenas[bucket.dtype, bucket.device]
            X, Y = X_[: bsz * r * c].view(bsz, r, c), Y_[: bsz * r * c].view(bsz, r, c)
            A, O = A_[: bsz * r * r].view(bsz, r, r), O_[: bsz * r * r].view(bsz, r, r)
            if kind == "gram":
                self._calls.append(functools.partial(torch.bmm, X, X.mT, out=O))
            elif kind == "square":
                self._calls.append(functools.partial(torch.bmm, A, A, out=O))
            elif kind == "wide":
                self._calls.append(functools.partial(torch.bmm, A, X, out=Y))
            else:
                self._calls.append(functools.partial(torch.linalg.eigh, _eigh_input(X)))

    def __call__(self) -> None:
        for call in self._calls:
            call()


def _operand(numel: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """Random values of a modest scale (products neither overflow nor go subnormal)."""
    return torch.randn(numel, device=device).div_(numel**0.25).to(dtype)


def _seconds(left: torch.Tensor, right: torch.Tensor, min_seconds: float) -> float:
    """Best time of ``bmm(left, right)`` into a kept output (as the engine runs them: a fresh
    85 MB output page-faults in every call) over repeats filling ``min_seconds``."""
    out = torch.empty(left.size(0), left.size(1), right.size(2), dtype=left.dtype, device=left.device)
    return best_seconds(lambda: torch.bmm(left, right, out=out), left.device, min_seconds)


def _eigh_seconds(X: torch.Tensor, min_seconds: float) -> float:
    """Best time of ``eigh`` on the Gram matrices of ``X``."""
    S = _eigh_input(X)
    return best_seconds(lambda: torch.linalg.eigh(S), S.device, min_seconds)


def _eigh_input(X: Tensor) -> Tensor:
    """The Gram matrices of ``X`` in the dtype the eigh route decomposes them in (fp32 at least)."""
    S = X.float() @ X.float().mT
    return S.double() if X.dtype == torch.float64 else S


def choose_ns_dtype(device: torch.device) -> tuple[torch.dtype, str]:
    """``--ns-dtype auto``: the optimizers' default, bfloat16, unless on this CPU it would really
    run in emulated bf16 (native mode forced) and float32 multiplies faster."""
    if device.type != "cpu":
        return torch.bfloat16, "bfloat16 on an accelerator"
    computed = compute_dtype(torch.bfloat16, device)
    if computed != torch.bfloat16:
        return torch.bfloat16, (
            "the optimizers' default; this CPU has no native bf16 matmul, so fastmuon runs its NS "
            f"in {str(computed).removeprefix('torch.')} (see fastmuon.ns.device)"
        )
    bf16 = matmul_rate(device, torch.bfloat16)
    fp32 = matmul_rate(device, torch.float32)
    chosen = torch.bfloat16 if bf16 >= fp32 else torch.float32
    why = f"CPU batched matmul: bfloat16 {bf16 / 1e9:.1f} GFLOP/s, float32 {fp32 / 1e9:.1f} GFLOP/s"
    return chosen, why
