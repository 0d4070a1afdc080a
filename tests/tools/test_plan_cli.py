"""``fastmuon plan``'s edges: the --plot sweep, expert-parallel sizes, --measure's guard and
progress, the --world a mesh sets, and the messages and help a mistake meets."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from fastmuon.scale import matrices, parse_layout, workload
from fastmuon.tools.cli import main

FAST = ["--design", "fastmuon", "--classes", "1"]


@pytest.fixture
def titles(monkeypatch) -> list[str]:
    """The titles of every figure drawn while the test runs."""
    from matplotlib.figure import Figure

    seen: list[str] = []
    draw = Figure.suptitle

    def record(self, t, *args, **kwargs):
        seen.append(t)
        return draw(self, t, *args, **kwargs)

    monkeypatch.setattr(Figure, "suptitle", record)
    return seen


# ----- --plot -------------------------------------------------------------------------------------
def test_plot_leaves_out_the_sizes_the_layout_cannot_take(tmp_path, capsys, titles):
    png = tmp_path / "p.png"
    assert main(["plan", "--model", "gpt2", "--layout", "hsdp:2x16", *FAST, "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "layout hsdp:2x16 on 32 ranks" in out
    assert f"plot: {png}; left out 8 ranks: " in out
    assert "inner (shard) dim 16 at every size, and 8 is not a multiple of 16" in out
    assert png.stat().st_size > 0
    assert titles == ["gpt2, layout hsdp:(W/16)x16 (inner shard dim 16)"]


def test_plot_note_goes_to_stderr_when_stdout_holds_json(tmp_path, capsys):
    png = tmp_path / "p.png"
    argv = ["plan", "--model", "gpt2", "--layout", "hsdp:1x64", "--json", "-", *FAST, "--plot", str(png)]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["world"] == 64
    assert "plot: left out 8 ranks: the plot keeps hsdp:1x64's inner (shard) dim 64" in captured.err
    assert png.exists()


def test_plot_refuses_up_front_a_layout_no_sweep_size_takes(tmp_path, capsys):
    png = tmp_path / "p.png"
    argv = ["plan", "--layout", "hsdp:3x5", "--world", "15", *FAST, "--plot", str(png)]
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""  # nothing printed before the refusal
    assert (
        "--plot sweeps 8, 64, 256 and 1,024 ranks, and --layout hsdp:3x5 takes none of them" in captured.err
    )
    assert "inner (shard) dim 5" in captured.err and "hsdp:Rx4, hsdp:Rx8" in captured.err
    assert "1x5" not in captured.err
    assert not png.exists()


@pytest.mark.parametrize(
    "layout, title",
    [
        ("hsdp:2x4", "gpt2, layout hsdp:(W/4)x4 (inner shard dim 4)"),
        ("fsdp+tp", "gpt2, layout fsdp+tp:(W/8)x8 (inner tp dim 8)"),
        ("fsdp", "gpt2, layout fsdp"),
    ],
)
def test_plot_title_names_the_layout_family_and_its_kept_inner_dim(layout, title, tmp_path, titles):
    argv = [
        "plan",
        "--model",
        "gpt2",
        "--layout",
        layout,
        "--world",
        "8",
        *FAST,
        "--plot",
        str(tmp_path / "p.png"),
    ]
    assert main(argv) == 0
    assert titles == [title]


# ----- ep:E against the model's experts ---------------------------------------------------------
@pytest.mark.parametrize(
    "argv, message",
    [
        (["--model", "mixtral-8x7b", "--layout", "ep:7", "--world", "7"], "7 does not divide them"),
        (["--model", "mixtral-8x7b", "--layout", "ep:16", "--world", "16"], "leave ranks holding no expert"),
        (["--model", "mixtral-8x7b", "--layout", "ep", "--world", "6"], "(at --world 6: ep:6)"),
    ],
)
def test_ep_size_must_divide_the_experts(argv, message, capsys):
    assert main(["plan", *argv, *FAST]) == 2
    err = capsys.readouterr().err
    assert "--layout ep" in err and "the model has 8 experts per layer" in err and message in err
    assert "give --layout ep:E with E dividing 8 (ep:1, ep:2, ep:4, ep:8)" in err


def test_ep_needs_a_moe_model_whatever_its_size(capsys):
    assert main(["plan", "--model", "gpt2", "--layout", "ep:3", *FAST]) == 2
    err = capsys.readouterr().err
    assert "--layout ep:3: gpt2 has no expert stacks to shard; ep needs a MoE model" in err


def test_ep_size_zero_is_refused_as_below_one(capsys):
    assert main(["plan", "--model", "mixtral-8x7b", "--layout", "ep:0", *FAST]) == 2
    err = capsys.readouterr().err
    assert "the ep size (ranks per expert stack) must be 1 or more" in err and "divide" not in err


# ----- --expert-shard -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "spec, world, experts, dim",
    [
        ("fsdp", 8, 8, 0),
        ("fsdp", 16, 8, 1),
        ("hsdp:2x4", 8, 4, 1),  # torchtitan weighs its 2-D mesh whole: 8 ranks, though 4 shard
        ("hsdp:2x4", 8, 8, 0),
        ("fsdp+tp:2x8", 16, 4, 0),  # the tp dim apart: 2 dp ranks
        ("fsdp+tp:8x2", 16, 4, 1),
        ("ep:8", 8, 8, 0),
        ("ep:8", 1024, 8, 1),  # (W/E)·E = W ranks weighed
        ("ddp", 1024, 8, 0),
        ("fsdp", 1024, 0, 0),
    ],
)
def test_the_expert_dim_is_torchtitans_rule_by_default(spec, world, experts, dim):
    from fastmuon.scale.layouts import torchtitan_expert_dim

    lay = parse_layout(spec, world, experts)
    assert lay.expert_dim == lay.default_expert_dim == dim
    assert torchtitan_expert_dim(lay.kind, lay.rows, lay.cols, experts) == dim
    assert "experts dim" not in str(lay)


def test_the_layout_names_an_expert_dim_other_than_the_rules():
    assert str(parse_layout("fsdp", 1024, 8, "0")) == "fsdp (experts dim 0)"
    assert str(parse_layout("fsdp", 8, 8, "1")) == "fsdp (experts dim 1)"
    assert str(parse_layout("ep:8", 64, 8, "0")) == "ep:8 (experts dim 0)"
    assert str(parse_layout("fsdp", 1024, 8, "1")) == "fsdp"


def test_with_the_rule_every_fsdp_rank_holds_experts():
    from fastmuon.scale import rank_regions

    for model, spec in (("mixtral-8x7b", "fsdp"), ("mixtral-8x7b", "ep:8"), ("deepseek-v3", "fsdp")):
        w = workload(model)
        stacks = [t for t in w.tensors if t.experts][:2]
        for shard in ("auto", "0"):
            lay = parse_layout(spec, 1024, w.num_experts, shard)
            empty = sum(box is None for t in stacks for box in rank_regions(lay, t))
            assert (empty == 0) == (shard == "auto"), (model, spec, shard, empty)


def test_expert_shard_is_shown_and_kept_in_the_json(capsys):
    argv = ["plan", "--model", "mixtral-8x7b", "--world", "16", "--layout", "fsdp", *FAST]
    assert main([*argv, "--expert-shard", "0", "--json", "-"]) == 0
    assert json.loads(capsys.readouterr().out)["layout"] == "fsdp (experts dim 0)"
    assert main([*argv, "--expert-shard", "1"]) == 0
    assert "layout fsdp on 16 ranks" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--model", "mixtral-8x7b", "--layout", "ddp", "--expert-shard", "1"],
            "--layout ddp shards nothing",
        ),
        (
            ["--model", "gpt2", "--expert-shard", "0"],
            "the model has no expert stacks; leave out --expert-shard",
        ),
        (
            ["--model", "mixtral-8x7b", "--world", "24"],
            "(torchtitan's rule: its 24 ranks outnumber the 8 experts), and FSDP2 shards a dim other than 0 "
            "only evenly: model.layers.0.mlp.experts.gate_up_proj's dim 1 (28672) does not divide over 24",
        ),
        (
            ["--model", "mixtral-8x7b", "--world", "6", "--expert-shard", "1"],
            "--layout fsdp (experts dim 1) at --world 6: expert stacks are sharded on dim 1 (--expert-shard 1)",
        ),
    ],
)
def test_expert_shard_refusals(argv, message, capsys):
    assert main(["plan", *argv, *FAST]) == 2
    err = capsys.readouterr().err
    assert message in err
    if "evenly" in err:
        assert err.rstrip().endswith("give --expert-shard 0, or a world whose FSDP dim divides it")


def test_expert_shard_takes_auto_0_or_1():
    with pytest.raises(ValueError, match="--expert-shard '2': choose one of auto, 0, 1"):
        parse_layout("fsdp", 8, 8, "2")


# ----- --measure ----------------------------------------------------------------------------------
MEASURE = ["--device", "cpu-measured", "--design", "fastmuon", "--classes", "1", "--measure"]


def test_measure_refuses_after_the_table_what_would_take_too_long(monkeypatch, capsys, tmp_path):
    def must_not_run(*args, **kwargs):
        raise AssertionError("measured although the prediction is over the limit")

    monkeypatch.setattr("fastmuon.scale.measure.measure_busiest", must_not_run)
    out_json = tmp_path / "plan.json"
    argv = [
        "plan",
        "--model",
        "llama3-70b",
        "--world",
        "64",
        "--layout",
        "fsdp",
        *MEASURE,
        "--json",
        str(out_json),
    ]
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert "fastmuon: NS imbalance" in captured.out  # the table came first
    assert "--measure would take ~" in captured.err
    assert "once to warm up and 3 times timed), over --max-measure-seconds 120;" in captured.err
    assert (
        "give a smaller --model" in captured.err
        and "raise --max-measure-seconds (0: no limit)" in captured.err
    )
    assert not out_json.exists()


def test_measure_limit_is_an_option(monkeypatch, capsys):
    monkeypatch.setattr("fastmuon.scale.measure.measure_busiest", None)  # never reached
    argv = ["plan", "--model", "gpt2", "--world", "64", *MEASURE, "--max-measure-seconds", "0.0001"]
    assert main(argv) == 2
    assert "over --max-measure-seconds 0.0001;" in capsys.readouterr().err


def test_measure_limit_must_not_be_negative(capsys):
    assert main(["plan", "--model", "gpt2", *MEASURE, "--max-measure-seconds", "-1"]) == 2
    assert "--max-measure-seconds must be 0 or more, got -1.0" in capsys.readouterr().err


def test_measure_shows_its_progress(capsys):
    # no limit: a loaded machine's slower calibration must not turn this run into a refusal
    argv = [
        "plan",
        "--model",
        "gpt2",
        "--world",
        "64",
        "--layout",
        "fsdp",
        *MEASURE,
        "--max-measure-seconds",
        "0",
    ]
    assert main(argv) == 0
    captured = capsys.readouterr()
    steps = [line for line in captured.err.splitlines() if line.startswith("measuring ")]
    total = int(steps[0].split()[1].split("/")[1])
    assert steps[0].startswith(f"measuring 0/{total} matrices of rank ")
    assert steps[-1].startswith(f"measuring {total}/{total} matrices of rank ")
    assert len(steps) >= 2
    table, _, measured = captured.out.partition("measured on this CPU: rank ")
    assert "fastmuon: NS imbalance" in table and "s (measured / predicted" in measured


# ----- --world and the messages -----------------------------------------------------------------
@pytest.mark.parametrize("layout, world", [("hsdp:2x4", 8), ("fsdp+tp:4x8", 32), ("fsdp", 1024)])
def test_a_mesh_naming_both_dims_sets_the_world(layout, world, capsys):
    assert main(["plan", "--model", "gpt2", "--layout", layout, *FAST]) == 0
    assert f"layout {layout} on {world} ranks" in capsys.readouterr().out


def test_a_given_world_still_has_to_match_the_mesh(capsys):
    assert main(["plan", "--model", "gpt2", "--layout", "hsdp:2x4", "--world", "16", *FAST]) == 2
    err = capsys.readouterr().err
    assert "the mesh 2x4 must multiply to --world 16 (or leave out --world" in err


@pytest.mark.parametrize(
    "layout, dim, fix",
    [("hsdp", "inner (shard) dim", "hsdp:2x6"), ("fsdp+tp", "inner (tp) dim", "fsdp+tp:2x6")],
)
def test_a_bare_mesh_says_what_it_means(layout, dim, fix, capsys):
    assert main(["plan", "--model", "gpt2", "--layout", layout, "--world", "12", *FAST]) == 2
    err = capsys.readouterr().err
    assert f"a bare {layout} takes one node (8 ranks) as its {dim}" in err
    assert "--world 12 is not a multiple of 8" in err and f"give the mesh, as {fix}" in err
    assert "1x8" not in err


def test_help_states_the_defaults_that_depend_on_other_options(capsys):
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "NS dtype (default: bf16 on the GPU devices, fp32 for cpu-measured)" in text
    assert (
        "ranks (default: R·S where --layout names both mesh dims, as hsdp:RxS or fsdp+tp:DxT; else 1024)"
        in text
    )
    assert "--max-measure-seconds" in text and "default 120 s" in text


# ----- the bundled gpt2 -------------------------------------------------------------------------
def test_gpt2_fused_qkv_is_three_matrices():
    w = workload("gpt2")
    qkv = [t for t in w.tensors if ".attn_qkv." in t.name]
    assert len(qkv) == 12 and all(t.shape == (2304, 768) and t.map == {"split": [768] * 3} for t in qkv)
    shapes = Counter(m.shape for m in matrices(w, parse_layout("fsdp", 8)))
    assert shapes == {(768, 768): 48, (3072, 768): 12, (768, 3072): 12}
