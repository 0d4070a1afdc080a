"""State dicts cross between Muon, NorMuon, AdaMuon and MuSGD in every order and along chains.

Each loaded optimizer's next step is checked against the per-parameter fp32 reference started
from the same weights and the buffers the loader promises to carry: the momentum (the same EMA
in all four), a second moment only from a state dict of the same variant (NorMuon's per-row
average and AdaMuon's elementwise one average different things), nothing else.
"""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
from conftest import rel_err
from reference_impl import musgd_reference_step, variant_reference_step
from torch import nn

from fastmuon import AdaMuon, Muon, MuSGD, NorMuon

HP = dict(lr=0.02, momentum=0.9, nesterov=True, ns_dtype=torch.float32)
VARIANT_KEYS = {"beta2", "moment_eps", "rescale", "sign_momentum"}
FAMILY = (Muon, NorMuon, AdaMuon, MuSGD)
NAME = {Muon: "muon", NorMuon: "normuon", AdaMuon: "adamuon", MuSGD: "musgd"}


def make_params(seed=0):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(8, 3, 3, 3), (12, 20), (20, 12), (12,)]
    return [nn.Parameter(torch.randn(s, generator=gen) * 0.5) for s in shapes]


def grads(params, seed):
    gen = torch.Generator().manual_seed(100 + seed)
    return [torch.randn(p.shape, generator=gen) for p in params]


def build(cls, params):
    groups = [{"params": params[:3], "use_muon": True}, {"params": params[3:], "use_muon": False}]
    return cls(groups, **HP)


def step(opt, params, seed):
    for p, g in zip(params, grads(params, seed)):
        p.grad = g.clone()
    opt.step()


def trained(cls, steps=2, seed=0):
    params = make_params(seed)
    opt = build(cls, params)
    for s in range(steps):
        step(opt, params, s)
    return opt, params


def assert_same_state_dict(a, b):
    """The same groups, and the same buffers bit for bit."""
    assert a["param_groups"] == b["param_groups"]
    assert a["state"].keys() == b["state"].keys()
    for pid, st in a["state"].items():
        assert st.keys() == b["state"][pid].keys()
        for k, v in st.items():
            assert torch.equal(torch.as_tensor(v), torch.as_tensor(b["state"][pid][k]))


def clone(params):
    return [nn.Parameter(p.detach().clone()) for p in params]


def carried_moment(source, target) -> bool:
    return source is target and target in (NorMuon, AdaMuon)


def expected_vector_state(source, target, saved):
    """The vector's buffers after loading: AdamW's between the Muon family, MuSGD's heavy ball
    between MuSGDs, nothing across (a heavy ball is no Adam moment)."""
    if (source is MuSGD) != (target is MuSGD):
        return {}
    return {k: saved[k] for k in saved}


def reference_matrices(target, group, params, source_opt, source_params, seed, moment_carried):
    """The target's next step on the matrices from the buffers the loader promises, one
    parameter at a time (fp32)."""
    out = [p.detach().clone() for p in params[:3]]
    for p, g, q in zip(out, grads(params, seed), source_params):
        saved = source_opt.state[q]
        state = {"momentum_buffer": saved["momentum_buffer"].clone()}  # the EMA in all four
        common = dict(lr=group["lr"], momentum=0.9, nesterov=True, weight_decay=group["weight_decay"])
        if target is MuSGD:
            if type(source_opt) is MuSGD:
                state["momentum_buffer_SGD"] = saved["momentum_buffer_SGD"].clone()
            else:  # both sums of βᵏ·g from zero where MuSGD's decay is 0 (its default)
                assert group["weight_decay"] == 0
                state["momentum_buffer_SGD"] = saved["momentum_buffer"] / (1 - 0.9)
            musgd_reference_step(p, g, state, use_muon=True, muon=group["muon"], sgd=group["sgd"], **common)
            continue
        if moment_carried:
            v = saved["second_moment"].clone()
            if target is NorMuon:
                state[("rows", 0)] = v
            else:
                state[("elems", 0)] = v.reshape(p.shape[0], -1)
        variant_reference_step(
            p, g, state, variant=NAME[target], beta2=group.get("beta2", 0.95),
            moment_eps=group.get("moment_eps", 1e-8), rescale=group.get("rescale"),
            sign_momentum=group.get("sign_momentum", False), **common,
        )  # fmt: skip
    return out


@pytest.mark.parametrize("source,target", list(itertools.product(FAMILY, FAMILY)), ids=lambda c: c.__name__)
def test_every_pair_loads_and_steps_from_what_it_carries(source, target):
    src, src_params = trained(source)
    saved = copy.deepcopy(src.state_dict())
    params = clone(src_params)
    opt = build(target, params)
    opt.load_state_dict(saved)
    own_keys = set(build(target, make_params()).param_groups[0])
    for group in opt.param_groups:
        assert set(group) <= own_keys, set(group) - own_keys  # no key of another variant kept
    moment = carried_moment(source, target)
    for p in params[:3]:
        assert ("second_moment" in opt.state[p]) is moment
    vector = expected_vector_state(source, target, src.state[src_params[3]])
    assert opt.state[params[3]].keys() == vector.keys()
    for k, v in vector.items():
        assert torch.equal(torch.as_tensor(opt.state[params[3]][k]), torch.as_tensor(v))
    expected = reference_matrices(target, opt.param_groups[0], params, src, src_params, 7, moment)
    step(opt, params, 7)
    for p, want in zip(params, expected):
        assert rel_err(p.detach(), want) < 1e-5
    assert torch.isfinite(params[3]).all()


CHAINS = [
    (NorMuon, Muon, AdaMuon),
    (AdaMuon, MuSGD, NorMuon),
    (NorMuon, AdaMuon, NorMuon),
    (AdaMuon, Muon, AdaMuon),
    (MuSGD, NorMuon, Muon, MuSGD),
]


@pytest.mark.parametrize("chain", CHAINS, ids=lambda c: "-".join(k.__name__ for k in c))
def test_chains_load_and_step_with_no_state_of_a_variant_passed_through(chain):
    """A second moment that an optimizer in the middle does not keep is not passed on, and no
    group keeps a key of an optimizer it is not; each link steps."""
    opt, params = trained(chain[0])
    for k, cls in enumerate(chain[1:], start=1):
        saved = copy.deepcopy(opt.state_dict())
        params = clone(params)
        opt = build(cls, params)
        opt.load_state_dict(saved)
        kept = carried_moment(chain[k - 1], cls)
        assert all(("second_moment" in opt.state[p]) is kept for p in params[:3])
        assert set(opt.param_groups[0]) <= set(build(cls, make_params()).param_groups[0])
        step(opt, params, 10 + k)
        assert all(torch.isfinite(p).all() for p in params)
    if chain[-1] in (NorMuon, AdaMuon):  # made afresh by the last step, of the variant's shape
        want = (8,) if chain[-1] is NorMuon else (8, 3, 3, 3)
        assert tuple(opt.state[params[0]]["second_moment"].shape) == want


@pytest.mark.parametrize("cls", [NorMuon, AdaMuon])
def test_a_second_moment_of_the_wrong_shape_is_refused_at_load_and_changes_nothing(cls):
    src, src_params = trained(cls)
    saved = copy.deepcopy(src.state_dict())
    (first,) = [pid for pid, st in saved["state"].items() if st.get("second_moment") is not None][:1]
    saved["state"][first]["second_moment"] = torch.zeros(5)
    params = clone(src_params)
    opt = build(cls, params)
    step(opt, params, 0)
    before = copy.deepcopy(opt.state_dict())
    with pytest.raises(ValueError, match=r"second_moment.*shape \(5,\).*(needs|matrix map)"):
        opt.load_state_dict(saved)
    assert_same_state_dict(opt.state_dict(), before)


def test_normuon_row_moments_under_a_matrix_map_load_with_the_map():
    """Per-row statistics of each expert (a map's matrices) have one entry per row per expert."""
    gen = torch.Generator().manual_seed(3)
    experts = nn.Parameter(torch.randn(4, 6, 5, generator=gen))
    group = {"params": [experts], "use_muon": True, "matrices": "experts"}
    src = NorMuon([group], **HP)
    experts.grad = torch.randn(4, 6, 5, generator=gen)
    src.step()
    assert src.state[experts]["second_moment"].shape == (24,)
    twin = nn.Parameter(experts.detach().clone())
    opt = NorMuon([{"params": [twin], "use_muon": True, "matrices": "experts"}], **HP)
    opt.load_state_dict(copy.deepcopy(src.state_dict()))
    assert torch.equal(opt.state[twin]["second_moment"], src.state[experts]["second_moment"])
    flat = NorMuon([{"params": [nn.Parameter(experts.detach().clone())], "use_muon": True}], **HP)
    saved = copy.deepcopy(src.state_dict())
    saved["param_groups"][0]["matrices"] = "flatten"  # a hand-edited map: one (4, 30) matrix, 4 rows
    with pytest.raises(ValueError, match=r"second_moment.*\(24,\).*needs \(4,\)"):
        flat.load_state_dict(saved)
    assert not flat.state


# ----- the tag naming the rule that wrote a state dict ------------------------------------
@pytest.mark.parametrize("cls", FAMILY, ids=lambda c: c.__name__)
def test_every_state_dict_names_the_rule_that_wrote_it(cls):
    opt, _ = trained(cls, steps=1)
    assert opt.state_dict()["fastmuon_family"] == NAME[cls]


@pytest.mark.parametrize(
    "cls, stray",
    [
        (Muon, {"sgd": 0.5}),
        (Muon, {"muon": 1.0}),
        (NorMuon, {"sign_momentum": True}),
        (AdaMuon, {"dampening": 0}),
    ],
    ids=["muon-sgd", "muon-muon", "normuon-sign_momentum", "adamuon-dampening"],
)
def test_a_round_trip_keeps_every_buffer_whatever_keys_the_groups_carry(cls, stray):
    """A group may carry keys of the user's own (torch keeps them); one that another family's
    groups have must not make loading read the buffers as that family's: the tag decides."""
    params = make_params(4)
    groups = [{"params": params[:3], **stray}, {"params": params[3:]}]  # use_muon: by shape
    opt = cls(groups, **HP)
    for s in range(2):
        step(opt, params, s)
    twin = clone(params)
    loaded = cls([{**g, "params": twin[:3] if i == 0 else twin[3:]} for i, g in enumerate(groups)], **HP)
    loaded.load_state_dict(copy.deepcopy(opt.state_dict()))
    for p, q in zip(params, twin):
        assert loaded.state[q].keys() == opt.state[p].keys()
    step(opt, params, 2)
    step(loaded, twin, 2)
    for p, q in zip(params, twin):
        assert torch.equal(p.detach(), q.detach())


@pytest.mark.parametrize("source,target", list(itertools.product(FAMILY, FAMILY)), ids=lambda c: c.__name__)
def test_an_untagged_state_dict_loads_as_the_tagged_one(source, target):
    """Older fastmuon versions wrote no tag, and loaders that keep only ``state`` and
    ``param_groups`` drop it: the groups' keys then tell the same writer."""
    src, src_params = trained(source)
    tagged = copy.deepcopy(src.state_dict())
    untagged = {k: v for k, v in copy.deepcopy(tagged).items() if k != "fastmuon_family"}
    loaded = []
    for saved in (tagged, untagged):
        opt = build(target, clone(src_params))
        opt.load_state_dict(saved)
        loaded.append(opt)
    assert_same_state_dict(*(o.state_dict() for o in loaded))


@pytest.mark.parametrize("tag", ["lion", 3, None])
def test_a_tag_this_version_does_not_know_is_refused_and_changes_nothing(tag):
    opt, params = trained(NorMuon)
    saved = copy.deepcopy(opt.state_dict())
    saved["fastmuon_family"] = tag
    before = copy.deepcopy(opt.state_dict())
    with pytest.raises(
        ValueError, match=r"state_dict\['fastmuon_family'\] is .*not one of .*delete that entry"
    ):
        opt.load_state_dict(saved)
    assert_same_state_dict(opt.state_dict(), before)
