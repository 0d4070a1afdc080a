"""The code an accelerator runs, run on CPU tensors.

Every choice fastmuon makes only on the host's CPU (reading a value on the host, writing momentum
into the NS buffers one tensor at a time, keeping NS outputs between steps, torch's fused CPU
kernels) asks :func:`fastmuon.ns.device.is_host`. With it answering "no", CPU tensors take the
paths a GPU takes, so those paths are checked here against the per-parameter fp32 reference and
for host reads, on any machine.
"""

from __future__ import annotations

import pytest
import torch
from conftest import MIXED_SHAPES, rel_err
from helpers import (
    clone_params,
    count_fused_tensors,
    make_grads,
    make_params,
    run_checking_grads_untouched,
    run_muon_reference,
    run_musgd_reference,
    run_optimizer,
    run_pieces_reference,
)
from reference_impl import muon_reference_pieces, musgd_reference_pieces

from fastmuon import Muon, MuSGD
from fastmuon.bench.hosttime import host_syncs
from fastmuon.ns import device as ns_device
from fastmuon.ns import engine as fastmuon_engine
from fastmuon.ns.engine import Orthogonalizer
from fastmuon.ns.planner import COST_MODELS
from fastmuon.step import matrix as fastmuon_matrix

SHAPES = MIXED_SHAPES + [(24,), (7,)]
MUSGD = dict(lr=0.02, momentum=0.9, nesterov=True, weight_decay=5e-4, muon=0.5, sgd=0.5)
MUON = dict(lr=0.02, momentum=0.95, nesterov=True, weight_decay=0.1)
ADAMW = dict(lr=0.02, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


@pytest.fixture
def accelerator_paths(monkeypatch):
    monkeypatch.setattr(ns_device, "is_host", lambda device: False)


def _musgd(params, **kw):
    n = len(MIXED_SHAPES)
    groups = [{"params": params[:n], "use_muon": True}, {"params": params[n:], "use_muon": False}]
    return MuSGD(groups, **MUSGD, ns_dtype=torch.float32, cost_model=COST_MODELS["cuda"], **kw)


def _muon(params, **kw):
    n = len(MIXED_SHAPES)
    groups = [{"params": params[:n], "use_muon": True}, {"params": params[n:], "use_muon": False}]
    return Muon(
        groups, **MUON, adamw_lr=ADAMW["lr"], ns_dtype=torch.float32, cost_model=COST_MODELS["cuda"], **kw
    )


def _reference(cls, params, grads):
    n = len(MIXED_SHAPES)
    groups = [(list(range(n)), {"use_muon": True}), ([n, n + 1], {"use_muon": False})]
    if cls is MuSGD:
        return run_musgd_reference(params, grads, groups, MUSGD)[0]
    return run_muon_reference(params, grads, groups, MUON, ADAMW)[0]


def _assert_accelerator_engine(opt):
    """The step really took the accelerator's paths: nothing written into kept NS buffers."""
    for engine in opt.orthogonalizers():
        assert engine.input_views() is None
        assert all(rec.output is None for rec in engine.records)


@pytest.mark.parametrize("cls", [MuSGD, Muon])
@pytest.mark.parametrize("policy", ["auto", "exact", "min_launches"])
def test_steps_are_the_reference_steps(accelerator_paths, cls, policy, monkeypatch):
    fused = [count_fused_tensors(monkeypatch, op) for op in ("_fused_sgd_", "_fused_adamw_")]
    params = make_params(SHAPES, channels_last=(1, 2))
    grads = make_grads(params, steps=3)
    ours = clone_params(params)
    opt = (_musgd if cls is MuSGD else _muon)(ours, policy=policy)
    run_checking_grads_untouched(opt, ours, grads)
    for o, r in zip(ours, _reference(cls, params, grads)):
        assert rel_err(o.detach(), r) <= 1e-5, o.shape
    _assert_accelerator_engine(opt)
    assert fused == [[], []]  # the CPU's fused kernels: not on this path


@pytest.mark.parametrize("cls", [MuSGD, Muon])
def test_matrix_maps_give_the_reference_steps(accelerator_paths, cls):
    """A stack of experts and a fused projection stored ``(in, out)``: every matrix cut out of
    them takes the reference's step."""
    params = [torch.nn.Parameter(torch.randn(4, 12, 20) * 0.1), torch.nn.Parameter(torch.randn(16, 36) * 0.1)]
    maps = ["experts", {"split": [12, 12, 12], "transposed": True}]
    pieces = [
        [((e,), False) for e in range(4)],
        [((slice(None), slice(12 * k, 12 * (k + 1))), True) for k in range(3)],
    ]
    hyper = MUSGD if cls is MuSGD else MUON
    grads = make_grads(params, steps=3)
    ours = clone_params(params)
    opt = cls(
        [{"params": ours, "matrices": maps, "use_muon": True}],
        **hyper,
        ns_dtype=torch.float32,
        cost_model=COST_MODELS["cuda"],
    )
    run_optimizer(opt, ours, grads)
    step = musgd_reference_pieces if cls is MuSGD else muon_reference_pieces
    for i, ref in enumerate(run_pieces_reference(step, params, grads, pieces, **hyper)):
        assert rel_err(ours[i].detach(), ref) <= 1e-5, i
    _assert_accelerator_engine(opt)


@pytest.mark.parametrize("cls", [MuSGD, Muon])
@pytest.mark.parametrize("nonfinite", ["skip", "ignore"])
def test_a_capturable_step_reads_nothing_on_the_host(accelerator_paths, cls, nonfinite):
    """What a CUDA graph needs: after the step that builds the program, no op copies a value to
    the host, with a tensor learning rate, and for a non-finite gradient too."""
    params = make_params(SHAPES)
    ours = clone_params(params)
    opt = (_musgd if cls is MuSGD else _muon)(ours, capturable=True, nonfinite=nonfinite)
    for group in opt.param_groups:
        group["lr"] = torch.tensor(group["lr"])
    grads = make_grads(params, steps=2)
    run_optimizer(opt, ours, grads[:1])
    for p, g in zip(ours, grads[1]):
        p.grad = g.clone()
    assert host_syncs(opt.step) == {}
    ours[0].grad[0, 0, 0, 0] = float("nan")
    assert host_syncs(opt.step) == {}
    _assert_accelerator_engine(opt)


@pytest.mark.parametrize("cls", [MuSGD, Muon])
def test_skip_leaves_the_non_finite_parameter_and_its_state_unchanged(accelerator_paths, cls):
    """``nonfinite="skip"`` decides on the device: the parameter with a NaN gradient and its
    state stay as they were; every other parameter takes the reference's step."""
    params = make_params(SHAPES)
    grads = make_grads(params, steps=2)
    ours = clone_params(params)
    opt = (_musgd if cls is MuSGD else _muon)(ours, nonfinite="skip")
    run_optimizer(opt, ours, grads[:1])
    before = ours[3].detach().clone()
    state_before = {k: v.clone() for k, v in opt.state[ours[3]].items() if isinstance(v, torch.Tensor)}
    bad = [g.clone() for g in grads[1]]
    bad[3][0, 0, 0, 0] = float("nan")
    run_optimizer(opt, ours, [bad])
    assert torch.equal(ours[3].detach(), before)
    for k, v in opt.state[ours[3]].items():
        if k in state_before:
            assert torch.equal(v, state_before[k]), k
    reference = _reference(cls, params, [grads[0], [None if i == 3 else g for i, g in enumerate(bad)]])
    for i, (o, r) in enumerate(zip(ours, reference)):
        if i != 3:
            assert rel_err(o.detach(), r) <= 1e-5, o.shape


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("cls", [MuSGD, Muon])
@pytest.mark.parametrize("policy", ["auto", "min_launches"])
def test_the_cuda_step_is_the_reference_step(cls, policy):
    """On a GPU (torch's fused CUDA SGD, the fp64 normalisation, buckets packed together, the
    deferred "raise"): three steps are the per-parameter fp32 reference's."""
    params = make_params(SHAPES, channels_last=(1, 2))
    grads = make_grads(params, steps=3)
    cuda = [torch.nn.Parameter(p.detach().to("cuda")) for p in params]
    opt = (_musgd if cls is MuSGD else _muon)(cuda, policy=policy)
    run_checking_grads_untouched(opt, cuda, [[g.to("cuda") for g in step] for step in grads])
    for o, r in zip(cuda, _reference(cls, params, grads)):
        assert rel_err(o.detach().cpu(), r) <= 1e-5, o.shape


def test_buckets_packed_together_are_each_the_reference(accelerator_paths):
    """Several buckets of many shapes, packed and unpacked together off the host (one staging
    buffer, one index), each matrix the reference's: no bucket reads or writes another's part."""
    shapes = [(8 + k, 5 + 2 * k) for k in range(9)] + [(6, 3, 3, 3), (10, 2, 3, 3), (7, 4, 1, 1)]
    params = make_params(shapes)
    grads = make_grads(params, steps=2)
    ours = clone_params(params)
    opt = MuSGD(
        ours,
        use_muon=True,
        **MUSGD,
        ns_dtype=torch.float32,
        cost_model=COST_MODELS["cuda"],
        policy="min_launches",
        max_bucket_bytes=4096,
    )
    run_optimizer(opt, ours, grads)
    (engine,) = opt.orthogonalizers()
    assert sum(rec.runs is not None and len(rec.runs) >= 3 for rec in engine.records) >= 2
    reference = run_musgd_reference(params, grads, [(list(range(len(shapes))), {"use_muon": True})], MUSGD)[0]
    for o, r in zip(ours, reference):
        assert rel_err(o.detach(), r) <= 1e-5, o.shape


def _same_shape_muon(params, monkeypatch, **kw):
    """Muon over matrices of two shapes (a tall one packed transposed), whose buckets are packed
    by runs: the step runs them one at a time, each applied from its NS dtype (the sizes from
    which those pay lowered to these small matrices)."""
    monkeypatch.setattr(fastmuon_matrix, "NARROW_APPLY_MIN_ELEMENTS", 64)
    monkeypatch.setattr(fastmuon_engine, "BY_BUCKET_MIN_BYTES", 0)
    return Muon(
        [{"params": params[:5], "use_muon": True}, {"params": params[5:], "use_muon": False}],
        **{**MUON, **kw},
        adamw_lr=ADAMW["lr"],
        ns_dtype=torch.float32,
        cost_model=COST_MODELS["cuda"],
    )


BY_BUCKET_SHAPES = [(24, 40), (24, 40), (24, 40), (40, 24), (40, 24), (16,)]
BY_BUCKET_CAP = 3 * 24 * 40 * 4  # three matrices a bucket: several buckets
BY_BUCKET_GROUPS = [(list(range(5)), {"use_muon": True}), ([5], {"use_muon": False})]  # the reference's


def _bad_step_leaves_it_untouched(opt, ours, grads, k, entry, value):
    """A good step, then one whose gradient ``k`` has ``value`` at ``entry``: parameter ``k``
    and its momentum end that step bit for bit as they began it. Returns the bad step's
    gradients."""
    run_optimizer(opt, ours, grads[:1])
    before = ours[k].detach().clone()
    momentum = opt.state[ours[k]]["momentum_buffer"].clone()
    bad = [g.clone() for g in grads[1]]
    bad[k][entry] = value
    run_optimizer(opt, ours, [bad])
    assert torch.equal(ours[k].detach(), before)
    assert torch.equal(opt.state[ours[k]]["momentum_buffer"], momentum)
    return bad


def test_buckets_packed_by_runs_run_one_at_a_time_and_keep_nothing(accelerator_paths, monkeypatch):
    """Off the host a plan whose buckets are packed by runs is stepped bucket by bucket: each
    bucket's momentum written into a fresh buffer in the NS dtype, NS, the results applied
    straight from it; nothing is kept between steps, and every matrix takes the reference's step."""
    params = make_params(BY_BUCKET_SHAPES)
    grads = make_grads(params, steps=3)
    ours = clone_params(params)
    opt = _same_shape_muon(ours, monkeypatch, max_bucket_bytes=BY_BUCKET_CAP)
    asked: list[torch.dtype | None] = []
    run_bucket = Orthogonalizer.run_bucket

    def spy(engine, b, dtype, *args):
        asked.append(dtype)
        return run_bucket(engine, b, dtype, *args)

    monkeypatch.setattr(Orthogonalizer, "run_bucket", spy)
    run_checking_grads_untouched(opt, ours, grads)
    (engine,) = opt.orthogonalizers()
    assert engine.bucketwise() and len(engine.records) >= 2
    assert asked and set(asked) == {None}
    assert engine.workspaces() == []
    reference = run_muon_reference(params, grads, BY_BUCKET_GROUPS, MUON, ADAMW)[0]
    for o, r in zip(ours, reference):
        assert rel_err(o.detach(), r) <= 1e-5, o.shape


def test_a_bucket_by_bucket_step_skips_a_non_finite_matrix(accelerator_paths, monkeypatch):
    """``nonfinite="skip"`` on the bucket-by-bucket path: the bad matrix and its state stay as
    they were, its bucket mates take the reference's step."""
    params = make_params(BY_BUCKET_SHAPES)
    grads = make_grads(params, steps=2)
    ours = clone_params(params)
    opt = _same_shape_muon(ours, monkeypatch, nonfinite="skip", max_bucket_bytes=BY_BUCKET_CAP)
    bad = _bad_step_leaves_it_untouched(opt, ours, grads, 1, (3, 5), float("nan"))
    reference = run_muon_reference(
        params, [grads[0], [None if i == 1 else g for i, g in enumerate(bad)]], BY_BUCKET_GROUPS, MUON, ADAMW
    )[0]
    for i, (o, r) in enumerate(zip(ours, reference)):
        if i != 1:
            assert rel_err(o.detach(), r) <= 1e-5, o.shape


def _only_program(opt):
    (program,) = opt._driver.cache.programs.values()
    return program


@pytest.mark.parametrize("nesterov", [True, False])
def test_masked_buckets_copy_nothing_and_a_finite_step_is_bitwise_the_unmasked_one(
    accelerator_paths, monkeypatch, nesterov
):
    """The matrices of a bucket-by-bucket step mask a rejected gradient themselves: the guard
    copies none of them (only the AdamW half's vector), and with every gradient finite the
    masked step ("skip") is bit for bit the plain one ("ignore"), decay included."""
    params = make_params(BY_BUCKET_SHAPES)
    grads = make_grads(params, steps=3)
    masked, plain = clone_params(params), clone_params(params)
    size = BY_BUCKET_CAP
    opt_masked = _same_shape_muon(
        masked, monkeypatch, nonfinite="skip", max_bucket_bytes=size, nesterov=nesterov
    )
    opt_plain = _same_shape_muon(
        plain, monkeypatch, nonfinite="ignore", max_bucket_bytes=size, nesterov=nesterov
    )
    run_optimizer(opt_masked, masked, grads)
    run_optimizer(opt_plain, plain, grads)
    program = _only_program(opt_masked)
    assert program.update.self_masked() == frozenset(range(5))
    assert program.guard.skip is not None
    copied = program.guard.skip.held()
    assert copied == 16 * 3 + 1  # the vector, its two moments, its step
    for a, b in zip(masked, plain):
        assert torch.equal(a.detach(), b.detach())
    for a, b in zip(masked[:5], plain[:5]):
        assert torch.equal(opt_masked.state[a]["momentum_buffer"], opt_plain.state[b]["momentum_buffer"])


def test_with_a_hook_around_ns_a_skipped_matrix_is_put_back(accelerator_paths, monkeypatch):
    """A hook around Newton–Schulz runs every bucket at once, so the matrices do not mask
    themselves: that step copies them too, and the skipped matrix and its momentum are put back
    bit for bit."""
    params = make_params(BY_BUCKET_SHAPES)
    grads = make_grads(params, steps=2)
    ours = clone_params(params)
    opt = _same_shape_muon(ours, monkeypatch, nonfinite="skip", max_bucket_bytes=BY_BUCKET_CAP)
    run_optimizer(opt, ours, grads[:1])
    assert _only_program(opt).update.self_masked()  # the masked buckets, without a hook
    ran = []
    opt.register_orthogonalize_hook(lambda run: ran.append(1) or run())
    bad = _bad_step_leaves_it_untouched(opt, ours, [grads[1], grads[1]], 2, (1, 2), float("nan"))
    assert ran and torch.isnan(bad[2]).any()


def test_a_deferred_raise_on_masked_buckets_leaves_the_matrix_and_raises_at_the_next_step(
    accelerator_paths, monkeypatch
):
    """The default "raise", off the host: the step with a NaN runs masked (the matrix and its
    momentum untouched, nothing copied for them) and the next step raises naming it."""
    params = make_params(BY_BUCKET_SHAPES)
    grads = make_grads(params, steps=3)
    ours = clone_params(params)
    opt = _same_shape_muon(ours, monkeypatch, max_bucket_bytes=BY_BUCKET_CAP)
    _bad_step_leaves_it_untouched(opt, ours, grads, 4, (0, 0), float("inf"))
    for p, g in zip(ours, grads[2]):
        p.grad = g.clone()
    with pytest.raises(FloatingPointError, match="non-finite gradient"):
        opt.step()
