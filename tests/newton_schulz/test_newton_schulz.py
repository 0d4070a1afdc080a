import importlib

import pytest
import torch
from conftest import rel_err
from reference_impl import ns_reference
from torch.utils._python_dispatch import TorchDispatchMode

from fastmuon import PRESETS, newton_schulz, orthogonalize
from fastmuon.ns.newton_schulz import resolve_coefficients
from fastmuon.ns.planner import ns_flops
from fastmuon.tools.accuracy import Variant, make_inputs, measure


@pytest.mark.parametrize("shape", [(32, 64), (64, 32), (40, 40), (1, 17), (17, 1)])
def test_matches_reference_fp32(shape):
    G = torch.randn(shape)
    out = newton_schulz(G, dtype=torch.float32)
    assert out.shape == G.shape and out.dtype == torch.float32
    assert rel_err(out, ns_reference(G)) <= 1e-5


def test_batch_equals_each_matrix():
    G = torch.randn(5, 24, 60)
    out = newton_schulz(G, dtype=torch.float32)
    for i in range(5):
        assert rel_err(out[i], ns_reference(G[i])) <= 1e-5


def test_tall_batch_is_iterated_on_transpose():
    G = torch.randn(3, 50, 10)
    out = newton_schulz(G, dtype=torch.float32)
    assert out.shape == (3, 50, 10)
    assert rel_err(out[1], ns_reference(G[1])) <= 1e-5


def test_output_dtype_and_input_untouched():
    G = torch.randn(8, 16)
    before = G.clone()
    out = newton_schulz(G)
    assert out.dtype == torch.bfloat16
    assert torch.equal(G, before)


def test_orthogonalises():
    """Singular values land in the quintic's band (~0.7..1.2) for a well-conditioned input."""
    G = torch.randn(32, 128)
    s = torch.linalg.svdvals(newton_schulz(G, steps=5, dtype=torch.float32))
    assert s.min() > 0.5 and s.max() < 1.3


def test_zero_matrix_gives_zero():
    out = newton_schulz(torch.zeros(4, 6), dtype=torch.float32)
    assert torch.equal(out, torch.zeros(4, 6))


def test_coefficient_forms():
    G = torch.randn(12, 20)
    by_name = newton_schulz(G, coefficients="jordan", dtype=torch.float32)
    by_tuple = newton_schulz(G, coefficients=PRESETS["jordan"][0], dtype=torch.float32)
    assert torch.equal(by_name, by_tuple)
    sched = [(3.0, -3.2, 1.2), (2.0, -1.5, 0.5)]
    out = newton_schulz(G, steps=4, coefficients=sched, dtype=torch.float32)
    ref = ns_reference(G, steps=4, coefficients=sched)
    assert rel_err(out, ref) <= 1e-5


def test_schedule_repeats_last_and_truncates():
    sched = [(1.0, 2.0, 3.0), (4.0, 5.0, 6.0)]
    assert resolve_coefficients(sched, 4) == [sched[0], sched[1], sched[1], sched[1]]
    assert resolve_coefficients(sched, 1) == [sched[0]]


@pytest.mark.parametrize(
    "bad,match",
    [("nope", "unknown Newton-Schulz coefficient preset 'nope'.*jordan"), ((1.0, 2.0), "preset name")],
)
def test_bad_coefficients(bad, match):
    with pytest.raises(ValueError, match=match):
        newton_schulz(torch.randn(3, 4), coefficients=bad)


@pytest.mark.parametrize("steps", [0, -1, 1.5])
def test_bad_steps(steps):
    with pytest.raises(ValueError, match="ns_steps must be an integer >= 1"):
        newton_schulz(torch.randn(3, 4), steps=steps)


def test_bad_rank():
    with pytest.raises(ValueError, match="matrix"):
        newton_schulz(torch.randn(3))


@pytest.mark.parametrize("method", ["standard", "gram", "eigh"])
@pytest.mark.parametrize("shape", [(0, 5), (5, 0), (3, 0, 4), (3, 4, 0), (0, 3, 4), (0, 0)])
def test_empty_matrices_give_empty_results(shape, method):
    out = newton_schulz(torch.empty(shape), dtype=torch.float32, method=method)
    assert out.shape == shape and out.dtype == torch.float32
    (res,) = orthogonalize([torch.empty(shape)], dtype=torch.float32, method=method)
    assert res.shape == shape and res.dtype == torch.float32


def test_complex_input_is_refused_not_truncated():
    X = torch.randn(4, 6, dtype=torch.complex64)
    with pytest.raises(ValueError, match=r"complex tensor \(torch.complex64\); only real matrices"):
        newton_schulz(X)
    with pytest.raises(ValueError, match="tensor 1 is complex; only real tensors"):
        orthogonalize([torch.randn(4, 6), X])


@pytest.mark.parametrize("shape", [(16, 144), (3, 40, 100), (100, 40), (1, 30)])
def test_gram_space_matches_reference(shape):
    G = torch.randn(shape)
    out = newton_schulz(G, dtype=torch.float32, method="gram")
    ref = torch.stack([ns_reference(g) for g in G]) if G.ndim == 3 else ns_reference(G)
    assert rel_err(out, ref) <= 1e-5


def test_gram_space_on_low_rank_input_stays_in_band():
    """Low-rank inputs are Gram space's hard case: measured error ~1e-4, far below bf16's ~1e-2."""
    G = torch.randn(64, 4) @ torch.randn(4, 576) + 1e-4 * torch.randn(64, 576)
    ref = ns_reference(G.double()).float()
    out = newton_schulz(G, dtype=torch.float32, method="gram")
    assert rel_err(out, ref) <= 1e-3
    s_out, s_ref = torch.linalg.svdvals(out), torch.linalg.svdvals(ref)
    assert torch.allclose(s_out[:4], s_ref[:4], rtol=1e-3)


@pytest.mark.parametrize("preset,steps", [("polar_express", 5), ("polar_express", 8), ("you", 6)])
def test_per_step_presets(preset, steps):
    G = torch.randn(32, 96)
    out = newton_schulz(G, steps=steps, coefficients=preset, dtype=torch.float32, method="standard")
    assert rel_err(out, ns_reference(G, steps=steps, coefficients=PRESETS[preset])) <= 1e-5
    s = torch.linalg.svdvals(out)
    assert s.min() > 0.8 and s.max() < 1.15  # both converge tighter than "jordan" on random inputs


def test_unknown_method():
    with pytest.raises(ValueError, match="unknown Newton-Schulz method 'svd'"):
        newton_schulz(torch.randn(3, 4), method="svd")


@pytest.mark.parametrize("method", ["standard", "gram", "eigh"])
@pytest.mark.parametrize("eps", [1e-7, 0.0])
def test_every_scale_matches_the_reference_on_either_normalisation_path(method, eps):
    """On a CPU the normalisation takes a plain two-pass (or, in Gram space, trace-based) path
    when every norm is in its exact range and falls back to the power-of-two rescaling
    otherwise; a batch mixing both, and a zero matrix, must give the reference's answer.

    The reference runs on the same problem scaled by an exact power of two into a safe range
    (eps scaled alike), which has the same exact answer."""
    torch.manual_seed(0)
    base = torch.randn(5, 12, 40)
    exponents = [-110, -30, 0, 20, 110]  # 2**±110: squares leave the fp32 range
    scales = torch.tensor([2.0**e for e in exponents]).view(-1, 1, 1)
    batch = torch.cat([base * scales, torch.zeros(1, 12, 40)])
    for members in (batch, batch[2:4], batch[2:3], batch[4:]):
        out = newton_schulz(members, eps=eps, dtype=torch.float32, method=method)
        for k, matrix in enumerate(members):
            expected = _reference_at_scale(matrix, eps)
            assert rel_err(out[k], expected) <= 1e-5 or expected.abs().max() == 0, (method, eps, k)
            assert torch.isfinite(out[k]).all()


def _reference_at_scale(matrix: torch.Tensor, eps: float) -> torch.Tensor:
    peak = matrix.abs().max()
    if peak == 0:
        return torch.zeros_like(matrix)
    shift = 2.0 ** torch.floor(torch.log2(peak)).item()
    return ns_reference(matrix / shift, eps=eps / shift)


def test_low_precision_gram_space_restarts_and_stays_in_standard_bf16_band(monkeypatch):
    """In bf16 the rounding of A₀ = X·Xᵀ leaves tiny negative eigenvalues that Gram-space NS
    grows ~12× per step; restarting from X_k = Q_k·X₀ keeps it in standard bf16 NS's band.
    Without the restart the same inputs blow up, which is what makes this test able to fail."""
    gram, standard = Variant("g", method="gram", dtype=torch.bfloat16), Variant("s", dtype=torch.bfloat16)
    for kind, G in make_inputs().items():
        ours, base = measure(gram, G), measure(standard, G)
        assert ours["sv_min"] >= base["sv_min"] - 0.05 and ours["sv_max"] <= base["sv_max"] + 0.05, kind
        assert ours["rel_err_vs_fp64"] <= 3 * base["rel_err_vs_fp64"], kind
    ns_module = importlib.import_module("fastmuon.ns.newton_schulz")
    monkeypatch.setattr(ns_module, "gram_restarts", lambda steps, dtype, first_run: ())
    blown = measure(gram, make_inputs()["low-rank (4) + 1e-4 noise"])
    assert blown["sv_max"] > 10


def _stress_inputs(rows: int = 64, cols: int = 576, seed: int = 0) -> dict[str, torch.Tensor]:
    """Inputs beyond ``fastmuon accuracy``'s three where Gram space's rounding matters most:
    exactly rank-deficient ones (most eigenvalues of A₀ are rounding), heavy tails, and one
    dominant direction (the rest of A₀ tiny beside it)."""
    g = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    return {
        "rank-1 exact": randn(rows, 1) @ randn(1, cols),
        "rank-half exact": randn(rows, rows // 2) @ randn(rows // 2, cols),
        "heavy-tailed": randn(rows, cols) ** 3,
        "one dominant direction": 30 * randn(rows, 1) @ randn(1, cols) + randn(rows, cols),
    }


@pytest.mark.parametrize(
    "preset, steps, dtype",
    [("jordan", 5, torch.bfloat16), ("deepseekv4", 10, torch.bfloat16), ("jordan", 5, torch.float16)],
)
def test_low_precision_gram_first_run_of_three_stays_in_standard_band(preset, steps, dtype):
    """Schedules as gentle as Jordan's run three steps before the first restart (then every 2);
    on the accuracy inputs and the stress inputs, over two seeds, that stays in standard NS's
    band in the same dtype, with errors against fp64 no more than 3x its own."""
    schedule = resolve_coefficients(preset, steps)
    assert ns_module().gram_first_run(schedule) == 3
    gram = Variant("g", method="gram", dtype=dtype, coefficients=preset, steps=steps)
    standard = Variant("s", dtype=dtype, coefficients=preset, steps=steps)
    for seed in (0, 1):
        for kind, G in {**make_inputs(seed=seed), **_stress_inputs(seed=seed)}.items():
            ours, base = measure(gram, G), measure(standard, G)
            assert ours["sv_min"] >= base["sv_min"] - 0.05 and ours["sv_max"] <= base["sv_max"] + 0.05, kind
            assert ours["rel_err_vs_fp64"] <= 3 * base["rel_err_vs_fp64"], kind


def test_a_longer_first_run_or_a_steeper_schedule_leaves_the_band(monkeypatch):
    """What bounds the first run: four of Jordan's steps (growth 2·10⁴) blow up on a matrix with
    one dominant direction, and Polar Express's steep first steps get two steps, not three."""
    ns = ns_module()
    assert ns.gram_first_run(resolve_coefficients("polar_express", 5)) == 2
    assert ns.gram_first_run(resolve_coefficients("jordan", 5)) == ns.DEFAULT_GRAM_FIRST_RUN
    G = _stress_inputs()["one dominant direction"]
    gram = Variant("g", method="gram", dtype=torch.bfloat16)
    assert measure(gram, G)["sv_max"] < 1.5
    monkeypatch.setattr(ns, "gram_first_run", lambda schedule: 4)
    assert measure(gram, G)["sv_max"] > 10


def ns_module():
    return importlib.import_module("fastmuon.ns.newton_schulz")


def test_gram_space_flops_count_the_restarts():
    r, c = 64, 576
    assert ns_flops(r, c, 5, "gram", torch.float32) == 4 * r * r * c + 34 * r**3
    assert ns_flops(r, c, 5, "gram", torch.bfloat16) == 8 * r * r * c + 28 * r**3  # 2 runs: 3+2
    assert ns_flops(r, c, 5, "gram", torch.bfloat16, gram_first_run=2) == 12 * r * r * c + 22 * r**3  # 2+2+1
    assert ns_flops(r, c, 5, "gram", torch.bfloat16) < ns_flops(r, c, 5, "standard")


@pytest.mark.parametrize("shape", [(16, 144), (3, 40, 100), (100, 40), (1, 30), (2, 24, 24)])
def test_eigh_matches_reference(shape):
    """The eigendecomposition route evaluates the same polynomial as the matrix iteration.
    A square random matrix has singular values near zero, whose eigenvalues fp32 resolves
    least well (measured 6e-5 against 2e-6 for the loop): ``auto`` never picks it for those."""
    G = torch.randn(shape)
    out = newton_schulz(G, dtype=torch.float32, method="eigh")
    ref = torch.stack([ns_reference(g) for g in G]) if G.ndim == 3 else ns_reference(G)
    assert rel_err(out, ref) <= (1e-3 if shape[-1] == shape[-2] else 1e-5)


@pytest.mark.parametrize("steps,preset", [(5, "jordan"), (8, "polar_express"), (6, "you")])
def test_eigh_follows_every_schedule(steps, preset):
    G = torch.randn(24, 200)
    out = newton_schulz(G, steps=steps, coefficients=preset, dtype=torch.float32, method="eigh")
    assert rel_err(out, ns_reference(G, steps=steps, coefficients=PRESETS[preset])) <= 1e-5


def test_eigh_keeps_the_fp32_band_on_hard_inputs():
    """fp32 eigenvalues resolve ~1e-7 of the largest, so ill-conditioned inputs lose accuracy
    (measured 1.6e-3, Gram loop 2.8e-4) but keep the band; bf16 NS is off by ~0.3 there."""
    eigh, base = Variant("e", method="eigh"), Variant("s")
    for kind, G in make_inputs().items():
        ours, ref = measure(eigh, G), measure(base, G)
        assert ours["sv_min"] == pytest.approx(ref["sv_min"], abs=2e-3), kind
        assert ours["sv_max"] == pytest.approx(ref["sv_max"], abs=2e-3), kind
        assert ours["rel_err_vs_fp64"] <= 5e-3, kind


def test_eigh_in_bf16_stays_in_standard_bf16_band():
    """bf16 input: the Gram matrix and its eigendecomposition still run in fp32 (a bf16 A₀
    gave singular values up to 2.5 on the ill-conditioned input), only Q·X₀ in bf16."""
    eigh, standard = Variant("e", method="eigh", dtype=torch.bfloat16), Variant("s", dtype=torch.bfloat16)
    for kind, G in make_inputs().items():
        ours, base = measure(eigh, G), measure(standard, G)
        assert ours["sv_min"] >= base["sv_min"] - 0.05 and ours["sv_max"] <= base["sv_max"] + 0.1, kind
        assert ours["rel_err_vs_fp64"] <= 1.2 * max(base["rel_err_vs_fp64"], 1e-2), kind


def test_eigh_non_finite_matrix_falls_back_and_propagates():
    """LAPACK refuses a NaN matrix; the batch then runs the Gram loop: NaN stays in its matrix."""
    G = torch.randn(3, 8, 20)
    G[1, 0, 0] = float("nan")
    out = newton_schulz(G, dtype=torch.float32, method="eigh")
    assert torch.isnan(out[1]).all()
    for k in (0, 2):
        assert rel_err(out[k], ns_reference(G[k])) <= 1e-5


@pytest.mark.parametrize("method", ["standard", "gram"])
def test_bf16_plain_normalisation_matches_the_safe_path(method):
    """bf16 on a CPU takes the plain (host-checked) normalisation too: scaling by a power of two
    commutes with bf16 rounding, so standard NS is bit for bit the safe path's; the Gram loop
    normalises through the trace of a bf16 ``X·Xᵀ`` instead, and is as close to the fp32
    reference as the safe path is."""
    torch.manual_seed(0)
    G = torch.randn(3, 24, 120).bfloat16()
    plain = newton_schulz(G, dtype=torch.bfloat16, method=method)
    safe = newton_schulz(G, dtype=torch.bfloat16, method=method, host_reads=False)
    if method == "standard":
        assert torch.equal(plain, safe)
    else:
        expected = torch.stack([ns_reference(g.float()) for g in G])
        assert rel_err(plain.float(), expected) <= 1.25 * rel_err(safe.float(), expected)


class _OutBuffers(TorchDispatchMode):
    """Records whether each ``out=`` tensor an op writes into is contiguous."""

    def __init__(self):
        super().__init__()
        self.contiguous: list[bool] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if isinstance(kwargs.get("out"), torch.Tensor):
            self.contiguous.append(kwargs["out"].is_contiguous())
        return func(*args, **kwargs)


@pytest.mark.parametrize("method", ["standard", "gram", "eigh"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_a_tall_matrix_is_never_iterated_into_a_transposed_buffer(method, dtype):
    """A tall matrix is iterated on its transpose; the loops write later iterates into earlier
    buffers, which must be contiguous (CPU bf16 ``baddbmm`` into a transposed ``out=`` falls
    back to a far slower kernel)."""
    torch.manual_seed(0)
    G = torch.randn(48, 16)
    with _OutBuffers() as mode:
        tall = newton_schulz(G, dtype=dtype, method=method)
    assert all(mode.contiguous)
    if method == "standard":  # the loop that ping-pongs between its two iterate buffers
        assert mode.contiguous
    wide = newton_schulz(G.T.contiguous(), dtype=dtype, method=method).T
    assert rel_err(tall.float(), wide.float()) <= (1e-2 if dtype == torch.bfloat16 else 1e-5)


@pytest.mark.parametrize("large", [False, True])
def test_off_the_host_either_normalisation_route_matches_the_reference_at_every_scale(monkeypatch, large):
    """Off the host a small batch is normalised through fp64 and a large one (here: any, the
    size lowered) through the power-of-two prescale in its own dtype: both give the
    reference's answer for matrices whose squares leave the fp32 range, and zero for zero."""
    from fastmuon.ns import newton_schulz as ns

    if large:
        monkeypatch.setattr(ns, "FP64_ROUTE_MAX_ELEMENTS", 0)
    calls = []
    fp64 = ns._normalize_in_fp64
    monkeypatch.setattr(ns, "_normalize_in_fp64", lambda *a: calls.append(1) or fp64(*a))
    torch.manual_seed(0)
    base = torch.randn(4, 12, 40)
    scales = torch.tensor([2.0**e for e in (-110, 0, 20, 110)]).view(-1, 1, 1)
    batch = torch.cat([base * scales, torch.zeros(1, 12, 40)])
    out = ns.ns_kernel("standard")(
        batch, resolve_coefficients("jordan", 5), 1e-7, host=False, host_reads=False
    )
    assert bool(calls) != large
    for k, matrix in enumerate(batch):
        expected = _reference_at_scale(matrix, 1e-7)
        assert rel_err(out[k], expected) <= 1e-5 or expected.abs().max() == 0, k
        assert torch.isfinite(out[k]).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gram_space_on_its_own_input_gives_the_same_bits_in_two_batch_sized_buffers(dtype):
    """Off the host with nothing kept, Gram-space NS may write its input: normalised in place,
    each restart into the buffer the last one freed. The values are the untouched-input call's,
    bit for bit, and the result lands in one of the two buffers (the input's or one other)."""
    from fastmuon.ns import newton_schulz as ns

    torch.manual_seed(0)
    batch = torch.randn(3, 16, 48).to(dtype)
    schedule = resolve_coefficients("jordan", 5)
    kernel = ns.ns_kernel("gram")
    expected = kernel(batch, schedule, 1e-7, host=False, host_reads=False)
    own = batch.clone()
    made = []
    bmm = torch.bmm

    def counting_bmm(*args, out=None):
        result = bmm(*args, out=out)
        if out is None and result.shape == batch.shape:
            made.append(result)
        return result

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch, "bmm", counting_bmm)
        got = kernel(own, schedule, 1e-7, host=False, host_reads=False, reuse_input=True)
    assert torch.equal(got, expected)
    assert len(made) <= 1  # besides the input, at most one batch-sized buffer


def test_fp32_ns_multiplies_in_fp32_under_a_lower_matmul_precision(monkeypatch):
    """``torch.set_float32_matmul_precision("high")`` lets fp32 matmuls run in TF32 (GPUs) or
    with bf16 passes (some CPUs): NS asked for in fp32 sets "highest" around its products, in
    the public function, the engine's buckets and an optimizer's step, and puts the user's
    setting back after; bf16 NS leaves it as it is."""
    from fastmuon import Muon

    seen: list[tuple[torch.dtype, str]] = []
    for name in ("bmm", "baddbmm"):
        real = getattr(torch, name)

        def spy(*args, _real=real, **kwargs):
            seen.append((args[0].dtype, torch.get_float32_matmul_precision()))
            return _real(*args, **kwargs)

        monkeypatch.setattr(torch, name, spy)
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        newton_schulz(torch.randn(3, 8, 16), dtype=torch.float32)
        for method in ("standard", "gram"):
            p = torch.nn.Parameter(torch.randn(8, 32))
            p.grad = torch.randn(8, 32)
            Muon([p], lr=0.02, ns_dtype=torch.float32, ns_method=method).step()
        assert torch.get_float32_matmul_precision() == "high"
        fp32 = {precision for dtype, precision in seen if dtype == torch.float32}
        assert fp32 == {"highest"}, seen
        seen.clear()
        newton_schulz(torch.randn(3, 8, 16), dtype=torch.bfloat16)
        assert {precision for _, precision in seen} == {"high"}
    finally:
        torch.set_float32_matmul_precision(previous)


@pytest.mark.parametrize("eps", [1e-7, 0.0])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fp64_normalisation_of_several_batches_in_place_gives_each_its_own_bits(eps, dtype):
    """Several batches normalised with their norms side by side (one add for all) get the
    values the fp64 route gives each alone, at every scale and for zeros."""
    from fastmuon.ns import newton_schulz as ns

    torch.manual_seed(0)
    scales = torch.tensor([2.0**e for e in (-110, 0, 20, 110)]).view(-1, 1, 1)
    batches = [
        (torch.randn(4, 6, 9) * scales).to(dtype),
        torch.randn(2, 3, 3).to(dtype),
        torch.zeros(1, 5, 8, dtype=dtype),
    ]
    expected = [ns._normalize_in_fp64(X, eps, None) for X in batches]
    ns.normalize_in_fp64_(batches, eps)
    for got, want in zip(batches, expected):
        assert torch.equal(got, want)
