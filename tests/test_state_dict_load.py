"""Corners a new user meets: torch's constructor convention, checkpoints saved by other
optimizers with keys or buffers missing, and matrix maps given or edited by hand."""

from __future__ import annotations

import copy

import pytest
import torch

import fastmuon

OPTIMIZERS = [fastmuon.MuSGD, fastmuon.Muon]


@pytest.mark.parametrize("cls", OPTIMIZERS, ids=lambda c: c.__name__)
def test_constructor_checks_its_arguments_before_reading_params(cls):
    # the call torch's generic optimizer tests (test_errors) make for every optimizer
    with pytest.raises(ValueError, match="Tensor lr must be 1-element"):
        cls(None, lr=torch.tensor([0.001, 0.001]))


def _musgd_after_one_step() -> tuple[fastmuon.MuSGD, torch.nn.Parameter, torch.nn.Parameter]:
    torch.manual_seed(0)
    w, b = torch.nn.Parameter(torch.randn(20, 30)), torch.nn.Parameter(torch.randn(30))
    opt = fastmuon.MuSGD(
        [dict(params=[w], use_muon=True), dict(params=[b], use_muon=False)], lr=0.05, momentum=0.9
    )
    w.grad, b.grad = torch.randn(20, 30), torch.randn(30)
    opt.step()
    return opt, w, b


def test_saved_groups_without_momentum_keep_their_buffers_at_the_filled_momentum():
    opt, w, b = _musgd_after_one_step()
    saved = copy.deepcopy(opt.state_dict())
    for g in saved["param_groups"]:
        g.pop("momentum")
    expected = {p: {k: v.clone() for k, v in opt.state[p].items()} for p in (w, b)}
    opt.load_state_dict(saved)
    assert opt.param_groups[0]["momentum"] == 0.9
    assert sorted(opt.state[w]) == ["momentum_buffer", "momentum_buffer_SGD"]
    for p in (w, b):
        assert opt.state[p].keys() == expected[p].keys()
        for name, buf in expected[p].items():
            torch.testing.assert_close(opt.state[p][name], buf, rtol=0, atol=0)


@pytest.mark.parametrize("source", ["sgd", "muon"])
def test_torch_state_dicts_without_momentum_keep_their_buffers(source):
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(20, 30))
    if source == "sgd":
        peer = torch.optim.SGD([w], lr=0.05, momentum=0.9)
        target = fastmuon.MuSGD([dict(params=[w], use_muon=False)], lr=0.05, momentum=0.9)
    else:
        peer = torch.optim.Muon([w], lr=0.05, momentum=0.9)
        target = fastmuon.Muon([w], lr=0.05, momentum=0.9)
    w.grad = torch.randn(20, 30)
    peer.step()
    saved = copy.deepcopy(peer.state_dict())
    saved["param_groups"][0].pop("momentum")
    target.load_state_dict(saved)
    torch.testing.assert_close(
        target.state[w]["momentum_buffer"], peer.state[w]["momentum_buffer"], rtol=0, atol=0
    )


def _sgd_group(**overrides) -> dict:
    """A param group as torch.optim.SGD saves it."""
    group = dict(lr=0.05, momentum=0.9, dampening=0, weight_decay=0.0, nesterov=False, maximize=False)
    return {**group, "foreach": None, "differentiable": False, "fused": None, "params": [0], **overrides}


@pytest.mark.parametrize("use_muon", [True, False])
@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_none_buffers_load_as_no_buffer_and_restart(use_muon, momentum):
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(20, 30))
    twin = torch.nn.Parameter(w.detach().clone())
    opt = fastmuon.MuSGD([dict(params=[w], use_muon=use_muon)], lr=0.05, momentum=momentum)
    fresh = fastmuon.MuSGD([dict(params=[twin], use_muon=use_muon)], lr=0.05, momentum=momentum)
    saved = {"state": {0: {"momentum_buffer": None}}, "param_groups": [_sgd_group(momentum=momentum)]}
    opt.load_state_dict(saved)
    assert all(v is not None for v in opt.state[w].values())
    grad = torch.randn(20, 30)
    w.grad, twin.grad = grad.clone(), grad.clone()
    opt.step()
    fresh.step()
    torch.testing.assert_close(w, twin, rtol=0, atol=0)


def test_none_buffers_from_a_muon_state_dict_load_into_muon():
    w = torch.nn.Parameter(torch.randn(20, 30))
    peer = torch.optim.Muon([w], lr=0.05)
    saved = copy.deepcopy(peer.state_dict())
    saved["state"] = {0: {"momentum_buffer": None}}
    opt = fastmuon.Muon([w], lr=0.05)
    opt.load_state_dict(saved)
    assert "momentum_buffer" not in opt.state[w]


@pytest.mark.parametrize(
    "good, bad",
    [
        ({"heads": 2}, {"heads": 2.0}),
        ({"batch_dims": 1}, {"batch_dims": True}),
        ({"split": [4, 4]}, {"split": [4.0, 4.0]}),
        ({"transposed": True}, {"transposed": 1}),
        ({"split": [4, 4], "dim": 1}, {"split": [4, 4], "dim": 1.0}),
    ],
)
@pytest.mark.parametrize("cls", OPTIMIZERS, ids=lambda c: c.__name__)
def test_a_map_is_refused_whatever_equal_map_was_parsed_before(cls, good, bad):
    shape = (2, 8, 8) if "batch_dims" in good else (8, 8)
    cls([{"params": [torch.nn.Parameter(torch.randn(shape))], "matrices": good, "use_muon": True}])
    with pytest.raises(ValueError, match="of a matrix map must be"):
        cls([{"params": [torch.nn.Parameter(torch.randn(shape))], "matrices": bad, "use_muon": True}])


def _build(cls, p: torch.nn.Parameter, foreach: bool | None) -> torch.optim.Optimizer:
    group = {"params": [p], "use_muon": True}
    if cls is fastmuon.MuSGD:
        return cls([group], lr=0.05, momentum=0.9, foreach=foreach)
    return cls([group], lr=0.05, foreach=foreach)


@pytest.mark.parametrize(
    "shape, edited",
    [
        ((6, 10), "experts"),
        ((4, 5, 6), {"batch_dims": 2}),
        ((8, 3, 3, 3), "transposed"),
        ((6, 10), {"heads": 4}),
    ],
)
@pytest.mark.parametrize("foreach", [None, False])
@pytest.mark.parametrize("cls", OPTIMIZERS, ids=lambda c: c.__name__)
def test_a_map_set_on_a_group_after_construction_is_checked_by_the_next_step(cls, foreach, shape, edited):
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(shape))
    twin = torch.nn.Parameter(p.detach().clone())
    opt, reference = _build(cls, p, foreach), _build(cls, twin, foreach)
    grads = [torch.randn(shape) for _ in range(3)]
    p.grad, twin.grad = grads[0].clone(), grads[0].clone()
    opt.step()
    reference.step()
    before = copy.deepcopy(opt.state_dict())
    weights = p.detach().clone()
    opt.param_groups[0]["matrices"] = edited
    p.grad = grads[1].clone()
    with pytest.raises(ValueError, match=r"parameter 0 of param group 0 \(shape .*matrix map"):
        opt.step()
    assert torch.equal(p, weights)
    assert str(opt.state_dict()["state"]) == str(before["state"])
    # put back, it steps on as an optimizer that never saw the edit
    opt.param_groups[0]["matrices"] = "flatten"
    for grad in grads[1:]:
        p.grad, twin.grad = grad.clone(), grad.clone()
        opt.step()
        reference.step()
    torch.testing.assert_close(p, twin, rtol=0, atol=0)
