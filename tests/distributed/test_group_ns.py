"""Newton–Schulz of matrices split by columns over an owner group (fastmuon.distributed.group_ns).

A group of ``g`` members is simulated with threads whose reduce sums every member's tensor in
member order; each member's columns of the result are compared with one process's NS of the
whole matrix (fp32: 1e-5 max abs; bf16: the suite's bf16 band). One gloo world of 4 ranks runs
the same with ``torch.distributed.all_reduce`` over subgroups of 2 and of 4 (group_ns_worker.py).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import pytest
import torch
import torch.distributed as dist
from conftest import rel_err
from torch import Tensor

from fastmuon import newton_schulz
from fastmuon.distributed.group_ns import (
    group_form,
    group_newton_schulz,
    group_ns_flops,
    group_reduce_calls,
    group_reduce_elements,
)
from fastmuon.ns.engine import NSConfig
from fastmuon.ns.planner import ns_flops

#: Column widths per group size, uneven, with blocks narrower than m (the factored form's case)
#: and, at 4, an empty one: widths[g] sums to N.
M, N = 24, 61
WIDTHS = {1: [61], 2: [40, 21], 3: [10, 30, 21], 4: [0, 17, 37, 7]}


class ThreadGroup:
    """``g`` members run in threads; ``reduce`` sums their tensors in member order, so every
    member gets the same sum, as an all-reduce gives."""

    def __init__(self, g: int):
        self.g = g
        self.barrier = threading.Barrier(g, timeout=30)
        self.slots: list[Tensor | None] = [None] * g

    def reducer(self, j: int) -> Callable[[Tensor], None]:
        def reduce(t: Tensor) -> None:
            self.slots[j] = t.clone()
            self.barrier.wait()
            total = self.slots[0].clone()
            for other in self.slots[1:]:
                total += other
            self.barrier.wait()  # every member has read the slots before any writes again
            t.copy_(total)

        return reduce

    def run(self, work: Callable[[int, Callable[[Tensor], None]], Tensor]) -> list[Tensor]:
        results: list[Tensor | None] = [None] * self.g
        errors: list[BaseException] = []

        def member(j: int) -> None:
            try:
                results[j] = work(j, self.reducer(j))
            except BaseException as e:  # noqa: BLE001 - re-raised in the main thread
                errors.append(e)
                self.barrier.abort()

        threads = [threading.Thread(target=member, args=(j,)) for j in range(self.g)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return results  # type: ignore[return-value]


def split_ns(W: Tensor, widths: Sequence[int], config: NSConfig, form: str | Sequence[str]) -> Tensor:
    """NS of the stored batch ``W`` (k, rows, cols) by a simulated group: oriented wide as the
    caller does (a tall matrix transposed), split by columns, results put back together."""
    tall = W.size(-2) > W.size(-1)
    X = W.mT if tall else W
    assert sum(widths) == X.size(-1)
    edges = [sum(widths[:j]) for j in range(len(widths) + 1)]
    forms = [form] * len(widths) if isinstance(form, str) else form

    def work(j: int, reduce: Callable[[Tensor], None]) -> Tensor:
        return group_newton_schulz(X[..., edges[j] : edges[j + 1]], config, reduce, forms[j])

    parts = ThreadGroup(len(widths)).run(work)
    for part, w in zip(parts, widths):
        assert part.shape == (X.size(0), X.size(1), w) and part.dtype == config.dtype
    out = torch.cat(parts, dim=-1)
    return out.mT if tall else out


def one_process(W: Tensor, coefficients: str, eps: float, dtype=torch.float32) -> Tensor:
    """The reference: one process's NS of each whole matrix, one call per matrix."""
    return torch.stack([newton_schulz(w, None, coefficients, eps, dtype, method="standard") for w in W])


def _max_abs(a: Tensor, b: Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


@pytest.mark.parametrize("coefficients", ["jordan", "polar_express", "aol"])
@pytest.mark.parametrize("g", [1, 2, 3, 4])
def test_fp32_equals_one_process(g, coefficients):
    """Every form, wide and tall stored matrices, eps 0 and not: within 1e-5 of one process."""
    for eps in (1e-7, 0.0):
        config = NSConfig.make(None, coefficients, eps, torch.float32)
        for shape in ((3, M, N), (3, N, M)):
            W = torch.randn(shape)
            W[1] *= 1e3  # the norm is each matrix's own, not the batch's
            want = one_process(W, coefficients, eps)
            for form in ("redundant", "factored", "auto"):
                got = split_ns(W, WIDTHS[g], config, form)
                assert _max_abs(got, want) <= 1e-5, (shape, eps, form)


def test_members_may_run_different_forms():
    """Both forms reduce the same tensors, so "auto" may pick differently per member."""
    config = NSConfig.make(None, "jordan", 1e-7, torch.float32)
    W = torch.randn(2, M, N)
    forms = [group_form(M, w) for w in WIDTHS[3]]
    assert forms == ["factored", "redundant", "factored"]
    got = split_ns(W, WIDTHS[3], config, ["redundant", "factored", "redundant"])
    assert _max_abs(got, one_process(W, "jordan", 1e-7)) <= 1e-5


@pytest.mark.parametrize("coefficients", ["jordan", "aol"])
def test_bf16_in_the_suite_band(coefficients):
    """bf16 NS with the Gram matrices reduced in bf16: within the suite's band for native bf16
    NS (rel. 5e-2 of the fp32 one-process result, as test_engine's; measured up to 0.03, one
    process's own bf16 NS 0.025), whatever float dtype the input comes in."""
    config = NSConfig.make(None, coefficients, 1e-7, torch.bfloat16)
    W = torch.randn(2, N, M)
    want = one_process(W, coefficients, 1e-7)
    for form in ("redundant", "factored"):
        got = split_ns(W, WIDTHS[3], config, form)
        assert rel_err(got.float(), want) <= 5e-2, form
        got = split_ns(W.bfloat16(), WIDTHS[3], config, form)
        assert rel_err(got.float(), want) <= 5e-2, form


@pytest.mark.parametrize("coefficients", ["jordan", "aol"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_zero_matrix_gives_zeros(coefficients, dtype):
    W = torch.randn(3, M, N)
    W[1] = 0
    for eps in (1e-7, 0.0):
        config = NSConfig.make(None, coefficients, eps, dtype)
        got = split_ns(W, WIDTHS[4], config, "auto")
        assert torch.isfinite(got).all()
        assert torch.equal(got[1], torch.zeros(M, N, dtype=dtype))


def test_input_untouched_and_no_host_reads():
    """The blocks are read, never written; the call reads nothing on the host (no .item(),
    .tolist() or bool() of a tensor), so a captured step can run it."""
    from torch.utils._python_dispatch import TorchDispatchMode

    reads = {"aten._local_scalar_dense.default", "aten.item.default", "aten.is_nonzero.default"}

    class HostReads(TorchDispatchMode):
        seen: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if str(func) in reads:
                self.seen.append(str(func))
            return func(*args, **(kwargs or {}))

    for coefficients in ("jordan", "aol"):
        blocks = torch.randn(2, 8, 20).mT.contiguous().mT  # non-contiguous, as a transposed slice is
        before = blocks.clone()
        config = NSConfig.make(None, coefficients, 0.0, torch.float32)
        with HostReads() as mode:
            group_newton_schulz(blocks, config, lambda t: None)
        assert not mode.seen
        assert torch.equal(blocks, before)


@pytest.mark.parametrize("preconditioning", ["frobenius", "aol"])
def test_flops_and_reduces(preconditioning):
    """One member's redundant form is one process's standard NS, FLOP for FLOP; the factored
    form is cheaper exactly where the block is narrower than the matrix is high."""
    for m, n, steps in ((24, 61, 5), (64, 64, 4), (7, 300, 8)):
        assert group_ns_flops(m, n, steps, "redundant", preconditioning) == ns_flops(
            m, n, steps, preconditioning=preconditioning
        )
        assert group_ns_flops(m, n, steps, "auto", preconditioning) == group_ns_flops(
            m, n, steps, "redundant", preconditioning
        )
    for n_j in (0, 1, 23, 24, 25, 100):
        factored = group_ns_flops(24, n_j, 5, "factored", preconditioning)
        redundant = group_ns_flops(24, n_j, 5, "redundant", preconditioning)
        assert (factored < redundant) == (group_form(24, n_j) == "factored") == (n_j < 24)
        assert group_ns_flops(24, n_j, 5, "auto", preconditioning) == min(factored, redundant)
    aol = preconditioning == "aol"
    assert group_reduce_calls(5, preconditioning) == (5 if aol else 6)
    assert group_reduce_elements(3, 24, 5, preconditioning) == (0 if aol else 3) + 5 * 3 * 24 * 24


def test_reduces_counted_are_the_reduces_run():
    for coefficients in ("jordan", "aol"):
        config = NSConfig.make(None, coefficients, 1e-7, torch.float32)
        sizes: list[int] = []
        group_newton_schulz(torch.randn(3, M, 20), config, lambda t, seen=sizes: seen.append(t.numel()))
        p = config.preconditioning
        assert len(sizes) == group_reduce_calls(config.steps, p)
        assert sum(sizes) == group_reduce_elements(3, M, config.steps, p)


def test_bad_input_is_named():
    config = NSConfig.make(None, "jordan", 1e-7, torch.float32)
    with pytest.raises(ValueError, match="form 'fused'.*choose one of"):
        group_newton_schulz(torch.randn(1, 4, 8), config, lambda t: None, "fused")
    with pytest.raises(ValueError, match=r"blocks must be a float \(k, m, n_j\) tensor, got a 2-D"):
        group_newton_schulz(torch.randn(4, 8), config, lambda t: None)
    with pytest.raises(ValueError, match="preconditioning 'spectral'"):
        group_ns_flops(4, 8, 5, "redundant", "spectral")


@pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed with gloo"
)
def test_gloo_groups_of_two_and_four(tmp_path):
    from test_distributed import launch

    report = launch(4, tmp_path, script="group_ns_worker.py", timeout=120)
    assert report.count("group of 2: equal to one process") == 4, report
    assert report.count("group of 4: equal to one process") == 4, report


def test_fp16_aol_start_beyond_fp16_range():
    """AOL's first Gram matrix is of the raw X: formed and reduced in fp32 for fp16 NS, whose
    range (65504) the diagonal here (~1.3e5) would overflow."""
    W = torch.randn(2, 8, 2000) * 8
    config = NSConfig.make(None, "aol", 1e-7, torch.float16)
    got = split_ns(W, [700, 1300], config, "redundant")
    assert torch.isfinite(got).all()
    assert rel_err(got.float(), one_process(W, "aol", 1e-7)) <= 5e-2
