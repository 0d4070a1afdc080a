"""No silent fall-back: an optimizer that orthogonalises nothing says so when it is made, and
``plan().describe()`` says what Muon takes, and where its plan is empty, the true reason."""

import warnings

import pytest
import torch

import fastmuon
from fastmuon import Muon, MuSGD


def mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def train(opt, model, steps):
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(3, 8)).sum().backward()
        opt.step()


def built_quietly(make):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return make()


def test_plain_sgd_musgd_warns_once_and_describes_why_after_steps():
    model = mlp()
    with pytest.warns(
        UserWarning, match="MuSGD orthogonalises no parameter: every param group has use_muon=False"
    ) as w:
        opt = MuSGD(model.parameters(), lr=0.02, momentum=0.9)
    assert len(w) == 1 and "fastmuon.param_groups(model)" in str(w[0].message)
    assert w[0].filename == __file__  # points at the caller's line
    before = [p.detach().clone() for p in model.parameters()]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once: not again at each step
        train(opt, model, 2)
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # SGD did step
    text = opt.plan().describe()
    assert "no parameter is orthogonalised: every param group has use_muon=False" in text
    assert "4 parameters (212 elements) take SGD; 2 steps taken" in text
    assert "no step taken yet" not in text and "no matrix has a gradient" not in text


def test_muon_with_every_group_off_warns_and_says_so():
    model = mlp()
    with pytest.warns(UserWarning, match="Muon orthogonalises no parameter.*all 4 parameters take AdamW"):
        opt = Muon([{"params": list(model.parameters()), "use_muon": False}])
    assert (
        "every param group has use_muon=False; 4 parameters (212 elements) take AdamW; no step taken yet"
        in (opt.plan().describe())
    )
    train(opt, model, 1)
    assert "take AdamW; 1 step taken" in opt.plan().describe()


@pytest.mark.parametrize("cls", [MuSGD, Muon])
def test_groups_that_hold_no_matrix_warn(cls):
    vectors = [torch.nn.Parameter(torch.randn(5)), torch.nn.Parameter(torch.randn(3))]
    kwargs = {"use_muon": True} if cls is MuSGD else {}
    with pytest.warns(UserWarning, match="no param group without use_muon=False holds a matrix"):
        cls(vectors, **kwargs)


def test_an_explicit_muon_group_of_vectors_stays_an_error_in_muon():
    with pytest.raises(ValueError, match="use_muon=True group .* Muon orthogonalises matrices only"):
        Muon([{"params": [torch.nn.Parameter(torch.randn(5))], "use_muon": True}])


@pytest.mark.parametrize("cls", [MuSGD, Muon])
def test_param_groups_builds_quietly_and_the_plan_counts_what_muon_takes(cls):
    model = mlp()
    opt = built_quietly(lambda: cls(fastmuon.param_groups(model, head=None), lr=0.02, momentum=0.9))
    other = "SGD" if cls is MuSGD else "AdamW"
    share = f"Muon takes 2 of 4 parameters (2 matrices, 192 elements); the other 2 parameters (20 elements) take {other}"
    assert share in opt.plan().describe()  # before a step, with no gradient
    assert "no step taken yet" in opt.plan().describe() and "none has a gradient now" in opt.plan().describe()
    train(opt, model, 2)
    plan = opt.plan()
    assert plan.num_matrices == 2 and share in plan.describe()
    assert opt.plan() is plan  # the same plan while nothing changes
    train(opt, model, 1)
    assert opt.plan() is plan


def test_matrices_of_mapped_tensors_are_counted():
    w = torch.nn.Parameter(torch.randn(4, 6, 5))
    opt = Muon([{"params": [w], "use_muon": True, "matrices": "experts"}])
    assert "Muon takes 1 of 1 parameters (4 matrices, 120 elements)" in opt.plan().describe()


def test_foreach_false_and_a_fresh_copy_say_what_is_true():
    model = mlp()
    opt = Muon(fastmuon.param_groups(model, head=None), foreach=False)
    train(opt, model, 3)
    text = opt.plan().describe()
    assert "foreach=False runs the per-parameter loop, nothing is batched; Muon takes 2 of 4" in text
    assert "take AdamW; 3 steps taken\n" in text
    fresh = Muon(fastmuon.param_groups(model, head=None), foreach=False)
    fresh.load_state_dict(opt.state_dict())
    assert "no step taken since this optimizer was made (its state was loaded" in fresh.plan().describe()
