"""The faster NS variants keep the orthogonality of standard 5-step NS in fp32."""

import pytest
import torch

from fastmuon.tools.accuracy import cuda_choice, make_inputs, run_accuracy


@pytest.fixture(scope="module")
def table():
    rows = run_accuracy(rows=32, cols=288)
    return {(r["input"], r["variant"]): r for r in rows}


def test_gram_space_keeps_the_baseline_band(table):
    inputs = {k[0] for k in table}
    assert len(inputs) == 3
    for kind in inputs:
        base, gram = table[(kind, "standard fp32 (baseline)")], table[(kind, "gram fp32")]
        assert gram["sv_min"] == pytest.approx(base["sv_min"], abs=2e-3)
        assert gram["sv_max"] == pytest.approx(base["sv_max"], abs=2e-3)
        # far closer to exact NS than the bf16 NS that Muon is normally run with; on the
        # ill-conditioned input (the Gram matrix squares its condition number) the fp32 rounding
        # of the CPU's matmul kernels alone moves it by about 1e-3, so the bound is eigh's
        assert gram["rel_err_vs_fp64"] < 5e-3 < table[(kind, "standard bf16")]["rel_err_vs_fp64"]


def test_per_step_presets_tighten_the_band_on_random_input(table):
    base = table[("random", "standard fp32 (baseline)")]
    for name in ("polar_express fp32", "you (6 steps) fp32"):
        r = table[("random", name)]
        assert r["sv_min"] > base["sv_min"] and r["sv_max"] < 1.15


def assert_eigh_keeps_the_baseline_band(table) -> None:
    """On each of the three inputs, eigh's singular values within 2e-3 of 5-step fp32 NS's and its
    error below 5e-3, under bf16 NS's."""
    inputs = {k[0] for k in table}
    assert len(inputs) == 3, inputs
    for kind in inputs:
        base, eigh = table[(kind, "standard fp32 (baseline)")], table[(kind, "eigh fp32")]
        assert eigh["sv_min"] == pytest.approx(base["sv_min"], abs=2e-3), kind
        assert eigh["sv_max"] == pytest.approx(base["sv_max"], abs=2e-3), kind
        assert eigh["rel_err_vs_fp64"] < 5e-3 < table[(kind, "standard bf16")]["rel_err_vs_fp64"], kind


def test_eigh_keeps_the_baseline_band(table):
    assert_eigh_keeps_the_baseline_band(table)


@pytest.mark.parametrize("rows, cols", [(48, 48), (64, 96)])
def test_eigh_keeps_the_baseline_band_on_square_ish_inputs(rows, cols):
    """``auto`` takes the eigendecomposition route for square-ish buckets too where bf16 NS was
    asked for (planner.choose_method): there its error must stay far below bf16 NS's."""
    measured = {(r["input"], r["variant"]): r for r in run_accuracy(rows=rows, cols=cols)}
    assert_eigh_keeps_the_baseline_band(measured)


def test_aol_in_four_steps_tightens_the_five_step_band_on_random_and_low_rank_input(table):
    for kind in ("random", "low-rank (4) + 1e-4 noise"):
        base, aol = table[(kind, "standard fp32 (baseline)")], table[(kind, "aol (4 steps) fp32")]
        assert aol["steps"] == 4 < base["steps"]
        assert aol["sv_min"] > base["sv_min"] + 0.2 and aol["sv_max"] < 1.06


def test_new_presets_agree_with_their_fp64_evaluation(table):
    for kind in {k[0] for k in table}:
        for name in ("aol (4 steps) fp32", "cans fp32", "deepseekv4 (10) fp32", "polar_express_paper fp32"):
            assert table[(kind, name)]["rel_err_vs_fp64"] < 1e-2
        assert table[(kind, "aol (4 steps) fp32")]["rel_err_vs_fp64"] < 1e-4


def _significant(G: torch.Tensor) -> int:
    """Singular values above the 1e-4 noise: the rank the input was built with."""
    s = torch.linalg.svdvals(G)
    return int((s > 1e-2 * s[0]).sum())


@pytest.mark.parametrize(
    "rows, cols, low_rank, spread",
    [
        (1, 1, "full rank (1) + 1e-4 noise", "one singular value (1)"),
        (1, 40, "full rank (1) + 1e-4 noise", "one singular value (1)"),
        (3, 40, "full rank (3) + 1e-4 noise", "ill-conditioned (1 .. 1e-6)"),
        (4, 4, "full rank (4) + 1e-4 noise", "ill-conditioned (1 .. 1e-6)"),
        (5, 40, "low-rank (4) + 1e-4 noise", "ill-conditioned (1 .. 1e-6)"),
    ],
)
def test_input_labels_claim_only_what_the_size_allows(rows, cols, low_rank, spread):
    inputs = make_inputs(rows, cols)
    assert list(inputs) == ["random", low_rank, spread]
    rank = int(low_rank.split("(")[1].split(")")[0])
    assert _significant(inputs[low_rank]) == rank  # built as randn(rows, r) @ randn(r, cols)
    s = torch.linalg.svdvals(inputs[spread])
    assert s[0] == pytest.approx(1.0) and s[-1] == pytest.approx(1e-6 if rows > 1 else 1.0)
    measured = run_accuracy(rows, cols)
    assert {r["input"] for r in measured} == set(inputs)


def test_the_default_inputs_keep_their_names_and_values():
    """At 64×576 the low-rank input is rank 4, drawn after the random one from the same generator."""
    inputs = make_inputs()
    assert list(inputs) == ["random", "low-rank (4) + 1e-4 noise", "ill-conditioned (1 .. 1e-6)"]
    g = torch.Generator().manual_seed(0)
    draw = [torch.randn(*shape, generator=g, dtype=torch.float64) for shape in ((64, 64), (576, 64))]
    draw += [
        torch.randn(*shape, generator=g, dtype=torch.float64) for shape in ((64, 576), (64, 4), (4, 576))
    ]
    noise = torch.randn(64, 576, generator=g, dtype=torch.float64)
    assert torch.equal(inputs["random"], draw[2])
    assert torch.equal(inputs["low-rank (4) + 1e-4 noise"], draw[3] @ draw[4] + 1e-4 * noise)
    assert _significant(inputs["low-rank (4) + 1e-4 noise"]) == 4


def _holds_standard_bf16_accuracy(measured: dict, variant: str) -> None:
    """The bound the suite holds bf16 Gram-space NS to (test_newton_schulz): on each input, the
    singular values within 0.05 of standard bf16 NS's band, the error at most 3x its error."""
    for kind in {k[0] for k in measured}:
        ours, base = measured[(kind, variant)], measured[(kind, "standard bf16")]
        assert ours["sv_min"] >= base["sv_min"] - 0.05 and ours["sv_max"] <= base["sv_max"] + 0.05, kind
        assert ours["rel_err_vs_fp64"] <= 3 * base["rel_err_vs_fp64"], kind


@pytest.mark.parametrize("rows, cols", [(32, 288), (32, 64), (24, 84)])  # 9x, 2x, 3.5x as wide
def test_the_cuda_choice_for_wide_bf16_buckets_holds_standard_bf16_accuracy(table, rows, cols):
    """What a CUDA plan runs for wide bf16 buckets (Gram-space NS in bf16, restarting), computed
    here in bf16 beside standard bf16 NS, from twice as wide as tall (where the planner may
    choose it) to a Llama MLP's 3.5x and a 3x3 conv's 9x."""
    choice = cuda_choice()
    assert (choice.method, choice.dtype) == ("gram", torch.bfloat16)
    measured = (
        table
        if (rows, cols) == (32, 288)
        else {(r["input"], r["variant"]): r for r in run_accuracy(rows=rows, cols=cols)}
    )
    _holds_standard_bf16_accuracy(measured, choice.name)
    assert all(measured[(k, choice.name)]["restarts_at"] == [3] for k in {k[0] for k in measured})
