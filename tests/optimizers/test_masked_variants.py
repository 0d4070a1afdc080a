"""NorMuon's and AdaMuon's matrices stepped bucket by bucket off the host mask a rejected
gradient themselves, second moment included.

Run on CPU tensors with :func:`fastmuon.ns.device.is_host` answering "no" (the accelerator's
paths, as in ``test_accelerator_paths``) and the plan's size from which a step runs bucket by
bucket lowered: with every gradient finite the masked step is bit for bit the plain one, a
rejected matrix's parameter, momentum and second moment end the step as they began it, its
bucket mates step as if it had no gradient, and the guard copies none of the matrices.
"""

from __future__ import annotations

import pytest
import torch
from conftest import rel_err
from helpers import clone_params, make_grads, make_params, run_optimizer

from fastmuon import AdaMuon, NorMuon
from fastmuon.ns import device as ns_device
from fastmuon.ns import engine as fastmuon_engine
from fastmuon.ns.planner import COST_MODELS

SHAPES = [(24, 40), (24, 40), (24, 40), (40, 24), (40, 24), (16,)]
CAP = 3 * 24 * 40 * 4  # three matrices a bucket: several buckets, a class spanning two
MATRIX_STATE = ("momentum_buffer", "second_moment")
VARIANTS = [
    (NorMuon, {}),
    (NorMuon, {"rescale": "rms"}),
    (AdaMuon, {}),  # signed NS input, RMS rescale
    (AdaMuon, {"sign_momentum": False, "rescale": "norm"}),
]


@pytest.fixture
def accelerator_paths(monkeypatch):
    monkeypatch.setattr(ns_device, "is_host", lambda device: False)
    monkeypatch.setattr(fastmuon_engine, "BY_BUCKET_MIN_BYTES", 0)


def _variant(cls, params, **kw):
    groups = [{"params": params[:5], "use_muon": True}, {"params": params[5:], "use_muon": False}]
    return cls(
        groups,
        lr=0.02,
        weight_decay=0.1,
        max_bucket_bytes=CAP,
        ns_dtype=torch.float32,
        cost_model=COST_MODELS["cuda"],
        **kw,
    )


def _only_program(opt):
    (program,) = opt._driver.cache.programs.values()
    return program


def _state(opt, p):
    return [opt.state[p][k].clone() for k in MATRIX_STATE]


@pytest.mark.parametrize("cls, options", VARIANTS, ids=lambda v: getattr(v, "__name__", str(v)))
def test_a_finite_step_is_bitwise_the_unmasked_one_and_no_matrix_is_copied(accelerator_paths, cls, options):
    params = make_params(SHAPES)
    grads = make_grads(params, steps=3)
    masked, plain = clone_params(params), clone_params(params)
    opt_masked = _variant(cls, masked, nonfinite="skip", **options)
    opt_plain = _variant(cls, plain, nonfinite="ignore", **options)
    run_optimizer(opt_masked, masked, grads)
    run_optimizer(opt_plain, plain, grads)
    program = _only_program(opt_masked)
    assert program.update.matrices.bucketwise_engine is not None
    assert program.update.self_masked() == frozenset(range(5))
    copied = program.guard.skip.held()
    assert copied == 16 * 3 + 1  # the AdamW vector, its moments, its step
    for a, b in zip(masked, plain):
        assert torch.equal(a.detach(), b.detach())
    for a, b in zip(masked[:5], plain[:5]):
        for x, y in zip(_state(opt_masked, a), _state(opt_plain, b)):
            assert torch.equal(x, y)


@pytest.mark.parametrize("cls, options", VARIANTS, ids=lambda v: getattr(v, "__name__", str(v)))
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_skip_leaves_a_rejected_matrix_and_its_second_moment_as_they_were(
    accelerator_paths, cls, options, value
):
    params = make_params(SHAPES)
    grads = make_grads(params, steps=2)
    ours, without = clone_params(params), clone_params(params)
    opt = _variant(cls, ours, nonfinite="skip", **options)
    run_optimizer(opt, ours, grads[:1])
    bad_k = 3  # a tall matrix, packed transposed, its class spanning two buckets
    before, state = ours[bad_k].detach().clone(), _state(opt, ours[bad_k])
    bad = [g.clone() for g in grads[1]]
    bad[bad_k][5, 7] = value
    run_optimizer(opt, ours, [bad])
    assert torch.equal(ours[bad_k].detach(), before)
    for x, y in zip(_state(opt, ours[bad_k]), state):
        assert torch.equal(x, y)
    # the others: as a step in which the rejected matrix had no gradient
    opt_without = _variant(cls, without, nonfinite="skip", **options)
    run_optimizer(opt_without, without, [grads[0], [None if i == bad_k else g for i, g in enumerate(bad)]])
    for i, (o, w) in enumerate(zip(ours, without)):
        if i != bad_k:
            assert rel_err(o.detach(), w.detach()) <= 1e-6, i


def test_a_deferred_raise_leaves_the_matrix_and_raises_at_the_next_step(accelerator_paths):
    params = make_params(SHAPES)
    grads = make_grads(params, steps=3)
    ours = clone_params(params)
    opt = _variant(NorMuon, ours)  # the default nonfinite="raise", deferred off the host
    run_optimizer(opt, ours, grads[:1])
    before, state = ours[0].detach().clone(), _state(opt, ours[0])
    bad = [g.clone() for g in grads[1]]
    bad[0][0, 0] = float("nan")
    run_optimizer(opt, ours, [bad])
    assert torch.equal(ours[0].detach(), before)
    for x, y in zip(_state(opt, ours[0]), state):
        assert torch.equal(x, y)
    for p, g in zip(ours, grads[2]):
        p.grad = g.clone()
    with pytest.raises(FloatingPointError, match="non-finite gradient"):
        opt.step()
