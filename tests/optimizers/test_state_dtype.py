"""``state_dtype``: state buffers stored in bf16 (or another floating dtype), the step in fp32.

Checked against per-parameter references that keep each buffer in bf16, read it in fp32, step
it in fp32 and store it rounded (``*_stored_reference_step`` in ``reference_impl.py``), and
against the fp32-state references: the batched and the per-parameter paths follow the former to
fp32 rounding and differ from the latter by the documented bound.
"""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
from conftest import rel_err
from helpers import clone_params, make_grads, make_params, run_optimizer
from reference_impl import (
    _piece_updates,
    adamw_reference_step,
    adamw_stored_reference_step,
    adjust,
    ema,
    load_stored,
    muon_reference_step,
    muon_stored_reference_step,
    musgd_reference_step,
    musgd_stored_reference_step,
    variant_stored_reference_step,
)

from fastmuon import AdaMuon, Muon, MuSGD, NorMuon
from fastmuon.bench.hosttime import host_syncs
from fastmuon.ns import device as ns_device
from fastmuon.ns.planner import COST_MODELS

BF16 = torch.bfloat16
MATRICES = [(16, 3, 3, 3), (32, 16, 3, 3), (64, 32), (20, 100), (100, 20)]
VECTORS = [(24,), (7,)]
N = len(MATRICES)
MUON = dict(lr=0.02, momentum=0.95, nesterov=True, weight_decay=0.1)
ADAMW = dict(lr=0.02, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
MUSGD = dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=5e-4, muon=0.5, sgd=0.5)
#: bf16's unit roundoff: round to nearest keeps 8 significant bits
U = 2.0**-8


def split(params):
    return [{"params": params[:N], "use_muon": True}, {"params": params[N:], "use_muon": False}]


def muon(params, hyper=MUON, **kw):
    return Muon(split(params), **hyper, adamw_lr=ADAMW["lr"], ns_dtype=torch.float32, **kw)


def musgd(params, **kw):
    return MuSGD(split(params), **MUSGD, ns_dtype=torch.float32, **kw)


def muon_references(params, grads, hyper=MUON):
    """(bf16-state reference, fp32-state reference): parameters and states after ``grads``."""
    out = []
    for stored in (True, False):
        ps, states = [p.detach().clone() for p in params], [{} for _ in params]
        for step_grads in grads:
            for i, (p, g, st) in enumerate(zip(ps, step_grads, states)):
                if i < N and stored:
                    muon_stored_reference_step(p, g, st, state_dtype=BF16, **hyper)
                elif i < N:
                    muon_reference_step(p, g, st, **hyper)
                elif stored:
                    adamw_stored_reference_step(p, g, st, state_dtype=BF16, **ADAMW)
                else:
                    adamw_reference_step(p, g, st, **ADAMW)
        out.append((ps, states))
    return out


def musgd_references(params, grads):
    out = []
    for stored in (True, False):
        ps, states = [p.detach().clone() for p in params], [{} for _ in params]
        for step_grads in grads:
            for i, (p, g, st) in enumerate(zip(ps, step_grads, states)):
                kw = dict(MUSGD, use_muon=i < N)
                if stored:
                    musgd_stored_reference_step(p, g, st, state_dtype=BF16, **kw)
                else:
                    musgd_reference_step(p, g, st, **kw)
        out.append((ps, states))
    return out


def assert_follows(ours, stored_ref, fp32_ref, tol=1e-5):
    """Each parameter within ``tol`` of the bf16-state reference (fp32 rounding), and visibly off
    the fp32-state one (so the comparison tells the two apart)."""
    for k, (o, r, f) in enumerate(zip(ours, stored_ref, fp32_ref)):
        assert rel_err(o.detach(), r) <= tol, k
        assert rel_err(o.detach(), f) > tol, k


def assert_same_buffer(ours: torch.Tensor, ref: torch.Tensor):
    """A stored buffer as the reference stores it: bf16, and (fp32 rounding aside, which may move
    a value across a rounding boundary) the same numbers."""
    assert ours.dtype == ref.dtype == BF16
    assert (ours != ref).float().mean() <= 1e-3
    assert rel_err(ours.float(), ref.float()) <= U


# ----- the update, against the references ---------------------------------------------------------
@pytest.mark.parametrize("foreach", [None, False])
@pytest.mark.parametrize("nesterov", [True, False])
def test_muon_and_its_adamw_part_follow_the_bf16_state_reference(foreach, nesterov):
    params = make_params(MATRICES + VECTORS, channels_last=(1,))
    grads = make_grads(params, steps=4)
    hyper = {**MUON, "nesterov": nesterov}
    (stored, stored_states), (fp32, _) = muon_references(params, grads, hyper)
    ours = clone_params(params)
    opt = muon(ours, hyper=hyper, state_dtype=BF16, foreach=foreach)
    run_optimizer(opt, ours, grads)
    assert_follows(ours, stored, fp32)
    for p, st in zip(ours[:N], stored_states[:N]):
        assert_same_buffer(opt.state[p]["momentum_buffer"], st["momentum_buffer"])
    for p, st in zip(ours[N:], stored_states[N:]):
        assert_same_buffer(opt.state[p]["exp_avg"], st["m"])
        assert_same_buffer(opt.state[p]["exp_avg_sq"], st["v"])
        assert opt.state[p]["step"].dtype == torch.float32 and opt.state[p]["step"].item() == 4


@pytest.mark.parametrize("foreach", [None, False])
def test_musgd_keeps_both_momentum_buffers_in_bf16(foreach):
    params = make_params(MATRICES + VECTORS, channels_last=(1,))
    grads = make_grads(params, steps=4)
    (stored, stored_states), (fp32, _) = musgd_references(params, grads)
    ours = clone_params(params)
    opt = musgd(ours, state_dtype=BF16, foreach=foreach)
    run_optimizer(opt, ours, grads)
    assert_follows(ours, stored, fp32)
    for p, st in zip(ours, stored_states):
        assert opt.state[p].keys() == st.keys()
        for key in st:
            assert_same_buffer(opt.state[p][key], st[key])


@pytest.mark.parametrize("cls, variant", [(NorMuon, "normuon"), (AdaMuon, "adamuon")])
@pytest.mark.parametrize("foreach", [None, False])
def test_second_moments_are_stored_in_bf16_and_stepped_in_fp32(cls, variant, foreach):
    shapes = [(64, 32), (20, 100), (100, 20), (20, 100)]
    params = make_params(shapes)
    grads = make_grads(params, steps=4)
    hyper = dict(lr=0.02, momentum=0.95, nesterov=variant == "normuon", weight_decay=0.1)
    refs = {}
    for dtype in (BF16, torch.float32):
        ps, states = [p.detach().clone() for p in params], [{} for _ in params]
        for step_grads in grads:
            for p, g, st in zip(ps, step_grads, states):
                sign = variant == "adamuon"
                variant_stored_reference_step(
                    p, g, st, variant=variant, state_dtype=dtype, sign_momentum=sign, **hyper
                )
        refs[dtype] = (ps, states)
    ours = clone_params(params)
    opt = cls(ours, **hyper, ns_dtype=torch.float32, state_dtype=BF16, foreach=foreach)
    run_optimizer(opt, ours, grads)
    (stored, stored_states), (fp32, _) = refs[BF16], refs[torch.float32]
    # AdaMuon's v is elementwise in NS's output, whose fp32 rounding differs from the
    # reference's: an element of it may round to the neighbouring bf16 value, and the elementwise
    # division carries that into the update (the bf16 state itself moves the update by ~2e-2)
    assert_follows(ours, stored, fp32, tol=1e-4 if variant == "adamuon" else 1e-5)
    for p, st in zip(ours, stored_states):
        assert_same_buffer(opt.state[p]["momentum_buffer"], st["momentum_buffer"])
        assert_same_buffer(opt.state[p]["second_moment"].reshape(st["v"].shape), st["v"])


@pytest.mark.parametrize("cls", [Muon, MuSGD])
def test_matrix_maps_step_views_of_a_bf16_buffer(cls):
    """Experts and a fused projection stored ``(in, out)``: each matrix's momentum is a view of
    the parameter's bf16 buffer, read in fp32 and written back through the view."""
    params = [torch.nn.Parameter(torch.randn(4, 12, 20) * 0.1), torch.nn.Parameter(torch.randn(16, 36) * 0.1)]
    maps = ["experts", {"split": [12, 12, 12], "transposed": True}]
    pieces = [
        [((e,), False) for e in range(4)],
        [((slice(None), slice(12 * k, 12 * (k + 1))), True) for k in range(3)],
    ]
    hyper = dict(MUSGD if cls is MuSGD else MUON)
    grads = make_grads(params, steps=3)
    ours = clone_params(params)
    opt = cls(
        [{"params": ours, "matrices": maps, "use_muon": True}],
        **hyper,
        ns_dtype=torch.float32,
        state_dtype=BF16,
    )
    run_optimizer(opt, ours, grads)
    beta, lr = hyper["momentum"], hyper["lr"]
    for i, (p0, pcs) in enumerate(zip(params, pieces)):
        p, state = p0.detach().clone(), {}
        for step_grads in grads:
            g = step_grads[i]
            M = ema(load_stored(state, "M", p), g, beta)
            state["M"] = M.to(BF16)
            U_ = beta * M + (1 - beta) * g
            if cls is Muon:
                update = _piece_updates(
                    U_, pcs, 5, (3.4445, -4.775, 2.0315), 1e-7, lambda s: adjust("original", s)
                )
                p = p * (1 - lr * hyper["weight_decay"]) - lr * update
            else:
                update = _piece_updates(
                    U_, pcs, 5, (3.4445, -4.775, 2.0315), 1e-7, lambda s: adjust("ultralytics", s)
                )
                p = p - lr * hyper["muon"] * update
                g2 = g + hyper["weight_decay"] * p
                B = beta * load_stored(state, "B", p) + g2
                state["B"] = B.to(BF16)
                p = p - lr * hyper["sgd"] * (g2 + beta * B)
        assert rel_err(ours[i].detach(), p) <= 1e-5, i
        assert_same_buffer(opt.state[ours[i]]["momentum_buffer"], state["M"])


# ----- the accelerator's paths, capturable steps, skipped non-finite gradients ---------------------
@pytest.fixture
def accelerator_paths(monkeypatch):
    """CPU tensors take the paths a GPU takes (see tests/test_accelerator_paths.py)."""
    monkeypatch.setattr(ns_device, "is_host", lambda device: False)


@pytest.mark.parametrize("cls", [Muon, MuSGD])
def test_the_accelerator_paths_follow_the_bf16_state_reference(accelerator_paths, cls):
    params = make_params(MATRICES + VECTORS, channels_last=(1,))
    grads = make_grads(params, steps=3)
    ours = clone_params(params)
    build = muon if cls is Muon else musgd
    opt = build(ours, state_dtype=BF16, cost_model=COST_MODELS["cuda"])
    run_optimizer(opt, ours, grads)
    (stored, _), (fp32, _) = (muon_references if cls is Muon else musgd_references)(params, grads)
    assert_follows(ours, stored, fp32)
    assert all(engine.input_views() is None for engine in opt.orthogonalizers())


@pytest.mark.parametrize("cls", [Muon, MuSGD])
def test_a_capturable_bf16_state_step_reads_nothing_on_the_host(accelerator_paths, cls):
    params = make_params(MATRICES + VECTORS)
    ours = clone_params(params)
    opt = (muon if cls is Muon else musgd)(ours, state_dtype=BF16, capturable=True, nonfinite="skip")
    for group in opt.param_groups:
        group["lr"] = torch.tensor(group["lr"])
    grads = make_grads(params, steps=2)
    run_optimizer(opt, ours, grads[:1])
    for p, g in zip(ours, grads[1]):
        p.grad = g.clone()
    assert host_syncs(opt.step) == {}
    assert all(t.dtype == BF16 for s in opt.state.values() for k, t in s.items() if k != "step")


@pytest.mark.parametrize("cls", [Muon, MuSGD])
@pytest.mark.parametrize("foreach", [None, False])
def test_skip_puts_back_a_bf16_state_exactly(cls, foreach):
    params = make_params(MATRICES + VECTORS)
    grads = make_grads(params, steps=2)
    ours = clone_params(params)
    opt = (muon if cls is Muon else musgd)(ours, state_dtype=BF16, nonfinite="skip", foreach=foreach)
    run_optimizer(opt, ours, grads[:1])
    bad = [g.clone() for g in grads[1]]
    bad[2][0, 0] = float("nan")
    bad[N][0] = float("inf")
    kept = {i: {k: v.clone() for k, v in opt.state[ours[i]].items()} for i in (2, N)}
    moved = {k: v.clone() for k, v in opt.state[ours[0]].items()}
    run_optimizer(opt, ours, [bad])
    for i, before in kept.items():
        for k, v in before.items():
            assert torch.equal(opt.state[ours[i]][k], v), (i, k)
    assert not torch.equal(opt.state[ours[0]]["momentum_buffer"], moved["momentum_buffer"])
    assert all(torch.isfinite(p).all() for p in ours)


# ----- the numerics: what a step rounds, and how far that drifts ---------------------------------
def test_one_step_from_the_same_state_gives_the_fp32_state_update_and_rounds_only_the_buffers():
    """From a state both can hold (bf16 values), one bf16-state step updates the parameters
    bitwise as the fp32-state step does (the update is computed from the unrounded momentum),
    and each stored buffer is the fp32 one rounded to nearest: within 2⁻⁸ of it, elementwise."""
    params = make_params(MATRICES + VECTORS)
    grads = make_grads(params, steps=2)
    narrow, wide = clone_params(params), clone_params(params)
    opts = [muon(narrow, state_dtype=BF16), muon(wide)]
    run_optimizer(opts[0], narrow, grads[:1])
    for p, q in zip(narrow, wide):  # the same parameters and a state both hold exactly
        q.data.copy_(p.detach())
        opts[1].state[q] = {k: v.float() if k != "step" else v.clone() for k, v in opts[0].state[p].items()}
    opts[1].invalidate()
    run_optimizer(opts[0], narrow, grads[1:])
    run_optimizer(opts[1], wide, grads[1:])
    for p, q in zip(narrow, wide):
        assert torch.equal(p, q)
        for key, stored in opts[0].state[p].items():
            if key == "step":
                continue
            exact = opts[1].state[q][key]
            assert torch.equal(stored, exact.to(BF16)), key  # round to nearest, once
            assert ((stored.float() - exact).abs() <= U * exact.abs()).all(), key


def test_the_momentum_drifts_from_the_fp32_one_within_the_documented_bound():
    """``|M̃_t − M_t| ≤ 2⁻⁸·Σ_k β^(t−k)·|M̃_k|`` elementwise, M the fp32-state momentum of the same
    gradients (lr 0: the parameters, and so nothing else, stay put), and so below
    ``2⁻⁸/(1−β)·max_k |M̃_k|``."""
    params = make_params(MATRICES[:3])
    grads = make_grads(params, steps=30)
    beta = 0.9
    opt = Muon(params, lr=0.0, momentum=beta, nesterov=False, state_dtype=BF16)
    exact = [torch.zeros_like(p) for p in params]
    bound = [torch.zeros_like(p) for p in params]
    largest = [torch.zeros(()) for _ in params]
    for step_grads in grads:
        run_optimizer(opt, params, [step_grads])
        for k, (p, g) in enumerate(zip(params, step_grads)):
            exact[k] = beta * exact[k] + (1 - beta) * g
            stored = opt.state[p]["momentum_buffer"].float()
            # each step adds one rounding of the stored value, and fp32's own (2⁻²⁴ of the terms)
            slack = 2.0**-22 * (g.abs() + exact[k].abs())
            bound[k] = beta * bound[k] + U * stored.abs() + slack
            largest[k] = torch.maximum(largest[k], stored.abs().max())
            error = (stored - exact[k]).abs()
            assert (error <= bound[k]).all(), k
            assert error.max() <= 1.01 * U / (1 - beta) * largest[k], k
    relative = max(
        (opt.state[p]["momentum_buffer"].float() - e).norm() / e.norm() for p, e in zip(params, exact)
    )
    assert 0 < relative <= U / (1 - beta)


def test_fp32_state_for_bf16_parameters_is_the_fp32_recurrence():
    """``state_dtype=torch.float32`` on bf16 parameters: the momentum is the fp32 EMA of the
    (bf16) gradients, and the AdamW moments the fp32 ones, however the parameters round."""
    params = make_params(MATRICES + VECTORS, dtype=torch.bfloat16)
    grads = make_grads(params, steps=3)
    ours = clone_params(params)
    opt = muon(ours, state_dtype=torch.float32)
    run_optimizer(opt, ours, grads)
    b1, b2 = ADAMW["betas"]
    for k, p in enumerate(ours):
        gs = [g[k].float() for g in grads]
        state = opt.state[p]
        if k < N:
            M = torch.zeros_like(gs[0])
            for g in gs:
                M = MUON["momentum"] * M + (1 - MUON["momentum"]) * g
            assert state["momentum_buffer"].dtype == torch.float32
            assert rel_err(state["momentum_buffer"], M) <= 1e-6, k
        else:
            m, v = torch.zeros_like(gs[0]), torch.zeros_like(gs[0])
            for g in gs:
                m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
            assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.float32
            assert rel_err(state["exp_avg"], m) <= 1e-6 and rel_err(state["exp_avg_sq"], v) <= 1e-6, k
        assert p.dtype == torch.bfloat16 and not torch.equal(p, params[k])


# ----- defaults, memory ----------------------------------------------------------------------------
@pytest.mark.parametrize("cls", [Muon, MuSGD, NorMuon, AdaMuon])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_state_dtype_equal_to_the_parameters_is_the_default_step_bitwise(cls, dtype):
    params = make_params(MATRICES[2:] + VECTORS, dtype=dtype)
    grads = make_grads(params, steps=3)
    runs = []
    for state_dtype in (None, dtype):
        ours = clone_params(params)
        groups = [{"params": ours[:3], "use_muon": True}, {"params": ours[3:], "use_muon": False}]
        opt = cls(groups, state_dtype=state_dtype, ns_dtype=torch.float32, momentum=0.9)
        run_optimizer(opt, ours, grads)
        runs.append((ours, opt))
    (a, opt_a), (b, opt_b) = runs
    assert opt_a.param_groups[0]["state_dtype"] is None
    for p, q in zip(a, b):
        assert torch.equal(p, q)
        assert opt_a.state[p].keys() == opt_b.state[q].keys()
        for key, value in opt_a.state[p].items():
            assert value.dtype == (torch.float32 if key == "step" else dtype)
            assert torch.equal(value, opt_b.state[q][key]), key


def state_bytes(opt, skip=("step",)) -> int:
    return sum(
        t.untyped_storage().nbytes() for s in opt.state.values() for k, t in s.items() if k not in skip
    )


@pytest.mark.parametrize("cls", [Muon, MuSGD, NorMuon, AdaMuon])
def test_bf16_state_halves_the_state_bytes_of_fp32_parameters(cls):
    params = make_params(MATRICES + VECTORS)
    grads = make_grads(params, steps=1)
    sizes = {}
    for state_dtype in (None, BF16):
        ours = clone_params(params)
        opt = cls(split(ours), state_dtype=state_dtype)
        run_optimizer(opt, ours, grads)
        sizes[state_dtype] = state_bytes(opt)
        steps = [s["step"] for s in opt.state.values() if "step" in s]
        assert all(
            t.dtype == torch.float32 and t.numel() == 1 for t in steps
        )  # AdamW's counts stay as torch keeps them
    assert sizes[BF16] * 2 == sizes[None] > 0


# ----- checkpoints across state dtypes ---------------------------------------------------------
def saved(opt) -> dict:
    """A state dict through ``torch.save`` and ``torch.load``, as a checkpoint would be."""
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


@pytest.mark.parametrize("cls", [Muon, MuSGD, NorMuon])
def test_a_bf16_state_checkpoint_resumes_bitwise(cls):
    params = make_params(MATRICES + VECTORS)
    grads = make_grads(params, steps=4)
    straight = clone_params(params)
    opt = cls(split(straight), state_dtype=BF16)
    run_optimizer(opt, straight, grads[:2])
    sd = saved(opt)
    assert all(g["state_dtype"] is BF16 for g in sd["param_groups"])
    assert all(t.dtype == BF16 for s in sd["state"].values() for k, t in s.items() if k != "step")
    resumed = clone_params(straight)
    again = cls(split(resumed), state_dtype=BF16)
    again.load_state_dict(sd)
    run_optimizer(opt, straight, grads[2:])
    run_optimizer(again, resumed, grads[2:])
    assert all(torch.equal(p, q) for p, q in zip(straight, resumed))
    for p, q in zip(straight, resumed):
        for key, value in opt.state[p].items():
            assert value.dtype == again.state[q][key].dtype and torch.equal(value, again.state[q][key]), key


@pytest.mark.parametrize("cls", [Muon, MuSGD, NorMuon, AdaMuon])
def test_state_dicts_load_across_state_dtypes_into_the_loaders_own(cls):
    """An fp32-state checkpoint loads into a bf16-state optimizer rounded to bf16, and a bf16 one
    into an fp32-state optimizer exactly; each group keeps its own ``state_dtype`` (it says how
    this optimizer holds its state, not how the saving run did); AdamW's count stays float32."""
    params = make_params(MATRICES + VECTORS)
    grads = make_grads(params, steps=2)
    for saved_dtype, own in ((None, BF16), (BF16, None)):
        ours = clone_params(params)
        source = cls(split(ours), state_dtype=saved_dtype)
        run_optimizer(source, ours, grads)
        sd = saved(source)
        target = cls(split(clone_params(ours)), state_dtype=own)
        target.load_state_dict(sd)
        assert [g["state_dtype"] for g in target.param_groups] == [own, own]
        want = own or torch.float32
        for p, q in zip(ours, [q for g in target.param_groups for q in g["params"]]):
            for key, value in source.state[p].items():
                loaded = target.state[q][key]
                if key == "step":
                    assert loaded.dtype == torch.float32 and loaded.device.type == "cpu"
                    continue
                assert loaded.dtype == want, key
                assert torch.equal(loaded, value.to(want)), key  # rounded once, or exact
        ps = [q for g in target.param_groups for q in g["params"]]
        run_optimizer(target, ps, grads[:1])
        assert all(t.dtype == want for s in target.state.values() for k, t in s.items() if k != "step")


def test_a_group_set_to_another_state_dtype_casts_its_buffers_on_reload():
    """``state_dtype`` is the dtype buffers are made in; existing ones keep theirs until a state dict is
    loaded, which casts them (reloading the optimizer's own state dict does it in place)."""
    params = make_params(MATRICES + VECTORS)
    grads = make_grads(params, steps=2)
    ours = clone_params(params)
    opt = muon(ours)
    run_optimizer(opt, ours, grads[:1])
    opt.param_groups[0]["state_dtype"] = BF16
    run_optimizer(opt, ours, grads[1:])
    assert opt.state[ours[0]]["momentum_buffer"].dtype == torch.float32
    fp32 = opt.state[ours[0]]["momentum_buffer"].clone()
    opt.load_state_dict(opt.state_dict())
    assert torch.equal(opt.state[ours[0]]["momentum_buffer"], fp32.to(BF16))
    assert opt.state[ours[N]]["exp_avg"].dtype == torch.float32  # the AdamW group keeps its None


@pytest.mark.parametrize("cls", [Muon, MuSGD])
def test_copies_keep_the_bf16_state(cls):
    params = make_params(MATRICES + VECTORS)
    grads = make_grads(params, steps=3)
    ours = clone_params(params)
    opt = cls(split(ours), state_dtype=BF16)
    run_optimizer(opt, ours, grads[:2])
    for clone in (copy.deepcopy(opt), pickle.loads(pickle.dumps(opt))):
        assert clone.defaults["state_dtype"] is BF16
        assert all(t.dtype == BF16 for s in clone.state.values() for k, t in s.items() if k != "step")


# ----- refusals ------------------------------------------------------------------------------------
BAD = [torch.int8, torch.bool, torch.complex64, torch.float8_e4m3fn, "bfloat16", 16]


@pytest.mark.parametrize("cls", [Muon, MuSGD, NorMuon, AdaMuon])
@pytest.mark.parametrize("value", BAD, ids=str)
def test_a_state_dtype_that_is_not_a_floating_dtype_is_refused_naming_the_option(cls, value):
    p = torch.nn.Parameter(torch.randn(6, 4))
    kw = {"use_muon": True} if cls is MuSGD else {}
    with pytest.raises(ValueError, match=r"^invalid state_dtype .* in param group 0: .*torch\.bfloat16") as e:
        cls([p], state_dtype=value, **kw)
    assert "state_dtype=torch.bfloat16" in str(e.value)  # the fix
    if value == "bfloat16":
        assert "a torch.dtype, not its name" in str(e.value)
    opt = cls([p], **kw)
    with pytest.raises(ValueError, match="invalid state_dtype"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.randn(3, 3))], "state_dtype": value})
    assert len(opt.param_groups) == 1


@pytest.mark.parametrize("foreach", [None, False])
def test_a_bad_state_dtype_set_on_a_group_later_is_refused_by_the_step_leaving_no_state(foreach):
    params = make_params(MATRICES + VECTORS)
    grads = make_grads(params, steps=1)
    ours = clone_params(params)
    opt = muon(ours, foreach=foreach)
    opt.param_groups[1]["state_dtype"] = torch.int32
    before = [p.detach().clone() for p in ours]
    with pytest.raises(ValueError, match=r"invalid state_dtype torch\.int32 in param group 1"):
        run_optimizer(opt, ours, grads)
    assert not any(opt.state.values())
    assert all(torch.equal(p, b) for p, b in zip(ours, before))
    opt.param_groups[1]["state_dtype"] = BF16
    run_optimizer(opt, ours, grads)
    assert (
        opt.state[ours[N]]["exp_avg"].dtype == BF16
        and opt.state[ours[0]]["momentum_buffer"].dtype == torch.float32
    )


def test_a_beta_whose_decay_bf16_rounds_away_is_warned_and_the_buffer_indeed_stalls():
    """AdamW's usual ``β₂ = 0.999`` with bf16 moments: ``0.999·v`` rounds to nearest back to ``v``
    (1 − β₂ is below 2⁻⁸), so ``exp_avg_sq`` stops decaying: said once, when the group is added."""
    w, b = torch.nn.Parameter(torch.randn(6, 4)), torch.nn.Parameter(torch.ones(4))
    groups = [{"params": [w]}, {"params": [b], "use_muon": False}]
    with pytest.warns(
        UserWarning, match=r"state_dtype=torch\.bfloat16 in param group 1 with betas\[1\]=0\.999: "
    ) as caught:
        opt = Muon(groups, betas=(0.9, 0.999), state_dtype=BF16)
    assert len(caught) == 1 and "state_dtype=torch.float32 for this group" in str(caught[0].message)
    b.grad = torch.ones(4)
    opt.step()
    b.grad = torch.zeros(4)
    stuck = opt.state[b]["exp_avg_sq"].clone()
    for _ in range(5):
        opt.step()
    assert torch.equal(opt.state[b]["exp_avg_sq"], stuck)  # what the warning says: no decay
    with pytest.warns(UserWarning, match=r"in param group 0 with momentum=0\.999"):
        MuSGD([w], use_muon=True, momentum=0.999, state_dtype=BF16)
    with pytest.warns(UserWarning, match=r"with beta2=0\.999"):
        NorMuon([w], beta2=0.999, state_dtype=BF16)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Muon(groups, betas=(0.9, 0.999))  # the parameters' own dtype: torch's arithmetic
        Muon(groups, state_dtype=BF16)  # Muon's AdamW betas (0.9, 0.95) decay fine in bf16
        MuSGD([w], use_muon=True, momentum=0.999, state_dtype=torch.float16)  # fp16: 2⁻¹¹
