"""Never corrupt a run: non-finite gradients, changing parameter sets, extreme values, memory, compile."""

from __future__ import annotations

import copy
import importlib
import os

import pytest
import torch
from helpers import by_ndim
from reference_impl import ns_reference
from reliability_support import (
    cuda_syncs_raise,
    make_params,
    random_grads,
    reference_muon_step,
    reference_musgd_step,
)
from torch import nn

import fastmuon
from fastmuon.bench.memory import AllocationTracker
from fastmuon.ns import device as ns_device
from fastmuon.ns.newton_schulz import _normalize, _normalize_safe
from fastmuon.step.nonfinite import DEFAULT_NONFINITE

F32 = dict(ns_dtype=torch.float32)
OPTIMIZERS = {
    "musgd": lambda params, **kw: fastmuon.MuSGD(
        by_ndim(params), lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3, **F32, **kw
    ),
    "muon": lambda params, **kw: fastmuon.Muon(params, lr=0.02, weight_decay=0.1, **F32, **kw),
}
# Three matrices of one shape share a bucket; a conv, a tall matrix, and vectors (SGD / AdamW).
SHAPES = [(6, 4), (6, 4), (6, 4), (8, 3, 3, 3), (9, 2), (6,), (3,)]


def _snapshot(opt, params):
    return [p.detach().clone() for p in params], [copy.deepcopy(opt.state[p]) for p in params]


def _assert_same_state(a: dict, b: dict):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


# ----- non-finite gradients ---------------------------------------------------------------------
def test_default_mode_is_raise():
    assert DEFAULT_NONFINITE == "raise"
    assert fastmuon.MuSGD([nn.Parameter(torch.zeros(2, 2))], use_muon=True).nonfinite == "raise"
    assert fastmuon.Muon([nn.Parameter(torch.zeros(2, 2))]).nonfinite == "raise"
    with pytest.raises(ValueError, match="invalid nonfinite='never'"):
        fastmuon.MuSGD([nn.Parameter(torch.zeros(2, 2))], nonfinite="never")


@pytest.mark.parametrize("kind", OPTIMIZERS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_raise_names_the_parameter_and_writes_nothing(kind, bad):
    model = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 3))
    opt = OPTIMIZERS[kind](list(model.named_parameters()))
    params = list(model.parameters())
    for p, g in zip(params, random_grads(params, 1)):
        p.grad = g
    opt.step()
    before, states = _snapshot(opt, params)
    for p, g in zip(params, random_grads(params, 2)):
        p.grad = g
    params[2].grad[1, 2] = bad
    with pytest.raises(FloatingPointError, match=r"parameter '1.weight' \(shape \(3, 6\)\) has a non-finite"):
        opt.step()
    for p, b, s in zip(params, before, states):
        assert torch.equal(p, b)
        _assert_same_state(opt.state[p], s)


@pytest.mark.parametrize("kind", OPTIMIZERS)
@pytest.mark.parametrize("foreach", [True, False])
def test_skip_leaves_bad_parameters_untouched_and_the_rest_exact(kind, foreach):
    """A NaN in one matrix of a shared bucket, and an Inf in a vector (SGD / AdamW, whose step
    count must not advance): both keep weights and state; every other parameter gets bitwise
    what it gets when those gradients are finite."""
    params = make_params(SHAPES, channels_last={3})
    twin = copy.deepcopy(params)
    opt = OPTIMIZERS[kind](params, nonfinite="skip", foreach=foreach)
    opt_twin = OPTIMIZERS[kind](twin, nonfinite="skip", foreach=foreach)
    for step in range(3):
        grads = random_grads(params, 10 + step)
        for p, q, g in zip(params, twin, grads):
            p.grad, q.grad = g.clone(), g.clone()
        if step == 1:
            before, states = _snapshot(opt, params)
            params[1].grad[2, 3] = float("nan")
            params[5].grad[0] = float("inf")
        opt.step()
        opt_twin.step()
        for i, (p, q) in enumerate(zip(params, twin)):
            if step == 1 and i in (1, 5):
                assert torch.equal(p, before[i])
                _assert_same_state(opt.state[p], states[i])
            elif step == 1:
                assert torch.equal(p, q), i
        if step == 1 and foreach:  # the bad matrix really shared its bucket with good ones
            bucket = next(b for b in opt.plan().buckets if any(m.index == 1 for m in b.members))
            assert len(bucket.members) >= 3
    assert all(torch.isfinite(p).all() for p in params)
    assert all(torch.isfinite(v).all() for s in opt.state.values() for v in s.values())
    if kind == "muon":  # the AdamW step count skipped one step
        assert float(opt.state[params[5]]["step"]) == 2 and float(opt.state[params[6]]["step"]) == 3


@pytest.mark.parametrize("kind", OPTIMIZERS)
@pytest.mark.parametrize("ns_method", ["auto", "gram", "eigh"])
def test_skip_is_bitwise_for_bucket_mates_with_gram_and_eigh_ns(kind, ns_method):
    """``auto`` runs 3×3 convs in Gram space: a NaN in one of three must leave the
    other two bitwise as in a run where its gradient was finite, at that step and after."""
    params = make_params([(32, 32, 3, 3)] * 3, seed=4)
    twin = copy.deepcopy(params)
    opt = OPTIMIZERS[kind](params, nonfinite="skip", ns_method=ns_method)
    opt_twin = OPTIMIZERS[kind](twin, nonfinite="skip", ns_method=ns_method)
    for step in range(3):
        grads = random_grads(params, 20 + step)
        for p, q, g in zip(params, twin, grads):
            p.grad, q.grad = g.clone(), g.clone()
        if step == 1:
            params[1].grad[5, 6, 1, 2] = float("nan")
        opt.step()
        opt_twin.step()
        assert opt.plan().buckets[0].method == ("gram" if ns_method == "auto" else ns_method)
        for i in (0, 2):
            assert torch.equal(params[i], twin[i]), (step, i)
            _assert_same_state(opt.state[params[i]], opt_twin.state[twin[i]])


@pytest.mark.parametrize("method", ["standard", "gram", "eigh"])
@pytest.mark.parametrize("mate_scale", [0.0, 1e30, 1e-30])
def test_a_matrix_result_does_not_depend_on_its_bucket_mates(method, mate_scale):
    """Zeros (a skipped matrix) or an extreme scale in one slot of a batch must not change the
    route, and so the bits, of the other slots' Newton–Schulz."""
    gen = torch.Generator().manual_seed(5)
    batch = torch.randn(3, 12, 40, generator=gen)
    mates = batch.clone()
    mates[1] *= mate_scale
    for eps in (1e-7, 0.0):
        alone = fastmuon.newton_schulz(batch, eps=eps, dtype=torch.float32, method=method)
        mixed = fastmuon.newton_schulz(mates, eps=eps, dtype=torch.float32, method=method)
        assert torch.equal(mixed[0], alone[0]) and torch.equal(mixed[2], alone[2]), eps
        assert torch.isfinite(mixed).all()


def test_skip_zeroes_the_bad_matrix_inside_its_bucket():
    """The engine sees the bad matrix as zeros: the NS output slot is exactly zero, not NaN."""
    params = make_params([(5, 7)] * 3)
    opt = fastmuon.MuSGD(params, lr=0.1, momentum=0.5, use_muon=True, nonfinite="skip", **F32)
    grads = random_grads(params, 3)
    grads[0][0, 0] = float("nan")
    for p, g in zip(params, grads):
        p.grad = g
    seen = []

    def spy(run):
        out = run()
        seen.append([o.clone() for o in out])
        return out

    opt.register_orthogonalize_hook(spy)
    opt.step()
    (outs,) = seen
    assert torch.count_nonzero(outs[0]) == 0
    assert all(torch.isfinite(o).all() and o.abs().sum() > 0 for o in outs[1:])


def test_skip_does_not_synchronise(monkeypatch):
    """Nothing on the "skip" path asks the host whether a gradient is finite.

    The one host read a CPU step makes on purpose, NS normalisation checking its norms' range
    (free on a CPU), is switched off as on an accelerator: any other read fails the test.
    """
    ns_module = importlib.import_module("fastmuon.ns.newton_schulz")
    monkeypatch.setattr(ns_module, "_host_check_is_free", lambda X, host_reads: False)
    params = make_params(SHAPES, channels_last={3})
    opt = OPTIMIZERS["musgd"](params, nonfinite="skip")
    for p, g in zip(params, random_grads(params, 4)):
        p.grad = g
    opt.step()  # builds the plan
    params[0].grad[0, 0] = float("nan")

    def sync(*args, **kwargs):
        raise AssertionError("host synchronisation on the skip path")

    for name in ("item", "tolist", "__bool__", "__float__", "__int__", "nonzero"):
        monkeypatch.setattr(torch.Tensor, name, sync)
    before = params[0].detach().clone()
    opt.step()
    monkeypatch.undo()
    assert torch.equal(params[0], before) and not torch.equal(params[1], before)


@pytest.mark.parametrize("kind", OPTIMIZERS)
def test_ignore_lets_nan_through(kind):
    params = make_params([(4, 4), (4,)])
    opt = OPTIMIZERS[kind](params, nonfinite="ignore")
    for p, g in zip(params, random_grads(params, 5)):
        p.grad = g
    params[0].grad[0, 0] = float("nan")
    opt.step()
    assert torch.isnan(params[0]).any() and torch.isfinite(params[1]).all()


@pytest.mark.parametrize("kind", OPTIMIZERS)
def test_grad_scaler_skips_overflowing_steps_then_matches_unscaled_training(kind):
    """An overflowing loss scale: the scaler skips the step itself (our default "raise" never
    fires), halves the scale, and the steps it does take equal training without a scaler."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    plain = copy.deepcopy(model)
    opt = OPTIMIZERS[kind](fastmuon.param_groups(model))
    opt_plain = OPTIMIZERS[kind](fastmuon.param_groups(plain))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**127, growth_interval=1000)
    x, y = torch.randn(16, 6), 100 * torch.randn(16, 3)  # gradients ~10: 10 * 2**127 overflows
    taken = skipped = 0
    for _ in range(12):
        before, states = _snapshot(opt, list(model.parameters()))
        opt.zero_grad(set_to_none=True)
        scale = scaler.get_scale()
        scaler.scale(nn.functional.mse_loss(model(x), y)).backward()
        overflow = any(not torch.isfinite(p.grad).all() for p in model.parameters())
        scaler.step(opt)
        scaler.update()
        if overflow:  # nothing was written, the scale backed off
            skipped += 1
            assert scaler.get_scale() == scale / 2
            for p, b, st in zip(model.parameters(), before, states):
                assert torch.equal(p, b)
                _assert_same_state(opt.state[p], st)
            continue
        taken += 1
        opt_plain.zero_grad(set_to_none=True)
        nn.functional.mse_loss(plain(x), y).backward()
        opt_plain.step()
        for p, q in zip(model.parameters(), plain.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    assert taken > 0 and skipped > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", OPTIMIZERS)
def test_skip_on_cuda_never_synchronises(kind):
    params = [nn.Parameter(p.detach().cuda()) for p in make_params(SHAPES[:5])]  # matrices only
    opt = OPTIMIZERS[kind](params, nonfinite="skip")
    for p, g in zip(params, random_grads(params, 6)):
        p.grad = g.cuda()
    opt.step()
    params[1].grad[0, 0] = float("nan")
    before = params[1].detach().clone()
    with cuda_syncs_raise():
        opt.step()
    assert torch.equal(params[1], before)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", OPTIMIZERS)
def test_raise_on_cuda_never_synchronises_and_raises_at_the_next_step(kind):
    """The default "raise" on CUDA: the bad step runs masked without a host sync (AdamW's step
    counts, on the CPU, included), and the next step raises naming the parameter."""
    params = [nn.Parameter(p.detach().cuda()) for p in make_params(SHAPES)]
    opt = OPTIMIZERS[kind](params)
    for p, g in zip(params, random_grads(params, 6)):
        p.grad = g.cuda()
    opt.step()
    params[1].grad[0, 0] = float("nan")
    params[5].grad[0] = float("inf")
    before, states = _snapshot(opt, params)
    with cuda_syncs_raise():
        opt.step()
    with pytest.raises(FloatingPointError, match=r"\(and 1 more\) had a non-finite gradient .* in step 2"):
        opt.step()
    for i in (1, 5):
        assert torch.equal(params[i], before[i])
        _assert_same_state(opt.state[params[i]], states[i])


# ----- changing parameter sets -------------------------------------------------------------------
@pytest.mark.parametrize("kind", OPTIMIZERS)
def test_changing_parameter_sets_match_the_reference(kind):
    """grad None on some steps, a group added mid-run, a parameter frozen and unfrozen, and
    zero-size parameters: the plan follows, and every step equals the per-parameter reference."""
    shapes = [(6, 4), (6, 4), (8, 3, 3, 3), (0, 5), (4, 0, 3, 3), (6,)]
    params = make_params(shapes, channels_last={2})
    extra = make_params([(5, 7), (6, 4)], seed=1)
    ref = [p.detach().clone() for p in params + extra]
    opt = OPTIMIZERS[kind](params)
    # the hyperparameters; without use_muon, the reference routes by ndim as by_ndim's groups do
    group = {k: v for k, v in opt.param_groups[0].items() if k != "use_muon"}
    reference = reference_musgd_step if kind == "musgd" else reference_muon_step
    ref_states: dict = {}
    schedule = {  # step -> indices into params + extra without a gradient
        0: {6, 7},
        1: {1, 6, 7},  # grad None
        2: set(),  # the extra group is added
        3: {0},  # frozen
        4: set(),  # unfrozen
    }
    for step, missing in schedule.items():
        if step == 2:
            opt.add_param_group({"params": extra, "lr": group["lr"] / 2, "use_muon": True})
        everything = params + extra
        everything[0].requires_grad_(step != 3)
        grads = random_grads(everything, 20 + step)
        live = []
        for i, (p, g) in enumerate(zip(everything, grads)):
            p.grad = None if i in missing else g
            live.append(p.grad is not None)
        opt.step()
        for lr, lo, hi in [(group["lr"], 0, len(params)), (group["lr"] / 2, len(params), len(everything))]:
            reference(
                ref[lo:hi],
                [g if ok else None for g, ok in zip(grads[lo:hi], live[lo:hi])],
                ref_states,
                {**group, "lr": lr},
            )
        for i, (p, r) in enumerate(zip(everything, ref)):
            torch.testing.assert_close(p.detach(), r, rtol=1e-5, atol=1e-6, msg=f"step {step} param {i}")
        matrices = sum(1 for p, ok in zip(everything, live) if ok and p.ndim >= 2 and p.numel() > 0)
        assert opt.plan().num_matrices == matrices
    assert sum(len(b.members) for b in opt.plan().buckets) == 5


# ----- extreme values ----------------------------------------------------------------------------
EXTREME_SHAPES = [(7, 12), (12, 5), (1, 9), (9, 1), (3, 3, 3, 3)]


@pytest.mark.parametrize("accelerator", [False, True], ids=["host", "accelerator"])
@pytest.mark.parametrize("ns_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_huge_tiny_zero_and_rank_one_matrices(ns_dtype, dtype, accelerator, monkeypatch):
    """1e30 orthogonalises like its unit-scale twin (the norm does not overflow); with eps=0, so
    does 1e-30 (the norm does not underflow); zeros give exactly zero, rank-1 and 1×n / n×1
    matrices give the reference. On the accelerators' paths too (the fp64 normalisation, the
    shared packing of gather buckets)."""
    if accelerator:
        monkeypatch.setattr(ns_device, "is_host", lambda device: False)
    gen = torch.Generator().manual_seed(7)
    base = [torch.randn(s, generator=gen) for s in EXTREME_SHAPES]
    base.append(torch.outer(torch.randn(6, generator=gen), torch.randn(10, generator=gen)))  # rank 1
    tol = dict(rtol=1e-4, atol=1e-5) if ns_dtype == torch.float32 and dtype == torch.float32 else None
    for eps, scales in [(1e-7, (1e30, 1.0)), (0.0, (1e30, 1e-30, 1.0))]:
        tensors = [(b * scale).to(dtype) for scale in scales for b in base]
        tensors.append(torch.zeros(6, 8, dtype=dtype))
        outs = fastmuon.orthogonalize(tensors, eps=eps, dtype=ns_dtype, policy="min_launches")
        assert all(torch.isfinite(o).all() for o in outs)
        assert torch.count_nonzero(outs[-1]) == 0
        for k, o in enumerate(outs[:-1]):
            b = base[k % len(base)]
            if k % len(base) == len(base) - 1 and not tol:
                continue  # bf16 noise makes a rank-1 matrix full rank, and NS lifts that noise
            expected = ns_reference(b.to(dtype).float().reshape(b.shape[0], -1)).reshape(b.shape)
            if tol:
                torch.testing.assert_close(o.float(), expected, **tol)
            else:  # bf16 rounding: compare as a whole
                err = torch.linalg.vector_norm(o.float() - expected) / torch.linalg.vector_norm(expected)
                assert err < 0.05, (k, err)


def test_tiny_matrices_are_damped_by_eps_as_the_formula_says():
    """X / (‖X‖ + eps) with ‖X‖ ≪ eps is ~X / eps: finite and tiny (pass eps=0 to avoid it)."""
    X = torch.randn(5, 8) * 1e-30
    out = fastmuon.newton_schulz(X, dtype=torch.float32)
    assert torch.isfinite(out).all() and out.abs().max() < 1e-18
    exact = ns_reference(X * 2.0**100, eps=1e-7 * 2.0**100)  # the same problem, scaled exactly
    torch.testing.assert_close(out, exact, rtol=1e-4, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_safe_normalisation_is_bitwise_the_plain_formula(dtype):
    """The overflow-safe prescale is an exact power of two: wherever the plain computation does
    not overflow or underflow, the result is bit for bit ``X / (‖X‖ + eps)``."""
    scales = torch.tensor([1e-3, 0.02, 1.5, 3.0, 100.0]).view(-1, 1, 1)
    X = (torch.randn(5, 6, 9) * scales).to(dtype)
    plain = X / (torch.linalg.vector_norm(X, dim=(-2, -1), keepdim=True) + 1e-7)
    assert torch.equal(_normalize_safe(X, 1e-7, host=True), plain)
    # off the host: the exact quotient, in fp64, rounded once (within an ulp of the plain formula)
    wide = X.double() / (torch.linalg.vector_norm(X.double(), dim=(-2, -1), keepdim=True) + 1e-7)
    assert torch.equal(_normalize_safe(X, 1e-7, host=False), wide.to(dtype))
    torch.testing.assert_close(_normalize_safe(X, 1e-7, host=False), plain)
    # the fast path where it applies, bit for bit
    assert torch.equal(_normalize(X, 1e-7, host=True, host_reads=True), plain)
    # Where the plain norm overflows (fp16 squares past 65504), the plain formula gives zeros.
    big = (torch.randn(1, 6, 9).clamp(-4, 4) * 1e4).to(torch.float16)  # finite, norm is not
    assert torch.linalg.vector_norm(big).isinf()
    safe = _normalize(big, 1e-7, host=True, host_reads=True).float()  # falls back to the safe path
    torch.testing.assert_close(torch.linalg.vector_norm(safe), torch.tensor(1.0), rtol=2e-3, atol=0)


def test_ns_zero_matrix_gives_zero_not_nan():
    for eps in (1e-7, 0.0):
        for shape in [(4, 6), (3, 4, 6)]:
            out = fastmuon.newton_schulz(torch.zeros(shape), eps=eps, dtype=torch.float32)
            assert torch.equal(out, torch.zeros(shape))


EXTREME_OPTIMIZERS = {  # Muon alone (sgd=0) so the orthogonalised part is what is checked
    "musgd": lambda params, eps: fastmuon.MuSGD(
        by_ndim(params), lr=0.05, momentum=0.9, nesterov=True, muon=1.0, sgd=0.0, eps=eps, **F32
    ),
    "muon": lambda params, eps: fastmuon.Muon(params, lr=0.02, weight_decay=0.1, eps=eps, **F32),
}


@pytest.mark.parametrize("kind", EXTREME_OPTIMIZERS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_optimizer_steps_stay_finite_and_correct_at_extreme_scales(kind, dtype):
    """From zero weights, a step moves each matrix by -lr·s·NS(g) — for g of 1e30 as for unit g,
    for 1e-30 too when eps=0 — and by exactly nothing for a zero gradient."""
    shapes = [(6, 4), (6, 4), (8, 3, 3, 3), (1, 7), (7, 1)]
    reference = reference_musgd_step if kind == "musgd" else reference_muon_step
    for scale, eps in [(1e30, 1e-7), (1e-30, 0.0), (0.0, 1e-7), (0.0, 0.0)]:
        params = [nn.Parameter(torch.zeros(s, dtype=dtype)) for s in shapes]
        opt = EXTREME_OPTIMIZERS[kind](params, eps)
        grads = random_grads(params, 8)
        for p, g in zip(params, grads):
            p.grad = (g.float() * scale).to(dtype)
        opt.step()
        assert all(torch.isfinite(p).all() for p in params)
        if scale == 0:
            assert all(torch.count_nonzero(p) == 0 for p in params)  # no 0/0 anywhere
            continue
        expected = [torch.zeros(s) for s in shapes]
        reference(expected, [g.float() for g in grads], {}, {**opt.param_groups[0], "eps": 1e-7})
        for p, e in zip(params, expected):
            if dtype == torch.float32:
                torch.testing.assert_close(p, e, rtol=1e-4, atol=1e-6)
            else:
                assert torch.linalg.vector_norm(p.float() - e) <= 0.03 * torch.linalg.vector_norm(e)


# ----- memory ------------------------------------------------------------------------------------
MEMORY_SHAPES = [(32, 16, 3, 3)] * 6 + [(64, 32)] * 4 + [(48, 48)] * 3 + [(16, 8, 1, 1)] * 5 + [(64,)] * 4


def _memory_setup(cap):
    params = make_params(MEMORY_SHAPES, channels_last={0, 1})
    opt = fastmuon.MuSGD(
        by_ndim(params), lr=0.01, momentum=0.9, nesterov=True, weight_decay=1e-4, max_bucket_bytes=cap, **F32
    )
    for p, g in zip(params, random_grads(params, 9)):
        p.grad = g
    opt.step()  # allocates state and bucket buffers
    return params, opt


@pytest.mark.parametrize("cap", [40_000, 200_000, 2**29])
def test_bucket_buffers_are_what_the_plan_accounts_for(cap):
    params, opt = _memory_setup(cap)
    plan = opt.plan()
    (engine,) = opt.orthogonalizers()
    batches = [rec.shared.batch() for rec in engine.records]
    assert len(batches) == len(plan.buckets)
    for batch, bucket in zip(batches, plan.buckets):
        assert tuple(batch.shape) == bucket.shape and batch.dtype == bucket.dtype
        assert batch.nbytes == bucket.nbytes()
        assert bucket.nbytes() <= cap or len(bucket.members) == 1
    if cap == 40_000:
        assert len(plan.buckets) > 4  # the cap really split buckets


def _step_peak(params, opt) -> int:
    for p, g in zip(params, random_grads(params, 10)):
        p.grad = g
    with AllocationTracker() as tracker:
        opt.step()
    return tracker.peak_bytes


@pytest.mark.parametrize("cap", [40_000, 200_000])
def test_memory_is_bounded_by_bucket_cap_and_state(cap):
    """On a CPU the NS works in one workspace kept between steps and shared by the buckets in
    turn: the largest bucket's input, the kernel's temporaries and outputs (fp32 standard NS:
    the normalised copy and two Gram-sized ones), within 4 largest buckets.
    What a warm step allocates afresh is the elementwise temporaries, within 2× the state
    (MuSGD's two momenta: Nesterov sources, SGD temporaries)."""
    params, opt = _memory_setup(cap)
    peak = _step_peak(params, opt)
    (engine,) = opt.orthogonalizers()
    largest = max(b.nbytes() for b in opt.plan().buckets)
    kept = sum(t.nbytes for t in engine.workspaces())
    assert 0 < kept <= 4 * largest, (kept, largest)
    state = sum(v.nbytes for s in opt.state.values() for v in s.values())
    assert 0 < peak <= 2 * state, (peak, state)
    # A smaller cap gives a smaller workspace, never a larger one.
    if cap == 40_000:
        big_params, big_opt = _memory_setup(2**29)
        _step_peak(big_params, big_opt)
        (big_engine,) = big_opt.orthogonalizers()
        assert kept < sum(t.nbytes for t in big_engine.workspaces())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("cap", [40_000, 200_000])
def test_cuda_peak_memory_is_bounded_by_bucket_cap_and_state(cap):
    params = [nn.Parameter(p.detach().cuda()) for p in make_params(MEMORY_SHAPES, channels_last={0, 1})]
    opt = fastmuon.MuSGD(
        by_ndim(params), lr=0.01, momentum=0.9, nesterov=True, weight_decay=1e-4, max_bucket_bytes=cap, **F32
    )
    for p, g in zip(params, random_grads(params, 9)):
        p.grad = g.cuda()
    opt.step()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    opt.step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    largest_bucket = max(b.nbytes() for b in opt.plan().buckets)
    state = sum(v.nbytes for s in opt.state.values() for v in s.values())
    assert peak <= 6 * largest_bucket + 2 * state + 2**20, (peak, largest_bucket, state)


# ----- torch.compile -----------------------------------------------------------------------------
SLOW = os.environ.get("FASTMUON_SLOW_TESTS") == "1"


@pytest.mark.parametrize(
    "backend",
    [
        "aot_eager",  # Dynamo + AOTAutograd tracing of our step: ~15 s on 2 CPU cores
        pytest.param(
            "inductor",  # code generation: ~35 s cold on 2 idle CPU cores, minutes on busy ones
            marks=pytest.mark.skipif(not SLOW, reason="set FASTMUON_SLOW_TESTS=1 (inductor compiles slowly)"),
        ),
    ],
)
# Dynamo, resuming after the step's graph break, reads the returned loss's .grad: torch's
# warning, raised inside its tracer, where an error would abort the trace
@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf Tensor:UserWarning")
def test_compiled_training_step_matches_eager(backend):
    """Smoke test on the tiniest model: the compiled step runs (with graph breaks where the
    step must talk to the host, e.g. the default nonfinite="raise" check) and matches eager.
    Dynamo starts afresh: what an earlier compile learnt of fastmuon's frames (shapes it made
    dynamic) would otherwise shape this trace."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    eager = nn.Linear(4, 3)
    compiled = copy.deepcopy(eager)
    x, y = torch.randn(5, 4), torch.randn(5, 3)

    def make_step(model):
        opt = fastmuon.MuSGD(by_ndim(model.parameters()), lr=0.05, momentum=0.9, nesterov=True, **F32)

        def step():
            opt.zero_grad(set_to_none=True)
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            return loss

        return step

    eager_step, compiled_step = make_step(eager), torch.compile(make_step(compiled), backend=backend)
    for _ in range(2):
        torch.testing.assert_close(compiled_step(), eager_step(), rtol=1e-5, atol=1e-6)
    for p, q in zip(eager.parameters(), compiled.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.skipif(not torch.distributed.is_gloo_available(), reason="needs torch.distributed with gloo")
@pytest.mark.parametrize("mode", ["skip", "raise"])
def test_ranks_agree_on_a_nan_only_one_of_them_sees(mode, tmp_path):
    """Rank 1 alone has a NaN: both ranks skip that parameter (and step the rest alike), or
    both raise — none is left waiting in a collective."""
    from reliability_support import nonfinite_worker

    torch.multiprocessing.spawn(
        nonfinite_worker, args=(2, str(tmp_path / "init"), mode, str(tmp_path)), nprocs=2, join=True
    )
    results = [torch.load(tmp_path / f"{r}.pt", weights_only=True) for r in range(2)]
    if mode == "raise":
        assert [r["outcome"] for r in results] == ["raised", "raised"]
        return
    assert [r["outcome"] for r in results] == ["stepped", "stepped"]
    for r in results:
        assert torch.equal(r["after"][0], r["before"][0])  # skipped on both ranks
        assert not torch.equal(r["after"][1], r["before"][1])
    for a, b in zip(results[0]["after"], results[1]["after"]):
        assert torch.equal(a, b)


@pytest.mark.slow
@pytest.mark.skipif(not torch.distributed.is_gloo_available(), reason="needs torch.distributed with gloo")
def test_ranks_that_return_right_after_a_step_exit_cleanly(tmp_path):
    """A 2-rank world whose ranks return straight after ``opt.step()``: no rank may abort at
    interpreter exit (a collective's tensor freed by a process-group thread during shutdown
    ends in ``terminate called without an active exception``)."""
    from reliability_support import exit_worker

    torch.multiprocessing.spawn(exit_worker, args=(2, str(tmp_path)), nprocs=2, join=True)
