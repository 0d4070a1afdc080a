"""The prepared step program: per-step hyperparameters take effect, the program is rebuilt when
what it was built for changes, and the capturable step reads nothing on the host."""

import copy
import gc
import importlib
import weakref

import pytest
import torch
from conftest import rel_err
from helpers import clone_params, make_grads, make_params, warns_no_muon
from reference_impl import adamw_reference_step, muon_reference_step, musgd_reference_step

from fastmuon import Muon, MuSGD
from fastmuon.bench.hosttime import host_syncs

F32 = dict(ns_dtype=torch.float32)
SHAPES = [(16, 8, 3, 3), (24, 40), (40, 24), (16,), (24,)]


def _groups(params, **over):
    return [{"params": params[:3], "use_muon": True, **over}, {"params": params[3:], "use_muon": False}]


def _musgd_reference(params, states, grads, groups_hp):
    for (idx, hp), use_muon in zip(groups_hp, (True, False)):
        for i in idx:
            if grads[i] is not None:
                musgd_reference_step(params[i], grads[i], states[i], use_muon=use_muon, **hp)


def _guard(capturable: bool) -> str:
    """The default non-finite check where it may run, the device-side one in a captured step."""
    return "skip" if capturable else "raise"


def _set_grads(params, grads):
    for p, g in zip(params, grads):
        p.grad = None if g is None else g.clone()


@pytest.mark.parametrize("capturable", [False, True])
def test_musgd_reads_lr_and_momentum_every_step(capturable):
    """A warm-up schedule edits ``lr`` and ``momentum`` in the groups between steps (as
    Ultralytics' trainer does); every step uses that step's values."""
    params = make_params(SHAPES)
    ours = clone_params(params)
    hp = dict(nesterov=True, weight_decay=1e-3, muon=0.4, sgd=0.6)
    opt = MuSGD(
        _groups(ours), lr=0.01, momentum=0.5, capturable=capturable, nonfinite=_guard(capturable), **hp, **F32
    )
    ref = [p.detach().clone() for p in params]
    states = [{} for _ in params]
    schedule = [(0.01, 0.5, 0.02), (0.03, 0.7, 0.01), (0.05, 0.9, 0.05), (0.05, 0.9, 0.05)]
    for step, (lr, momentum, other_lr) in enumerate(schedule):
        opt.param_groups[0]["lr"], opt.param_groups[0]["momentum"] = lr, momentum
        opt.param_groups[1]["lr"], opt.param_groups[1]["momentum"] = other_lr, momentum
        grads = make_grads(params, steps=1, seed=10 + step)[0]
        _set_grads(ours, grads)
        opt.step()
        _musgd_reference(
            ref,
            states,
            grads,
            [
                ([0, 1, 2], {**hp, "lr": lr, "momentum": momentum}),
                ([3, 4], {**hp, "lr": other_lr, "momentum": momentum}),
            ],
        )
        for o, r in zip(ours, ref):
            assert rel_err(o.detach(), r) <= 1e-5, (step, o.shape)


@pytest.mark.parametrize("capturable", [False, True])
def test_muon_reads_lr_and_weight_decay_every_step(capturable):
    params = make_params(SHAPES)
    ours = clone_params(params)
    opt = Muon(
        _groups(ours), lr=0.01, weight_decay=0.1, capturable=capturable, nonfinite=_guard(capturable), **F32
    )
    ref = [p.detach().clone() for p in params]
    states = [{} for _ in params]
    for step, (lr, wd) in enumerate([(0.01, 0.1), (0.02, 0.0), (0.04, 0.2)]):
        for group in opt.param_groups:
            group["lr"], group["weight_decay"] = lr, wd
        grads = make_grads(params, steps=1, seed=20 + step)[0]
        _set_grads(ours, grads)
        opt.step()
        for i in range(3):
            muon_reference_step(
                ref[i], grads[i], states[i], lr=lr, momentum=0.95, nesterov=True, weight_decay=wd
            )
        for i in range(3, 5):
            adamw_reference_step(ref[i], grads[i], states[i], lr=lr, weight_decay=wd)
        for o, r in zip(ours, ref):
            assert rel_err(o.detach(), r) <= 1e-5, (step, o.shape)


def test_a_tensor_lr_is_used_as_a_tensor():
    """Writing a new value into a tensor ``lr`` (what a captured graph replays) takes effect
    without a rebuild and without the step reading it on the host."""
    params = make_params(SHAPES)
    by_float, by_tensor = clone_params(params), clone_params(params)
    lr = torch.tensor(0.01)
    floats = MuSGD(_groups(by_float), lr=0.01, momentum=0.9, **F32)
    tensors = MuSGD(
        _groups(by_tensor, lr=lr), lr=0.01, momentum=0.9, capturable=True, nonfinite="skip", **F32
    )
    for step, value in enumerate([0.01, 0.03, 0.02]):
        floats.param_groups[0]["lr"] = value
        lr.fill_(value)
        grads = make_grads(params, steps=1, seed=30 + step)[0]
        _set_grads(by_float, grads)
        _set_grads(by_tensor, grads)
        floats.step()
        tensors.step()
    assert len(tensors._driver.cache.programs) == 1
    for a, b in zip(by_float, by_tensor):
        assert rel_err(b.detach(), a.detach()) <= 1e-6


def test_gaining_and_losing_gradients_rebuilds_the_program():
    params = make_params(SHAPES)
    opt = MuSGD(_groups(params), lr=0.02, momentum=0.9, **F32)
    grads = make_grads(params, steps=3)
    _set_grads(params, grads[0])
    opt.step()
    (first,) = opt._driver.cache.programs.values()
    params[1].grad = None
    opt.step()
    assert len(opt._driver.cache.programs) == 2 and first not in [
        opt._driver.cache.programs[k] for k in list(opt._driver.cache.programs)[1:]
    ]
    _set_grads(params, grads[2])
    opt.step()
    assert len(opt._driver.cache.programs) == 2  # the first program serves again


@pytest.mark.parametrize("cls", [MuSGD, Muon])
def test_a_kept_program_holds_no_gradient(cls):
    """The program outlives the step that built it; the gradients it was built from are freed
    once the model drops them (a kept gradient would cost a model's worth of memory)."""
    params = make_params(SHAPES)
    opt = cls(_groups(params, matrices=["flatten", {"split": [12, 12]}, "flatten"]), lr=0.02, **F32)
    _set_grads(params, make_grads(params, steps=1)[0])
    opt.step()
    grads = [weakref.ref(p.grad) for p in params]
    for p in params:
        p.grad = None
    gc.collect()
    assert len(opt._driver.cache.programs) == 1 and not any(g() is not None for g in grads)


def test_load_state_dict_and_add_param_group_invalidate_the_program():
    """After ``load_state_dict`` the step uses the loaded buffers (not the ones the program was
    built over); after ``add_param_group`` the new parameters step."""
    params = make_params(SHAPES)
    a_params, b_params = clone_params(params), clone_params(params)
    a = MuSGD(_groups(a_params), lr=0.02, momentum=0.9, **F32)
    b = MuSGD(_groups(b_params), lr=0.02, momentum=0.9, **F32)
    grads = make_grads(params, steps=3)
    for g in grads[:2]:
        _set_grads(a_params, g)
        a.step()
    _set_grads(b_params, grads[2])
    b.step()  # b's program holds its own fresh buffers
    with torch.no_grad():
        for p, q in zip(a_params, b_params):
            q.copy_(p)
    b.load_state_dict(copy.deepcopy(a.state_dict()))  # torch loads tensors without copying
    for opt, ps in ((a, a_params), (b, b_params)):
        _set_grads(ps, grads[2])
        opt.step()
    for p, q in zip(a_params, b_params):
        assert torch.equal(p, q)
    extra = torch.nn.Parameter(torch.randn(12, 6))
    b.add_param_group({"params": [extra], "use_muon": True})
    extra.grad = torch.randn(12, 6)
    before = extra.detach().clone()
    b.step()
    assert not torch.equal(extra, before)


def test_a_gradient_in_another_layout_refits_the_fused_kernel():
    """torch's fused SGD kernel ignores strides: a gradient that arrives channels_last after the
    program chose the kernel for contiguous ones must not be read in the wrong order."""
    params = make_params([(8, 4, 3, 3), (8,)])
    ours = clone_params(params)
    with warns_no_muon():  # SGD's fused kernel, on every parameter
        opt = MuSGD([{"params": ours, "use_muon": False}], lr=0.1, momentum=0.9, **F32)
    ref = [p.detach().clone() for p in params]
    states = [{}, {}]
    grads = make_grads(params, steps=2)
    for step, g in enumerate(grads):
        if step == 1:
            g = [g[0].to(memory_format=torch.channels_last), g[1]]
        _set_grads(ours, g)
        opt.step()
        for i in range(2):
            musgd_reference_step(
                ref[i],
                g[i],
                states[i],
                lr=0.1,
                momentum=0.9,
                nesterov=False,
                weight_decay=0.0,
                muon=0.5,
                sgd=0.5,
                use_muon=False,
            )
    for o, r in zip(ours, ref):
        assert rel_err(o.detach(), r) <= 1e-6


@pytest.mark.parametrize("cls", [MuSGD, Muon])
@pytest.mark.parametrize("nonfinite", ["skip", "ignore"])
@pytest.mark.parametrize("tensor_lr", [False, True])
def test_capturable_step_reads_nothing_on_the_host(cls, nonfinite, tensor_lr, monkeypatch):
    """After the first (program-building) step, a capturable step dispatches no op that copies
    a value to the host and calls no Python method that reads one (even for a NaN gradient)."""
    params = make_params(SHAPES)
    lr = torch.tensor(0.02) if tensor_lr else 0.02
    opt = cls(_groups(params, lr=lr), lr=0.02, nonfinite=nonfinite, capturable=True, **F32)
    _set_grads(params, make_grads(params, steps=1)[0])
    opt.step()
    params[0].grad[0, 0] = float("nan")
    assert host_syncs(opt.step) == {}

    def sync(*args, **kwargs):
        raise AssertionError("host read in a capturable step")

    for name in ("item", "tolist", "__bool__", "__float__", "__int__", "nonzero"):
        monkeypatch.setattr(torch.Tensor, name, sync)
    opt.step()
    monkeypatch.undo()
    if nonfinite == "skip":
        assert all(torch.isfinite(p).all() for p in params)


def test_capturable_muon_keeps_step_counts_on_the_parameters_device_across_a_checkpoint():
    params = make_params(SHAPES)
    opt = Muon(_groups(params), capturable=True, nonfinite="skip", **F32)
    _set_grads(params, make_grads(params, steps=1)[0])
    opt.step()
    other = Muon(_groups(clone_params(params)), capturable=True, nonfinite="skip", **F32)
    other.load_state_dict(opt.state_dict())
    steps = [s["step"] for s in other.state.values() if "step" in s]
    assert steps and all(s.device == params[3].device and s.dtype == torch.float32 for s in steps)
    assert set(opt.state_dict()["state"][3]) == {"step", "exp_avg", "exp_avg_sq"}


def test_capturable_ns_skips_the_host_range_check(monkeypatch):
    """The CPU's one free host read (NS checking its norms' range) is off in a capturable step."""
    ns = importlib.import_module("fastmuon.ns.newton_schulz")
    calls = []
    real = ns._plain_norm_is_exact
    monkeypatch.setattr(ns, "_plain_norm_is_exact", lambda n: calls.append(1) or real(n))
    params = make_params(SHAPES)
    for capturable, expected in ((False, True), (True, False)):
        calls.clear()
        opt = MuSGD(
            _groups(params), lr=0.02, momentum=0.9, capturable=capturable, nonfinite=_guard(capturable), **F32
        )
        _set_grads(params, make_grads(params, steps=1)[0])
        opt.step()
        assert bool(calls) == expected
