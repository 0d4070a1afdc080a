"""State dicts cross between fastmuon and the optimizers it replaces, in both directions.

Each cross-load test steps one optimizer, saves, loads into the other and steps on; what the
loaded optimizer then does is checked against the per-parameter fp32 reference started from the
same weights and the buffers the mapping promises (see fastmuon.optim.checkpoint).
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import rel_err
from helpers import ultralytics_musgd_class
from reference_impl import adamw_reference_step, muon_reference_step, musgd_reference_step
from torch import nn

from fastmuon import Muon, MuSGD

F32 = dict(ns_dtype=torch.float32)
MIX = dict(muon=0.3, sgd=0.7)


def ultralytics_musgd():
    return ultralytics_musgd_class()


def to_fp16_like_ultralytics(state_dict):
    """What Ultralytics' trainer does to an optimizer state dict before saving it: fp32 buffers
    to fp16, except ``step``, ``exp_avg``, ``exp_avg_sq`` (its convert_optimizer_state_dict_to_fp16)."""
    sd = copy.deepcopy(state_dict)
    for state in sd["state"].values():
        for k, v in state.items():
            if (
                k not in {"step", "exp_avg", "exp_avg_sq"}
                and isinstance(v, torch.Tensor)
                and v.dtype == torch.float32
            ):
                state[k] = v.half()
    return sd


def model_params(seed=0):
    """A conv, a matrix, vectors: ``(matrices, others)`` as fresh leaf parameters."""
    gen = torch.Generator().manual_seed(seed)
    shapes_m, shapes_o = [(8, 4, 3, 3), (12, 20), (20, 12)], [(8,), (12,)]
    make = lambda s: nn.Parameter(torch.randn(s, generator=gen) * 0.5)  # noqa: E731
    return [make(s) for s in shapes_m], [make(s) for s in shapes_o]


def grads_for(params, seed):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(p.shape, generator=gen) for p in params]


def step_with(opt, params, seed):
    for p, g in zip(params, grads_for(params, seed)):
        p.grad = g.clone()
    opt.step()


def musgd_groups(mats, others, **hp):
    return [{"params": mats, "use_muon": True, **hp}, {"params": others, "use_muon": False, **hp}]


def clone(params):
    return [nn.Parameter(p.detach().clone()) for p in params]


def reference_musgd(params, states, seeds, hp, use_muon):
    for seed in seeds:
        for p, g, st, um in zip(params, grads_for(params, seed), states, use_muon):
            with torch.no_grad():
                musgd_reference_step(p, g, st, use_muon=um, **hp)


# ----- Ultralytics' MuSGD ------------------------------------------------------------------------
def test_ultralytics_checkpoint_loads_into_fastmuon_and_steps_like_the_reference():
    UMuSGD = ultralytics_musgd()
    mats, others = model_params()
    theirs = mats + others
    hp = dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=5e-4)
    u = UMuSGD(musgd_groups(mats, others, **hp), **MIX)
    for seed in range(3):
        step_with(u, theirs, seed)
    saved = to_fp16_like_ultralytics(u.state_dict())
    assert all(g.keys() >= {"use_muon"} and "ns_steps" not in g for g in saved["param_groups"])

    ours = clone(theirs)
    opt = MuSGD(musgd_groups(ours[:3], ours[3:]), **MIX, **F32)
    opt.load_state_dict(saved)
    for p in ours:  # fp16 buffers back in the parameter's dtype, under Ultralytics' names
        assert all(v.dtype == torch.float32 for v in opt.state[p].values())
    assert set(opt.state[ours[0]]) == {"momentum_buffer", "momentum_buffer_SGD"}
    assert set(opt.state[ours[3]]) == {"momentum_buffer"}

    ref = clone(theirs)
    states = [{k: v.float().clone() for k, v in saved["state"][i].items()} for i in range(len(ref))]
    for seed in (3, 4):
        step_with(opt, ours, seed)
        step_with(u, theirs, seed)
    reference_musgd(ref, states, (3, 4), {**hp, **MIX}, [True] * 3 + [False] * 2)
    for o, t, r in zip(ours, theirs, ref):
        assert rel_err(o.detach(), r) <= 1e-5
        assert rel_err(t.detach(), r) <= 2e-2  # Ultralytics iterates NS in bf16


def test_fastmuon_checkpoint_loads_into_ultralytics_and_steps_like_the_reference():
    UMuSGD = ultralytics_musgd()
    mats, others = model_params(1)
    ours = mats + others
    hp = dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=5e-4)
    # the second group does not say use_muon: it takes the default, and is saved with it
    opt = MuSGD([{"params": mats, "use_muon": True}, {"params": others}], **hp, **MIX, **F32)
    for seed in range(3):
        step_with(opt, ours, seed)
    saved = to_fp16_like_ultralytics(opt.state_dict())
    assert [g["use_muon"] for g in saved["param_groups"]] == [True, False]

    theirs = clone(ours)
    u = UMuSGD([{"params": theirs[:3], "use_muon": True}, {"params": theirs[3:]}], **hp, **MIX)
    u.load_state_dict(saved)
    ref = clone(ours)
    states = [{k: v.float().clone() for k, v in saved["state"][i].items()} for i in range(len(ref))]
    for seed in (3, 4):
        step_with(u, theirs, seed)
        step_with(opt, ours, seed)
    reference_musgd(ref, states, (3, 4), {**hp, **MIX}, [True] * 3 + [False] * 2)
    for t, r in zip(theirs, ref):
        assert rel_err(t.detach(), r) <= 2e-2


# ----- torch.optim ------------------------------------------------------------------------------
def test_torch_muon_checkpoint_both_ways():
    gen = torch.Generator().manual_seed(3)
    theirs = [nn.Parameter(torch.randn(s, generator=gen)) for s in [(12, 20), (20, 12), (16, 16)]]
    hp = dict(lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True)
    t = torch.optim.Muon(theirs, **hp)
    for seed in range(3):
        step_with(t, theirs, seed)
    ours = clone(theirs)
    opt = Muon(ours, **F32)  # other hyperparameters: the saved ones win
    opt.load_state_dict(t.state_dict())
    assert opt.param_groups[0]["momentum"] == 0.95 and opt.param_groups[0]["ns_method"] == "auto"
    ref = clone(theirs)
    states = [{"momentum_buffer": t.state[p]["momentum_buffer"].clone()} for p in theirs]
    for seed in (3, 4):
        step_with(opt, ours, seed)
        for p, g, st in zip(ref, grads_for(ref, seed), states):
            with torch.no_grad():
                muon_reference_step(p, g, st, **hp)
    for o, r in zip(ours, ref):
        assert rel_err(o.detach(), r) <= 1e-5
    # and back: torch's Muon steps from what fastmuon saved
    back = clone(ours)
    t2 = torch.optim.Muon(back, **hp)
    t2.load_state_dict(opt.state_dict())
    step_with(t2, back, 5)
    step_with(opt, ours, 5)
    for b, o in zip(back, ours):
        assert rel_err(b.detach(), o.detach()) <= 2e-2  # torch iterates NS in bf16


@pytest.mark.parametrize("matrix_decay", [5e-4, 0.0])
def test_torch_sgd_checkpoint_loads_into_musgd(matrix_decay):
    """SGD's heavy ball becomes MuSGD's SGD buffer; the Muon EMA starts from zero unless the
    heavy ball saw no weight decay, when it is exactly ``(1−β)·B``."""
    mats, others = model_params(4)
    theirs = mats + others
    beta = 0.9
    t = torch.optim.SGD(
        [
            {"params": mats, "weight_decay": matrix_decay},
            {"params": others, "weight_decay": 0.0},
        ],
        lr=0.05,
        momentum=beta,
        nesterov=True,
    )
    for seed in range(3):
        step_with(t, theirs, seed)
    ours = clone(theirs)
    opt = MuSGD(musgd_groups(ours[:3], ours[3:]), **MIX, **F32)
    opt.load_state_dict(t.state_dict())
    assert "dampening" not in opt.param_groups[0] and opt.param_groups[0]["ns_steps"] == 5
    heavy = [t.state[p]["momentum_buffer"] for p in theirs]
    for j in range(3):
        assert torch.equal(opt.state[ours[j]]["momentum_buffer_SGD"], heavy[j])
        if matrix_decay:
            assert "momentum_buffer" not in opt.state[ours[j]]
        else:
            assert torch.allclose(opt.state[ours[j]]["momentum_buffer"], heavy[j] * (1 - beta))
    for j in (3, 4):
        assert torch.equal(opt.state[ours[j]]["momentum_buffer"], heavy[j])
    ref = clone(theirs)
    states = [{k: v.clone() for k, v in opt.state[p].items()} for p in ours]
    hp = dict(lr=0.05, momentum=beta, nesterov=True, **MIX)
    step_with(opt, ours, 3)
    for p, g, st, um, wd in zip(
        ref, grads_for(ref, 3), states, [True] * 3 + [False] * 2, [matrix_decay] * 3 + [0] * 2
    ):
        with torch.no_grad():
            musgd_reference_step(p, g, st, use_muon=um, weight_decay=wd, **hp)
    for o, r in zip(ours, ref):
        assert rel_err(o.detach(), r) <= 1e-5


def test_torch_adamw_checkpoint_loads_into_muon():
    """AdamW's moments and step carry over to Muon's AdamW part; a matrix's ``exp_avg`` becomes
    its Muon momentum where ``betas[0]`` is the group's momentum."""
    mats, others = model_params(5)
    theirs = mats + others
    t = torch.optim.AdamW(
        [{"params": mats}, {"params": others}], lr=0.01, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1
    )
    for seed in range(3):
        step_with(t, theirs, seed)
    ours = clone(theirs)
    opt = Muon(
        [{"params": ours[:3], "use_muon": True}, {"params": ours[3:], "use_muon": False}], momentum=0.9, **F32
    )
    opt.load_state_dict(t.state_dict())
    assert "amsgrad" not in opt.param_groups[0]
    assert opt.param_groups[0]["eps"] == 1e-7 and opt.param_groups[0]["adamw_eps"] == 1e-8
    assert opt.param_groups[1]["eps"] == 1e-8
    for p, q in zip(ours[3:], theirs[3:]):
        step = opt.state[p]["step"]
        assert step.dtype == torch.float32 and step.device.type == "cpu" and step.item() == 3
        assert torch.equal(opt.state[p]["exp_avg_sq"], t.state[q]["exp_avg_sq"])
    for p, q in zip(ours[:3], theirs[:3]):
        assert set(opt.state[p]) == {"momentum_buffer"}
        assert torch.equal(opt.state[p]["momentum_buffer"], t.state[q]["exp_avg"])

    ref = clone(theirs)
    muon_states = [{"momentum_buffer": t.state[q]["exp_avg"].clone()} for q in theirs[:3]]
    adam_states = [
        {"t": 3, "m": t.state[q]["exp_avg"].clone(), "v": t.state[q]["exp_avg_sq"].clone()}
        for q in theirs[3:]
    ]
    step_with(opt, ours, 3)
    g = grads_for(ref, 3)
    with torch.no_grad():
        for p, gp, st in zip(ref[:3], g[:3], muon_states):
            muon_reference_step(p, gp, st, lr=0.01, momentum=0.9, nesterov=True, weight_decay=0.1)
        for p, gp, st in zip(ref[3:], g[3:], adam_states):
            adamw_reference_step(p, gp, st, lr=0.01, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    for o, r in zip(ours, ref):
        assert rel_err(o.detach(), r) <= 1e-5
    # another momentum than betas[0]: not the same average, so the matrices start from zero
    other = clone(theirs)
    opt = Muon([{"params": other[:3], "use_muon": True}, {"params": other[3:], "use_muon": False}], **F32)
    opt.load_state_dict(t.state_dict())
    assert all(not opt.state[p] for p in other[:3]) and all(opt.state[p] for p in other[3:])


def test_musgd_checkpoint_into_muon_keeps_only_what_is_exact():
    """MuSGD's Muon EMA is Muon's momentum; its coupled weight decay is not Muon's decoupled one."""
    mats, others = model_params(6)
    src = MuSGD(musgd_groups(mats, others, weight_decay=5e-4), lr=0.02, momentum=0.95, **F32)
    for seed in range(2):
        step_with(src, mats + others, seed)
    ours = clone(mats + others)
    opt = Muon([{"params": ours[:3], "use_muon": True}, {"params": ours[3:], "use_muon": False}], **F32)
    opt.load_state_dict(src.state_dict())
    g0 = opt.param_groups[0]
    assert g0["weight_decay"] == 0.1 and "sgd" not in g0 and g0["momentum"] == 0.95
    for p, q in zip(ours[:3], mats):
        assert torch.equal(opt.state[p]["momentum_buffer"], src.state[q]["momentum_buffer"])
    assert all(not opt.state[p] for p in ours[3:])  # heavy ball is not an Adam moment
    step_with(opt, ours, 5)
    assert all(torch.isfinite(p).all() for p in ours)


# ----- older fastmuon versions ---------------------------------------------------------------
@pytest.mark.parametrize("cls", [MuSGD, Muon])
def test_can_load_older_state_dict(cls):
    """A state dict whose groups lack keys added later loads, and the run goes on identically."""
    mats, others = model_params(7)
    params = mats + others
    groups = [{"params": mats, "use_muon": True}, {"params": others, "use_muon": False}]
    opt = cls(groups, lr=0.02, momentum=0.9, **F32)
    for seed in range(2):
        step_with(opt, params, seed)
    old = copy.deepcopy(opt.state_dict())
    del old["fastmuon_family"]  # older versions named no rule
    newer = {
        "ns_method",
        "ns_dtype",
        "adjust_lr",
        "adjust_lr_fn",
        "muon",
        "sgd",
        "adamw_eps",
        "use_muon",
        "betas",
    }
    for g in old["param_groups"]:
        for key in newer:
            g.pop(key, None)
    twin = clone(params)
    loaded = cls(
        [{"params": twin[:3], "use_muon": True}, {"params": twin[3:], "use_muon": False}],
        lr=0.02,
        momentum=0.9,
        **F32,
    )
    loaded.load_state_dict(old)
    assert loaded.param_groups[0]["ns_method"] == "auto" and loaded.param_groups[1]["use_muon"] is False
    for seed in (2, 3):
        step_with(opt, params, seed)
        step_with(loaded, twin, seed)
    for a, b in zip(params, twin):
        assert torch.equal(a.detach(), b.detach())


def test_loaded_buffers_do_not_share_storage_with_the_state_dict():
    mats, others = model_params(8)
    opt = MuSGD(musgd_groups(mats, others), momentum=0.9, **F32)
    step_with(opt, mats + others, 0)
    saved = opt.state_dict()
    before = copy.deepcopy(saved)
    twin = clone(mats + others)
    loaded = MuSGD(musgd_groups(twin[:3], twin[3:]), momentum=0.9, **F32)
    loaded.load_state_dict(saved)
    step_with(loaded, twin, 1)
    for pid, st in saved["state"].items():
        for k, v in st.items():
            assert torch.equal(v, before["state"][pid][k])


# ----- refusals leave the optimizer as it was ------------------------------------------------
def snapshot(opt):
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    params = [[id(p) for p in g["params"]] for g in opt.param_groups]
    state = {id(p): {k: v.clone() for k, v in s.items()} for p, s in opt.state.items()}
    return groups, params, state


def assert_same(a, b):
    assert a[0] == b[0] and a[1] == b[1]
    assert a[2].keys() == b[2].keys()
    for pid in a[2]:
        assert a[2][pid].keys() == b[2][pid].keys()
        for k in a[2][pid]:
            assert torch.equal(a[2][pid][k], b[2][pid][k])


def _break(sd, how):
    g0, first = sd["param_groups"][0], sd["param_groups"][0]["params"][0]
    if how == "shape":
        sd["state"][first]["momentum_buffer"] = torch.zeros(3, 3)
    elif how == "groups":
        sd["param_groups"] = sd["param_groups"][:1]
    elif how == "params":
        g0["params"] = g0["params"][:-1]
    elif how == "lr":
        g0["lr"] = "0.01"
    elif how == "momentum":
        g0["momentum"] = [0.9]
    elif how == "nesterov":
        g0["nesterov"] = "yes"
    elif how == "buffer_type":
        sd["state"][first]["momentum_buffer"] = "zeros"
    elif how == "buffer_dtype":
        buf = sd["state"][first]["momentum_buffer"]
        sd["state"][first]["momentum_buffer"] = torch.zeros(buf.shape, dtype=torch.int64)
    elif how == "state_entry":
        sd["state"][first] = [1, 2]
    elif how == "no_params":
        del g0["params"]
    return sd


@pytest.mark.parametrize(
    "how, match",
    [
        ("shape", r"parameter 0 of param group 0 .*'momentum_buffer' has shape \(3, 3\)"),
        ("groups", "1 param groups, this optimizer 2"),
        ("params", "param group 0 has 2 parameters in the state dict and 3"),
        ("lr", r"learning rate .* param group 0 of the state dict.*state_dict\['param_groups'\]\[0\]"),
        ("momentum", "momentum .* param group 0"),
        ("nesterov", "nesterov in param group 0"),
        ("buffer_type", "parameter 0 of param group 0 .*'momentum_buffer' is 'zeros'.*drop that entry"),
        ("buffer_dtype", "torch.int64 tensor, not a floating-point buffer"),
        ("state_entry", "parameter 0 of param group 0 .*not a dict"),
        ("no_params", "param group 0 of the state dict has no 'params' list"),
    ],
)
def test_unusable_state_dict_is_refused_and_changes_nothing(how, match):
    mats, others = model_params(9)
    opt = MuSGD(musgd_groups(mats, others), momentum=0.9, **F32)
    step_with(opt, mats + others, 0)
    bad = _break(copy.deepcopy(opt.state_dict()), how)
    before = snapshot(opt)
    with pytest.raises((TypeError, ValueError), match=match):
        opt.load_state_dict(bad)
    assert_same(before, snapshot(opt))
    step_with(opt, mats + others, 1)  # still usable


# ----- load hooks ------------------------------------------------------------------------------
@pytest.mark.parametrize("cls", [MuSGD, Muon])
def test_post_hook_may_store_anything_and_runs_after_the_clean_up(cls):
    mats, others = model_params(10)
    groups = [{"params": mats, "use_muon": True}, {"params": others, "use_muon": False}]
    opt = cls(groups, momentum=0.9, **F32)
    step_with(opt, mats + others, 0)
    sd = opt.state_dict()
    for st in sd["state"].values():  # a step saved as float64 (as some tools rewrite it)
        if "step" in st:
            st["step"] = st["step"].double()
    seen = []

    def post_hook(optimizer):
        seen.append(
            [s["step"].dtype for s in optimizer.state.values() if isinstance(s, dict) and "step" in s]
        )
        seen.append(len(optimizer.orthogonalizers()))
        optimizer.state["loaded_by_hook"] = True  # not a parameter's dict

    opt.register_load_state_dict_post_hook(post_hook)
    opt.load_state_dict(sd)
    opt.load_state_dict(sd)  # the stored value does not upset a second load either
    assert opt.state["loaded_by_hook"] is True
    assert all(dtype == torch.float32 for dtype in seen[0]) and seen[1] == 0
    step_with(opt, mats + others, 1)


def test_pre_hooks_run_before_the_checks_and_may_replace_the_state_dict():
    mats, others = model_params(11)
    opt = MuSGD(musgd_groups(mats, others), momentum=0.9, **F32)
    step_with(opt, mats + others, 0)
    sd = opt.state_dict()
    order = []

    def set_lr(optimizer, state_dict):
        order.append("pre1")
        state_dict["param_groups"][0]["lr"] = 0.123

    def replace(optimizer, state_dict):
        order.append("pre2")
        new = copy.deepcopy(state_dict)
        new["param_groups"] = new["param_groups"][:2]  # drops the group the checks would refuse
        new["param_groups"][1]["lr"] = 0.456
        return new

    sd["param_groups"].append({**sd["param_groups"][1], "params": []})  # a group this optimizer lacks
    opt.register_load_state_dict_pre_hook(set_lr)
    opt.register_load_state_dict_pre_hook(replace)
    opt.register_load_state_dict_post_hook(lambda o: order.append("post"))
    opt.load_state_dict(sd)
    assert order == ["pre1", "pre2", "post"]
    assert [g["lr"] for g in opt.param_groups] == [0.123, 0.456]
