"""Placeholder flops functions until the owner-group kernel lands (replaced by the helper's module)."""

from __future__ import annotations

AOL_EXTRA = 0


def group_form(m: int, n_j: int) -> str:
    return "factored" if n_j < m else "redundant"


def group_ns_flops(m: int, n_j: int, steps: int, form: str, preconditioning: str = "frobenius") -> int:
    if form == "factored":
        return steps * 6 * m * m * n_j
    return steps * (4 * m * m * n_j + 2 * m * m * m)


def group_reduce_elements(k: int, m: int, steps: int, preconditioning: str = "frobenius") -> int:
    return k + k * m * m * steps


def group_newton_schulz(blocks, config, reduce, form: str = "auto"):
    import torch

    X = blocks.to(config.dtype)
    sq = X.float().pow(2).sum(dim=(-2, -1), keepdim=True)
    reduce(sq)
    X = X / (sq.sqrt().to(X.dtype) + config.eps)
    for a, b, c in config.coefficients:
        A = torch.bmm(X, X.mT)
        reduce(A)
        B = torch.baddbmm(A, A, A, beta=b, alpha=c)
        X = torch.baddbmm(X, B, X, beta=a)
    return X


def group_reduce_calls(steps: int, preconditioning: str = "frobenius") -> int:
    return steps + 1
