"""The faster NS variants keep the orthogonality of standard 5-step NS in fp32."""

import pytest

from fastmuon.accuracy import run_accuracy


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


def test_eigh_keeps_the_baseline_band(table):
    for kind in {k[0] for k in table}:
        base, eigh = table[(kind, "standard fp32 (baseline)")], table[(kind, "eigh fp32")]
        assert eigh["sv_min"] == pytest.approx(base["sv_min"], abs=2e-3)
        assert eigh["sv_max"] == pytest.approx(base["sv_max"], abs=2e-3)
        assert eigh["rel_err_vs_fp64"] < 5e-3 < table[(kind, "standard bf16")]["rel_err_vs_fp64"]


@pytest.mark.parametrize("rows, cols", [(48, 48), (64, 96)])
def test_eigh_keeps_the_baseline_band_on_square_ish_inputs(rows, cols):
    """``auto`` takes the eigendecomposition route for square-ish buckets too where bf16 NS was
    asked for (planner.choose_method): there its error must stay far below bf16 NS's."""
    measured = {(r["input"], r["variant"]): r for r in run_accuracy(rows=rows, cols=cols)}
    test_eigh_keeps_the_baseline_band(measured)


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
