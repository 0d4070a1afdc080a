"""The batching planner: a pure function from matrix shapes to buckets, touching no tensor data.

Matrices of one oriented shape stack unpadded; other shapes may share a bucket zero-padded to the
largest, which is exact but costs FLOPs. A merge trades launches (dominant on GPUs) against padded
FLOPs (on CPUs), so the cost model carries constants per device type.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

import torch

from .device import cpu_class
from .newton_schulz import DEFAULT_GRAM_FIRST_RUN, check_method_preconditioning, gram_runs

POLICIES = ("auto", "exact", "min_launches")
DEFAULT_MAX_BUCKET_BYTES = 512 * 2**20


@dataclass(frozen=True)
class MatrixSpec:
    """One matrix to orthogonalise: its 2D (rows, cols) after flattening, and where it lives.
    ``key`` separates matrices that must never share a bucket (e.g. different NS settings);
    ``layout`` only orders members, so tensors the engine packs with one copy sit side by side.
    ``requested``: the dtype asked for where ``dtype`` (what runs) is wider (:func:`choose_method`);
    ``fallback``: a wider one to run each shape in where faster (``device.wider_dtype``)."""

    rows: int
    cols: int
    dtype: torch.dtype = torch.float32
    device: torch.device = torch.device("cpu")
    key: Hashable = None
    layout: Hashable = None
    method: str = "auto"
    requested: torch.dtype | None = None
    fallback: torch.dtype | None = None
    preconditioning: str = "frobenius"
    gram_first_run: int = DEFAULT_GRAM_FIRST_RUN

    @property
    def transposed(self) -> bool:
        """Tall matrices are orthogonalised as their (wide) transpose."""
        return self.rows > self.cols

    @property
    def oriented(self) -> tuple[int, int]:
        return (self.cols, self.rows) if self.transposed else (self.rows, self.cols)


@dataclass(frozen=True)
class Member:
    """A matrix placed in a bucket: ``index`` into the planner's input, slot ``slot`` of the batch."""

    index: int
    slot: int
    rows: int
    cols: int
    transposed: bool

    @property
    def oriented(self) -> tuple[int, int]:
        return (self.cols, self.rows) if self.transposed else (self.rows, self.cols)


@dataclass(frozen=True)
class Bucket:
    """One batched NS call: ``shape = (B, R, C)`` with ``R <= C``, members padded into it."""

    shape: tuple[int, int, int]
    members: tuple[Member, ...]
    dtype: torch.dtype
    device: torch.device
    key: Hashable = None
    method: str = "standard"
    preconditioning: str = "frobenius"
    gram_first_run: int = DEFAULT_GRAM_FIRST_RUN  # see MatrixSpec

    def nbytes(self) -> int:
        b, r, c = self.shape
        return b * r * c * _itemsize(self.dtype)

    def flops(self, steps: int) -> int:
        """FLOPs the padded batch computes."""
        b, r, c = self.shape
        return b * ns_flops(r, c, steps, self.method, self.dtype, self.preconditioning, self.gram_first_run)

    def useful_flops(self, steps: int) -> int:
        """FLOPs the members would cost unpadded (with the bucket's method)."""
        return sum(
            ns_flops(*m.oriented, steps, self.method, self.dtype, self.preconditioning, self.gram_first_run)
            for m in self.members
        )


@dataclass(frozen=True)
class EighCost:
    """What one ``R×R`` eigendecomposition costs on a device, in FLOPs of batched matmul per ``R³``:
    ``(base + per_inverse_row / R) · threads ** thread_exponent``. LAPACK's fixed overheads dominate
    small ones; more threads speed matmuls up more than the tridiagonalisation."""

    base: float
    per_inverse_row: float
    thread_exponent: float = 0.0

    def per_r3(self, rows: int, threads: int = 1) -> float:
        scale: float = max(threads, 1) ** self.thread_exponent
        return (self.base + self.per_inverse_row / rows) * scale


@dataclass(frozen=True)
class CostModel:
    """Seconds per kernel launch and per FLOP (by dtype) on one kind of device, and what an
    eigendecomposition costs there (``eigh=None``: not considered). ``low_precision_gram``:
    bf16/fp16 Gram-space NS competes (:func:`choose_method`); ``gram_weighs_launches``: that choice
    also weighs the Gram loop's extra launches against the FLOPs it saves (else FLOPs decide)."""

    launch_seconds: float
    seconds_per_flop: dict[torch.dtype, float] = field(default_factory=dict)
    default_seconds_per_flop: float = 1e-11
    eigh: EighCost | None = None
    launch_seconds_by_dtype: dict[torch.dtype, float] = field(default_factory=dict)
    low_precision_gram: bool = False
    gram_weighs_launches: bool = False

    def flop_seconds(self, dtype: torch.dtype) -> float:
        return self.seconds_per_flop.get(dtype, self.default_seconds_per_flop)

    def launch_cost(self, dtype: torch.dtype) -> float:
        return self.launch_seconds_by_dtype.get(dtype, self.launch_seconds)


#: What an eigendecomposition costs on a CPU, in matmul FLOPs per ``R³``: the upper side of the
#: timings in docs/performance.md ("Where the planner's constants come from").
CPU_EIGH = EighCost(base=9.0, per_inverse_row=4400.0, thread_exponent=0.4)

# Rough constants: one saved launch is worth ~10^8-10^9 padded FLOPs on CUDA and ~10^6 on a CPU.
# GPUs run eigendecompositions slowly (and synchronise with the host): their model leaves eigh out.
COST_MODELS: dict[str, CostModel] = {
    "cpu": CostModel(
        launch_seconds=15e-6,
        seconds_per_flop={
            torch.float32: 1 / 1.5e11,
            torch.bfloat16: 1 / 4e11,
            torch.float16: 1 / 2e11,
        },
        eigh=CPU_EIGH,
    ),
    "cuda": CostModel(
        launch_seconds=6e-6,
        seconds_per_flop={
            torch.float32: 1 / 4e13,
            torch.bfloat16: 1 / 2e14,
            torch.float16: 1 / 2e14,
        },
        default_seconds_per_flop=1 / 4e13,
        low_precision_gram=True,
        gram_weighs_launches=True,
    ),
}


#: CPU cost models by CPU class (``device.cpu_class``). With AVX512-BF16, bf16 costs less per FLOP
#: than fp32 but a small bf16 matmul more, so bf16 kernels get a dearer launch (docs/performance.md,
#: "Where the planner's constants come from"). AMX shares these until timed (``"calibrate"``).
CPU_COST_MODELS: dict[str, CostModel] = {
    "no_bf16": COST_MODELS["cpu"],
    "avx512_bf16": CostModel(
        launch_seconds=15e-6,
        seconds_per_flop={torch.float32: 1 / 1.0e11, torch.bfloat16: 1 / 2.5e11},
        default_seconds_per_flop=1 / 1.0e11,
        eigh=CPU_EIGH,
        launch_seconds_by_dtype={torch.bfloat16: 45e-6},
        low_precision_gram=True,
    ),
}
CPU_COST_MODELS["amx_bf16"] = CPU_COST_MODELS["avx512_bf16"]


def counted(n: int, noun: str, plural: str | None = None) -> str:
    """``1 bucket``, ``2 buckets``: a count and its noun in the right number (``plural``: irregular)."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"


def default_cost_model(device: torch.device | str) -> CostModel:
    """The built-in constants for ``device``: per device type, and on CPUs per CPU class."""
    device = torch.device(device)
    if device.type == "cpu":
        return CPU_COST_MODELS[cpu_class()]
    return COST_MODELS.get(device.type, COST_MODELS["cuda"])


#: the Newton-Schulz formulations a matrix can be planned with (the iterations are in newton_schulz)
NS_METHODS = ("standard", "gram", "eigh")

#: Elementwise FLOPs per ``R²`` of AOL's rescaling on the ``R×R`` side: ``|A|``, its row sums and
#: the two rescalings of ``A`` (``newton_schulz._aol_rescaled``).
AOL_FLOPS_PER_R2 = 4

#: Nominal FLOPs of a symmetric eigendecomposition per ``R³`` (Golub & Van Loan's ~9n³ for
#: symmetric QR), as FLOP counts report it; the planner chooses by its cost (:class:`EighCost`).
EIGH_FLOPS_PER_R3 = 9


def ns_flops(
    rows: int,
    cols: int,
    steps: int,
    method: str = "standard",
    dtype: torch.dtype | None = None,
    preconditioning: str = "frobenius",
    gram_first_run: int = DEFAULT_GRAM_FIRST_RUN,
) -> int:
    """Matmul FLOPs of ``steps`` NS iterations on one matrix, oriented wide (r <= c). Gram space
    touches ``X`` twice per run from a fresh ``A`` (``X·Xᵀ``, ``Q·X``), the rest is ``R×R``; low
    precision restarts, so ``s > 1`` runs. AOL's rescaling makes the first ``A``: standard NS's
    matmuls plus :data:`AOL_FLOPS_PER_R2` (rescaling ``X``, like normalising it, is not counted)."""
    r, c = min(rows, cols), max(rows, cols)
    if preconditioning == "aol":  # the standard loop only
        return steps * (4 * r * r * c + 2 * r * r * r) + AOL_FLOPS_PER_R2 * r * r
    if method == "eigh":  # A = X·Xᵀ, the eigendecomposition, V·h·Vᵀ, Q·X
        return 4 * r * r * c + (EIGH_FLOPS_PER_R3 + 2) * r * r * r
    if method == "gram":
        s = len(gram_runs(steps, dtype, gram_first_run))
        return 4 * s * r * r * c + (8 * steps - 6 * s) * r * r * r
    return steps * (4 * r * r * c + 2 * r * r * r)


def ns_cost(
    rows: int,
    cols: int,
    steps: int,
    method: str,
    dtype: torch.dtype | None = None,
    eigh: EighCost | None = None,
    threads: int = 1,
    preconditioning: str = "frobenius",
    gram_first_run: int = DEFAULT_GRAM_FIRST_RUN,
) -> float:
    """What the planner minimises: :func:`ns_flops`, with an eigendecomposition counted at what
    it costs on the device in matmul FLOPs (``eigh``; ``None``: its nominal count)."""
    if method != "eigh" or eigh is None:
        return ns_flops(rows, cols, steps, method, dtype, preconditioning, gram_first_run)
    r, c = min(rows, cols), max(rows, cols)
    return 4 * r * r * c + (2 + eigh.per_r3(r, threads)) * r**3


def choose_method(
    allowed: str,
    rows: int,
    cols: int,
    steps: int,
    dtype: torch.dtype,
    narrowest: float = math.inf,
    requested: torch.dtype | None = None,
    eigh: EighCost | None = None,
    threads: int = 1,
    low_precision_gram: bool = False,
    preconditioning: str = "frobenius",
    count: int = 1,
    launch_flops: float = 0.0,
    gram_first_run: int = DEFAULT_GRAM_FIRST_RUN,
) -> str:
    """The cheapest NS formulation (by :func:`ns_cost`) among those accurate enough here; AOL runs
    standard NS, which always qualifies. Gram-space NS needs every member at least twice as wide as
    tall (``narrowest`` = min cols/rows): a square matrix's small singular values are what it
    resolves worst. In bf16/fp16 (``X·Xᵀ`` squares the dynamic range) only its restarting loop keeps
    standard NS's band, and competes where ``low_precision_gram`` says, by the FLOPs of ``count``
    matrices plus ``launch_flops`` per launch. Where bf16/fp16 was ``requested`` but fp32 runs, the
    eigh route (far more precise than the request) qualifies where the model prices it."""
    if allowed != "auto":
        return allowed
    if preconditioning == "aol":
        return "standard"
    if dtype not in (torch.float32, torch.float64):
        if low_precision_gram and narrowest >= 2:
            return min(
                ("standard", "gram"),
                key=lambda m: (
                    count * ns_flops(rows, cols, steps, m, dtype, gram_first_run=gram_first_run)
                    + launch_flops * kernels_per_bucket(steps, m)
                ),
            )
        return "standard"
    tolerant = requested in (torch.bfloat16, torch.float16)
    candidates = ["standard"]
    if narrowest >= 2:
        candidates.append("gram")
    if tolerant and eigh is not None:
        candidates.append("eigh")
    return min(  # ties: first
        candidates,
        key=lambda m: ns_cost(rows, cols, steps, m, dtype, eigh, threads, gram_first_run=gram_first_run),
    )


def kernels_per_bucket(steps: int, method: str = "standard", preconditioning: str = "frobenius") -> int:
    """Launches a bucket costs however many matrices it holds: standard NS normalises (3) and runs
    3 per step; the Gram loop builds and scales ``A₀`` (9) and runs ~4 per step; the eigh route 13
    and 7 per step. AOL's rescaling (~14) replaces the normalisation and the first Gram matrix."""
    if preconditioning == "aol":
        return 14 + 3 * steps - 1
    if method == "gram":
        return 9 + 4 * steps
    if method == "eigh":
        return 13 + 7 * steps
    return 3 + 3 * steps


@dataclass(frozen=True)
class Plan:
    """The buckets for one set of matrices, with the settings that produced them."""

    buckets: tuple[Bucket, ...]
    num_matrices: int
    policy: str
    steps: int
    max_bucket_bytes: int
    note: str = ""  # why a plan is empty, for describe()

    def flops(self) -> int:
        return sum(b.flops(self.steps) for b in self.buckets)

    def useful_flops(self) -> int:
        return sum(b.useful_flops(self.steps) for b in self.buckets)

    def baseline_flops(self) -> int:
        """FLOPs of standard NS on every matrix alone (what a per-parameter loop computes)."""
        return sum(ns_flops(m.rows, m.cols, self.steps, "standard") for b in self.buckets for m in b.members)

    def padding_overhead(self) -> float:
        """Extra FLOPs spent on padding, as a fraction of the unpadded FLOPs."""
        useful = self.useful_flops()
        return self.flops() / useful - 1.0 if useful else 0.0

    def describe(self) -> str:
        matrices, buckets = (
            counted(self.num_matrices, "matrix", "matrices"),
            counted(len(self.buckets), "bucket"),
        )
        lines = [
            f"plan: {matrices} in {buckets} "
            f"(policy={self.policy}, steps={self.steps}, "
            f"max_bucket_bytes={self.max_bucket_bytes / 2**20:.0f} MiB)"
            + (f": {self.note}" if self.note else ""),
            f"NS FLOPs: {self.flops() / 1e9:.3f} G computed, {self.useful_flops() / 1e9:.3f} G useful, "
            f"padding overhead {100 * self.padding_overhead():.1f}%; per-matrix standard NS would "
            f"compute {self.baseline_flops() / 1e9:.3f} G",
        ]
        for i, b in enumerate(self.buckets):
            shapes: dict[tuple[int, int], int] = {}
            for m in b.members:
                shapes[(m.rows, m.cols)] = shapes.get((m.rows, m.cols), 0) + 1
            members = ", ".join(f"{n}x{r}x{c}" for (r, c), n in shapes.items())
            method = b.method + (" aol" if b.preconditioning == "aol" else "")
            lines.append(
                f"  bucket {i}: batch {b.shape[0]}x{b.shape[1]}x{b.shape[2]} {_dtype_name(b.dtype)} {method} "
                f"on {b.device}, {b.nbytes() / 2**20:.2f} MiB, padding "
                f"{100 * (b.flops(self.steps) / max(b.useful_flops(self.steps), 1) - 1):.1f}%: "
                f"{members}"
            )
        return "\n".join(lines)


#: what splits the specs before buckets are drawn (the MatrixSpec fields plan_buckets reads)
_PartitionKey = tuple[
    torch.dtype, torch.device, Hashable, str, "torch.dtype | None", "torch.dtype | None", str, int
]
#: a method chooser for one run's dtype: ``chooser(rows=, cols=, narrowest=, count=)`` -> method name
_Chooser = Callable[..., str]


def plan_buckets(
    specs: Sequence[MatrixSpec],
    *,
    policy: str = "auto",
    steps: int = 5,
    max_bucket_bytes: int = DEFAULT_MAX_BUCKET_BYTES,
    cost_model: CostModel | None = None,
    threads: int | None = None,
) -> Plan:
    """Assign every matrix to exactly one bucket.

    ``policy="exact"`` stacks identical oriented shapes only; ``"min_launches"`` merges whenever
    that lowers the number of batched calls, fewest added padded FLOPs first; ``"auto"`` merges
    while the cost model (``cost_model`` overrides the device type's) falls. Buckets over
    ``max_bucket_bytes`` are split. ``threads`` (``None``: torch's) prices :class:`EighCost`.
    """
    if policy not in POLICIES:
        raise ValueError(f"unknown batching policy {policy!r}; choose one of {POLICIES}")
    if max_bucket_bytes <= 0:
        raise ValueError(f"max_bucket_bytes must be positive, got {max_bucket_bytes}")
    partitions: dict[_PartitionKey, dict[tuple[int, int], list[int]]] = {}
    for i, s in enumerate(specs):
        if s.rows < 1 or s.cols < 1:
            raise ValueError(f"matrix {i} has an empty shape ({s.rows}, {s.cols}); nothing to plan")
        if s.method not in ("auto", *NS_METHODS):
            raise ValueError(
                f"matrix {i}: unknown NS method {s.method!r}; choose 'auto' or one of {NS_METHODS}"
            )
        check_method_preconditioning(s.method, s.preconditioning)
        fallback = s.fallback if s.fallback is not None and s.fallback != s.dtype else None
        part = partitions.setdefault(
            (
                s.dtype,
                torch.device(s.device),
                s.key,
                s.method,
                s.requested,
                fallback,
                s.preconditioning,
                s.gram_first_run,
            ),
            {},
        )
        part.setdefault(s.oriented, []).append(i)

    threads = torch.get_num_threads() if threads is None else threads
    buckets: list[Bucket] = []
    for (dtype, device, key, allowed, requested, fallback, pre, first_run), by_shape in partitions.items():
        model = cost_model or default_cost_model(device)
        groups = [_DraftBucket(r, c, members, c / r) for (r, c), members in by_shape.items()]

        def chooser_for(
            run_dtype: torch.dtype,
            run_requested: torch.dtype | None,
            allowed: str = allowed,
            model: CostModel = model,
            pre: str = pre,
            first_run: int = first_run,
        ) -> _Chooser:
            launch = model.launch_cost(run_dtype) / model.flop_seconds(run_dtype)
            return functools.partial(
                choose_method,
                allowed,
                steps=steps,
                dtype=run_dtype,
                requested=run_requested,
                eigh=model.eigh,
                threads=threads,
                low_precision_gram=model.low_precision_gram,
                preconditioning=pre,
                launch_flops=launch if model.gram_weighs_launches else 0.0,
                gram_first_run=first_run,
            )

        runs = [(dtype, requested, groups)]
        if fallback is not None:  # each shape in whichever dtype runs it faster
            native, wide = chooser_for(dtype, requested), chooser_for(fallback, dtype)
            faster_wide = [
                _seconds(g, steps, fallback, model, wide, threads, max_bucket_bytes, pre, first_run)
                < _seconds(g, steps, dtype, model, native, threads, max_bucket_bytes, pre, first_run)
                for g in groups
            ]
            runs = [
                (dtype, requested, [g for g, w in zip(groups, faster_wide) if not w]),
                (fallback, dtype, [g for g, w in zip(groups, faster_wide) if w]),
            ]
        for run_dtype, run_requested, run_groups in runs:
            chooser = chooser_for(run_dtype, run_requested)
            if policy != "exact" and run_groups:
                run_groups = _merge(
                    run_groups,
                    policy,
                    steps,
                    run_dtype,
                    max_bucket_bytes,
                    model,
                    chooser,
                    threads,
                    pre,
                    first_run,
                )
            for g in sorted(run_groups, key=lambda g: (-g.rows * g.cols, g.rows)):
                method = chooser(rows=g.rows, cols=g.cols, narrowest=g.narrowest, count=len(g.members))
                buckets.extend(
                    _materialise(g, specs, run_dtype, device, key, max_bucket_bytes, method, pre, first_run)
                )
    return Plan(tuple(buckets), len(specs), policy, steps, max_bucket_bytes)


def _seconds(
    g: _DraftBucket,
    steps: int,
    dtype: torch.dtype,
    model: CostModel,
    chooser: _Chooser,
    threads: int,
    cap: int,
    pre: str,
    first_run: int,
) -> float:
    """What the cost model says group ``g`` costs alone in ``dtype``: FLOPs plus launches."""
    method = chooser(rows=g.rows, cols=g.cols, narrowest=g.narrowest, count=len(g.members))
    flops = len(g.members) * ns_cost(
        g.rows, g.cols, steps, method, dtype, model.eigh, threads, pre, first_run
    )
    launches = g.chunks(_itemsize(dtype), cap) * kernels_per_bucket(steps, method, pre)
    seconds: float = flops * model.flop_seconds(dtype) + launches * model.launch_cost(dtype)
    return seconds


@dataclass
class _DraftBucket:
    """Matrices padded to one ``rows × cols`` (a bucket before the memory cap splits it in chunks)."""

    rows: int
    cols: int
    members: list[int]
    narrowest: float  # min cols/rows over the members' own (oriented) shapes

    def chunks(self, itemsize: int, cap: int) -> int:
        return math.ceil(len(self.members) / _per_chunk(self.rows, self.cols, itemsize, cap))

    def union(self, other: _DraftBucket) -> _DraftBucket:
        return _DraftBucket(
            max(self.rows, other.rows),
            max(self.cols, other.cols),
            self.members + other.members,
            min(self.narrowest, other.narrowest),
        )


def _per_chunk(rows: int, cols: int, itemsize: int, cap: int) -> int:
    return max(1, cap // (rows * cols * itemsize))


def _merge(
    groups: list[_DraftBucket],
    policy: str,
    steps: int,
    dtype: torch.dtype,
    cap: int,
    model: CostModel,
    chooser: _Chooser,
    threads: int,
    pre: str = "frobenius",
    first_run: int = DEFAULT_GRAM_FIRST_RUN,
) -> list[_DraftBucket]:
    """Greedy agglomeration: apply the best merge until none helps (costs in matmul FLOPs)."""
    itemsize = _itemsize(dtype)
    per_flop = model.flop_seconds(dtype)

    @functools.cache  # every score asks for three groups' methods: choose each shape's once
    def method_of(rows: int, cols: int, narrowest: float, count: int) -> str:
        method: str = chooser(rows=rows, cols=cols, narrowest=narrowest, count=count)
        return method

    def method(g: _DraftBucket) -> str:
        return method_of(g.rows, g.cols, g.narrowest, len(g.members))

    def flops(g: _DraftBucket) -> float:
        return len(g.members) * ns_cost(
            g.rows, g.cols, steps, method(g), dtype, model.eigh, threads, pre, first_run
        )

    def launches(g: _DraftBucket) -> int:
        return g.chunks(itemsize, cap) * kernels_per_bucket(steps, method(g), pre)

    def score(a: _DraftBucket, b: _DraftBucket) -> tuple[float, float] | None:
        """Lower is better; ``None`` means this merge does not help."""
        m = a.union(b)
        extra_flops = flops(m) - flops(a) - flops(b)  # FLOP-equivalents: eigh at its cost
        if policy == "min_launches":  # fewer batched calls, whatever each costs
            saved_calls = a.chunks(itemsize, cap) + b.chunks(itemsize, cap) - m.chunks(itemsize, cap)
            return (-saved_calls, extra_flops) if saved_calls > 0 else None
        saved_launches = launches(a) + launches(b) - launches(m)
        delta = extra_flops * per_flop - saved_launches * model.launch_cost(dtype)
        return (delta, extra_flops) if delta < 0 else None

    groups = sorted(groups, key=lambda g: (g.rows, g.cols))
    while len(groups) > 1:
        # All pairs for the usual few dozen shapes; a sorted window keeps huge shape sets fast.
        window = len(groups) if len(groups) <= 96 else 16
        best = None
        for i in range(len(groups)):
            for j in range(i + 1, min(len(groups), i + 1 + window)):
                s = score(groups[i], groups[j])
                if s is not None and (best is None or s < best[0]):
                    best = (s, i, j)
        if best is None:
            break
        _, i, j = best
        merged = groups[i].union(groups[j])
        groups = [g for k, g in enumerate(groups) if k not in (i, j)] + [merged]
        groups.sort(key=lambda g: (g.rows, g.cols))
    return groups


def _materialise(
    group: _DraftBucket,
    specs: Sequence[MatrixSpec],
    dtype: torch.dtype,
    device: torch.device,
    key: Hashable,
    cap: int,
    method: str,
    pre: str = "frobenius",
    first_run: int = DEFAULT_GRAM_FIRST_RUN,
) -> list[Bucket]:
    """Order members so identical tensors are adjacent, then split by the memory cap."""
    order = sorted(
        group.members,
        key=lambda i: (
            -specs[i].oriented[0],
            -specs[i].oriented[1],
            specs[i].transposed,
            repr(specs[i].layout),
            i,
        ),
    )
    per_chunk = _per_chunk(group.rows, group.cols, _itemsize(dtype), cap)
    buckets = []
    for start in range(0, len(order), per_chunk):
        chunk = order[start : start + per_chunk]
        rows = max(specs[i].oriented[0] for i in chunk)
        cols = max(specs[i].oriented[1] for i in chunk)
        members = tuple(
            Member(i, slot, specs[i].rows, specs[i].cols, specs[i].transposed) for slot, i in enumerate(chunk)
        )
        buckets.append(Bucket((len(chunk), rows, cols), members, dtype, device, key, method, pre, first_run))
    return buckets


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
