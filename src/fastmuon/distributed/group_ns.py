"""Newton–Schulz of one matrix split by columns over an owner group of ranks.

Oriented wide (``X`` is ``m×n``, ``m <= n``), member ``j`` of the ``g`` ranks holds columns ``X_j``
(``m×n_j``). NS needs only the Gram matrix ``A = X·Xᵀ = Σ_j X_j·X_jᵀ`` and ``‖X‖² = Σ_j ‖X_j‖²``,
and each iteration maps every block by the same left factor, ``X_j ← a·X_j + (b·A + c·A²)·X_j``; so
one all-reduce of the norms and one of ``A`` per iteration give each member its columns of the
one-process result, and no member holds the whole matrix. The ``"redundant"`` form builds the
factor (``2m³``), the ``"factored"`` one does not, cheaper where ``n_j < m`` (:func:`group_form`).

Precision: Gram matrices are reduced in the NS dtype (as one process rounds its own), sums of
squares in fp32 at least (bf16 loses the norm's leading digits), AOL's first, unscaled Gram
matrix in fp32 under fp16 (which it would overflow). Range: only sums are reduced, not the max
the one-process power-of-two prescaling needs, so squared norms (and AOL Gram entries) must stay
normal fp32, about 1e-19 to 1e19. Nothing is read on the host and no branch depends on a value,
so this can be captured in a CUDA graph.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from ..ns.engine import NSConfig
from ..ns.newton_schulz import PRECONDITIONINGS, Coefficients, fp32_matmuls, resolve_coefficients
from ..ns.planner import AOL_FLOPS_PER_R2

#: Sums a tensor in place over the owner group, as ``torch.distributed.all_reduce`` does.
GroupReduce = Callable[[Tensor], object]  # its result (a Work handle, or None) is not read

#: How a member applies an iteration to its block; "auto": group_form.
GROUP_FORMS = ("auto", "redundant", "factored")


def group_form(m: int, n_j: int) -> str:
    """The cheaper form for a member's ``m×n_j`` block: ``"factored"`` (``6m²n_j`` FLOPs an
    iteration) where ``n_j < m``, else ``"redundant"`` (``4m²n_j + 2m³``)."""
    return "factored" if n_j < m else "redundant"


def group_ns_flops(m: int, n_j: int, steps: int, form: str, preconditioning: str = "frobenius") -> int:
    """Matmul FLOPs one member runs for one matrix, counted as planner.ns_flops counts them
    (equal to it for one ``"redundant"`` member); AOL's rescaling as ``AOL_FLOPS_PER_R2·m²``."""
    form = _checked_form(form, m, n_j)
    _check_preconditioning(preconditioning)
    gram = 2 * m * m * n_j
    apply = 4 * m * m * n_j if form == "factored" else 2 * m**3 + 2 * m * m * n_j
    extra = AOL_FLOPS_PER_R2 * m * m if preconditioning == "aol" else 0
    return steps * (gram + apply) + extra


def group_reduce_calls(steps: int, preconditioning: str = "frobenius") -> int:
    """All-reduces per call: one Gram matrix per iteration, and the norms before them (AOL's
    rescaling comes from the first iteration's Gram matrix: no norm to reduce)."""
    _check_preconditioning(preconditioning)
    return steps if preconditioning == "aol" else steps + 1


def group_reduce_elements(k: int, m: int, steps: int, preconditioning: str = "frobenius") -> int:
    """Elements a member all-reduces per call for ``k`` matrices: ``k`` norms (fp32) unless AOL,
    and ``k·m²`` Gram entries (NS dtype) per iteration."""
    _check_preconditioning(preconditioning)
    norms = 0 if preconditioning == "aol" else k
    return norms + steps * k * m * m


def group_newton_schulz(blocks: Tensor, config: NSConfig, reduce: GroupReduce, form: str = "auto") -> Tensor:
    """This member's columns ``(k, m, n_j)`` of NS(X) in ``config.dtype``, for ``k`` matrices split
    by columns over a group. ``blocks``: its ``(k, m, n_j)`` column blocks of the same-shape
    matrices oriented wide (a tall one transposed), any float dtype, not modified; the standard
    iteration runs whatever ``config.method``. ``form``: ``"auto"`` takes :func:`group_form`;
    members may differ, as both forms reduce the same tensors. Every member must call this with
    the same ``k``, ``m`` and ``config``, in the same order: the reduces are collectives."""
    if not isinstance(blocks, Tensor) or blocks.ndim != 3 or not blocks.is_floating_point():
        got = (
            f"a {blocks.ndim}-D {blocks.dtype} tensor"
            if isinstance(blocks, Tensor)
            else type(blocks).__name__
        )
        raise ValueError(f"group_newton_schulz blocks must be a float (k, m, n_j) tensor, got {got}")
    _check_preconditioning(config.preconditioning)
    k, m, n_j = blocks.shape
    form = _checked_form(form, m, n_j)
    schedule = resolve_coefficients(list(config.coefficients), config.steps)
    X = torch.empty((k, m, n_j), dtype=config.dtype, device=blocks.device)
    if k == 0 or m == 0:  # the same on every member (k and m are shared): no collective is skipped alone
        return X
    with fp32_matmuls(config.dtype):
        if config.preconditioning == "aol":
            X, A = _aol_start(blocks, X, config.eps, reduce)
        else:
            X, A = _frobenius_start(blocks, X, config.eps, reduce), None
        return _iterate(X, schedule, reduce, form, A)


def _frobenius_start(blocks: Tensor, X: Tensor, eps: float, reduce: GroupReduce) -> Tensor:
    """``X_j / (‖X‖ + eps)`` into ``X``, ``‖X‖²`` of the NS-dtype values summed over the group
    (clamped at the smallest normal when ``eps`` is 0, so a zero matrix stays zero)."""
    X.copy_(blocks)
    wide = torch.promote_types(X.dtype, torch.float32)
    squares = torch.linalg.vector_norm(X, dim=(-2, -1), dtype=wide).square_()  # (k,)
    reduce(squares)
    norm = squares.sqrt_().view(-1, 1, 1)
    norm = norm.add_(eps) if eps else norm.clamp_min_(torch.finfo(wide).tiny)
    return X.div_(norm)  # divides in the wide dtype, rounds once


def _aol_start(blocks: Tensor, X: Tensor, eps: float, reduce: GroupReduce) -> tuple[Tensor, Tensor]:
    """``(D·X_j, D·A·D)``, ``A = Σ_j X_j·X_jᵀ``, ``D = diag(Σ_i |A_ri|)^(-1/2)`` (row sums clamped
    at ``eps``): AOL's rescaling as newton_schulz._iterate_aol applies it to in-range values."""
    X.copy_(blocks)
    gram = torch.float32 if X.dtype == torch.float16 else X.dtype  # an unscaled Gram overflows fp16
    Xg = X if gram == X.dtype else X.to(gram)
    A = torch.bmm(Xg, Xg.mT)
    reduce(A)
    wide = torch.promote_types(X.dtype, torch.float32)
    rows = A.abs().sum(dim=-1, keepdim=True, dtype=wide)  # (k, m, 1)
    s = rows.clamp_min_(max(eps, torch.finfo(wide).tiny)).rsqrt_()
    X.mul_(s)
    A = A.mul_(s).mul_(s.mT).to(X.dtype)
    return X, A


def _iterate(
    X: Tensor, schedule: list[Coefficients], reduce: GroupReduce, form: str, A: Tensor | None
) -> Tensor:
    """The NS loop on the normalised block; ``A``: the first reduced Gram matrix, if known."""
    spare = torch.empty_like(X)
    step = _factored if form == "factored" else _redundant
    for i, (a, b, c) in enumerate(schedule):
        if i or A is None:
            A = torch.bmm(X, X.mT)
            reduce(A)
        X, spare = step(X, A, a, b, c, spare), X
    return X


def _redundant(X: Tensor, A: Tensor, a: float, b: float, c: float, out: Tensor) -> Tensor:
    """``a·X + (b·A + c·A²)·X`` into ``out``, the one-process kernel's two fused products."""
    B = torch.baddbmm(A, A, A, beta=b, alpha=c)
    return torch.baddbmm(X, B, X, beta=a, out=out)


def _factored(X: Tensor, A: Tensor, a: float, b: float, c: float, out: Tensor) -> Tensor:
    """``a·X + A·(b·X + c·A·X)`` into ``out``: no ``m×m×m`` product, two fused ``m×m×n_j`` ones,
    and no rounded intermediate scaled by the large ``b`` (-4.8 for "jordan"), so it errs in bf16
    about as the redundant form does; ``a·X + b·Y + c·A·Y`` (``Y = A·X``) errs several times more."""
    Z = torch.baddbmm(X, A, X, beta=b, alpha=c)
    return torch.baddbmm(X, A, Z, beta=a, out=out)


def _checked_form(form: str, m: int, n_j: int) -> str:
    if form not in GROUP_FORMS:
        raise ValueError(f"unknown group NS form {form!r}; choose one of {list(GROUP_FORMS)}")
    return group_form(m, n_j) if form == "auto" else form


def _check_preconditioning(preconditioning: str) -> None:
    if preconditioning not in PRECONDITIONINGS:
        raise ValueError(
            f"unknown preconditioning {preconditioning!r} for group NS; choose one of {list(PRECONDITIONINGS)}"
        )
