"""The Newton–Schulz kernel: orthogonalise one matrix or a batch of them.

Each iteration maps X -> a·X + (b·A + c·A²)·X with A = X·Xᵀ, which pushes every
singular value of X towards 1 while keeping its singular vectors. Two fused
``baddbmm`` calls per iteration plus one ``bmm`` is all the kernel work; the
whole algorithm is the dozen lines of :func:`newton_schulz`.
The quintic form and the "jordan" coefficients come from Keller Jordan's Muon write-up.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Union

import torch
from torch import Tensor

Coefficients = tuple[float, float, float]
CoefficientSpec = Union[str, Coefficients, Sequence[Coefficients]]

#: Named coefficient schedules. Each is a tuple of per-step (a, b, c); the last repeats.
PRESETS: dict[str, tuple[Coefficients, ...]] = {
    # Keller Jordan's quintic: maximal slope at zero, converges to singular values in ~[0.7, 1.2].
    "jordan": ((3.4445, -4.7750, 2.0315),),
}


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
        schedule = [tuple(float(v) for v in spec)]  # type: ignore[union-attr]
    elif isinstance(spec, Sequence) and len(spec) > 0 and all(_is_triple(t) for t in spec):
        schedule = [tuple(float(v) for v in t) for t in spec]
    else:
        raise ValueError(
            f"ns_coefficients must be a preset name {sorted(PRESETS)}, one (a, b, c) tuple "
            f"or a non-empty sequence of them, got {spec!r}"
        )
    schedule = schedule[:steps]
    schedule += [schedule[-1]] * (steps - len(schedule))
    return schedule  # type: ignore[return-value]


def _is_triple(value: object) -> bool:
    return (
        isinstance(value, Sequence)
        and not isinstance(value, str)
        and len(value) == 3
        and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)
    )


def newton_schulz(
    X: Tensor,
    steps: int = 5,
    coefficients: CoefficientSpec = "jordan",
    eps: float = 1e-7,
    dtype: torch.dtype = torch.bfloat16,
) -> Tensor:
    """Orthogonalise a matrix ``(m, n)`` or a batch ``(b, m, n)``; returns the input's shape in ``dtype``.

    Every matrix is first divided by its own Frobenius norm (+ ``eps``, taken after scaling the
    largest entry to 1 so that huge or tiny matrices neither overflow nor vanish) so that its
    spectral norm is at most 1, then iterated. Tall matrices are iterated on their transpose so the
    Gram matrix ``X·Xᵀ`` is the small side. Zero-padded rows/columns stay exactly zero and do
    not change the norm, which is what lets the batched engine pad matrices into shared buckets.
    """
    if X.ndim not in (2, 3):
        raise ValueError(f"newton_schulz expects a matrix (m, n) or a batch (b, m, n), got {X.ndim}D")
    if not dtype.is_floating_point:
        raise ValueError(f"newton_schulz dtype must be a floating dtype, got {dtype}")
    schedule = resolve_coefficients(coefficients, steps)
    single = X.ndim == 2
    Y = X.unsqueeze(0) if single else X
    tall = Y.size(-2) > Y.size(-1)
    if tall:
        Y = Y.mT
    Y = _iterate(Y.to(dtype), schedule, eps)
    if tall:
        Y = Y.mT
    return Y.squeeze(0) if single else Y


def _iterate(X: Tensor, schedule: list[Coefficients], eps: float) -> Tensor:
    """The NS loop on a wide batch (rows <= cols). ``X`` is never modified in place.

    Each matrix is first divided by its largest |entry| so that the Frobenius norm can neither
    overflow (|x| ~ 1e30 squares past fp32/bf16 range) nor underflow (|x| ~ 1e-30): the result is
    then scale invariant, ``eps`` acts relative to the largest entry, and an all-zero matrix
    stays zero (0 / tiny, not 0 / 0).
    """
    peak = torch.linalg.vector_norm(X, ord=float("inf"), dim=(-2, -1), keepdim=True)
    X = X / peak.clamp_min(torch.finfo(X.dtype).tiny)
    X = X / (torch.linalg.vector_norm(X, dim=(-2, -1), keepdim=True) + eps)
    for a, b, c in schedule:
        A = torch.bmm(X, X.mT)
        B = torch.baddbmm(A, A, A, beta=b, alpha=c)
        X = torch.baddbmm(X, B, X, beta=a)
    return X
