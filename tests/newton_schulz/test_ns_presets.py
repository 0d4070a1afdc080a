"""AOL-preconditioned NS and the named coefficient sets, against plain per-matrix float64 code.

The references below are written from the published rules (one matrix at a time, no batching,
no padding, no scaling tricks), not from the batched kernels.
"""

import math

import pytest
import torch
from helpers import by_ndim
from hypothesis import given, settings
from hypothesis import strategies as st

import fastmuon
from fastmuon import PRESETS, newton_schulz, orthogonalize
from fastmuon.ns.device import cpu_low_precision
from fastmuon.ns.engine import NSConfig, TensorLayout, spec_of
from fastmuon.ns.newton_schulz import (
    DEFAULT_NS_STEPS,
    PRESET_STEPS,
    _aol_rescaled,
    _fresh,
    default_steps,
    resolve_coefficients,
)
from fastmuon.ns.planner import AOL_FLOPS_PER_R2, MatrixSpec, ns_flops, plan_buckets

NEW = ("aol", "cans", "deepseekv4", "polar_express_paper")
LENGTH = {"aol": 4, "cans": 5, "deepseekv4": 10, "polar_express_paper": 8}


def aol_reference(G: torch.Tensor, schedule, eps: float = 1e-7) -> torch.Tensor:
    """Turbo-Muon's rule on one matrix, float64: on the wide side, A = X·Xᵀ, each row of X divided
    by the square root of its absolute row sum of A (clamped below at eps), the first
    iteration reusing the rescaled A, then plain quintic NS steps."""
    X = G.double()
    tall = X.shape[0] > X.shape[1]
    if tall:
        X = X.T
    A = X @ X.T
    s = 1.0 / torch.sqrt(torch.clamp(A.abs().sum(dim=1), min=eps))
    X = s[:, None] * X
    A = s[:, None] * A * s[None, :]
    for k, (a, b, c) in enumerate(schedule):
        if k:
            A = X @ X.T
        X = a * X + (b * A + c * (A @ A)) @ X
    return X.T if tall else X


def frobenius_reference(G: torch.Tensor, schedule, eps: float = 1e-7) -> torch.Tensor:
    """Quintic NS on one matrix, float64, after Frobenius normalisation."""
    X = G.double()
    tall = X.shape[0] > X.shape[1]
    if tall:
        X = X.T
    X = X / (torch.linalg.matrix_norm(X) + eps)
    for a, b, c in schedule:
        A = X @ X.T
        X = a * X + (b * A + c * (A @ A)) @ X
    return X.T if tall else X


def reference(G, name, steps):
    schedule = resolve_coefficients(name, steps)
    return (aol_reference if name == "aol" else frobenius_reference)(G, schedule)


def rel_err(out, ref):
    return ((out.double() - ref).abs().max() / ref.abs().max()).item()


def inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(48, 160, generator=g),
        torch.randn(160, 48, generator=g),
        torch.randn(64, 64, generator=g),
    ]


# ---------------------------------------------------------------------------------------------
# the batched kernels against the plain float64 iteration, per matrix


@pytest.mark.parametrize("name", NEW)
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 3e-5), (torch.bfloat16, 0.15)])
def test_batched_kernel_matches_float64_per_matrix(name, dtype, tol):
    steps = LENGTH[name]
    for G in inputs():
        batch = torch.stack([G, 3 * G, torch.flip(G, (0,))])
        with cpu_low_precision("native"):  # the dtype itself, not a CPU's fp32 fallback
            out = newton_schulz(batch, steps, name, dtype=dtype)
        assert out.dtype == dtype
        for i in range(len(batch)):
            assert rel_err(out[i], reference(batch[i], name, steps)) <= tol


@pytest.mark.parametrize("name", NEW)
def test_public_calls_and_the_planner_agree_with_float64(name):
    steps = LENGTH[name]
    Gs = inputs(1)
    outs = orthogonalize(Gs, steps=steps, coefficients=name, dtype=torch.float32, policy="min_launches")
    for G, out in zip(Gs, outs):
        assert out.shape == G.shape
        assert rel_err(out, reference(G, name, steps)) <= 3e-5


def test_aol_reference_matches_an_fp32_transcription_of_the_rule():
    """The float64 reference is the rule itself: the same lines in fp32 agree with it."""
    G = inputs(2)[0]
    schedule = resolve_coefficients("aol", 4)
    X = G.float()
    A = X @ X.T
    s = torch.rsqrt(torch.clamp_min(A.abs().sum(-1), 1e-7))
    X, A = X * s[:, None], A * s[:, None] * s[None, :]
    for k, (a, b, c) in enumerate(schedule):
        if k:
            A = X @ X.T
        X = a * X + (b * A + c * A @ A) @ X
    assert rel_err(X, aol_reference(G, schedule)) <= 1e-5
    assert rel_err(newton_schulz(G, 4, "aol", dtype=torch.float32), X.double()) <= 1e-5


# ---------------------------------------------------------------------------------------------
# the scalar maps: each schedule's composed polynomial on the singular values


def composed(name, steps, low, high=1.0, n=20001):
    x = torch.logspace(math.log10(low), math.log10(high), n, dtype=torch.float64)
    for a, b, c in resolve_coefficients(name, steps):
        x = a * x + b * x**3 + c * x**5
    return x.min().item(), x.max().item()


@pytest.mark.parametrize(
    "name, steps, band_in, band_out",
    [
        ("jordan", 5, (1e-2, 1.0), (0.68, 1.14)),  # what the others are compared with
        ("aol", 4, (1e-2, 1.0), (0.94, 1.051)),  # from AOL's start: one step fewer, tighter
        ("cans", 5, (1e-3, 1.0), (0.88, 1.12)),
        ("deepseekv4", 10, (1e-3, 1.0), (1 - 1e-9, 1.0006)),
        ("polar_express", 8, (1e-3, 1.0), (1 - 1e-9, 1 + 1e-9)),
        ("polar_express_paper", 8, (1e-3, 1.01), (1 - 1e-9, 1 + 1e-9)),
    ],
)
def test_schedule_maps_the_input_band_into_its_output_band(name, steps, band_in, band_out):
    lo, hi = composed(name, steps, *band_in)
    assert band_out[0] <= lo and hi <= band_out[1]


def test_polar_express_presets_against_the_paper():
    """Amsel et al. 2025, Implementation 1: the optimal degree-5 polynomials, all but the last
    divided by the 1.01 safety factor (x/1.01 in each), and the input divided by 1.01·‖X‖."""
    paper = [
        (8.28721201814563, -23.595886519098837, 17.300387312530933),
        (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
        (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
        (3.3184196573706015, -2.488488024314874, 0.51004894012372),
        (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
        (1.891301407787398, -1.2679958271945868, 0.37680408948524835),
        (1.8750014808534479, -1.2500016453999487, 0.3750001645474248),
        (1.875, -1.25, 0.375),
    ]
    safe = [(a / 1.01, b / 1.01**3, c / 1.01**5) for a, b, c in paper[:-1]] + [paper[-1]]
    assert [pytest.approx(t, rel=1e-15) for t in PRESETS["polar_express"]] == safe
    # emerging-optimizers prints the same safety-scaled numbers to four decimals
    assert PRESETS["polar_express"][0] == pytest.approx((8.2051, -22.9019, 16.4607), abs=1e-4)
    # the paper variant: the first polynomial of x/1.01, i.e. the input divided by 1.01·‖X‖
    x = torch.linspace(0, 1.01, 1001, dtype=torch.float64)
    (a, b, c), (a1, b1, c1) = PRESETS["polar_express_paper"][0], safe[0]
    y = x / 1.01
    assert torch.allclose(a * x + b * x**3 + c * x**5, a1 * y + b1 * y**3 + c1 * y**5, rtol=1e-13, atol=1e-13)
    assert PRESETS["polar_express_paper"][1:] == PRESETS["polar_express"][1:]
    G = inputs(3)[0].double()
    X = G / (1.01 * torch.linalg.matrix_norm(G) + 1e-7)  # the paper's code, in float64
    for a, b, c in safe:
        A = X @ X.T
        X = a * X + (b * A + c * A @ A) @ X
    assert rel_err(newton_schulz(G.float(), 8, "polar_express_paper", dtype=torch.float32), X) <= 3e-5


def test_deepseekv4_and_cans_are_the_published_numbers():
    assert PRESETS["deepseekv4"] == ((3.4445, -4.7750, 2.0315),) * 8 + ((2.0, -1.5, 0.5),) * 2
    a, b, c = PRESETS["deepseekv4"][-1]
    assert a + b + c == 1.0 and a + 3 * b + 5 * c == 0.0  # fixed point at 1 with zero slope
    assert len(PRESETS["cans"]) == 5 and PRESETS["cans"][0] == (8.4703, -25.1081, 18.6293)


# ---------------------------------------------------------------------------------------------
# AOL's rescaling: padding, zeros, scale, the spectral bound


def test_aol_padding_stays_zero_and_changes_nothing():
    g = torch.Generator().manual_seed(4)
    small = torch.randn(20, 70, generator=g)
    padded = torch.zeros(2, 32, 96)
    padded[0, :20, :70] = small
    padded[1] = torch.randn(32, 96, generator=g)
    out = newton_schulz(padded, 4, "aol", dtype=torch.float32)
    assert torch.isfinite(out).all()
    assert (out[0, 20:] == 0).all() and (out[0, :, 70:] == 0).all()
    alone = newton_schulz(small, 4, "aol", dtype=torch.float32)
    assert rel_err(out[0, :20, :70], alone.double()) <= 1e-5  # fp32 sums in another order
    assert rel_err(out[0, :20, :70], aol_reference(small, resolve_coefficients("aol", 4))) <= 3e-5


@pytest.mark.parametrize("eps", [1e-7, 0.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_aol_zero_matrix_and_zero_rows_never_nan(eps, dtype):
    X = torch.zeros(3, 8, 24)
    X[1, :3] = torch.randn(3, 24)  # zero rows below
    out = newton_schulz(X, 4, "aol", eps=eps, dtype=dtype)
    assert torch.isfinite(out).all()
    assert (out[0] == 0).all() and (out[2] == 0).all() and (out[1, 3:] == 0).all()


def test_aol_is_exact_under_power_of_two_scaling_and_never_overflows():
    G = inputs(5)[0]
    base = newton_schulz(G, 4, "aol", dtype=torch.float32)
    for k in (-8, 20, 60):  # 2**60 entries square past fp32's range in X·Xᵀ
        assert torch.equal(newton_schulz(G * 2.0**k, 4, "aol", dtype=torch.float32), base)
    # without the clamp (eps=0) tiny matrices too; with it they are damped (next test)
    base = newton_schulz(G, 4, "aol", eps=0.0, dtype=torch.float32)
    for k in (-60, -20, 20, 60):
        assert torch.equal(newton_schulz(G * 2.0**k, 4, "aol", eps=0.0, dtype=torch.float32), base)


def test_aol_damps_a_matrix_far_below_eps_as_the_clamp_says():
    G = inputs(6)[0] * 1e-8
    out = newton_schulz(G, 4, "aol", eps=1e-7, dtype=torch.float32)
    ref = aol_reference(G, resolve_coefficients("aol", 4), eps=1e-7)
    assert torch.isfinite(out).all()
    assert (out.double() - ref).abs().max() <= 1e-5 * max(ref.abs().max().item(), 1e-6)


@settings(max_examples=25, deadline=None)
@given(
    rows=st.integers(1, 12),
    cols=st.integers(1, 20),
    pad_rows=st.integers(0, 4),
    pad_cols=st.integers(0, 4),
    seed=st.integers(0, 2**16),
    log_scale=st.floats(-20, 20),
)
def test_aol_rescaling_bounds_the_spectral_norm_by_one(rows, cols, pad_rows, pad_cols, seed, log_scale):
    """Prach & Lampert's bound, per slot of a padded batch: ‖D·X‖₂ <= 1, padding untouched."""
    r, c = min(rows, cols), max(rows, cols)
    g = torch.Generator().manual_seed(seed)
    X = torch.zeros(2, r + pad_rows, c + pad_cols, dtype=torch.float64)
    X[0, :r, :c] = torch.randn(r, c, generator=g, dtype=torch.float64) * 10.0**log_scale
    X[1] = torch.randn(X.shape[1:], generator=g, dtype=torch.float64)
    X0, A0 = _aol_rescaled(X, 1e-7, _fresh, True)
    assert torch.isfinite(X0).all() and torch.isfinite(A0).all()
    assert torch.linalg.matrix_norm(X0, ord=2).max() <= 1 + 1e-12
    assert (X0[0, r:] == 0).all() and (X0[0, :, c:] == 0).all()
    assert torch.allclose(A0, X0 @ X0.mT, rtol=1e-12, atol=1e-14)


# ---------------------------------------------------------------------------------------------
# how it is selected: NSConfig, methods, the planner, the optimizers


def test_the_aol_preset_selects_aol_preconditioning_and_others_do_not():
    assert NSConfig.make(4, "aol", 1e-7, torch.bfloat16).preconditioning == "aol"
    assert NSConfig.make(5, "jordan", 1e-7, torch.bfloat16).preconditioning == "frobenius"
    assert NSConfig.make(5, "cans", 1e-7, torch.bfloat16).preconditioning == "frobenius"
    # AOL with other coefficients, and the aol numbers after Frobenius normalisation
    custom = NSConfig.make(5, "jordan", 1e-7, torch.float32, preconditioning="aol")
    assert custom.preconditioning == "aol"
    G = inputs(7)[0]
    out = newton_schulz(G, 5, "jordan", dtype=torch.float32, preconditioning="aol")
    assert rel_err(out, aol_reference(G, resolve_coefficients("jordan", 5))) <= 3e-5
    plain = newton_schulz(G, 4, "aol", dtype=torch.float32, preconditioning="frobenius")
    assert rel_err(plain, frobenius_reference(G, resolve_coefficients("aol", 4))) <= 3e-5


@pytest.mark.parametrize("method", ["gram", "eigh"])
def test_aol_with_another_method_is_an_error_naming_the_fix(method):
    with pytest.raises(ValueError, match=r"ns_method=.*standard.*auto"):
        NSConfig.make(4, "aol", 1e-7, torch.float32, method)
    with pytest.raises(ValueError, match=r"ns_method=.*standard"):
        newton_schulz(torch.randn(8, 16), 4, "aol", method=method)
    with pytest.raises(ValueError, match=r"ns_method=.*standard"):
        orthogonalize([torch.randn(8, 16)], steps=4, coefficients="aol", method=method)


def test_unknown_preconditioning_is_an_error_naming_the_choices():
    with pytest.raises(ValueError, match=r"ns_preconditioning.*frobenius.*aol"):
        newton_schulz(torch.randn(8, 16), 4, "jordan", preconditioning="spectral")


def test_auto_runs_aol_with_the_standard_method_where_gram_would_win():
    t = torch.randn(64, 1024)  # 16x as wide as tall, fp32: auto picks Gram space for Frobenius
    plain = NSConfig.make(5, "jordan", 1e-7, torch.float32)
    aol = NSConfig.make(4, "aol", 1e-7, torch.float32)
    layout = TensorLayout.of(t)
    (b_plain,) = plan_buckets([spec_of(t, plain, layout)], steps=5).buckets
    (b_aol,) = plan_buckets([spec_of(t, aol, layout)], steps=4).buckets
    assert b_plain.method == "gram"
    assert (b_aol.method, b_aol.preconditioning) == ("standard", "aol")
    assert "standard aol" in plan_buckets([spec_of(t, aol, layout)], steps=4).describe()


def test_flops_count_the_rescaling_and_the_saved_iteration():
    r, c = 96, 384
    standard4 = ns_flops(r, c, 4, "standard")
    aol4 = ns_flops(r, c, 4, "standard", torch.float32, "aol")
    assert aol4 == standard4 + AOL_FLOPS_PER_R2 * r * r
    assert aol4 < ns_flops(r, c, 5, "standard")  # one iteration fewer than Frobenius NS needs
    spec = MatrixSpec(r, c, torch.float32, preconditioning="aol")
    plan = plan_buckets([spec, spec], steps=4)
    assert plan.flops() == 2 * aol4
    with pytest.raises(ValueError, match="ns_method"):
        plan_buckets([MatrixSpec(r, c, method="gram", preconditioning="aol")], steps=4)


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.Linear(40, 16), torch.nn.Linear(16, 3))


def _cosine(a, b):
    return (a * b).sum().item() / (a.norm() * b.norm()).item()


@pytest.mark.parametrize("cls", [fastmuon.Muon, fastmuon.MuSGD])
def test_optimizers_take_aol_by_name_for_every_bucket(cls):
    """Muon's first step of each matrix is a multiple of NS of a multiple of its gradient, and
    AOL's NS is scale invariant: so it is a multiple of the AOL result, per matrix; and the
    batched and per-parameter paths of both optimizers run the same."""
    results = []
    for foreach in (True, False):
        model = _model()
        before = [p.detach().clone() for p in model.parameters()]
        opt = cls(
            model.parameters() if cls is fastmuon.Muon else by_ndim(model.parameters()),
            lr=0.02,
            weight_decay=0.0,
            ns_coefficients="aol",
            ns_steps=4,
            ns_dtype=torch.float32,
            foreach=foreach,
        )
        g = torch.Generator().manual_seed(1)
        grads = [torch.randn(p.shape, generator=g) for p in model.parameters()]
        for p, grad in zip(model.parameters(), grads):
            p.grad = grad.clone()
        opt.step()
        results.append([p.detach().clone() for p in model.parameters()])
        matrices = [(p0, p1, grad) for p0, p1, grad in zip(before, results[-1], grads) if grad.ndim == 2]
        for p0, p1, grad in matrices[:2] if cls is fastmuon.Muon else []:  # MuSGD mixes in SGD
            step = p0 - p1
            aol = newton_schulz(grad, 4, "aol", dtype=torch.float32)
            jordan = newton_schulz(grad, 4, "jordan", dtype=torch.float32)
            assert _cosine(step, aol) > 1 - 1e-6
            assert _cosine(step, jordan) < 1 - 1e-4
    for a, b in zip(*results):  # batched and per-parameter paths agree
        assert torch.isfinite(a).all()
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-7)


# ---------------------------------------------------------------------------------------------
# the number of steps each preset runs when none is given


def test_each_preset_carries_its_published_step_count():
    assert PRESET_STEPS == {
        "jordan": 5,
        "you": 6,
        "aol": 4,
        "cans": 5,
        "deepseekv4": 10,
        "polar_express": 8,
        "polar_express_paper": 8,
    }
    assert set(PRESET_STEPS) == set(PRESETS)
    assert {name: default_steps(name) for name in LENGTH} == LENGTH
    # tuples have no published count; AOL's start saves one iteration of theirs, and the aol
    # polynomials after Frobenius normalisation take the iteration back
    assert default_steps((3.4445, -4.775, 2.0315)) == DEFAULT_NS_STEPS == 5
    assert default_steps("jordan", "aol") == default_steps((3.4445, -4.775, 2.0315), "aol") == 4
    assert default_steps("aol", "frobenius") == 5


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_functions_run_the_published_count_unless_told(name):
    G = inputs()[0]
    steps = PRESET_STEPS[name]
    assert torch.equal(
        newton_schulz(G, coefficients=name, dtype=torch.float32),
        newton_schulz(G, steps, name, dtype=torch.float32),
    )
    got = orthogonalize([G], coefficients=name, dtype=torch.float32, method="standard")[0]
    assert (
        rel_err(
            got,
            reference(G, name, steps)
            if name != "polar_express_paper"
            else newton_schulz(G.double(), steps, name, dtype=torch.float64),
        )
        < 1e-4
    )
    assert NSConfig.make(None, name, 1e-7, torch.float32).steps == steps
    explicit = newton_schulz(G, steps + 1, name, dtype=torch.float32)
    assert not torch.equal(explicit, newton_schulz(G, coefficients=name, dtype=torch.float32))


def test_aol_preconditioning_of_other_coefficients_saves_an_iteration():
    G = inputs()[0]
    got = newton_schulz(G, coefficients="jordan", dtype=torch.float32, preconditioning="aol")
    want = aol_reference(G, resolve_coefficients("jordan", 4))
    assert rel_err(got, want) < 3e-5


@pytest.mark.parametrize("cls", [fastmuon.Muon, fastmuon.MuSGD, fastmuon.NorMuon, fastmuon.AdaMuon])
def test_optimizers_take_the_presets_count_unless_ns_steps_is_set(cls):
    """``ns_coefficients="aol"`` runs 4 steps, one fewer than Jordan's 5; an explicit ``ns_steps``
    wins; a group that names its own coefficients takes their count, or its own ``ns_steps``."""
    p, q, r = (torch.nn.Parameter(torch.randn(8, 6)) for _ in range(3))
    kw = {"use_muon": True} if cls is fastmuon.MuSGD else {}
    assert cls([p], **kw).param_groups[0]["ns_steps"] == 5
    opt = cls([p], ns_coefficients="aol", **kw)
    assert opt.defaults["ns_steps"] == opt.param_groups[0]["ns_steps"] == 4
    assert cls([p], ns_coefficients="aol", ns_steps=5, **kw).param_groups[0]["ns_steps"] == 5
    assert cls([p], ns_coefficients="you", **kw).param_groups[0]["ns_steps"] == 6
    groups = [
        {"params": [p], "ns_coefficients": "aol"},
        {"params": [q], "ns_coefficients": "deepseekv4", "ns_steps": 3},
        {"params": [r]},
    ]
    opt = cls(groups, ns_steps=7, **kw)
    assert [g["ns_steps"] for g in opt.param_groups] == [4, 3, 7]
    for x in (p, q, r):
        x.grad = torch.randn(x.shape)
    opt.step()
    runs = opt.orthogonalizers()[-1].configs.values()
    assert sorted(c.steps for c in runs) == [3, 4, 7]
    assert opt.state_dict()["param_groups"][0]["ns_steps"] == 4  # an int, as torch's Muon saves


def test_muon_with_the_aol_preset_steps_as_four_aol_iterations():
    """One Muon step from zero momentum: ``p ← p − lr·NS(g)`` with the 4-step AOL NS, against
    an fp32 per-matrix transcription of the rule."""
    g = torch.Generator().manual_seed(3)
    p = torch.nn.Parameter(torch.randn(12, 20, generator=g))
    grad = torch.randn(12, 20, generator=g)
    before = p.detach().clone()
    opt = fastmuon.Muon(
        [p], lr=0.1, weight_decay=0.0, nesterov=False, ns_coefficients="aol", ns_dtype=torch.float32
    )
    p.grad = grad.clone()
    opt.step()
    want = before - 0.1 * aol_reference(grad.float(), PRESETS["aol"]).float()
    assert ((p.detach() - want).norm() / want.norm()).item() < 1e-6
