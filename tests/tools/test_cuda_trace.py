"""fastmuon's CUDA step traced on fake cuda tensors (``fastmuon.bench.trace``), with no GPU: the
kernels it launches, the host syncs it makes, where its state and workspaces live, what it plans.

Tracing needs a torch whose ``FakeTensorMode`` makes fake ``cuda`` tensors (a CUDA build, GPU or
not); elsewhere those tests skip with the reason. The launch model's rules are checked on
CPU tensors everywhere.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from fastmuon import AdaMuon, Muon, MuSGD, NorMuon
from fastmuon.bench.contenders import Workbench, fastmuon_variant
from fastmuon.bench.fake_cuda import (
    CHUNK,
    fake_cuda_problem,
    foreach_fallback,
    mta_launches,
    non_overlapping_and_dense,
)
from fastmuon.bench.manifest import materialize
from fastmuon.bench.workloads import resolve_workload

PROBLEM = fake_cuda_problem()
needs_fake_cuda = pytest.mark.skipif(PROBLEM is not None, reason=str(PROBLEM))

#: yolo26n MuSGD (nonfinite="skip"), with the auto plan and with policy="min_launches": ATen ops
#: dispatched on the GPU per traced step (what a dispatch mode counting ops sees), and CUDA
#: launches as the launch model counts them (a cat of hundreds of tensors, a foreach over
#: them, takes several); the defaults (a deferred "raise") add the flags' copy. The auto plan's
#: buckets share one add of eps in their normalisation (ns.engine._StagedGathers); the
#: min_launches plan's one padded bucket is large enough to be normalised by the power-of-two
#: prescale (eight more launches, fewer bytes: ns.newton_schulz.FP64_ROUTE_MAX_ELEMENTS)
YOLO_MUSGD_SKIP_OPS = {"auto": 73, "min_launches": 47}
YOLO_MUSGD_SKIP_KERNELS = {"auto": 79, "min_launches": 53}
#: the bench's gpt2 workload (GPT-2 small's 768-wide blocks), each rule at its defaults: its
#: plan's inputs are large enough to run bucket by bucket (ns.engine.BY_BUCKET_MIN_BYTES), the
#: momentum kept in each bucket's layout and masked a bucket at a time (a write per gradient,
#: one launch each for the EMA and the NS input: step.bucket_momentum; the variants' second
#: moment masked with it: step.moments.MomentStage); the 50257×768 embedding's AdamW step masks
#: itself too (step.adamw.Masks). Far fewer bytes and far less memory than packing and copying:
#: the peak extra memory during the step is about three of the largest bucket's inputs for
#: Muon (324 MiB of them), and the variants' stacked fp32 statistics besides
GPT2_KERNELS = {Muon: 290, NorMuon: 335, AdaMuon: 330}
GPT2_PEAK_MIB = {Muon: 400, NorMuon: 650, AdaMuon: 1000}

CUDA = torch.device("cuda")


def NARROW_GPT2():
    """The bench's gpt2 workload cut to 2 of its 768-wide blocks: every kind of its tensors, a
    sixth of the lists (for the configurations checked beyond the kernel limits)."""
    from fastmuon.bench.models import GPT2
    from fastmuon.bench.workloads import Generated, manifest_of

    return manifest_of(Generated(lambda: GPT2(layers=2), "GPT-2 small's layout, 2 blocks"), "gpt2-narrow")


# ----- the launch model on CPU tensors (any torch) ---------------------------------------------------
def test_multi_tensor_apply_launches_as_its_header_batches():
    assert mta_launches([], 1) == 0
    assert mta_launches([0, 0], 1) == 0  # empty tensors take no block
    assert mta_launches([10] * 5, 2) == 1
    # a launch holds at most so many tensors (depth 1: 770 on CUDA 13 builds, 110 before)
    big = int((torch.version.cuda or "0").split(".")[0]) >= 13
    per_launch = 770 if big else 110
    assert mta_launches([1] * per_launch, 1) == 1
    assert mta_launches([1] * (per_launch + 1), 1) == 2
    # ... and at most so many 64K-element chunks (2240 blocks, 320 before)
    blocks = 2240 if big else 320
    assert mta_launches([CHUNK * blocks], 1) == 1
    assert mta_launches([CHUNK * blocks + 1], 1) == 2


def test_the_foreach_fast_route_needs_one_dtype_dense_tensors_of_matching_layouts():
    a = [torch.zeros(4, 4), torch.zeros(3)]
    assert foreach_fallback("_foreach_add_", (a, [torch.zeros(4, 4), torch.zeros(3)]), {}) is None
    mixed = foreach_fallback(
        "_foreach_add_", (a, [torch.zeros(4, 4, dtype=torch.bfloat16), torch.zeros(3)]), {}
    )
    assert mixed is not None and "dtype" in mixed
    # a copy may cast: one dtype per list is enough
    assert (
        foreach_fallback("_foreach_copy_", (a, [torch.zeros(4, 4, dtype=torch.bfloat16)] * 2), {}) is not None
    )
    cast = [torch.zeros(4, 4, dtype=torch.bfloat16), torch.zeros(3, dtype=torch.bfloat16)]
    assert foreach_fallback("_foreach_copy_", (a, cast), {}) is None
    strided = [torch.zeros(4, 8)[:, ::2], torch.zeros(3)]
    assert "dense" in foreach_fallback("_foreach_mul_", (strided, 2.0), {})
    transposed = [torch.zeros(4, 4).T, torch.zeros(3)]  # dense, but its strides differ from list 0's
    assert "strides" in foreach_fallback("_foreach_add_", (a, transposed), {})
    assert "promotes" in foreach_fallback("_foreach_mul_", ([torch.zeros(3, dtype=torch.int64)], 0.5), {})
    assert foreach_fallback("_foreach_norm", ([torch.zeros(3)], 2), {}) is None
    assert "order" in foreach_fallback("_foreach_norm", ([torch.zeros(3)], 3), {})


def test_dense_means_filling_the_span_once_in_some_order():
    assert non_overlapping_and_dense(torch.zeros(3, 4).T)
    assert non_overlapping_and_dense(torch.zeros(1, 5)[:, :])
    assert not non_overlapping_and_dense(torch.zeros(3, 4)[:, :2])
    assert not non_overlapping_and_dense(torch.zeros(3).expand(4, 3))


# ----- the TraceCounter on fake cuda tensors -------------------------------------------------------
@needs_fake_cuda
def test_host_reads_are_syncs_answered_as_finite_values_would_be():
    from fastmuon.bench.trace import TraceCounter, fake_cuda

    here = str(Path(__file__).resolve().parent)
    with fake_cuda():
        x = torch.zeros(8, device=CUDA)
        with TraceCounter([here]) as tc:
            finite = bool(torch.isfinite(x).all())
            value = x.sum().item()
            count = int((x > 1).sum())
            x.to("cpu")
            torch.zeros(3).to(CUDA)
            x.mul_(torch.tensor(2.0))  # a CPU scalar goes to the kernel by value: no copy, no sync
    assert finite is True and value == 1.0 and count == 0
    whats = [s.what for s in tc.syncs]
    assert whats[:3] == ["item (_local_scalar_dense)"] * 3
    assert whats[3:] == ["blocking copy cuda→cpu", "blocking copy cpu→cuda"]
    assert all(s.where.startswith("tools/test_cuda_trace.py:") for s in tc.syncs)  # relative to tests/
    assert tc.syncs[0].where.endswith("test_host_reads_are_syncs_answered_as_finite_values_would_be")


@needs_fake_cuda
def test_foreach_fallbacks_and_per_input_copies_count_a_kernel_per_tensor():
    from fastmuon.bench.trace import TraceCounter, fake_cuda

    with fake_cuda():
        xs = [torch.zeros(4, 4, device=CUDA) for _ in range(5)]
        ys = [torch.zeros(4, 4, device=CUDA, dtype=torch.bfloat16) for _ in range(5)]
        out = torch.zeros(5, 4, 8, device=CUDA)[:, :, :4]
        with TraceCounter() as tc:
            torch._foreach_add_(xs, xs)  # fast route: one launch
            torch._foreach_add_(xs, ys)  # dtypes differ: one add_ per tensor
            torch._foreach_copy_(xs, ys)  # a copy may cast: one launch
            torch.stack(xs, out=out)  # a non-contiguous out=: one batched copy, with strides
            torch.stack(ys, out=out)  # a cast: one copy per input
            torch.cat(xs)  # contiguous inputs: one batched copy
            torch._foreach_norm(xs)  # partial norms, then one clean-up launch
    assert tc.kernels == 1 + 5 + 1 + 1 + 5 + 1 + 2
    assert tc.aten_ops == 7
    assert [(f.op, f.kernels) for f in tc.fallbacks] == [("_foreach_add_", 5), ("stack", 5)]


def test_kept_memory_leaves_out_the_symbolic_fake_tensors_a_compile_left_alive():
    """A ``torch.compile`` earlier in the process may leave fake tensors alive whose sizes are
    symbols of its shape environment: counted, they would make the kept bytes a symbol too."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from fastmuon.bench.trace import live_storages, storage_id

    real = torch.zeros(7, 3)
    leaked = FakeTensorMode(shape_env=ShapeEnv(), static_shapes=False).from_tensor(torch.zeros(3, 5))
    assert not isinstance(leaked.untyped_storage().nbytes(), int)  # a symbol
    sizes = live_storages()
    assert all(isinstance(n, int) for n in sizes.values())
    assert sizes[storage_id(real)] == real.nbytes


# ----- fastmuon's step ------------------------------------------------------------------------------
_TRACES: dict = {}


def traced(model: str, cls: type, ns_dtype=torch.bfloat16, policy="auto", tensor_lr=False, **options):
    """The trace of fastmuon's ``cls`` on ``model``'s parameters as fake cuda tensors, and what the
    optimizer holds after it: (trace, plan, state tensors, workspaces). Cached per configuration."""
    from fastmuon.bench.trace import fake_cuda, trace_contender

    key = (model, cls, ns_dtype, policy, tensor_lr, tuple(sorted(options.items())))
    if key in _TRACES:
        return _TRACES[key]
    manifest = NARROW_GPT2() if model == "gpt2-narrow" else resolve_workload(model)
    with fake_cuda():
        wb = Workbench(manifest, materialize(manifest, CUDA, 0), CUDA, cls.__name__.lower(), ns_dtype, policy)
        groups = wb.groups()
        on_device = tensor_lr and options.get("capturable")  # what a captured step needs
        if tensor_lr and not on_device:
            for g in groups:
                g["lr"] = torch.tensor(float(g["lr"]))
        contender = fastmuon_variant(wb, cls, "fastmuon", "", groups=groups, **options)
        if on_device:  # set after the checks, which read a value given at construction once
            for g in contender.optimizers[0].param_groups:
                g["lr"] = torch.full((), float(g["lr"]), device=CUDA)
        trace = trace_contender(contender)
        opt = contender.optimizers[0]
        state = [(k, t) for s in opt.state.values() for k, t in s.items() if isinstance(t, torch.Tensor)]
        result = (trace, opt.plan(), state, opt.workspaces(), manifest)
    assert trace.error is None, trace.error
    _TRACES[key] = result
    return result


def _on_cuda(trace, state, workspaces, capturable=False):
    """Every state and workspace tensor on the parameters' device; the one exception by design:
    AdamW's ``step`` counter, a float on the host unless ``capturable`` (read there each step)."""
    off = {k: t.device for k, t in state if t.device.type != "cuda"}
    assert state and off in ({}, *([] if capturable else [{"step": torch.device("cpu")}])), off
    assert all(t.device.type == "cuda" for t in workspaces)
    assert trace.state_bytes > 0 and trace.kept_bytes >= trace.state_bytes


def _planned(plan, manifest, ns_dtype):
    assert plan.buckets, plan.note
    assert {b.dtype for b in plan.buckets} == {ns_dtype}
    assert {b.device.type for b in plan.buckets} == {"cuda"}
    assert sum(len(b.members) for b in plan.buckets) == manifest.ns_matrices()
    assert all(b.shape[0] >= len(b.members) for b in plan.buckets)


def _no_sync(trace):
    assert trace.syncs == [], [f"{s.what} at {s.where}" for s in trace.syncs]


@needs_fake_cuda
def test_yolo26n_musgd_skip_auto_plan():
    trace, plan, state, workspaces, manifest = traced("yolo26n", MuSGD, nonfinite="skip")
    _on_cuda(trace, state, workspaces)
    _planned(plan, manifest, torch.bfloat16)
    _no_sync(trace)
    assert trace.aten_ops - trace.host_ops <= YOLO_MUSGD_SKIP_OPS["auto"], trace.top_ops
    assert trace.kernels <= YOLO_MUSGD_SKIP_KERNELS["auto"], trace.top_ops


@needs_fake_cuda
def test_yolo26n_musgd_skip_min_launches():
    trace, plan, state, workspaces, manifest = traced(
        "yolo26n", MuSGD, policy="min_launches", nonfinite="skip"
    )
    _on_cuda(trace, state, workspaces)
    _planned(plan, manifest, torch.bfloat16)
    _no_sync(trace)
    assert trace.aten_ops - trace.host_ops <= YOLO_MUSGD_SKIP_OPS["min_launches"], trace.top_ops
    assert trace.kernels <= YOLO_MUSGD_SKIP_KERNELS["min_launches"], trace.top_ops


@needs_fake_cuda
@pytest.mark.parametrize("cls", [Muon, NorMuon, AdaMuon], ids=lambda c: c.__name__)
def test_gpt2_defaults(cls):
    trace, plan, state, workspaces, manifest = traced("gpt2", cls)
    _on_cuda(trace, state, workspaces)
    _planned(plan, manifest, torch.bfloat16)
    assert trace.kernels <= GPT2_KERNELS[cls], trace.top_ops
    assert trace.peak_extra_bytes <= GPT2_PEAK_MIB[cls] * 2**20, trace.top_bytes
    _no_sync(trace)  # nonfinite="raise" screens the gradients without reading the device


@needs_fake_cuda
@pytest.mark.parametrize("cls", [Muon, NorMuon, AdaMuon], ids=lambda c: c.__name__)
@pytest.mark.parametrize("mode", ["raise", "skip", "ignore"])
def test_no_nonfinite_mode_reads_the_device(mode, cls):
    trace, plan, state, workspaces, manifest = traced("gpt2-narrow", cls, nonfinite=mode)
    _on_cuda(trace, state, workspaces)
    _planned(plan, manifest, torch.bfloat16)
    _no_sync(trace)


@needs_fake_cuda
def test_fp32_ns_plans_fp32_buckets():
    trace, plan, state, workspaces, manifest = traced(
        "gpt2-narrow", Muon, ns_dtype=torch.float32, nonfinite="ignore"
    )
    _planned(plan, manifest, torch.float32)
    _on_cuda(trace, state, workspaces)
    _no_sync(trace)


@needs_fake_cuda
@pytest.mark.parametrize("cls", [MuSGD, Muon], ids=lambda c: c.__name__)
def test_a_cpu_tensor_lr_is_read_on_the_host_without_a_sync(cls):
    trace, plan, state, workspaces, manifest = traced("gpt2-narrow", cls, tensor_lr=True, nonfinite="ignore")
    _on_cuda(trace, state, workspaces)
    _no_sync(trace)


@needs_fake_cuda
@pytest.mark.parametrize("cls", [MuSGD, Muon, NorMuon, AdaMuon], ids=lambda c: c.__name__)
def test_capturable_steps_neither_sync_nor_copy(cls):
    trace, plan, state, workspaces, manifest = traced(
        "gpt2-narrow", cls, tensor_lr=True, capturable=True, nonfinite="skip"
    )
    _on_cuda(trace, state, workspaces, capturable=True)
    _planned(plan, manifest, torch.bfloat16)
    _no_sync(trace)


@needs_fake_cuda
@pytest.mark.parametrize(
    ("model", "cls"), [("gpt2-split", Muon), ("granite-moe", NorMuon)], ids=["qkv-split", "experts"]
)
def test_matrix_maps(model, cls):
    trace, plan, state, workspaces, manifest = traced(model, cls, nonfinite="ignore")
    assert manifest.ns_matrices() > len(manifest.matrices())  # the maps split tensors into matrices
    _on_cuda(trace, state, workspaces)
    _planned(plan, manifest, torch.bfloat16)
    _no_sync(trace)


# ----- the bench ----------------------------------------------------------------------------------
@needs_fake_cuda
def test_bench_traces_the_cuda_lineup_and_writes_it_as_json(tmp_path, capsys):
    from fastmuon.bench.gpucheck import QUICK_YOLO, write_quick_manifests
    from fastmuon.bench.trace import LABEL
    from fastmuon.tools.cli import main

    write_quick_manifests(tmp_path)
    out = tmp_path / "trace.json"
    argv = ["bench", "--device", "cuda", "--trace", "--model", str(tmp_path / QUICK_YOLO), "--json", str(out)]
    assert main([*argv, "--contenders", "fastmuon,torch.optim.sgd"]) == 0
    text = capsys.readouterr().out
    assert LABEL in text and "kernels" in text and "host syncs" in text
    document = json.loads(out.read_text())
    assert document["label"] == LABEL and document["settings"]["device"] == "cuda (fake tensors)"
    rows = {r["name"]: r for r in document["results"]}
    fastmuon = rows["fastmuon MuSGD"]
    assert fastmuon["kernels"] > 0 and fastmuon["python_calls"] > 0 and fastmuon["label"] == LABEL
    assert fastmuon["state_bytes"] > 0 and math.isfinite(fastmuon["ns_flops"])
    assert rows["torch.optim.SGD foreach"]["ns_flops"] == 0
    assert main([*argv, "--step-mode", "compiled"]) == 2
    assert "a trace follows eager steps only" in capsys.readouterr().err
