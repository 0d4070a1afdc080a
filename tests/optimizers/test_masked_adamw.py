"""Large AdamW tensors off the host mask their own update where their gradient is rejected.

Run on CPU tensors with :func:`fastmuon.ns.device.is_host` answering "no" (the accelerator's
paths, as in ``test_accelerator_paths``) and the size from which a tensor masks itself lowered,
so that small tensors take that path: with every gradient finite the masked step is bit for bit
the plain one, a rejected tensor's parameter, moments and step count end the step as they began
it, and the guard copies none of the masked tensors' device memory.
"""

from __future__ import annotations

import pytest
import torch
from conftest import rel_err
from helpers import clone_params, make_grads, make_params, run_muon_reference, run_optimizer

from fastmuon import Muon
from fastmuon.ns import device as ns_device
from fastmuon.ns.planner import COST_MODELS
from fastmuon.step import adamw as fastmuon_adamw

# two matrices (Muon), then an embedding-like matrix, a vector and a small vector (AdamW): the
# small vector stays under the lowered size and is copied and put back as before
SHAPES = [(24, 40), (40, 24), (50, 16), (48,), (8,)]
GROUPS = [(list(range(2)), {"use_muon": True}), ([2, 3, 4], {"use_muon": False})]  # the reference's
MUON = dict(lr=0.02, momentum=0.95, nesterov=True, weight_decay=0.1)
ADAMW = dict(lr=0.01, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
MASKED = frozenset({2, 3})  # the AdamW tensors at or above the lowered size


@pytest.fixture
def masked_adamw(monkeypatch):
    monkeypatch.setattr(ns_device, "is_host", lambda device: False)
    monkeypatch.setattr(fastmuon_adamw, "MASK_MIN_ELEMENTS", 32)


def _muon(params, lr=ADAMW["lr"], **kw):
    groups = [{"params": params[:2], "use_muon": True}, {"params": params[2:], "use_muon": False, "lr": lr}]
    return Muon(
        groups, **MUON, betas=ADAMW["betas"], ns_dtype=torch.float32, cost_model=COST_MODELS["cuda"], **kw
    )


def _only_program(opt):
    (program,) = opt._driver.cache.programs.values()
    return program


def _adamw_state(opt, p):
    state = opt.state[p]
    return [state["exp_avg"].clone(), state["exp_avg_sq"].clone(), state["step"].clone()]


@pytest.mark.parametrize("tensor_lr", [False, True])
def test_a_finite_step_is_bitwise_the_unmasked_one_and_nothing_masked_is_copied(masked_adamw, tensor_lr):
    params = make_params(SHAPES)
    grads = make_grads(params, steps=3)
    masked, plain = clone_params(params), clone_params(params)
    lr = torch.tensor(ADAMW["lr"]) if tensor_lr else ADAMW["lr"]
    opt_masked, opt_plain = _muon(masked, lr, nonfinite="skip"), _muon(plain, lr, nonfinite="ignore")
    run_optimizer(opt_masked, masked, grads)
    run_optimizer(opt_plain, plain, grads)
    program = _only_program(opt_masked)
    assert program.update.self_masked() >= MASKED
    assert 4 not in program.update.self_masked()
    # copied: the matrices and their momentum (too small to be stepped bucket by bucket), the
    # small vector, its two moments and step, and of the masked tensors their step counts alone
    copied = program.guard.skip.held()
    matrices = 2 * (24 * 40 + 40 * 24)
    assert copied == matrices + 8 * 3 + 1 + len(MASKED)
    for a, b in zip(masked, plain):
        assert torch.equal(a.detach(), b.detach())
    for a, b in zip(masked[2:], plain[2:]):
        for x, y in zip(_adamw_state(opt_masked, a), _adamw_state(opt_plain, b)):
            assert torch.equal(x, y)


@pytest.mark.parametrize("tensor_lr", [False, True])
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_skip_leaves_a_masked_tensor_and_its_state_as_they_were(masked_adamw, value, tensor_lr):
    params = make_params(SHAPES)
    grads = make_grads(params, steps=3)
    ours = clone_params(params)
    lr = torch.tensor(ADAMW["lr"]) if tensor_lr else ADAMW["lr"]
    opt = _muon(ours, lr, nonfinite="skip")
    run_optimizer(opt, ours, grads[:1])
    before, state = ours[2].detach().clone(), _adamw_state(opt, ours[2])
    bad = [g.clone() for g in grads[1]]
    bad[2][3, 5] = value
    run_optimizer(opt, ours, [bad])
    assert torch.equal(ours[2].detach(), before)
    for x, y in zip(_adamw_state(opt, ours[2])[:2], state[:2]):
        assert torch.equal(x, y)
    run_optimizer(opt, ours, grads[2:])  # the step count is put back once the flags reach the host
    assert float(opt.state[ours[2]]["step"]) == 2.0 and float(opt.state[ours[3]]["step"]) == 3.0
    skipped = [None if i == 2 else g for i, g in enumerate(bad)]
    reference = run_muon_reference(params, [grads[0], skipped, grads[2]], GROUPS, MUON, ADAMW)[0]
    for i, (o, r) in enumerate(zip(ours, reference)):
        assert rel_err(o.detach(), r) <= 1e-5, i


def test_a_deferred_raise_leaves_a_masked_tensor_and_raises_at_the_next_step(masked_adamw):
    params = make_params(SHAPES)
    grads = make_grads(params, steps=3)
    ours = clone_params(params)
    opt = _muon(ours)  # the default nonfinite="raise", deferred off the host
    run_optimizer(opt, ours, grads[:1])
    before, state = ours[3].detach().clone(), _adamw_state(opt, ours[3])
    bad = [g.clone() for g in grads[1]]
    bad[3][7] = float("nan")
    run_optimizer(opt, ours, [bad])
    assert torch.equal(ours[3].detach(), before)
    for x, y in zip(_adamw_state(opt, ours[3])[:2], state[:2]):
        assert torch.equal(x, y)
    for p, g in zip(ours, grads[2]):
        p.grad = g.clone()
    with pytest.raises(FloatingPointError, match="non-finite gradient"):
        opt.step()
    assert float(opt.state[ours[3]]["step"]) == 1.0
