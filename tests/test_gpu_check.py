"""scripts/gpu-check.sh and its driver, fastmuon.bench.gpucheck: the parts, their time slots,
the outcome of each part (ok, failed, timed out, skipped) and the one JSON document."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fastmuon.bench import gpucheck
from fastmuon.bench.gpucheck import Part, plan_parts, run_part, summary_lines, write_document

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu-check.sh"


def test_the_script_parses():
    assert subprocess.run(["bash", "-n", str(SCRIPT)]).returncode == 0


def test_on_cuda_every_part_runs_within_the_budget(tmp_path):
    parts = plan_parts("cuda", quick=False, work=tmp_path)
    assert [p.name for p in parts] == [
        "yolo26n-musgd-trace",
        "gpt2-muon-trace",
        "cuda-tests",
        "yolo26n-musgd-eager",
        "gpt2-muon-eager",
        "yolo26n-musgd-compiled",
        "gpt2-muon-compiled",
    ]
    assert all(p.skip is None for p in parts)
    assert sum(p.timeout_s for p in parts) <= gpucheck.TOTAL_BUDGET_S - gpucheck.RESERVE_S
    traces, parts = parts[:2], parts[2:]
    assert "pytest -q -rs -m cuda" in " ".join(parts[0].argv)
    for p in traces:  # the same workloads and main contenders, traced before any GPU part
        argv = " ".join(p.argv)
        assert "fastmuon bench --device cuda --trace" in argv and f"--json {p.json_path}" in argv
        assert "--contenders fastmuon," in argv
    assert "--model yolo26n --optimizer musgd" in " ".join(traces[0].argv)
    assert "--model gpt2 --optimizer muon" in " ".join(traces[1].argv)
    for p in parts[1:]:
        argv = " ".join(p.argv)
        assert "fastmuon bench --device cuda" in argv and f"--json {p.json_path}" in argv
        mode = p.name.rsplit("-", 1)[1]
        assert f"--step-mode {mode}" in argv
        assert ("--contenders" in argv) == (mode == "compiled")  # the loops would spend the slot compiling
    assert "--model yolo26n --optimizer musgd" in " ".join(parts[1].argv)
    assert "--model gpt2 --optimizer muon" in " ".join(parts[2].argv)
    assert "ultralytics" in " ".join(parts[3].argv) and "torch.optim.muon" in " ".join(parts[4].argv)


def test_on_a_cpu_the_compiled_parts_are_skipped_with_the_reason(tmp_path):
    parts = {p.name: p for p in plan_parts("cpu", quick=True, work=tmp_path)}
    assert "CUDA only" in parts["gpt2-muon-compiled"].skip and parts["gpt2-muon-eager"].skip is None
    assert "--steps 1 --rounds 1" in " ".join(parts["gpt2-muon-eager"].argv)
    assert str(tmp_path / gpucheck.QUICK_GPT2) in parts["gpt2-muon-eager"].argv


def test_where_the_step_cannot_be_traced_its_parts_are_skipped_with_the_reason(tmp_path):
    parts = {p.name: p for p in plan_parts("cpu", True, tmp_path, trace_problem="no fake cuda here")}
    assert parts["gpt2-muon-trace"].skip == parts["yolo26n-musgd-trace"].skip == "no fake cuda here"
    assert parts["gpt2-muon-eager"].skip is None


def test_a_part_that_runs_fails_or_times_out_says_so(tmp_path):
    out = tmp_path / "bench.json"
    script = f"import json; open({str(out)!r}, 'w').write(json.dumps({{'results': []}}))"
    ok = run_part(Part("ok", "writes a document", [sys.executable, "-c", script], 30, out), limit_s=60)
    assert ok["status"] == "ok" and ok["rc"] == 0 and ok["bench"] == {"results": []}
    failed = run_part(
        Part("bad", "fails", [sys.executable, "-c", "import sys; print('why'); sys.exit(3)"], 30), 60
    )
    assert failed["status"] == "failed" and failed["rc"] == 3 and "why" in failed["output_tail"]
    slow = run_part(Part("slow", "sleeps", [sys.executable, "-c", "import time; time.sleep(60)"], 30), 5)
    assert slow["status"] == "timeout" and slow["timeout_s"] == 5
    late = run_part(Part("late", "no time left", [sys.executable, "-c", "pass"], 30), limit_s=2)
    assert late["status"] == "skipped" and "no time left" in late["reason"]


def test_the_document_and_its_summary(tmp_path):
    gpu = {"kernels": 120, "memcpy": 2, "launches": 120, "syncs": 1}
    bench = {
        "results": [
            {
                "name": "fastmuon MuSGD",
                "median_ms": 1.25,
                "host_ms": 0.8,
                "kernels_per_step": 118,
                "extra": {"cuda_activity": gpu},
            },
            {"name": "Ultralytics MuSGD", "median_ms": None, "skipped": "not supported with torch.compile"},
        ]
    }
    traced = {"name": "fastmuon MuSGD", "kernels": 116, "aten_ops": 113, "host_syncs": 1, "python_calls": 559}
    failed = {"name": "Ultralytics MuSGD", "error": "TraceError: an op needs device values"}
    trace = {"label": "traced on fake cuda tensors: counts, not times", "results": [traced, failed]}
    document = {
        "schema": gpucheck.SCHEMA,
        "device": "cuda",
        "machine": {"torch": "2.x", "gpu": "Some GPU"},
        "parts": {
            "yolo26n-musgd-trace": {"status": "ok", "seconds": 9.0, "bench": trace},
            "yolo26n-musgd-compiled": {"status": "ok", "seconds": 42.0, "bench": bench},
            "gpt2-muon-compiled": {"status": "timeout", "seconds": 105.0},
            "cuda-tests": {"status": "skipped", "reason": "no tests/ folder"},
        },
    }
    path = tmp_path / "deeper" / "gpu-check.json"
    write_document(path, document)
    assert json.loads(path.read_text()) == document and not path.with_suffix(".json.tmp").exists()
    text = "\n".join(summary_lines(document))
    assert "gpu-check on Some GPU" in text and "yolo26n-musgd-compiled: ok in 42 s" in text
    assert "1.25 ms/step  host    0.80 ms  118 kernels" in text
    assert "GPU ran 120 kernels, 2 copies/sets, 1 host waits" in text
    assert "traced: 116 kernels (113 ATen ops), 1 host syncs, 559 Python calls" in text
    assert "yolo26n-musgd-trace: ok in 9 s" in text and "counts, not times" in text
    assert "TraceError: an op needs device values" in text
    assert "Ultralytics MuSGD" in text and "skipped: not supported with torch.compile" in text
    assert "gpt2-muon-compiled: timeout in 105 s" in text and "cuda-tests: skipped (no tests/ folder)" in text


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine where torch sees no GPU")
def test_without_cuda_the_cuda_check_is_a_one_line_usage_error(tmp_path, capsys):
    assert gpucheck.main(["--device", "cuda", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--device cpu --quick" in err
    assert not (tmp_path / "gpu-check.json").exists()


def test_what_the_gpu_ran_is_counted_from_the_profilers_events():
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    from fastmuon.bench.hosttime import count_activity

    def event(name, device=DeviceType.CPU):
        return SimpleNamespace(name=name, device_type=device)

    events = [
        event("aten::add_"),
        event("cudaLaunchKernel"),
        event("void at::native::vectorized_elementwise_kernel<...>", DeviceType.CUDA),
        event("cudaMemcpyAsync"),
        event("Memcpy DtoH (Device -> Pageable)", DeviceType.CUDA),
        event("cudaStreamSynchronize"),
    ]
    assert count_activity(events) == {"kernels": 1, "memcpy": 1, "launches": 1, "syncs": 1}
