"""What a traced step costs a GPU (``fastmuon.bench.gpu_cost``): bytes moved, matmul FLOPs, peak
extra memory and the modelled time; the ``llama-8b-layers`` workload.

The accounting reads only shapes, strides and dtypes, so it is checked on CPU tensors with any
torch; what needs fake ``cuda`` tensors (a CUDA build of torch, GPU or not) skips elsewhere.
"""

from __future__ import annotations

import gc
import json

import pytest
import torch

from fastmuon.bench.fake_cuda import fake_cuda_problem
from fastmuon.bench.gpu_cost import (
    GpuModel,
    OpCost,
    PeakTracker,
    flops_by_dtype,
    matmul_flops,
    modelled_time,
    op_bytes,
    op_cost,
    product_flops,
    view_bytes,
)

aten = torch.ops.aten
PROBLEM = fake_cuda_problem()
needs_fake_cuda = pytest.mark.skipif(PROBLEM is not None, reason=str(PROBLEM))
CUDA = torch.device("cuda")


# ----- the accounting on CPU tensors (any torch) ------------------------------------------------------
def test_a_bmm_reads_both_operands_writes_the_product_and_counts_2bmnk():
    b, m, k, n = 3, 4, 5, 6
    x, y = torch.zeros(b, m, k, dtype=torch.bfloat16), torch.zeros(b, k, n, dtype=torch.bfloat16)
    out = torch.bmm(x, y)
    moved = op_bytes(aten.bmm.default, (x, y), {}, out)
    assert (moved.read, moved.written) == (b * (m * k + k * n) * 2, b * m * n * 2)
    assert matmul_flops(aten.bmm.default, (x, y), {}) == (2 * b * m * n * k, torch.bfloat16)
    cost = op_cost(aten.bmm.default, (x, y), {}, out, kernels=1)
    assert cost == OpCost(1, b * (m * k + k * n + m * n) * 2, 2 * b * m * n * k, torch.bfloat16)


def test_addmm_like_products_read_self_unless_beta_is_zero():
    c, a, b = torch.zeros(4, 6), torch.zeros(4, 5), torch.zeros(5, 6)
    out = torch.addmm(c, a, b)
    assert op_bytes(aten.addmm.default, (c, a, b), {}, out).read == (24 + 20 + 30) * 4
    assert op_bytes(aten.addmm.default, (c, a, b), {"beta": 0}, out).read == (20 + 30) * 4
    assert matmul_flops(aten.addmm.default, (c, a, b), {})[0] == 2 * 4 * 5 * 6
    batched = torch.zeros(2, 4, 6), torch.zeros(2, 4, 5), torch.zeros(2, 5, 6)
    assert matmul_flops(aten.baddbmm.default, batched, {})[0] == 2 * 2 * 4 * 5 * 6
    assert matmul_flops(aten.add.Tensor, (c, c), {}) == (0, None)


def test_matmul_flops_follow_matmuls_broadcasting():
    assert product_flops((7, 1, 4, 5), (3, 5, 6)) == 2 * 4 * 5 * 6 * 7 * 3
    assert product_flops((4, 5), (5,)) == 2 * 4 * 5
    assert product_flops((5,), (5,)) == 2 * 5
    sym = torch.zeros(3, 8, 8)
    assert matmul_flops(aten._linalg_eigh.default, (sym,), {}) == (9 * 8**3 * 3, torch.float32)


def test_a_foreach_add_reads_both_lists_and_writes_the_first():
    xs = [torch.zeros(4, 4), torch.zeros(10)]
    ys = [torch.zeros(4, 4), torch.zeros(10)]
    moved = op_bytes(aten._foreach_add_.List, (xs, ys), {}, None)
    assert (moved.read, moved.written) == (2 * 26 * 4, 26 * 4)
    fresh = torch._foreach_add(xs, ys)
    moved = op_bytes(aten._foreach_add.List, (xs, ys), {}, fresh)
    assert (moved.read, moved.written) == (2 * 26 * 4, 26 * 4)


def test_pure_writes_and_out_arguments_are_not_read():
    dst, src = torch.zeros(8), torch.zeros(8, dtype=torch.bfloat16)
    copy = op_bytes(aten.copy_.default, (dst, src), {}, dst)
    assert (copy.read, copy.written) == (16, 32)
    assert (
        op_bytes(aten.zero_.default, (dst,), {}, dst).read,
        op_bytes(aten.fill_.Scalar, (dst, 1), {}, dst).read,
    ) == (0, 0)
    out = torch.zeros(8)
    div = op_bytes(aten.div.out, (dst, dst), {"out": out}, out)
    assert (div.read, div.written) == (64, 32)
    lerp = op_bytes(aten.lerp_.Scalar, (dst, dst, 0.5), {}, dst)  # in place: read and written
    assert (lerp.read, lerp.written) == (64, 32)
    # a CPU scalar goes to the kernel by value; a broadcast dimension is read once
    assert view_bytes(torch.tensor(2.0)) == 0
    assert view_bytes(torch.zeros(5).expand(1000, 5)) == 20
    assert view_bytes(torch.zeros(6, 8)[:, :2]) == 48


def test_indexing_ops_move_the_rows_they_select_or_place():
    table, index = torch.zeros(100, 8), torch.zeros(3, dtype=torch.int64)
    rows = torch.index_select(table, 0, index)
    select = op_bytes(aten.index_select.default, (table, 0, index), {}, rows)
    assert (select.read, select.written) == (24 + 3 * 8 * 4, 3 * 8 * 4)
    source = torch.zeros(3, 8)
    placed = op_bytes(aten.index_copy_.default, (table, 0, index, source), {}, table)
    assert (placed.read, placed.written) == (24 + 96, 96)


def test_modelled_time_is_the_roofline_per_op_plus_each_launch():
    gpu = GpuModel("test", matmul_tflops=100.0, fp32_tflops=10.0, bandwidth_tbs=1.0, launch_us=5.0)
    costs = [
        OpCost(1, 10**9, 10**12, torch.bfloat16),  # 10 ms of FLOPs beats 1 ms of bytes
        OpCost(1, 10**9, 10**9, torch.float32),  # 0.1 ms of FLOPs: the 1 ms of bytes bound it
        OpCost(3, 2 * 10**9),  # a foreach op over 3 launches: 2 ms of bytes
    ]
    m = modelled_time(costs, gpu)
    assert m.compute_bound_ms == pytest.approx(10.0)
    assert m.memory_bound_ms == pytest.approx(3.0)
    assert m.launch_ms == pytest.approx(5 * 5e-3)
    assert m.ms == pytest.approx(13.025)
    assert flops_by_dtype(costs) == {"bfloat16": 10**12, "float32": 10**9}
    assert GpuModel().matmul_rate(torch.float16) == 790e12 and GpuModel().matmul_rate(torch.float32) == 67e12
    with pytest.raises(ValueError, match="bandwidth_tbs"):
        GpuModel(bandwidth_tbs=0)


def test_peak_counts_new_storages_alive_at_once_and_not_older_ones():
    tracker = PeakTracker(counted=lambda t: True)
    old = torch.zeros(1000)  # made before: an op on it, or a view of it, adds nothing
    tracker.saw((old,), old[10:])
    tracker.saw((old,), old)
    assert tracker.peak == 0
    a = torch.zeros(100)
    tracker.saw((old,), a)
    view = a[50:]
    tracker.saw((a,), view)  # a view of a new storage: the same storage
    del a
    gc.collect()
    assert tracker.live == 400  # the view holds it
    del view
    assert tracker.live == 0 and tracker.peak == 400
    b, c = torch.zeros(300), torch.zeros(200)  # two alive at once
    tracker.saw((), b)
    tracker.saw((), c)
    assert (tracker.live, tracker.peak) == (2000, 2000)
    tracker.close()
    del b
    assert tracker.live == 2000  # closed: later frees leave the figures


# ----- the workload ---------------------------------------------------------------------------------
LLAMA_8B_BLOCK = {
    "q_proj": (4096, 4096),
    "k_proj": (1024, 4096),
    "v_proj": (1024, 4096),
    "o_proj": (4096, 4096),
    "gate_proj": (14336, 4096),
    "up_proj": (14336, 4096),
    "down_proj": (4096, 14336),
}


def test_llama_8b_layers_holds_four_blocks_of_llama_3_8bs_matrices():
    from fastmuon.bench.workloads import resolve_workload

    manifest = resolve_workload("llama-8b-layers")
    assert len(manifest.params) == 28 and len(manifest.matrices()) == 28
    assert manifest.numel() * 4 == 3.25 * 2**30
    for p in manifest.params:
        assert p.shape == LLAMA_8B_BLOCK[p.name.split(".")[2]]
    assert len(manifest.param_groups) == 1 and manifest.param_groups[0]["use_muon"]


def test_llama_8b_layers_is_refused_on_a_cpu_with_the_reason(capsys):
    from fastmuon.tools.cli import main

    assert main(["bench", "--optimizer", "muon", "--model", "llama-8b-layers"]) == 2
    err = capsys.readouterr().err
    assert "--model llama-8b-layers is meant for a GPU" in err and "--device cuda" in err


def test_gpu_options_need_a_trace(capsys):
    from fastmuon.tools.cli import main

    assert main(["bench", "--gpu-bandwidth", "3.35"]) == 2
    assert "--gpu-bandwidth set a trace's modelled time" in capsys.readouterr().err


# ----- on fake cuda tensors ---------------------------------------------------------------------------
@needs_fake_cuda
def test_the_trace_counts_bytes_flops_and_the_peak_of_a_step():
    from fastmuon.bench.trace import TraceCounter, fake_cuda

    with fake_cuda():
        x = torch.zeros(2, 64, 32, device=CUDA, dtype=torch.bfloat16)
        y = torch.zeros(2, 32, 16, device=CUDA, dtype=torch.bfloat16)
        xs = [torch.zeros(100, device=CUDA) for _ in range(3)]
        with TraceCounter() as tc:
            z = torch.bmm(x, y)  # kept alive to the end
            torch._foreach_add_(xs, xs)
            for _ in range(3):
                t = torch.ones(1000, device=CUDA)  # a temporary, freed before the next one
                del t
            u, v = torch.ones(500, device=CUDA), torch.ones(700, device=CUDA)  # two alive at once
        tc.peak.close()
    assert tc.kernels == 1 + 1 + 3 + 2
    bmm, foreach = tc.costs[0], tc.costs[1]
    assert bmm.flops == 2 * 2 * 64 * 16 * 32 and bmm.dtype == torch.bfloat16
    assert bmm.bytes == 2 * (64 * 32 + 32 * 16 + 64 * 16) * 2
    assert foreach.bytes == 3 * 100 * 4 * 3
    assert tc.bytes_moved == bmm.bytes + foreach.bytes + 3 * 4000 + 4 * 1200
    assert tc.peak.peak == z.untyped_storage().nbytes() + max(4000, 4800)
    del u, v


@needs_fake_cuda
def test_the_bench_reports_the_cost_columns_in_text_markdown_and_json(tmp_path, capsys):
    from fastmuon.bench.gpucheck import QUICK_YOLO, write_quick_manifests
    from fastmuon.tools.cli import main

    write_quick_manifests(tmp_path)
    out, md = tmp_path / "trace.json", tmp_path / "trace.md"
    argv = ["bench", "--device", "cuda", "--trace", "--model", str(tmp_path / QUICK_YOLO)]
    argv += ["--json", str(out), "--markdown", str(md), "--contenders", "fastmuon,torch.optim.sgd"]
    assert main([*argv, "--gpu-model", "H100", "--gpu-bandwidth", "3.0", "--nonfinite", "ignore"]) == 0
    text = capsys.readouterr().out
    for column in ("GiB moved", "matmul GFLOP", "peak extra MiB", "modelled H100 ms"):
        assert column in text and column in md.read_text()
    document = json.loads(out.read_text())
    assert document["settings"]["modelled_gpu"]["bandwidth_tbs"] == 3.0
    assert document["settings"]["nonfinite"] == "ignore"
    assert "nonfinite='ignore'" in {r["name"]: r for r in document["results"]}["fastmuon MuSGD"]["note"]
    rows = {r["name"]: r for r in document["results"]}
    fastmuon, sgd = rows["fastmuon MuSGD"], rows["torch.optim.SGD foreach"]
    for key in ("kernels", "aten_ops", "host_syncs", "python_calls", "ns_flops", "state_bytes", "kept_bytes"):
        assert key in fastmuon  # the keys a trace had before stay
    assert fastmuon["bytes_moved"] > fastmuon["state_bytes"] and fastmuon["top_bytes"]
    assert fastmuon["matmul_flops_total"] == sum(fastmuon["matmul_flops"].values()) > 0
    assert set(fastmuon["matmul_flops"]) == {"bfloat16"}
    assert fastmuon["peak_extra_bytes"] > 0 and fastmuon["modelled_ms"] > 0
    assert fastmuon["modelled_gpu"]["name"] == "H100" and fastmuon["modelled_gpu"]["launch_us"] == 4.0
    assert sgd["matmul_flops_total"] == 0 and sgd["bytes_moved"] > 0
    assert main([*argv, "--gpu-launch-us", "-1"]) == 2
    assert "--gpu-launch-us must be 0 or more, got -1.0" in capsys.readouterr().err
    assert sgd["modelled_ms"] == pytest.approx(
        sum(sgd["modelled_gpu"][k] for k in ("compute_bound_ms", "memory_bound_ms", "launch_ms"))
    )


@needs_fake_cuda
def test_llama_8b_layers_is_built_on_fake_tensors_without_its_memory():
    from torch._subclasses.fake_tensor import FakeTensor

    from fastmuon.bench.manifest import materialize
    from fastmuon.bench.trace import fake_cuda
    from fastmuon.bench.workloads import resolve_workload

    with fake_cuda():
        params = materialize(resolve_workload("llama-8b-layers"), CUDA, 0)
    assert len(params) == 28
    assert all(isinstance(p, FakeTensor) and isinstance(p.grad, FakeTensor) for p in params)
