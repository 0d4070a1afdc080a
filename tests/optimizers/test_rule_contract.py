"""The rule contract (``fastmuon.step.contracts.Rule``): every rule satisfies it (mypy checks
what an optimizer class names; this checks the rules themselves at run time)."""

from __future__ import annotations

import pytest
import torch

import fastmuon
from fastmuon.rules import muon, musgd
from fastmuon.rules.second_moment import ADAMUON, NORMUON
from fastmuon.step.contracts import Rule

RULES = (muon, musgd, NORMUON, ADAMUON)


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.__name__)
def test_every_rule_satisfies_the_contract(rule):
    assert isinstance(rule, Rule)


@pytest.mark.parametrize(
    ("cls", "update"),
    [
        (fastmuon.Muon, "AdamW"),
        (fastmuon.NorMuon, "AdamW"),
        (fastmuon.AdaMuon, "AdamW"),
        (fastmuon.MuSGD, "SGD"),
    ],
)
def test_an_optimizer_with_no_matrix_names_the_update_its_rule_declares(cls, update):
    bias = torch.nn.Parameter(torch.zeros(4))
    with pytest.warns(UserWarning, match=f"orthogonalises no parameter: .* take {update}"):
        opt = cls([bias])
    assert opt.rule.other_update == update
    assert opt.muon_takes().other_update == update
