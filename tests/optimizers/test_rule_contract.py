"""The rule contract (``fastmuon.step.contracts.Rule``): every rule module satisfies it, and an
optimizer class naming a rule that lacks a member is refused when the class is made."""

from __future__ import annotations

import types

import pytest
import torch

import fastmuon
from fastmuon.optim.base import MatrixOptimizer
from fastmuon.rules import muon, musgd
from fastmuon.rules.second_moment import ADAMUON, NORMUON
from fastmuon.step.contracts import Rule, missing_members

RULES = (muon, musgd, NORMUON, ADAMUON)


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.__name__)
def test_every_rule_satisfies_the_contract(rule):
    assert isinstance(rule, Rule) and missing_members(rule) == []


def test_a_class_naming_a_rule_without_a_member_is_refused_at_its_definition():
    lacking = types.ModuleType("lacking")
    lacking.__dict__.update({k: v for k, v in vars(muon).items() if k not in ("other_update", "reference")})
    with pytest.raises(TypeError, match=r"Broken\._rule .* lacks other_update, reference"):

        class Broken(MatrixOptimizer):
            _rule = lacking


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
