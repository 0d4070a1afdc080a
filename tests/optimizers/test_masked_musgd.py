"""MuSGD's large tensors off the host mask a rejected gradient themselves, in both halves.

Run on CPU tensors with :func:`fastmuon.ns.device.is_host` answering "no" and torch's fused
kernels taken where a GPU takes them (the accelerator's paths, as in ``test_accelerator_paths``),
the sizes from which a tensor masks itself lowered: a matrix's EMA momentum is lerped with
weight 0 toward a gradient read as zeros (its NS input zeroed by the engine), its SGD step is a
fused call of its own whose ``found_inf`` is its rejection. With every gradient finite the step
is bit for bit the plain one; a rejected tensor, its EMA and its SGD buffer end the step as they
began it; the guard copies none of them.
"""

from __future__ import annotations

import pytest
import torch
from conftest import MIXED_SHAPES, rel_err
from helpers import clone_params, make_grads, make_params, run_optimizer

from fastmuon import MuSGD
from fastmuon.ns import device as ns_device
from fastmuon.ns.planner import COST_MODELS
from fastmuon.step import elementwise as fastmuon_elementwise
from fastmuon.step import matrix as fastmuon_matrix
from fastmuon.step import sgd as fastmuon_sgd

SHAPES = MIXED_SHAPES + [(24,), (7,)]
MUSGD = dict(lr=0.02, momentum=0.9, nesterov=True, weight_decay=5e-4, muon=0.5, sgd=0.5)
LARGE = 100  # elements from which a tensor masks itself here


@pytest.fixture
def accelerator_paths(monkeypatch):
    monkeypatch.setattr(ns_device, "is_host", lambda device: False)
    # torch's fused kernels where a GPU takes them (the CPU has them too)
    monkeypatch.setattr(fastmuon_elementwise, "fused_kernel_on", lambda where, cuda=False: cuda)
    monkeypatch.setattr(fastmuon_matrix, "PACKED_MASK_MIN_ELEMENTS", LARGE)
    monkeypatch.setattr(fastmuon_sgd, "MASK_MIN_ELEMENTS", LARGE)


def _musgd(params, **kw):
    n = len(MIXED_SHAPES)
    groups = [{"params": params[:n], "use_muon": True}, {"params": params[n:], "use_muon": False}]
    return MuSGD(groups, **MUSGD, ns_dtype=torch.float32, cost_model=COST_MODELS["cuda"], **kw)


def _only_program(opt):
    (program, *_) = opt._driver.cache.programs.values()
    return program


def _tensors(opt, p):
    return [p.detach().clone()] + [v.clone() for v in opt.state[p].values() if isinstance(v, torch.Tensor)]


def _large(params):
    return [k for k, p in enumerate(params) if p.numel() >= LARGE]


def test_a_finite_step_is_bitwise_the_unmasked_one_and_nothing_large_is_copied(accelerator_paths):
    params = make_params(SHAPES)
    grads = make_grads(params, steps=3)
    masked, plain = clone_params(params), clone_params(params)
    opt_masked, opt_plain = _musgd(masked, nonfinite="skip"), _musgd(plain, nonfinite="ignore")
    run_optimizer(opt_masked, masked, grads)
    run_optimizer(opt_plain, plain, grads)
    program = _only_program(opt_masked)
    large = _large(params)
    assert large and program.update.self_masked() == frozenset(large)
    copied = program.guard.skip.held()
    small = [p for k, p in enumerate(masked) if k not in large]
    assert copied == sum(
        t.numel() for p in small for t in [p, *opt_masked.state[p].values()] if isinstance(t, torch.Tensor)
    )
    for a, b in zip(masked, plain):
        for x, y in zip(_tensors(opt_masked, a), _tensors(opt_plain, b)):
            assert torch.equal(x, y)


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_skip_leaves_a_large_matrix_and_its_buffers_as_they_were(accelerator_paths, value):
    params = make_params(SHAPES)
    grads = make_grads(params, steps=2)
    ours, without = clone_params(params), clone_params(params)
    opt = _musgd(ours, nonfinite="skip")
    run_optimizer(opt, ours, grads[:1])
    k = next(k for k in _large(params) if params[k].ndim >= 2)
    before = _tensors(opt, ours[k])
    bad = [g.clone() for g in grads[1]]
    bad[k].view(-1)[3] = value
    run_optimizer(opt, ours, [bad])
    for x, y in zip(_tensors(opt, ours[k]), before):
        assert torch.equal(x, y)
    opt_without = _musgd(without, nonfinite="skip")
    run_optimizer(opt_without, without, [grads[0], [None if i == k else g for i, g in enumerate(bad)]])
    for i, (o, w) in enumerate(zip(ours, without)):
        if i != k:
            assert rel_err(o.detach(), w.detach()) <= 1e-6, i


def test_a_deferred_raise_leaves_a_large_matrix_and_raises_at_the_next_step(accelerator_paths):
    params = make_params(SHAPES)
    grads = make_grads(params, steps=3)
    ours = clone_params(params)
    opt = _musgd(ours)  # the default nonfinite="raise", deferred off the host
    run_optimizer(opt, ours, grads[:1])
    k = next(k for k in _large(params) if params[k].ndim >= 2)
    before = _tensors(opt, ours[k])
    bad = [g.clone() for g in grads[1]]
    bad[k].view(-1)[0] = float("nan")
    run_optimizer(opt, ours, [bad])
    for x, y in zip(_tensors(opt, ours[k]), before):
        assert torch.equal(x, y)
    for p, g in zip(ours, grads[2]):
        p.grad = g.clone()
    with pytest.raises(FloatingPointError, match="non-finite gradient"):
        opt.step()


def test_a_parameter_split_into_a_large_and_a_small_matrix_is_still_copied(accelerator_paths):
    """A parameter whose matrix map cuts it into pieces of which only some are large masks
    itself only where all do: here it does not, so the guard copies and puts it back."""
    torch.manual_seed(0)
    fused = torch.nn.Parameter(torch.randn(14, 10) * 0.1)  # pieces of 10 (100 elements) and 4 rows
    other = torch.nn.Parameter(torch.randn(12, 10) * 0.1)  # 120 elements: masks itself
    params = [fused, other]
    groups = [{"params": params, "use_muon": True, "matrices": [{"split": [10, 4]}, "flatten"]}]
    opt = MuSGD(groups, **MUSGD, ns_dtype=torch.float32, cost_model=COST_MODELS["cuda"], nonfinite="skip")
    grads = make_grads(params, steps=2)
    run_optimizer(opt, params, grads[:1])
    assert _only_program(opt).update.self_masked() == frozenset({1})
    before = _tensors(opt, fused)
    bad = [g.clone() for g in grads[1]]
    bad[0][12, 3] = float("nan")  # in the small piece
    run_optimizer(opt, params, [bad])
    for x, y in zip(_tensors(opt, fused), before):
        assert torch.equal(x, y)
