"""The Newton–Schulz kernels: orthogonalise one matrix or a batch of them.

Each iteration maps X -> a·X + (b·A + c·A²)·X with A = X·Xᵀ, which pushes every singular value of
X towards 1 while keeping its singular vectors: two fused ``baddbmm`` and one ``bmm`` per step.
The quintic form and the "jordan" coefficients come from Keller Jordan's Muon write-up.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import operator
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Union

import torch
from torch import Tensor

from . import device
from .matrices import MatrixMapSpec, parse

Coefficients = tuple[float, float, float]
CoefficientSpec = Union[str, Coefficients, Sequence[Coefficients]]


def _with_safety(schedule: list[Coefficients], factor: float) -> tuple[Coefficients, ...]:
    """Shrink each polynomial's input range by ``factor`` (all but the last), as Polar Express
    does against rounding pushing singular values past the interval it was optimised on."""
    scaled = [(a / factor, b / factor**3, c / factor**5) for a, b, c in schedule[:-1]]
    return (*scaled, schedule[-1])


#: Named coefficient schedules: per-step (a, b, c) tuples; the last repeats.
PRESETS: dict[str, tuple[Coefficients, ...]] = {
    # Keller Jordan's quintic: maximal slope at zero, converges to singular values in ~[0.7, 1.2].
    "jordan": ((3.4445, -4.7750, 2.0315),),
    # Polar Express (Amsel, Persson, Musco & Gower 2025, arXiv:2505.16932, degree 5): an optimal
    # polynomial per step, with the paper's 1.01 safety factor.
    "polar_express": _with_safety(
        [
            (8.28721201814563, -23.595886519098837, 17.300387312530933),
            (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
            (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
            (3.3184196573706015, -2.488488024314874, 0.51004894012372),
            (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
            (1.891301407787398, -1.2679958271945868, 0.37680408948524835),
            (1.8750014808534479, -1.2500016453999487, 0.3750001645474248),
            (1.875, -1.25, 0.375),
        ],
        1.01,
    ),
    # You Jiacheng's six-step schedule (published as fractions of 1024), tuned for 6 steps.
    "you": tuple(
        (a / 1024, b / 1024, c / 1024)
        for a, b, c in [
            (3955, -8306, 5008),
            (3735, -6681, 3463),
            (3799, -6499, 3211),
            (4019, -6385, 2906),
            (2677, -3029, 1162),
            (2172, -1833, 682),
        ]
    ),
    # Turbo-Muon (Boissin, Massena, Mamalet & Serrurier 2025, arXiv:2512.04632): four steps fitted
    # to start from the AOL-rescaled matrix; the numbers of the authors' thib-s/flash-newton-schulz
    # (after its rescaling fix) and of microsoft/dion. NVIDIA's emerging-optimizers ships an earlier
    # fit (4.0098, -7.0585, 2.4635), ... under this name, run after Frobenius normalisation.
    "aol": (
        (4.6051, -9.6552, 5.6769),
        (4.7505, -6.0861, 2.1790),
        (2.7763, -2.3190, 0.5523),
        (2.4231, -2.2861, 0.8193),
    ),
    # CANS (Grishina, Smirnov & Rakhuba 2025, arXiv:2506.10935): Chebyshev-type (Remez) polynomials
    # with an adaptive interval; the five steps NVIDIA's emerging-optimizers ships as "cans".
    "cans": (
        (8.4703, -25.1081, 18.6293),
        (4.1828, -3.1087, 0.5806),
        (3.9619, -2.9541, 0.5630),
        (3.2866, -2.4647, 0.5074),
        (2.2737, -1.6447, 0.4162),
    ),
    # DeepSeek-V4's hybrid schedule (DeepSeek-V4 technical report; emerging-optimizers' "deepseekv4"):
    # eight Jordan steps bring singular values into ~[0.7, 1.2], two of (2, -1.5, 0.5) pull them to 1.
    "deepseekv4": ((3.4445, -4.7750, 2.0315),) * 8 + ((2.0, -1.5, 0.5),) * 2,
}


#: Polar Express as the paper's Implementation 1 runs it: the input divided by 1.01·‖X‖, folded
#: into the first polynomial: p(x/1.01) = (a/1.01)·x + (b/1.01³)·x³ + (c/1.01⁵)·x⁵.
def _input_divided(step: Coefficients, factor: float) -> Coefficients:
    a, b, c = step
    return (a / factor, b / factor**3, c / factor**5)


PRESETS["polar_express_paper"] = (
    _input_divided(PRESETS["polar_express"][0], 1.01),
    *PRESETS["polar_express"][1:],
)

#: How NS brings a matrix's spectral norm to at most 1: Frobenius normalisation, or AOL's rescaling.
PRECONDITIONINGS = ("frobenius", "aol")

#: Presets that select a preconditioning by their name (the schedule was fitted to start from it).
PRESET_PRECONDITIONING: dict[str, str] = {"aol": "aol"}

#: The iteration count when none is given: Keller Jordan's five (his Muon write-up and code,
#: which torch.optim.Muon, optax and microsoft/dion keep as their default).
DEFAULT_NS_STEPS = 5

#: The steps each preset was published for: the count when ``ns_steps`` is not given.
PRESET_STEPS: dict[str, int] = {
    "jordan": 5,
    "you": 6,  # six polynomials, tuned for a six-step run
    "aol": 4,  # Turbo-Muon: AOL's start saves one of Jordan's five iterations
    "cans": 5,
    "deepseekv4": 10,  # 8 + 2
    "polar_express": 8,  # the paper's code runs its eight polynomials once each
    "polar_express_paper": 8,
}


def default_steps(coefficients: CoefficientSpec, preconditioning: str | None = None) -> int:
    """NS steps when none is given: the preset's published count, else :data:`DEFAULT_NS_STEPS`;
    one fewer where AOL runs on coefficients fitted without it, one more where an AOL-fitted preset
    runs after Frobenius normalisation (AOL's start is worth one iteration, as Turbo-Muon reports)."""
    name = coefficients if isinstance(coefficients, str) else None
    steps = PRESET_STEPS.get(name, DEFAULT_NS_STEPS) if name else DEFAULT_NS_STEPS
    fitted = PRESET_PRECONDITIONING.get(name, "frobenius") if name else "frobenius"
    try:
        used = resolve_preconditioning(coefficients, preconditioning)
    except ValueError:
        return steps  # an unknown preconditioning is reported where it is checked
    if used != fitted:
        steps += -1 if used == "aol" else 1
    return steps


def resolve_preconditioning(coefficients: CoefficientSpec, preconditioning: str | None) -> str:
    """``preconditioning`` if given, else the one the coefficient preset names, else frobenius."""
    if preconditioning is None:
        name = coefficients if isinstance(coefficients, str) else None
        return PRESET_PRECONDITIONING.get(name, "frobenius") if name else "frobenius"
    if preconditioning not in PRECONDITIONINGS:
        raise ValueError(
            f"unknown ns_preconditioning {preconditioning!r}; choose one of {list(PRECONDITIONINGS)} "
            "(or None: the one the coefficient preset implies)"
        )
    return preconditioning


def check_method_preconditioning(method: str, preconditioning: str) -> None:
    """AOL preconditioning runs in the standard NS loop only: a clear error for the others."""
    if preconditioning == "aol" and method not in ("auto", "standard"):
        raise ValueError(
            f"ns_method={method!r} cannot run AOL preconditioning (ns_coefficients='aol' or "
            "preconditioning='aol'), which rescales X's rows in the standard NS loop; use "
            "ns_method='standard' or 'auto', or Frobenius normalisation with other coefficients"
        )


def resolve_coefficients(spec: CoefficientSpec, steps: int) -> list[Coefficients]:
    """Turn a preset name, one (a, b, c) or a per-step sequence into exactly ``steps`` tuples."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"ns_steps must be an integer >= 1, got {steps!r}")
    if isinstance(spec, str):
        if spec not in PRESETS:
            raise ValueError(
                f"unknown Newton-Schulz coefficient preset {spec!r}; "
                f"choose one of {sorted(PRESETS)} or pass (a, b, c) tuples"
            )
        schedule = list(PRESETS[spec])
    elif _is_triple(spec):
        schedule = [_floats(spec)]
    elif isinstance(spec, Sequence) and len(spec) > 0 and all(_is_triple(t) for t in spec):
        schedule = [_floats(t) for t in spec]
    else:
        raise ValueError(
            f"ns_coefficients must be a preset name {sorted(PRESETS)}, one (a, b, c) tuple "
            f"or a non-empty sequence of them, got {spec!r}"
        )
    schedule = schedule[:steps]
    schedule += [schedule[-1]] * (steps - len(schedule))
    return schedule


def _floats(triple: Any) -> Coefficients:
    a, b, c = (float(v) for v in triple)
    return (a, b, c)


def _is_triple(value: object) -> bool:
    return (
        isinstance(value, Sequence)
        and not isinstance(value, str)
        and len(value) == 3
        and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)
    )


def newton_schulz(
    X: Tensor,
    steps: int | None = None,
    coefficients: CoefficientSpec = "jordan",
    eps: float = 1e-7,
    dtype: torch.dtype = torch.bfloat16,
    method: str = "standard",
    matrices: MatrixMapSpec = None,
    *,
    preconditioning: str | None = None,
    host_reads: bool = True,
) -> Tensor:
    """Orthogonalise a matrix ``(m, n)`` or a batch ``(b, m, n)``; returns the input's shape in ``dtype``.

    Each matrix is divided by its Frobenius norm (+ ``eps``, without overflow or underflow), so its
    spectral norm is at most 1, then iterated; tall ones as their transpose, so ``X·Xᵀ`` is the small
    side. Zero padding stays zero and leaves the norm alone, which lets the engine pad matrices into
    shared buckets. ``matrices`` (:mod:`fastmuon.ns.matrices`): ``X`` is the matrices the map makes
    of it, one call each. ``method``: ``"standard"``, ``"gram"`` or ``"eigh"`` (:data:`METHODS`).
    ``preconditioning="aol"`` (``None``: what the preset implies) replaces the normalisation by AOL's
    row rescaling, standard method only. ``host_reads=False`` reads no value on the host, as a step
    captured into a CUDA graph must. ``steps=None``: the count the coefficients were published for.
    """
    if matrices is not None:
        m = parse(matrices)
        m.check(X.shape)
        results = [
            newton_schulz(
                piece.reshape(piece.shape[0], -1),
                steps,
                coefficients,
                eps,
                dtype,
                method,
                preconditioning=preconditioning,
                host_reads=host_reads,
            ).view(piece.shape)
            for piece in m.views(X)
        ]
        return m.assemble(X.shape, results, dtype, X.device)
    if X.ndim not in (2, 3):
        raise ValueError(f"newton_schulz expects a matrix (m, n) or a batch (b, m, n), got {X.ndim}D")
    if X.is_complex():
        raise ValueError(
            f"newton_schulz got a complex tensor ({X.dtype}); only real matrices can be orthogonalised "
            "(pass a real tensor, e.g. torch.view_as_real(X) if its real view is what you mean)"
        )
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"newton_schulz dtype must be a floating dtype, got {dtype}")
    if method not in METHODS:
        raise ValueError(f"unknown Newton-Schulz method {method!r}; choose one of {sorted(METHODS)}")
    if steps is None:
        steps = default_steps(coefficients, preconditioning)
    schedule = resolve_coefficients(coefficients, steps)
    preconditioning = resolve_preconditioning(coefficients, preconditioning)
    check_method_preconditioning(method, preconditioning)
    if X.numel() == 0:  # nothing to orthogonalise (and no norm to take): the empty result
        return torch.zeros(X.shape, dtype=dtype, device=X.device)
    single = X.ndim == 2
    Y = X.unsqueeze(0) if single else X
    tall = Y.size(-2) > Y.size(-1)
    if tall:
        Y = Y.mT
    host = device.is_host(X.device)
    host_reads = host_reads and host and not torch.compiler.is_compiling()
    with fp32_matmuls(dtype):
        Y = ns_kernel(method, preconditioning)(Y.to(dtype), schedule, eps, host=host, host_reads=host_reads)
    if tall:
        Y = Y.mT
    return Y.squeeze(0) if single else Y


#: Where a kernel takes its temporaries: ``scratch(tag, shape)`` returns a tensor of the input's
#: dtype and device, or ``None`` to allocate; tags name roles, so live temporaries never share
#: memory. ``reuse_input=True``: a kernel may also write into its input after its last read, and
#: return its result there or in scratch (tag ``"out"``; ``out`` unused): one or two fewer buffers.
Scratch = Callable[[str, tuple[int, ...]], Union[Tensor, None]]

# Every kernel below also takes ``host`` (the batch is on the host's CPU: device.is_host) and
# ``host_reads`` (it may read values there, which no trace nor capturable step may; implies host).


def _fresh(tag: str, shape: tuple[int, ...]) -> None:
    return None


def _normalize(
    X: Tensor,
    eps: float,
    out: Tensor | None = None,
    *,
    host: bool,
    host_reads: bool,
    keep: Tensor | None = None,
) -> Tensor:
    """Divide each matrix by its Frobenius norm (+ eps): spectral norm <= 1, as NS needs. With
    ``host_reads``, a matrix whose norm lies where squares neither overflow nor underflow gets the
    plain ``X / (‖X‖ + eps)``, the others (and all off the host, which must not synchronise)
    :func:`_normalize_safe`: the same value bit for bit in that range, chosen per matrix so a
    result never depends on its bucket mates. The result is a new contiguous tensor (``out`` if
    given): CPU bf16 ``baddbmm`` into a transposed ``out=`` takes a far slower kernel."""
    if out is None and not X.is_contiguous():
        out = torch.empty(X.shape, dtype=X.dtype, device=X.device)
    if keep is None and _host_check_is_free(X, host_reads):
        norm = torch.linalg.vector_norm(X, dim=(-2, -1), keepdim=True)
        exact = _plain_norm_is_exact(norm)
        if all(exact):
            return torch.div(X, _plus_eps(norm, eps), out=out)
        if any(exact):  # rare (a skipped matrix's zeros, extreme scales): both routes, then pick
            safe = _normalize_safe(X, eps, host=host)
            plain = torch.div(X, _plus_eps(norm, eps), out=out)
            return torch.where(_slot_mask(exact, X.device), plain, safe, out=plain)
    return _normalize_safe(X, eps, out, host=host, keep=keep)


def _normalize_safe(
    X: Tensor, eps: float, out: Tensor | None = None, *, host: bool, keep: Tensor | None = None
) -> Tensor:
    """``X / (‖X‖ + eps)`` as ``(X/s) / (‖X/s‖ + eps/s)``, ``s`` the power of two just below the
    largest |entry|: the same value bit for bit (power-of-two scaling is exact), but the norm can
    neither overflow (|x| ~ 1e30) nor underflow (|x| ~ 1e-30); with ``eps=0`` a zero matrix gives
    zero, not 0/0. Where :func:`takes_fp64_route`, :func:`_normalize_in_fp64` (so a matrix's last
    bit may depend on its bucket's size). ``keep`` (``(B, 1, 1)``, 1 or 0 per matrix): a 0 divides
    the denominator by 0, so the matrix comes out zeros with no pass of its own; 1 leaves it exact.
    """
    if takes_fp64_route(X.numel(), X.dtype, X.device, host):
        return _normalize_in_fp64(X, eps, out, keep)
    scale = _power_of_two_below(_largest_entry(X, host))
    X = torch.div(X, scale, out=out)  # a new tensor: the division below may work in place
    norm = torch.linalg.vector_norm(X, dim=(-2, -1), keepdim=True)
    denom = norm + eps / scale if eps else norm.clamp_min(torch.finfo(X.dtype).tiny)
    return X.div_(denom if keep is None else denom.div_(keep))


#: Device types without float64 arithmetic (they take the power-of-two route).
_NO_FP64 = frozenset({"mps"})

#: Off the host, batches of at least this many elements take the power-of-two route: from here
#: its eight more launches cost less than the ~10 bytes per element it saves.
FP64_ROUTE_MAX_ELEMENTS = 2**24


def takes_fp64_route(numel: int, dtype: torch.dtype, where: torch.device, host: bool) -> bool:
    """Whether :func:`_normalize_safe` divides a batch by way of :func:`_normalize_in_fp64`."""
    return (
        not host and dtype != torch.float64 and where.type not in _NO_FP64 and numel < FP64_ROUTE_MAX_ELEMENTS
    )


def normalize_in_fp64_(batches: Sequence[Tensor], eps: float) -> None:
    """In-place :func:`_normalize_in_fp64` of several batches of one dtype, their norms side by
    side in one vector (one add for all, a launch per batch fewer), each value as if alone."""
    ends = list(itertools.accumulate(X.size(0) for X in batches))
    norms = torch.empty(ends[-1], dtype=torch.float64, device=batches[0].device)
    parts = [norms[end - X.size(0) : end].view(-1, 1, 1) for X, end in zip(batches, ends)]
    for X, norm in zip(batches, parts):
        torch.linalg.vector_norm(X, dim=(-2, -1), keepdim=True, dtype=torch.float64, out=norm)
    if eps:
        norms.add_(eps)
    else:
        norms.clamp_min_(torch.finfo(batches[0].dtype).tiny)
    for X, denom in zip(batches, parts):
        torch.div(X, denom, out=X)


def _normalize_in_fp64(X: Tensor, eps: float, out: Tensor | None, keep: Tensor | None = None) -> Tensor:
    """``X / (‖X‖ + eps)`` with the norm and the division in fp64, rounded once to ``X``'s dtype:
    fp32/bf16 squares cannot overflow or underflow there, so three kernels do the power-of-two
    route's eleven (the last bit may differ). Its fp64 work is elementwise, cheap even where slow."""
    norm = torch.linalg.vector_norm(X, dim=(-2, -1), keepdim=True, dtype=torch.float64)
    denom = norm.add_(eps) if eps else norm.clamp_min_(torch.finfo(X.dtype).tiny)
    if keep is not None:  # see _normalize_safe
        denom.div_(keep)
    if out is None:
        out = torch.empty(X.shape, dtype=X.dtype, device=X.device)
    return torch.div(X, denom, out=out)


#: Norms in this range come from sums of squares that stayed normal fp32 numbers, so the plain
#: formula is exact there. A zero norm is not trusted: tiny entries square to zero too.
_PLAIN_NORM_RANGE = (2.0**-40, 2.0**60)


def _host_check_is_free(X: Tensor, host_reads: bool) -> bool:
    """Whether the plain normalisation's range check applies: host reads allowed, and a dtype it
    covers (bf16 shares fp32's exponent range; fp16 would overflow ``X·Xᵀ`` before the norm did)."""
    return host_reads and X.dtype in (torch.float32, torch.float64, torch.bfloat16)


def _plain_norm_is_exact(norm: Tensor) -> list[bool]:
    """Per matrix, whether its norm is in range (NaN is not): one host read of a few numbers."""
    low, high = _PLAIN_NORM_RANGE
    values = norm.view(-1).tolist()
    # ``low <= v <= high`` per value, through C-level comparisons: no Python frame per matrix
    return list(map(operator.and_, map(low.__le__, values), map(high.__ge__, values)))


def _slot_mask(flags: list[bool], device: torch.device) -> Tensor:
    return torch.tensor(flags, dtype=torch.bool, device=device).view(-1, 1, 1)


def _plus_eps(norm: Tensor, eps: float) -> Tensor:
    return norm + eps if eps else norm.clamp_min(torch.finfo(norm.dtype).tiny)


def _largest_entry(X: Tensor, host: bool) -> Tensor:
    """Largest |entry| of each matrix, ``(B, 1, 1)`` (NaN if any is NaN); on a CPU from a max and
    a min, as torch's inf-norm kernel is far slower there."""
    if host:
        return torch.maximum(X.amax(dim=(-2, -1), keepdim=True), X.amin(dim=(-2, -1), keepdim=True).neg_())
    norm: Tensor = torch.linalg.vector_norm(X, ord=float("inf"), dim=(-2, -1), keepdim=True)
    return norm


_EXPONENT_BITS = {torch.float32: (torch.int32, 0x7F800000), torch.float64: (torch.int64, 0x7FF0000000000000)}


def _power_of_two_below(x: Tensor) -> Tensor:
    """``2**floor(log2(x))`` exactly, by keeping only the exponent bits (``x`` >= 0; zero and
    subnormals give the smallest normal number, inf and NaN give inf)."""
    wide = torch.float64 if x.dtype == torch.float64 else torch.float32
    as_int, mask = _EXPONENT_BITS[wide]
    y = x.to(wide).clamp_min(torch.finfo(x.dtype).tiny)
    return (y.view(as_int) & mask).view(wide).to(x.dtype)


def _iterate(
    X: Tensor,
    schedule: list[Coefficients],
    eps: float,
    scratch: Scratch = _fresh,
    out: Tensor | None = None,
    *,
    host: bool,
    host_reads: bool,
    reuse_input: bool = False,
    normalized: bool = False,
    keep: Tensor | None = None,
) -> Tensor:
    """The NS loop (:func:`_polynomial_steps`) on a wide batch (rows <= cols); ``X`` is written only
    with ``reuse_input`` (:data:`Scratch`) or ``normalized`` (``X`` already divided by its norms,
    :func:`normalize_in_fp64_`, the caller's to overwrite). ``keep``: :func:`_normalize_safe`'s."""
    if normalized:
        return _polynomial_steps(X, schedule, scratch, out)
    source = X
    X = _normalize(X, eps, out=scratch("X", X.shape), host=host, host_reads=host_reads, keep=keep)
    return _polynomial_steps(X, schedule, scratch, out, spare=source if reuse_input else None)


def _polynomial_steps(
    X: Tensor,
    schedule: list[Coefficients],
    scratch: Scratch,
    out: Tensor | None,
    A: Tensor | None = None,
    spare: Tensor | None = None,
) -> Tensor:
    """``X ← aX + (bA + cA²)X`` with ``A = X·Xᵀ`` per step of ``schedule``, from a normalised wide
    batch; ``A``: the first step's, if already computed. The last iterate goes to ``out`` when
    given, the others ping-pong in scratch; ``spare``: a free buffer of ``X``'s shape to ping-pong
    with instead, which then also takes the last iterate where it is free (``out`` unused)."""
    R = X.size(-2)
    into_spare = spare is not None
    spare = spare if into_spare else scratch("Y", X.shape)
    for k, (a, b, c) in enumerate(schedule):
        if k or A is None:
            A = torch.bmm(X, X.mT, out=scratch("A", (X.size(0), R, R)))
        B = torch.baddbmm(A, A, A, beta=b, alpha=c, out=scratch("B", A.shape))
        target = out if k + 1 == len(schedule) and not into_spare else spare
        X, spare = torch.baddbmm(X, B, X, beta=a, out=target), X
    return X


def _iterate_aol(
    X: Tensor,
    schedule: list[Coefficients],
    eps: float,
    scratch: Scratch = _fresh,
    out: Tensor | None = None,
    *,
    host: bool,
    host_reads: bool,
    reuse_input: bool = False,
) -> Tensor:
    """The NS loop of :func:`_iterate` started from AOL's rescaling instead of ``X/‖X‖``: with
    ``A = X·Xᵀ`` (the wide side), ``X₀ = D·X``, ``D = diag(Σ_j |A_ij|)^(-1/2)``, has spectral norm
    at most 1 (Prach & Lampert 2022, "Almost-Orthogonal Layers", Theorem 1, applied to ``Xᵀ``),
    usually much closer to it than after Frobenius normalisation, so one iteration fewer reaches the
    same band; the first iteration reuses ``A₀ = D·A·D``. The published rule (flash-newton-schulz's
    and dion's AOL kernels, optax's ``preconditioning="aol"``): rows of the wide orientation, row
    sums clamped below at ``eps``. It changes the singular vectors slightly, which Turbo-Muon
    (arXiv:2512.04632) measured not to hurt training. Each matrix is first divided by the power of
    two below its largest |entry|, so ``X·Xᵀ`` neither overflows nor underflows; no host reads."""
    source = X
    X, A = _aol_rescaled(X, eps, scratch, host)
    return _polynomial_steps(X, schedule, scratch, out, A, spare=source if reuse_input else None)


def _aol_rescaled(X: Tensor, eps: float, scratch: Scratch, host: bool) -> tuple[Tensor, Tensor]:
    """``(D·X, D·A·D)`` for a wide batch (see :func:`_iterate_aol`), statistics in fp32 at least."""
    B, R, _ = X.shape
    scale = _power_of_two_below(_largest_entry(X, host))  # (B, 1, 1), exact powers of two
    out = scratch("X", X.shape)
    if out is None and not X.is_contiguous():  # later iterates are written into this buffer
        out = torch.empty(X.shape, dtype=X.dtype, device=X.device)
    Xs = torch.div(X, scale, out=out)
    A = torch.bmm(Xs, Xs.mT, out=scratch("A", (B, R, R)))
    wide = torch.promote_types(X.dtype, torch.float32)
    rows = A.abs().sum(dim=-1, keepdim=True, dtype=wide)  # (B, R, 1); padding adds zeros
    # the clamp at eps of the unscaled row sums, in the scaled units: eps / scale²
    tiny = torch.finfo(wide).tiny
    if eps:
        floor = (eps / scale.to(wide)).div_(scale.to(wide)).clamp_min_(tiny)
        s = torch.maximum(rows, floor).rsqrt_()
    else:
        s = rows.clamp_min_(tiny).rsqrt_()
    Xs.mul_(s)
    A.mul_(s).mul_(s.mT)
    return Xs, A


def _iterate_gram(
    X: Tensor,
    schedule: list[Coefficients],
    eps: float,
    scratch: Scratch = _fresh,
    out: Tensor | None = None,
    *,
    host: bool,
    host_reads: bool,
    reuse_input: bool = False,
    keep: Tensor | None = None,
) -> Tensor:
    """The same iteration carried out on the small ``R×R`` side, for wide ``R×C`` batches.

    Every iterate is ``X_k = Q_k·X_0`` with ``Q_k`` a polynomial in ``A_0 = X_0·X_0ᵀ``: each step
    multiplies by ``P_k = a·I + b·A_k + c·A_k²``, so ``Q_{k+1} = P_k·Q_k`` and, as ``P_k`` commutes
    with ``A_k``, ``A_{k+1} = P_k·A_k·P_k``. Only ``R×R`` products remain inside the loop and
    ``X_0`` is touched twice (``A_0`` and the final ``Q·X_0``): ~``4R²C + (8k−6)R³`` FLOPs instead
    of ``k·(4R²C + 2R³)``, a win once ``C >= 2R`` (e.g. 3×3 convs, where ``C = 9·C_in``).
    (Gram-space NS is discussed in Dion and in the Polar Express paper, Amsel et al. 2025.)
    Squaring into ``A`` doubles the dynamic range: in bf16/fp16 ``A_0``'s rounding leaves tiny
    negative eigenvalues that the steps grow until the output blows up, so there the iteration
    restarts (:func:`gram_restarts`, the Gram-space NS literature's remedy) from ``Q_k·X_0``.
    """
    source = X
    # nothing kept and the input ours: normalise it in place, and let each restart write into the
    # batch-sized buffer the one before left free, so that two such buffers live at once, not four
    rotate = reuse_input and scratch is _fresh and X.is_contiguous()
    X, A, inv_norm = _normalized_gram(
        X, eps, scratch, host=host, host_reads=host_reads, into=X if rotate else None, keep=keep
    )
    restarts = gram_restarts(len(schedule), X.dtype, gram_first_run(schedule))
    Q: Tensor | None = None
    spare: Tensor | None = None
    free: Tensor | None = None  # with ``rotate``: a batch-sized buffer read no more
    restarted = 0
    for k, (a, b, c) in enumerate(schedule):
        if k in restarts:  # start afresh from X_k = Q_k·X_0
            assert Q is not None  # made by step 0
            if inv_norm is not None:
                Q, inv_norm = Q.mul_(inv_norm), None
            restarted += 1
            if rotate:
                target = free
            else:
                second = restarted % 2 == 0  # never X's own buffer
                target = source if reuse_input and second else scratch(f"X{restarted % 2}", X.shape)
            X, free = torch.bmm(Q, X, out=target), X
            A = torch.bmm(X, X.mT, out=A)
            Q = None
        B = torch.baddbmm(A, A, A, beta=b, alpha=c, out=scratch("B", A.shape))  # P = a·I + B
        if k + 1 < len(schedule) and k + 1 not in restarts:
            PA = torch.baddbmm(A, B, A, beta=a, out=scratch("PA", A.shape))  # P·A
            A = torch.baddbmm(PA, PA, B, beta=a, out=A)  # P·A·P, over A (not an input here)
            del PA  # with nothing kept, its memory is the next step's
        if Q is None:  # Q₁ = P = a·I + B (with nothing kept, B itself: fresh, read no more)
            Q = B if rotate else torch.add(B, 0, out=scratch("Q", A.shape))
            Q.diagonal(dim1=-2, dim2=-1).add_(a)
            spare = scratch("Q'", A.shape)
        else:
            Q, spare = torch.baddbmm(Q, B, Q, beta=a, out=spare), Q  # P·Q
    assert Q is not None  # the schedule has a step
    if inv_norm is not None:
        Q.mul_(inv_norm)  # Q·X₀ = (Q/(‖X‖+eps))·X: the normalisation rides on the R×R side
    if rotate:
        out = free
    elif reuse_input:  # the input's buffer if X left it, else X1's (free when X is back in it)
        out = source if X is not source else scratch("X1" if restarted else "out", X.shape)
    return torch.bmm(Q, X, out=out)


#: How far the first run of low-precision Gram-space NS may grow ``A₀``'s rounding errors (a tiny
#: negative eigenvalue ``λ`` becomes ``λ·p(λ)²``, ``~a²·λ`` per step) before it restarts: Jordan's
#: three steps (``3.4445⁶ ≈ 1.7·10³``) held standard bf16 NS's band on ``fastmuon accuracy``'s
#: stress inputs; four (``2·10⁴``), or Polar Express's steeper three (``≈ 1.7·10⁴``), did not. Later
#: runs start with singular values near 1, so larger absolute errors: they restart every 2 steps.
FIRST_RUN_GROWTH = 2e3


def gram_first_run(schedule: Sequence[Coefficients]) -> int:
    """How many steps of ``schedule`` low-precision Gram-space NS runs before its first restart:
    the longest start whose growth ``∏ a_k²`` stays within :data:`FIRST_RUN_GROWTH` (at least 2)."""
    growth, length = 1.0, 0
    for a, _, _ in schedule:
        growth *= a * a
        if growth > FIRST_RUN_GROWTH:
            break
        length += 1
    return max(length, 2)


#: :func:`gram_first_run` of the default schedule (Jordan's): what a plan assumes unless told
DEFAULT_GRAM_FIRST_RUN = 3


def gram_restarts(
    steps: int, dtype: torch.dtype | None, first_run: int = DEFAULT_GRAM_FIRST_RUN
) -> tuple[int, ...]:
    """The steps of a ``steps``-long Gram-space NS in ``dtype`` that restart from ``X_k = Q_k·X_0``:
    after ``first_run`` steps (:func:`gram_first_run`), then every 2; none in fp32/fp64 or None."""
    if dtype is None or dtype in (torch.float32, torch.float64):
        return ()
    return tuple(range(first_run, steps, 2))


def gram_runs(steps: int, dtype: torch.dtype | None, first_run: int = DEFAULT_GRAM_FIRST_RUN) -> list[int]:
    """The lengths of the runs from a fresh ``A = X·Xᵀ`` of a Gram-space NS of ``steps`` in
    ``dtype`` (each costs ``X·Xᵀ``, ``4·length − 3`` R×R products and ``Q·X``)."""
    bounds = [0, *gram_restarts(steps, dtype, first_run), steps]
    return [end - start for start, end in zip(bounds, bounds[1:])]


def _normalized_gram(
    X: Tensor,
    eps: float,
    scratch: Scratch,
    *,
    host: bool,
    host_reads: bool,
    into: Tensor | None = None,
    keep: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """``(X, A₀, 1/(‖X‖+eps))`` with ``A₀ = X₀·X₀ᵀ`` for ``X₀ = X/(‖X‖+eps)``, ``X₀`` unwritten:
    ``‖X‖²`` is the trace of ``X·Xᵀ``, so normalising costs two ``R×R`` passes, not three over ``X``.
    Where that is not exact or a host check is not free, per matrix as in :func:`_normalize`:
    ``(X₀, X₀·X₀ᵀ, None)``, ``X₀`` from :func:`_normalize_safe` (into ``into``, which may be ``X``);
    in a mixed batch those slots get factor 1."""
    gram_shape = (X.size(0), X.size(1), X.size(1))
    if keep is None and _host_check_is_free(X, host_reads):
        A = torch.bmm(X, X.mT, out=scratch("A", gram_shape))
        norm = A.diagonal(dim1=-2, dim2=-1).sum(-1).clamp_min_(0).sqrt_().view(-1, 1, 1)
        exact = _plain_norm_is_exact(norm)
        inv_norm = _plus_eps(norm, eps).reciprocal_()
        if all(exact):
            return X, A.mul_(inv_norm.square()), inv_norm
        if any(exact):  # rare (a skipped matrix's zeros, extreme scales): both routes, then pick
            plain = _slot_mask(exact, X.device)
            X0 = _normalize_safe(X, eps, out=scratch("X", X.shape), host=host)
            X0 = torch.where(plain, X, X0, out=X0)
            A0 = torch.bmm(X0, X0.mT)
            A = torch.where(plain, A.mul_(inv_norm.square()), A0, out=A)
            return X0, A, torch.where(plain, inv_norm, 1.0)
    X0 = _normalize_safe(
        X, eps, out=into if into is not None else scratch("X", X.shape), host=host, keep=keep
    )
    return X0, torch.bmm(X0, X0.mT, out=scratch("A", gram_shape)), None


def _iterate_eigh(
    X: Tensor,
    schedule: list[Coefficients],
    eps: float,
    scratch: Scratch = _fresh,
    out: Tensor | None = None,
    *,
    host: bool,
    host_reads: bool,
    reuse_input: bool = False,
) -> Tensor:
    """The same polynomial, applied through one eigendecomposition of the Gram matrix: as in
    :func:`_iterate_gram` the result is ``h(A₀)·X₀`` with ``A₀ = X₀·X₀ᵀ`` and ``h`` the product of
    the steps' polynomials; with ``A₀ = V·diag(λ)·Vᵀ`` that is ``V·diag(h(λ))·Vᵀ·X₀``, and ``h(λ)``
    is the scalar recursion ``h ← h·p_k(λ_k)``, ``λ_{k+1} = λ_k·p_k(λ_k)²`` with ``p_k(λ) = a +
    b·λ + c·λ²``: NS run on each singular value ``σ = √λ``. One ``R×R`` eigendecomposition and one
    product replace the Gram loop's 4k−3 ``R×R`` products (``planner.EighCost`` prices both). (A
    polar factor from the eigendecomposition of ``X·Xᵀ`` is textbook, e.g. Higham, *Functions of
    Matrices*, ch. 8; here it evaluates the NS polynomial, not the exact polar factor.) fp32
    eigenvalues resolve only ~1e-7 of the largest, so it is less exact than the fp32 Gram loop,
    though far inside bf16 NS's band. A matrix LAPACK cannot decompose (NaN or inf) falls back to
    the Gram loop, which propagates them."""
    low = X.dtype not in (torch.float32, torch.float64)
    kept = scratch  # in X's dtype
    Xf = X.float() if low else X
    Xw, A, inv_norm = _normalized_gram(Xf, eps, _fresh if low else scratch, host=host, host_reads=host_reads)
    try:
        lam, V = torch.linalg.eigh(A)
    except torch.linalg.LinAlgError:
        return _iterate_gram(
            X, schedule, eps, scratch, out, host=host, host_reads=host_reads, reuse_input=reuse_input
        )
    lam = lam.clamp_min_(0)  # A₀ is positive semi-definite; rounding leaves tiny negatives
    h = None
    for a, b, c in schedule:
        p = (lam * c).add_(b).mul_(lam).add_(a)  # a + b·λ + c·λ²
        h = p if h is None else h.mul_(p)
        lam.mul_(p).mul_(p)
    assert h is not None  # the schedule has a step
    if inv_norm is not None:
        h.mul_(inv_norm.view(-1, 1))  # Q·X = (Q/(‖X‖+eps))·X, as in the Gram loop: R numbers each
    # Xw is X (as given to _normalized_gram) where the plain route ran, else X₀ (in its slots)
    X0 = X if Xw is Xf else (Xw.to(X.dtype) if low else Xw)
    if low:
        scratch = _fresh  # the kept temporaries are in X's dtype; these are fp32
    Vh = torch.mul(V, h.unsqueeze(-2), out=scratch("Vh", V.shape))
    Q = torch.bmm(Vh, V.mT, out=scratch("Q", V.shape))
    if reuse_input:
        out = kept("out", X.shape)
    return torch.bmm(Q.to(X.dtype), X0, out=out)


METHODS = {"standard": _iterate, "gram": _iterate_gram, "eigh": _iterate_eigh}


@contextlib.contextmanager
def fp32_matmuls(dtype: torch.dtype) -> Iterator[None]:
    """Run fp32 NS's matmuls in fp32: under ``set_float32_matmul_precision("high")`` they would
    silently run in TF32 or bf16 passes, and NS's accuracy is set by ``ns_dtype``, not by a global
    meant for a model's layers. Put back after; a no-op while traced (a trace cannot set a global)."""
    if dtype != torch.float32 or torch.compiler.is_compiling():
        yield
        return
    previous = torch.get_float32_matmul_precision()
    if previous == "highest":
        yield
        return
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(previous)


def pinned_kernel(kernel: Callable[..., Tensor], dtype: torch.dtype) -> Callable[..., Tensor]:
    """``kernel`` run under :func:`fp32_matmuls` where its batches are fp32 (else itself)."""
    if dtype != torch.float32:
        return kernel

    @functools.wraps(kernel)
    def run(*args: Any, **kwargs: Any) -> Tensor:
        # nothing to pin costs no context manager (several Python calls, per bucket and step)
        if not torch.compiler.is_compiling() and torch.get_float32_matmul_precision() == "highest":
            return kernel(*args, **kwargs)
        with fp32_matmuls(dtype):
            return kernel(*args, **kwargs)

    return run


def ns_kernel(method: str, preconditioning: str = "frobenius") -> Callable[..., Tensor]:
    """The NS kernel of ``method`` with ``preconditioning`` (AOL: the standard loop only)."""
    if preconditioning == "aol":
        check_method_preconditioning(method, preconditioning)
        return _iterate_aol
    return METHODS[method]
