"""What the plan, the optimizer's repr and the Muon-share notes print: counts in the number
their noun takes, and the update the parameters Muon leaves really get; and what the README
says of the padding its quick start's plan shows."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import fastmuon
from fastmuon import AdaMuon, Muon, MuSGD, NorMuon
from fastmuon.ns.planner import MatrixSpec, counted, plan_buckets

#: each optimizer and the update its parameters outside Muon take
ELEMENTWISE = [(MuSGD, "SGD"), (Muon, "AdamW"), (NorMuon, "AdamW"), (AdaMuon, "AdamW")]


def test_counted_puts_the_noun_in_the_number_of_its_count():
    assert counted(1, "bucket") == "1 bucket"
    assert counted(0, "bucket") == "0 buckets"
    assert counted(3, "bucket") == "3 buckets"
    assert counted(1, "matrix", "matrices") == "1 matrix"
    assert counted(2, "matrix", "matrices") == "2 matrices"


def test_describe_of_one_matrix_in_one_bucket_says_both_in_the_singular():
    first = plan_buckets([MatrixSpec(4, 6)]).describe().splitlines()[0]
    assert first.startswith("plan: 1 matrix in 1 bucket (policy=")


def test_describe_of_several_says_them_in_the_plural():
    plan = plan_buckets([MatrixSpec(4, 6), MatrixSpec(8, 6)], policy="exact")
    assert plan.describe().startswith("plan: 2 matrices in 2 buckets (policy=exact")


def test_an_empty_plan_counts_in_the_plural():
    opt = Muon([torch.nn.Parameter(torch.randn(4, 6))], foreach=False)
    assert opt.plan().describe().startswith("plan: 0 matrices in 0 buckets (")


def test_repr_counts_a_group_of_one_tensor_and_one_name_in_the_singular():
    weight = torch.nn.Parameter(torch.randn(4, 6))
    text = repr(Muon([("w", weight)]))
    assert "    params: 1 tensor\n" in text and "    param_names: 1 name\n" in text


def test_repr_counts_several_in_the_plural():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    text = repr(Muon(list(model.named_parameters())))
    assert "    params: 4 tensors\n" in text and "    param_names: 4 names\n" in text


def _one_matrix_and_a_bias() -> list[dict]:
    layer = torch.nn.Linear(4, 6)
    return [{"params": [layer.weight], "use_muon": True}, {"params": [layer.bias], "use_muon": False}]


@pytest.mark.parametrize("cls, update", ELEMENTWISE)
def test_foreach_false_note_names_the_update_the_other_parameters_take(cls, update):
    note = cls(_one_matrix_and_a_bias(), foreach=False).plan().note
    assert "foreach=False runs the per-parameter loop" in note
    assert f"the other 1 parameter (6 elements) take {update}; no step taken yet" in note
    assert "elementwise update" not in note


@pytest.mark.parametrize("cls, update", ELEMENTWISE)
def test_an_optimizer_that_orthogonalises_nothing_names_the_update_its_parameters_take(cls, update):
    params = [torch.nn.Parameter(torch.randn(4, 6)), torch.nn.Parameter(torch.randn(6))]
    with pytest.warns(UserWarning, match=f"so all 2 parameters take {update}\\. To orthogonalise"):
        opt = cls([{"params": params, "use_muon": False}])
    assert f"2 parameters (30 elements) take {update}" in opt.plan().note


def test_every_rule_names_the_update_of_the_parameters_it_does_not_orthogonalise():
    import fastmuon.rules.muon
    import fastmuon.rules.musgd
    import fastmuon.rules.second_moment

    rules = fastmuon.rules
    assert (rules.musgd.other_update, rules.muon.other_update) == ("SGD", "AdamW")
    variants = rules.second_moment
    assert variants.NORMUON.other_update == variants.ADAMUON.other_update == "AdamW"
    for cls, update in ELEMENTWISE:
        assert cls(_one_matrix_and_a_bias()).rule.other_update == update, cls.__name__


def test_param_groups_of_a_model_still_say_which_update_each_part_takes():
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    note = NorMuon(fastmuon.param_groups(model)).plan().note
    # the head (the last layer) and the biases take AdamW
    assert "Muon takes 2 of 6 parameters (2 matrices, 96 elements)" in note
    assert "the other 4 parameters (34 elements) take AdamW" in note


def test_the_readme_says_why_its_quick_start_plan_may_pad_much():
    root = Path(__file__).resolve().parents[2]
    text = (root / "README.md").read_text()
    quick_start = text[text.index("## Quick start") :]
    # the paragraph after the code's expected output
    after_code = quick_start[quick_start.index("```\n", quick_start.index("```text")) + 4 :]
    paragraph = " ".join(after_code.strip().split("\n\n")[0].split())
    assert "padding overhead" in paragraph and "kernel launches" in paragraph
    # what it says holds: the quick start's convs as matrices, merged they pad the smaller to
    # the larger's shape, and the exact policy keeps them apart, unpadded
    convs = [torch.nn.Conv2d(3, 16, 3).weight, torch.nn.Conv2d(16, 32, 3).weight]
    shapes = [(w.shape[0], w[0].numel()) for w in convs]
    assert shapes == [(16, 27), (32, 144)] and "16×27 and a 32×144 matrix" in paragraph
    specs = [MatrixSpec(*shape) for shape in shapes]
    (merged,) = plan_buckets(specs, policy="min_launches").buckets
    assert merged.shape == (2, 32, 144)
    assert plan_buckets(specs, policy="exact").padding_overhead() == 0
