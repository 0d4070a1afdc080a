"""Builders shared by the optimizer tests: parameter sets, gradients, reference runs."""

from __future__ import annotations

import copy

import pytest
import torch
from reference_impl import adamw_reference_step, muon_reference_step, musgd_reference_step


def warns_no_muon():
    """Asserts the warning of an optimizer given no parameter for Muon (every group
    ``use_muon=False``: MuSGD's default for a plain parameter list, as in Ultralytics)."""
    return pytest.warns(UserWarning, match="orthogonalises no parameter")


def make_params(shapes, channels_last=(), dtype=torch.float32):
    params = []
    for i, s in enumerate(shapes):
        p = torch.randn(s, dtype=dtype) * 0.1
        if i in channels_last:
            p = p.to(memory_format=torch.channels_last)
        params.append(torch.nn.Parameter(p))
    return params


def make_grads(params, steps, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(p.shape, generator=g).to(p.dtype) for p in params] for _ in range(steps)]


def run_optimizer(opt, params, grads):
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = None if g is None else g.clone()
        opt.step()


def run_musgd_reference(params, grads, groups, defaults):
    """groups: list of (indices, overrides) describing which params sit in which group."""
    params = [p.detach().clone() for p in params]
    states = [dict() for _ in params]
    for step_grads in grads:
        for idx, over in groups:
            hp = {**defaults, **over}
            for i in idx:
                if step_grads[i] is None:
                    continue
                musgd_reference_step(params[i], step_grads[i], states[i], **hp)
    return params, states


def run_muon_reference(params, grads, groups, defaults, adamw_defaults):
    params = [p.detach().clone() for p in params]
    states = [dict() for _ in params]
    for step_grads in grads:
        for idx, over in groups:
            for i in idx:
                if step_grads[i] is None:
                    continue
                use_muon = over.get("use_muon", params[i].ndim >= 2)
                if use_muon:
                    hp = {**defaults, **{k: v for k, v in over.items() if k != "use_muon"}}
                    muon_reference_step(params[i], step_grads[i], states[i], **hp)
                else:
                    hp = {**adamw_defaults, **{k: v for k, v in over.items() if k in adamw_defaults}}
                    adamw_reference_step(params[i], step_grads[i], states[i], **hp)
    return params, states


def run_pieces_reference(step, params, grads, pieces, **hyper):
    """``step`` (``muon_reference_pieces`` or ``musgd_reference_pieces``) over every step's
    gradients, each parameter with its own ``pieces``; returns the updated copies."""
    params = [p.detach().clone() for p in params]
    states = [dict() for _ in params]
    for step_grads in grads:
        for p, g, state, pcs in zip(params, step_grads, states, pieces):
            step(p, g, state, pcs, **hyper)
    return params


def clone_params(params):
    return [torch.nn.Parameter(copy.deepcopy(p.detach())) for p in params]


def count_fused_tensors(monkeypatch, op_name):
    """Patch ``torch.<op_name>`` (a fused optimizer op) to record the sizes of the parameters it
    is given; returns that list."""
    sizes = []
    real = getattr(torch, op_name)

    def counting(params, *args, **kwargs):
        sizes.extend(p.numel() for p in params)
        return real(params, *args, **kwargs)

    monkeypatch.setattr(torch, op_name, counting)
    return sizes


def run_checking_grads_untouched(opt, params, grads):
    """``run_optimizer``, asserting after every step that no gradient was written to."""
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g.clone()
        kept = [p.grad.clone() for p in params]
        opt.step()
        assert all(torch.equal(p.grad, k) for p, k in zip(params, kept)), "a gradient was modified"


def by_ndim(params):
    """MuSGD groups routing matrices (>=2D) to Muon and the rest to SGD, as the per-parameter
    references do for a group without ``use_muon``; param groups (dicts) pass through."""
    params = list(params)
    if params and isinstance(params[0], dict):
        return params
    tensor = (lambda x: x[1]) if params and isinstance(params[0], tuple) else (lambda x: x)
    groups = [
        {"params": [x for x in params if tensor(x).ndim >= 2], "use_muon": True},
        {"params": [x for x in params if tensor(x).ndim < 2], "use_muon": False},
    ]
    return [g for g in groups if g["params"]]


def ultralytics_musgd_class() -> type:
    """Ultralytics' MuSGD, loaded from its module file (``import ultralytics`` needs torchvision,
    which may not load beside a CPU torch); skips the test when the package is not installed."""
    import pytest

    from fastmuon.bench.contenders import Unavailable, load_ultralytics_musgd

    try:
        return load_ultralytics_musgd()[0]
    except Unavailable as e:
        pytest.skip(str(e))
