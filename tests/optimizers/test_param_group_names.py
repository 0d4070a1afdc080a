"""Named and unnamed param groups, side by side with torch.optim's rule.

torch.optim (2.6 and later) stores ``param_names`` for groups given ``(name, tensor)`` pairs and
refuses a named group beside unnamed ones ("all optimizer param groups should be with/without
names"). fastmuon follows it where torch accepts, and differs on purpose where torch refuses a
mix: ``fastmuon.param_groups`` returns named groups, and a plain group added beside them (or the
other way round) is the common case, so the side without names gets positional placeholders
(``"param_groups[i][j]"``); docs/optimizers.md says so.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fastmuon import AdaMuon, Muon, MuSGD, NorMuon

OURS = [Muon, MuSGD, NorMuon, AdaMuon]
TORCH = [torch.optim.SGD, torch.optim.AdamW]
MIXED = "all optimizer param groups should be with/without names"


def layers() -> tuple[nn.Linear, nn.Linear]:
    torch.manual_seed(0)
    return nn.Linear(4, 6), nn.Linear(6, 3)


def make(cls, params):
    """``cls`` at lr 0.01; MuSGD told to orthogonalise (its default leaves every matrix to SGD)."""
    return cls(params, lr=0.01, **({"use_muon": True} if cls is MuSGD else {}))


def names(opt: torch.optim.Optimizer) -> list[list[str] | None]:
    return [g.get("param_names") for g in opt.param_groups]


@pytest.mark.parametrize("cls", OURS + TORCH)
def test_all_named_or_all_unnamed_is_stored_as_torch_stores_it(cls):
    a, b = layers()
    assert names(make(cls, a.named_parameters())) == [["weight", "bias"]]
    assert names(make(cls, a.parameters())) == [None]
    named = make(cls, a.named_parameters())
    named.add_param_group({"params": list(b.named_parameters())})
    assert names(named) == [["weight", "bias"], ["weight", "bias"]]
    plain = make(cls, a.parameters())
    plain.add_param_group({"params": list(b.parameters())})
    assert names(plain) == [None, None]


def test_torch_refuses_a_mix():
    """The convention fastmuon departs from, as torch.optim states it."""
    a, b = layers()
    for cls in TORCH:
        with pytest.raises(ValueError, match=MIXED):
            make(cls, [{"params": list(a.named_parameters())}, {"params": list(b.parameters())}])
        opt = make(cls, a.parameters())
        with pytest.raises(ValueError, match=MIXED):
            opt.add_param_group({"params": list(b.named_parameters())})
        assert names(opt) == [None]
        opt = make(cls, a.named_parameters())
        with pytest.raises(ValueError, match=MIXED):
            opt.add_param_group({"params": list(b.parameters())})
        assert names(opt) == [["weight", "bias"]]


@pytest.mark.parametrize("cls", OURS)
def test_fastmuon_names_the_unnamed_side_of_a_mix(cls):
    a, b = layers()
    opt = make(cls, [{"params": list(a.named_parameters())}, {"params": list(b.parameters())}])
    assert names(opt) == [["weight", "bias"], ["param_groups[1][0]", "param_groups[1][1]"]]
    # a named group added to an unnamed optimizer names the groups before it too
    opt = make(cls, a.parameters())
    opt.add_param_group({"params": list(b.named_parameters())})
    assert names(opt) == [["param_groups[0][0]", "param_groups[0][1]"], ["weight", "bias"]]
    opt = make(cls, a.named_parameters())
    opt.add_param_group({"params": list(b.parameters())})
    assert names(opt) == [["weight", "bias"], ["param_groups[1][0]", "param_groups[1][1]"]]
    # the placeholders are names like any other: the state dict round-trips them
    fresh = make(cls, a.named_parameters())
    fresh.add_param_group({"params": list(b.parameters())})
    fresh.load_state_dict(opt.state_dict())
    assert names(fresh) == names(opt)


@pytest.mark.parametrize("cls", OURS + TORCH)
def test_a_group_half_named_is_refused_with_torchs_error(cls):
    """Within one group, pairs and bare tensors do not mix, in fastmuon as in torch."""
    a, _ = layers()
    with pytest.raises(ValueError, match="all optimizer params should be with/without names"):
        make(cls, [("weight", a.weight), a.bias])


@pytest.mark.parametrize("cls", OURS)
def test_a_refused_named_add_leaves_the_optimizer_unchanged(cls):
    """The placeholders for the earlier groups are written only once the add has passed."""
    a, b = layers()
    opt = make(cls, a.parameters())
    before = opt.state_dict()
    with pytest.raises(ValueError, match="more than one parameter group"):
        opt.add_param_group({"params": [("again", a.weight), ("weight", b.weight)]})
    assert names(opt) == [None] and len(opt.param_groups) == 1
    assert opt.state_dict() == before
