"""``fastmuon train`` end to end on a tiny budget: every contender must actually learn."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch

pytest.importorskip("sklearn")

from fastmuon import param_groups  # noqa: E402
from fastmuon.tools.cli import main  # noqa: E402
from fastmuon.train.contenders import CONTENDERS, lr_multiplier, parse_optimizers  # noqa: E402
from fastmuon.train.data import load_char_corpus  # noqa: E402
from fastmuon.train.loop import train_run  # noqa: E402
from fastmuon.train.models import CharTransformer  # noqa: E402
from fastmuon.train.tasks import CharsTask, DigitsTask  # noqa: E402

CPU = torch.device("cpu")


def tiny_tasks():
    """(task, steps): narrower models than the defaults, a fraction of the budget."""
    return [
        (DigitsTask(width=8, hidden=32, batch_size=32, evals=2), 50),
        (
            CharsTask(
                dim=16, layers=1, heads=2, block=16, batch_size=8, max_chars=40_000, eval_windows=32, evals=2
            ),
            30,
        ),
    ]


@pytest.mark.slow
@pytest.mark.parametrize("task, steps", tiny_tasks(), ids=["digits", "chars"])
def test_every_contender_learns(task, steps):
    torch.set_num_threads(1)
    task.setup(CPU)
    results = [
        train_run(task, c, steps=steps, seed=1, device=CPU, ns_dtype=torch.float32)
        for c in CONTENDERS.values()
    ]
    initial = results[0].evals[0]
    for r in results:
        assert not r.diverged, r.label
        # same seed -> same initial weights and so the same step-0 evaluation for all contenders
        assert r.evals[0] == initial, r.label
        assert r.final["train_loss"] < 0.9 * initial["train_loss"], (r.label, r.final, initial)
        assert r.final["val_loss"] < 0.9 * initial["val_loss"], (r.label, r.final, initial)
        assert len(r.step_loss) == steps and r.step_time_s == sorted(r.step_time_s)
        assert 0 < r.optimizer_s < r.wall_s


@pytest.mark.slow
def test_cli_json_and_plot(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    png, out = tmp_path / "curves.png", tmp_path / "runs.json"
    rc = main(
        ["train", "--model", "digits", "--optimizer", "musgd,sgd", "--optimizer", "muon,adamw"]
        + ["--steps", "4", "--threads", "1", "--json", str(out), "--plot", str(png)]
    )
    assert rc == 0
    table = capsys.readouterr().out.splitlines()  # printed as well as the JSON file
    assert max(len(line) for line in table) <= 80  # an 80-column terminal shows it whole
    for label in ("fastmuon MuSGD", "fastmuon Muon", "torch SGD (Nesterov)", "torch AdamW"):
        assert f"digits · {label}" in table
    doc = json.loads(out.read_text())
    assert doc["config"]["steps"] == {"digits": 4}
    assert doc["config"]["ns_dtype"] == "float32"
    assert [r["optimizer"] for r in doc["runs"]] == ["musgd", "sgd", "muon", "adamw"]
    for r in doc["runs"]:
        assert r["task"] == "digits" and r["steps"] == 4 and r["seed"] == 0
        assert set(r["final"]) == {"train_loss", "val_loss", "val_acc"}
        assert all(math.isfinite(v) for v in r["final"].values())
        assert 0 <= r["final"]["val_acc"] <= 1
        assert 0 < r["step_share"] < 1 and r["wall_s"] > 0 and r["ms_per_step"] > 0
        assert [e["step"] for e in r["evals"]][0] == 0 and r["evals"][-1]["step"] == 4
        assert len(r["step_loss"]) == len(r["step_time_s"]) == 4
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_json_to_stdout_replaces_the_table(capsys):
    rc = main(
        ["train", "--model", "digits", "--optimizer", "sgd", "--steps", "2", "--threads", "1"]
        + ["--json", "-"]
    )
    assert rc == 0
    doc = json.loads(capsys.readouterr().out)  # standard output is the JSON alone
    assert [(r["optimizer"], r["steps"]) for r in doc["runs"]] == [("sgd", 2)]


def test_parse_optimizers():
    assert [c.name for c in parse_optimizers(None)] == list(CONTENDERS)
    assert [c.name for c in parse_optimizers(["adamw,musgd", "musgd", "sgd"])] == ["adamw", "musgd", "sgd"]
    with pytest.raises(ValueError, match="unknown optimizer 'lion'"):
        parse_optimizers(["lion"])


def test_schedule_warms_up_then_decays_to_zero():
    values = [lr_multiplier(s, 100) for s in range(100)]
    assert values[0] == pytest.approx(0.2) and max(values) == 1.0
    assert values[5:] == sorted(values[5:], reverse=True) and values[-1] < 0.01


def test_muon_contender_splits_matrices_from_adamw_params():
    corpus = load_char_corpus(max_chars=5_000)
    model = CharTransformer(corpus.vocab_size, block=8, dim=16, layers=1, heads=2)
    opt = CONTENDERS["muon"].build(model, "chars", torch.float32)
    muon, other, no_decay = opt.param_groups
    assert muon["use_muon"] and not other["use_muon"] and not no_decay["use_muon"]
    assert set(muon["param_names"]) == {
        f"blocks.0.{name}.weight" for name in ("attn.qkv", "attn.proj", "mlp.0", "mlp.2")
    }
    assert set(other["param_names"]) == {"tok_emb.weight", "pos_emb.weight", "head.weight"}
    assert other["lr"] == no_decay["lr"] == CONTENDERS["muon"].hparams["chars"]["adamw_lr"]
    assert no_decay["weight_decay"] == 0 and other["weight_decay"] == muon["weight_decay"] > 0
    assert [g["use_muon"] for g in param_groups(model)] == [True, False, False]


def test_cli_trains_the_variants_beside_muon_and_adamw(capsys):
    rc = main(
        ["train", "--model", "digits", "--optimizer", "normuon,adamuon", "--optimizer", "muon,adamw"]
        + ["--steps", "3", "--threads", "1", "--json", "-"]
    )
    assert rc == 0
    doc = json.loads(capsys.readouterr().out)
    runs = doc["runs"]
    assert [r["optimizer"] for r in runs] == ["normuon", "adamuon", "muon", "adamw"]
    assert [r["label"] for r in runs[:2]] == ["fastmuon NorMuon", "fastmuon AdaMuon"]
    assert len({json.dumps(r["evals"][0]) for r in runs}) == 1  # the same start for all
    for r in runs:
        assert all(math.isfinite(v) for v in r["final"].values()) and not r["diverged"]
    # three steps apart: each rule moved the weights its own way
    assert len({r["final"]["train_loss"] for r in runs}) == 4


@pytest.mark.parametrize("name, cls", [("normuon", "NorMuon"), ("adamuon", "AdaMuon")])
def test_variant_contenders_take_muons_split(name, cls):
    corpus = load_char_corpus(max_chars=5_000)
    model = CharTransformer(corpus.vocab_size, block=8, dim=16, layers=1, heads=2)
    opt = CONTENDERS[name].build(model, "chars", torch.float32)
    assert type(opt).__name__ == cls
    muon = CONTENDERS["muon"].build(model, "chars", torch.float32)
    assert [g["param_names"] for g in opt.param_groups] == [g["param_names"] for g in muon.param_groups]
    hp = CONTENDERS[name].hparams["chars"]
    assert opt.param_groups[0]["lr"] == hp["lr"] and opt.param_groups[1]["lr"] == hp["adamw_lr"]


def test_train_help_names_every_contender_and_what_each_loss_is(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for c in CONTENDERS.values():
        assert c.label in text, c.label
    assert f"--optimizer NAME[,NAME] {', '.join(CONTENDERS)} or all" in text
    assert "Train loss and val loss are the final model's losses (in eval mode)" in text
    assert "the progress bars' batch loss is the loss of each step's training batch" in text
    # the one-line summary under `fastmuon --help` names all the optimizers or none of them
    with pytest.raises(SystemExit):
        main(["--help"])
    (summary,) = [line for line in capsys.readouterr().out.split("\n    ") if line.startswith("train ")]
    classes = {c.label.split()[1] for c in CONTENDERS.values()}
    named = {n for n in classes if re.search(rf"\b{n}\b", summary)}
    assert named in (set(), classes), summary


def test_the_bar_and_the_table_say_which_loss_each_shows(tmp_path, capsys, monkeypatch):
    """The bar's figure is the last batch's loss, the table's the final evaluation's."""
    monkeypatch.setenv("COLUMNS", "120")
    out = tmp_path / "runs.json"
    rc = main(
        ["train", "--model", "digits", "--optimizer", "muon", "--steps", "3", "--threads", "1"]
        + ["--json", str(out)]
    )
    assert rc == 0
    captured = capsys.readouterr()
    (run,) = json.loads(out.read_text())["runs"]
    (bar,) = re.findall(r"batch loss (\d+\.\d{3})", captured.err)
    assert bar == f"{run['step_loss'][-1]:.3f}"
    table = " ".join(captured.out.split())
    assert f"{run['final']['train_loss']:.4f}" in table
    assert "Train loss and val loss are the final model's losses (in eval mode) on a fixed subset" in table


@pytest.mark.parametrize("name, base", [("musgd-bf16", "musgd"), ("muon-bf16", "muon")])
def test_bf16_state_contenders_are_their_optimizer_with_bf16_state(name, base):
    """The same settings on every task as the contender they shadow, and state in bf16."""
    assert CONTENDERS[name].hparams == {
        task: {**hp, "state_dtype": torch.bfloat16} for task, hp in CONTENDERS[base].hparams.items()
    }
    corpus = load_char_corpus(max_chars=5_000)
    model = CharTransformer(corpus.vocab_size, block=8, dim=16, layers=1, heads=2)
    opt = CONTENDERS[name].build(model, "chars", torch.float32)
    assert type(opt) is type(CONTENDERS[base].build(model, "chars", torch.float32))
    assert {g["state_dtype"] for g in opt.param_groups} == {torch.bfloat16}
    model(torch.zeros(2, 8, dtype=torch.long)).square().mean().backward()
    opt.step()
    assert {t.dtype for s in opt.state.values() for k, t in s.items() if k != "step"} == {torch.bfloat16}
