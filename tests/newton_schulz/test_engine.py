import importlib

import pytest
import torch
from conftest import MIXED_SHAPES, rel_err
from helpers import clone_params, make_grads, make_params, run_musgd_reference, run_optimizer
from reference_impl import ns_reference

from fastmuon import MuSGD, orthogonalize
from fastmuon import newton_schulz as fastmuon_newton_schulz
from fastmuon.ns import engine
from fastmuon.ns.device import compute_dtype, cpu_low_precision, set_cpu_low_precision
from fastmuon.ns.planner import plan_buckets


def reference(t):
    return ns_reference(t.reshape(t.shape[0], -1)).reshape(t.shape)


@pytest.mark.parametrize("policy", ["exact", "auto", "min_launches"])
def test_batched_equals_per_matrix_reference(policy):
    tensors = [torch.randn(s) for s in MIXED_SHAPES]
    tensors[1] = tensors[1].to(memory_format=torch.channels_last)
    tensors[9] = tensors[9].to(memory_format=torch.channels_last)
    outs = orthogonalize(tensors, dtype=torch.float32, policy=policy)
    for t, o in zip(tensors, outs):
        assert o.shape == t.shape and o.dtype == torch.float32
        assert rel_err(o, reference(t)) <= 1e-5, t.shape


def test_padding_is_exact():
    """Matrices padded into one bucket give what each gets alone (fp32, to rounding)."""
    tensors = [torch.randn(s) for s in [(8, 30), (16, 40), (40, 16), (3, 5)]]
    merged = orthogonalize(tensors, dtype=torch.float32, policy="min_launches")
    alone = [orthogonalize([t], dtype=torch.float32, policy="exact")[0] for t in tensors]
    for m, a in zip(merged, alone):
        assert rel_err(m, a) <= 1e-5


def test_channels_last_equals_contiguous_twin():
    w = torch.randn(32, 16, 3, 3)
    a = orthogonalize([w], dtype=torch.float32)[0]
    b = orthogonalize([w.to(memory_format=torch.channels_last)], dtype=torch.float32)[0]
    assert torch.equal(a, b)


def test_inputs_untouched_and_bf16_default():
    tensors = [torch.randn(4, 6), torch.randn(6, 4)]
    before = [t.clone() for t in tensors]
    outs = orthogonalize(tensors)
    assert all(o.dtype == torch.bfloat16 for o in outs)
    assert all(torch.equal(t, b) for t, b in zip(tensors, before))


def test_non_dense_inputs_are_handled():
    base = torch.randn(20, 40)
    strided = base[:, ::2]  # gappy strides
    out = orthogonalize([strided], dtype=torch.float32)[0]
    assert rel_err(out, ns_reference(strided)) <= 1e-5


def test_empty_tensor_and_bad_rank():
    out = orthogonalize([torch.randn(0, 5), torch.randn(3, 5)], dtype=torch.float32)
    assert out[0].shape == (0, 5)
    with pytest.raises(ValueError, match="tensor 0 has shape \\(5,\\)"):
        orthogonalize([torch.randn(5)])


@pytest.mark.parametrize("gather_min_runs", [1, 10**9])
def test_gather_and_run_packing_agree_with_reference(monkeypatch, gather_min_runs):
    """Both packing strategies (one index copy per bucket, or one strided copy per run)."""
    monkeypatch.setattr(engine, "GATHER_MIN_RUNS", gather_min_runs)
    tensors = [torch.randn(s) for s in MIXED_SHAPES]
    tensors[1] = tensors[1].to(memory_format=torch.channels_last)
    outs = orthogonalize(tensors, dtype=torch.float32, policy="min_launches", method="standard")
    for t, o in zip(tensors, outs):
        assert o.stride() == t.stride()
        assert rel_err(o, reference(t)) <= 1e-5


def test_low_precision_output_dtype_and_cpu_compute_modes():
    t = [torch.randn(8, 24)]
    with cpu_low_precision("native"):
        native = orthogonalize(t, dtype=torch.bfloat16)[0]
    with cpu_low_precision("fp32"):
        upcast = orthogonalize(t, dtype=torch.bfloat16)[0]
    assert native.dtype == upcast.dtype == torch.bfloat16
    assert rel_err(upcast.float(), reference(t[0])) <= 1e-2
    assert rel_err(native.float(), reference(t[0])) <= 5e-2
    assert compute_dtype(torch.bfloat16, "cuda") == torch.bfloat16
    with pytest.raises(ValueError, match="unknown CPU low-precision mode"):
        set_cpu_low_precision("fast")


@pytest.mark.slow
def test_compiled_ns_matches_eager():
    shapes = [(6, 4, 3, 3), (6, 4, 3, 3), (10, 8)]
    grads = [torch.randn(s) for s in shapes]
    results = []
    for compile in (False, True):
        params = [torch.nn.Parameter(torch.ones(s)) for s in shapes]
        opt = MuSGD(
            params,
            lr=0.1,
            momentum=0.9,
            use_muon=True,
            ns_dtype=torch.float32,
            policy="exact",
            compile=compile,
        )
        for p, g in zip(params, grads):
            p.grad = g
        opt.step()
        results.append(params)
    for eager, compiled in zip(*results):
        assert rel_err(compiled.detach(), eager.detach()) <= 1e-5


@pytest.mark.parametrize("reuse_max_rows", [0, 12, None])
@pytest.mark.parametrize("policy", ["exact", "min_launches"])
def test_kept_and_fresh_output_buffers_give_the_reference_steps(monkeypatch, reuse_max_rows, policy):
    """On a CPU, buckets of short matrices keep their NS output and temporaries between steps
    (in the shared workspace) and hand the step views into them; the others allocate afresh.
    Either way, over several steps (buffers reused, views cached), the optimizer takes the
    reference's steps."""
    monkeypatch.setattr(engine, "REUSE_MAX_ROWS", reuse_max_rows)
    opt, _ = _musgd_steps_match_the_reference(policy, nesterov=True)
    (eng,) = opt.orthogonalizers()
    kept = [bool(rec.shared.offsets) for rec in eng.records]
    expected = [reuse_max_rows is None or b.shape[1] <= reuse_max_rows for b in eng.plan.buckets]
    assert kept == expected


def _musgd_steps_match_the_reference(policy: str, nesterov: bool):
    """Three MuSGD steps on mixed shapes (channels_last among them) equal the per-parameter
    fp32 reference's; returns the optimizer and its parameters for further checks."""
    params = make_params(MIXED_SHAPES, channels_last=(1, 9))
    grads = make_grads(params, steps=3)
    hyper = dict(lr=0.02, momentum=0.9, nesterov=nesterov, weight_decay=5e-4, muon=0.5, sgd=0.5)
    ref, _ = run_musgd_reference(params, grads, [(list(range(len(params))), {"use_muon": True})], hyper)
    ours = clone_params(params)
    opt = MuSGD(ours, **hyper, use_muon=True, ns_dtype=torch.float32, policy=policy)
    run_optimizer(opt, ours, grads)
    for o, r in zip(ours, ref):
        assert rel_err(o.detach(), r) <= 1e-5, o.shape
    return opt, ours


def test_low_precision_gram_space_through_the_engine_equals_the_kernel_alone():
    """The engine's kept buffers (restart iterates ping-pong in scratch) change nothing: bf16
    Gram-space NS through a plan equals the kernel called on each matrix with fresh memory."""
    tensors = [torch.randn(16, 8, 3, 3), torch.randn(16, 8, 3, 3), torch.randn(24, 100)]
    with cpu_low_precision("native"):
        outs = orthogonalize(tensors, dtype=torch.bfloat16, policy="exact", method="gram")
        for t, o in zip(tensors, outs):
            alone = fastmuon_newton_schulz(t.reshape(t.shape[0], -1), dtype=torch.bfloat16, method="gram")
            assert torch.equal(o.reshape(alone.shape), alone)


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("policy", ["exact", "min_launches"])
def test_momentum_written_into_the_ns_inputs_gives_the_reference_steps(nesterov, policy):
    """On a CPU the momentum step writes each matrix's NS input straight into its slot of the
    bucket's batch in the shared workspace (tall matrices transposed, channels_last in its own
    order, padding around it). The steps are the reference's, nothing is packed (no staging, no
    gather index, no per-bucket buffer), the padding is zero and no slot aliases the state."""
    opt, ours = _musgd_steps_match_the_reference(policy, nesterov)
    (eng,) = opt.orthogonalizers()
    assert all(r.gather is None and r.staging is None and r.buffer is None for r in eng.records)
    state = [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    shared = eng.workspaces()[-1].untyped_storage().data_ptr()
    for b, bucket in enumerate(eng.plan.buckets):
        views = eng.open_bucket(b)
        assert len(views) == len(bucket.members)
        for v in views:
            assert v.untyped_storage().data_ptr() == shared
            assert not any(v.untyped_storage().data_ptr() == t.untyped_storage().data_ptr() for t in state)
        padding = eng.records[b].shared.batch().clone()
        for m in bucket.members:
            engine._slot_view(padding, m.slot, eng.layouts[m.index], m.transposed).zero_()
        assert torch.count_nonzero(padding) == 0


@pytest.mark.parametrize(
    "param_dtype, ns_dtype",
    [(torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16), (torch.float32, torch.float32)],
)
@pytest.mark.parametrize("nesterov", [True, False])
def test_momentum_written_into_ns_inputs_of_another_dtype_is_the_packed_step(
    param_dtype, ns_dtype, nesterov, monkeypatch
):
    """Where NS runs in another dtype than the parameters, the momentum step writes each input
    into its bucket slot rounded once on the store: bit for bit the step that computes the
    momentum in the parameters' dtype and casts it while packing."""
    from fastmuon.ns import device as ns_device
    from fastmuon.ns.engine import Orthogonalizer

    shapes = [(8, 4, 3, 3), (12, 20), (30, 6)]
    params = make_params(shapes, dtype=param_dtype)
    grads = make_grads(params, steps=3)
    runs = []
    with ns_device.cpu_low_precision("native"):  # bf16 NS in bf16 on any CPU
        for views in (True, False):
            if not views:
                monkeypatch.setattr(Orthogonalizer, "input_views", lambda self: None)
            ours = clone_params(params)
            opt = MuSGD(ours, lr=0.02, momentum=0.9, nesterov=nesterov, use_muon=True, ns_dtype=ns_dtype)
            run_optimizer(opt, ours, grads)
            (eng,) = opt.orthogonalizers()
            if views:
                inputs = eng.input_views()
                assert {t.dtype for t in inputs} == {ns_dtype}
                assert not any(rec.buffer is None for rec in eng.records)
                assert len(eng.records) == len(eng.plan.buckets)
            runs.append([p.detach().clone() for p in ours])
    assert all(torch.equal(a, b) for a, b in zip(*runs))


def test_eigh_route_through_the_engine_is_exact_with_padding():
    """Zero padding leaves zero eigenvalues in the Gram matrix and zero rows in X₀, so padded
    members get exactly their own result, as with the loop methods."""
    tensors = [torch.randn(16, 8, 3, 3), torch.randn(20, 50), torch.randn(60, 12), torch.randn(6, 6)]
    outs = orthogonalize(tensors, dtype=torch.float32, policy="min_launches", method="eigh")
    for t, o in zip(tensors, outs):
        assert rel_err(o, reference(t)) <= 1e-5, t.shape


def test_muon_asked_for_bf16_on_a_cpu_computing_fp32_takes_the_eigh_route():
    """``auto`` picks the eigendecomposition route for a large bucket when bf16 NS is asked for
    and computed in fp32 (not for a small one: LAPACK's overheads); the steps are still the fp32
    reference's."""
    from fastmuon import Muon

    params = make_params([(384, 800), (24, 40)])
    grads = make_grads(params, steps=2)
    with cpu_low_precision("fp32"):
        ours = clone_params(params)
        opt = Muon(ours, lr=0.02, momentum=0.95, ns_dtype=torch.bfloat16)
        run_optimizer(opt, ours, grads)
        methods = sorted(b.method for b in opt.plan().buckets)
        loop = clone_params(params)
        run_optimizer(Muon(loop, lr=0.02, momentum=0.95, ns_dtype=torch.bfloat16, foreach=False), loop, grads)
    assert methods == ["eigh", "standard"]
    for o, r in zip(ours, loop):
        assert rel_err(o.detach(), r.detach()) <= 1e-5, o.shape


@pytest.mark.parametrize("method", ["standard", "gram", "eigh"])
def test_host_reads_are_decided_when_the_engine_is_built(method, monkeypatch):
    """``host_reads=False`` (a capturable step) reaches every bucket's kernel from the engine's
    constructor: no norm is read on the host, and fp32 standard NS gives the same bits (the safe
    normalisation equals the plain one in range); the Gram-space routes normalise through
    another formula then, equal to rounding."""
    ns = importlib.import_module("fastmuon.ns.newton_schulz")
    calls = []
    real = ns._plain_norm_is_exact
    monkeypatch.setattr(ns, "_plain_norm_is_exact", lambda n: calls.append(1) or real(n))
    torch.manual_seed(0)
    tensors = [torch.randn(s) for s in MIXED_SHAPES]
    config = engine.NSConfig.make(5, "jordan", 1e-7, torch.float32, method)
    layouts = [engine.TensorLayout.of(t) for t in tensors]
    specs = [engine.spec_of(t, config, lay) for t, lay in zip(tensors, layouts)]
    plan = plan_buckets(specs, policy="min_launches")
    configs = {b.key: config for b in plan.buckets}
    outs = {}
    for host_reads in (True, False):
        calls.clear()
        eng = engine.Orthogonalizer(plan, layouts, configs, host_reads=host_reads)
        assert [rec.host_reads for rec in eng.records] == [host_reads] * len(plan.buckets)
        outs[host_reads] = eng(tensors, [torch.float32] * len(tensors))
        assert bool(calls) == host_reads
    for a, b in zip(outs[True], outs[False]):
        assert torch.equal(a, b) if method == "standard" else rel_err(b, a) <= 2e-4


def test_off_the_host_packed_buckets_share_one_eps_add_and_keep_their_bits(monkeypatch):
    """Off the host, the buckets packed together are normalised before their kernels run, the
    norms of all of them in one vector (one add of eps for all): the results are bit for bit
    those of each kernel normalising its own bucket."""
    from fastmuon.ns import device

    monkeypatch.setattr(device, "is_host", lambda where: False)
    monkeypatch.setattr(engine, "GATHER_MIN_RUNS", 1)
    torch.manual_seed(0)
    tensors = [torch.randn(s) for s in [(8, 30), (16, 40), (40, 16), (3, 5), (24, 24), (6, 7)]]
    tensors[0] = tensors[0] * 2.0**100  # squares beyond fp32: the fp64 norm's case
    calls = []
    batched = engine.normalize_in_fp64_
    monkeypatch.setattr(
        engine, "normalize_in_fp64_", lambda bs, eps: calls.append(len(bs)) or batched(bs, eps)
    )
    together = orthogonalize(tensors, policy="exact", method="standard")
    assert calls and max(calls) >= 2, calls
    monkeypatch.setattr(engine, "takes_fp64_route", lambda *a: False)
    alone = orthogonalize(tensors, policy="exact", method="standard")
    for t, a, b in zip(tensors, together, alone):
        assert a.dtype == torch.bfloat16 and torch.equal(a, b), t.shape
