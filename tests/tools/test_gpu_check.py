"""scripts/gpu-check.sh and its driver, fastmuon.bench.gpucheck: the parts, their time slots,
the outcome of each part (ok, failed, timed out, skipped) and the one JSON document."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fastmuon.bench import gpucheck
from fastmuon.bench.gpucheck import Part, plan_parts, run_part, summary_lines, write_document

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu-check.sh"


def test_the_script_parses():
    assert subprocess.run(["bash", "-n", str(SCRIPT)]).returncode == 0


def test_on_cuda_every_part_runs_within_the_budget(tmp_path):
    parts = plan_parts("cuda", quick=False, work=tmp_path)
    assert [p.name for p in parts] == [
        "correctness",
        "memory",
        "cuda-graph",
        "distributed",
        "yolo26n-musgd-trace",
        "gpt2-muon-trace",
        "yolo26n-musgd-eager",
        "gpt2-muon-eager",
        "cuda-tests",
        "yolo26n-musgd-compiled",
        "gpt2-muon-compiled",
    ]
    assert all(p.skip is None for p in parts)
    assert sum(p.timeout_s for p in parts) <= gpucheck.TOTAL_BUDGET_S - gpucheck.RESERVE_S
    checks, traces, benches = parts[:4], parts[4:6], parts[6:]
    for p in checks:  # each check in its own process, its records written to its own file
        argv = " ".join(p.argv)
        assert f"fastmuon.bench.gpu_parts --check {p.name} --device cuda --json {p.json_path}" in argv
        assert p.result_key == "check" and "--quick" not in argv
    for p in traces:  # the same workloads and main contenders, traced before the timed parts
        argv = " ".join(p.argv)
        assert "fastmuon bench --device cuda --trace" in argv and f"--json {p.json_path}" in argv
        assert "--contenders fastmuon," in argv
    assert "--model yolo26n --optimizer musgd" in " ".join(traces[0].argv)
    assert "--model gpt2 --optimizer muon" in " ".join(traces[1].argv)
    tests = benches.pop(2)
    assert "pytest -q -rs -m cuda" in " ".join(tests.argv)
    for p in benches:
        argv = " ".join(p.argv)
        assert "fastmuon bench --device cuda" in argv and f"--json {p.json_path}" in argv
        mode = p.name.rsplit("-", 1)[1]
        assert f"--step-mode {mode}" in argv
        assert ("--contenders" in argv) == (mode == "compiled")  # the loops would spend the slot compiling
    assert "--model yolo26n --optimizer musgd" in " ".join(benches[0].argv)
    assert "--model gpt2 --optimizer muon" in " ".join(benches[1].argv)
    assert "ultralytics" in " ".join(benches[2].argv) and "torch.optim.muon" in " ".join(benches[3].argv)


def test_a_part_gets_its_slot_and_what_the_parts_before_it_left():
    assert gpucheck.part_limit(50, left_s=400, later_s=300) == 100  # 50 unused before it
    assert gpucheck.part_limit(50, left_s=350, later_s=300) == 50
    assert gpucheck.part_limit(50, left_s=30, later_s=300) == 30  # a short budget: first come
    assert gpucheck.part_limit(50, left_s=-1, later_s=0) == 0


def test_on_a_cpu_the_cuda_only_parts_are_skipped_with_the_reason(tmp_path):
    parts = {p.name: p for p in plan_parts("cpu", quick=True, work=tmp_path)}
    assert "CUDA only" in parts["gpt2-muon-compiled"].skip and parts["gpt2-muon-eager"].skip is None
    assert parts["cuda-graph"].skip == "CUDA graphs need a CUDA device"
    assert "no CUDA device" in parts["cuda-tests"].skip
    for name in ("correctness", "memory", "distributed"):
        assert parts[name].skip is None and "--quick" in parts[name].argv
    assert "--steps 1 --rounds 1" in " ".join(parts["gpt2-muon-eager"].argv)
    assert str(tmp_path / gpucheck.QUICK_GPT2) in parts["gpt2-muon-eager"].argv
    assert "--contenders fastmuon,torch.optim.muon" in " ".join(parts["gpt2-muon-eager"].argv)


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
    partial = tmp_path / "partial.json"
    first_then_sleep = (
        f"import json, time; open({str(partial)!r}, 'w').write(json.dumps({{'sections': 1}})); time.sleep(60)"
    )
    slow = Part("slow", "sleeps", [sys.executable, "-c", first_then_sleep], 30, partial, result_key="check")
    slow_record = run_part(slow, 5)
    assert slow_record["status"] == "timeout" and slow_record["timeout_s"] == 5
    assert slow_record["check"] == {"sections": 1}  # what it wrote before its slot ran out is kept
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
        event("cudaEventSynchronize"),
    ]
    counts = {"kernels": 1, "memcpy": 1, "launches": 1, "syncs": 2, "event_waits": 1}
    assert count_activity(events) == counts


def test_a_check_writes_its_records_after_every_item_and_goes_on_after_an_error(tmp_path):
    from fastmuon.bench.gpu_shared import Recorder

    path = tmp_path / "part.json"
    rec = Recorder(path, torch.device("cpu"), quick=True)
    rec.attempt("rows", "first", lambda: rec.add("rows", {"item": "first", "value": 1}))
    assert json.loads(path.read_text())["sections"] == {"rows": [{"item": "first", "value": 1}]}

    def broken() -> None:
        raise ValueError("what went wrong")

    rec.attempt("rows", "second", broken)
    rec.attempt("rows", "third", lambda: rec.add("rows", {"item": "third", "value": 3}))
    written = json.loads(path.read_text())
    assert [r["item"] for r in written["sections"]["rows"]] == ["first", "second", "third"]
    assert written["sections"]["rows"][1]["error"] == "ValueError: what went wrong"
    assert written["errors"] == rec.errors == 1 and not path.with_suffix(".json.tmp").exists()


def test_a_cuda_only_check_is_refused_on_a_cpu(capsys):
    from fastmuon.bench import gpu_parts

    assert gpu_parts.main(["--check", "cuda-graph", "--device", "cpu"]) == 2
    assert "CUDA graphs need a CUDA device" in capsys.readouterr().err


def _verdict_document(**changes):
    comparison = {"model": "mixed", "path": "packed", "holds": True, "worst_err_over_bound": 0.1}
    large = comparison | {"model": "large", "path": "bucket by bucket"}
    memory = {
        "workload": "gpt2",
        "optimizer": "muon",
        "predicted_host_syncs": 0,
        "measured_sync_warnings": 0,
        "measured_host_waits": 1,  # the wait for the previous step's flags
        "measured_event_waits": 1,
        "predicted_peak_extra_bytes": 100 * 2**20,
        "measured_peak_extra_bytes": 120 * 2**20,
        "modelled_ms": 1.0,
        "measured_ms": 2.5,
        "measured_ms_ignore": 2.0,
        "trace_problem": None,
        "measured_problem": None,
    }
    captured = {"workload": "yolo26n", "optimizer": "musgd", "bitwise_equal": True, "worst_rel_err": 0.0}
    captured |= {"eager_ms": 2.0, "replay_ms": 0.5}
    sections = {
        "correctness": {
            "comparisons": [comparison, large],
            "nonfinite_skip": [{"holds": True}],
            "fused_sgd": [{"bitwise": True, "worst_rel_err": 0.0, "holds": True}],
        },
        "memory": {"workloads": [memory], "machine": [{"launch_us": 31.25, "bf16_tflops": 702.4}]},
        "cuda-graph": {"captured": [captured]},
    }
    for name, changed in changes.items():
        sections[name] = changed
    parts = {name: {"status": "ok", "check": {"sections": s}} for name, s in sections.items()}
    parts["distributed"] = {"status": "timeout", "seconds": 30}
    trace = [
        {"name": "fastmuon MuSGD", "modelled_ms": 1.0},
        {"name": "Ultralytics MuSGD 8.4.190", "modelled_ms": 3.0},
    ]
    timed = [
        {"name": "fastmuon MuSGD", "median_ms": 2.0},
        {"name": "Ultralytics MuSGD 8.4.190", "median_ms": 5.0},
        {"name": "Ultralytics MuSGD 8.4.190 (NS in float32)", "median_ms": 1.0},
    ]
    parts["yolo26n-musgd-trace"] = {"status": "ok", "bench": {"results": trace}}
    parts["yolo26n-musgd-eager"] = {"status": "ok", "bench": {"results": timed}}
    parts["yolo26n-musgd-compiled"] = {
        "status": "skipped",
        "reason": "compiled steps are checked on CUDA only",
    }
    return {"device": "cuda", "quick": False, "parts": parts}


def test_the_verdict_reads_each_claim_off_its_part():
    from fastmuon.bench.gpu_verdict import failed_required, table_lines, verdicts

    rows = {v.claim: v for v in verdicts(_verdict_document())}
    assert not failed_required(list(rows.values()))
    correct = next(v for c, v in rows.items() if c.startswith("steps equal the CPU"))
    assert correct.holds and correct.required and correct.measured.startswith("2/2 within")
    assert rows["NS takes the packed path and the bucket-by-bucket path (>= 64 MiB of NS inputs)"].holds
    synced = rows["no host sync in a default step but its wait for the previous step's flags (gpt2, muon)"]
    assert synced.holds and synced.measured == "0 sync-debug warnings, 1 host waits of which 1 for an event"
    peak = rows["peak extra memory <= predicted x 1.25 (gpt2)"]
    assert peak.holds and (peak.predicted, peak.measured) == ("100.0 MiB (trace)", "120.0 MiB (allocator)")
    alone = rows["steps alone back to back (gpt2): the default beside nonfinite='ignore' (not a claim)"]
    assert alone.holds is None and alone.measured == "2.500 ms default, 2.000 ms ignore"
    rates = rows["this machine's rates beside the model's (not a claim)"]
    assert rates.measured == "31.2 us a launch (tiny kernels back to back), 702 TFLOP/s bf16"
    timing = rows["step time (gpt2): the trace's roofline beside the measurement (not a claim)"]
    assert timing.holds is None and "(modelled)" in timing.predicted and "2.500 ms" in timing.measured
    speed = rows["fastmuon MuSGD faster than Ultralytics' MuSGD (yolo26n, eager)"]
    assert (speed.predicted, speed.measured, speed.holds) == (
        "3.00x (modelled ms ratio)",
        "2.50x (ms/step ratio)",
        True,
    )
    compiled = rows["fastmuon MuSGD faster than Ultralytics' MuSGD (yolo26n, compiled)"]
    assert compiled.holds is None and "skipped (compiled steps are checked on CUDA only)" in compiled.measured
    assert rows["a replayed step is faster than an eager one (yolo26n, musgd)"].holds
    distributed = rows["a one-process distributed step equals the plain step, with no host sync"]
    assert distributed.holds is None and distributed.measured == "not measured: distributed timeout"
    lines = table_lines(list(rows.values()))
    assert lines[0] == "| claim | predicted | measured | holds? |" and len(lines) == len(rows) + 2


def test_the_verdict_fails_a_correctness_claim_that_does_not_hold():
    from fastmuon.bench.gpu_verdict import failed_required, verdicts

    wrong = {"model": "mixed", "path": "bucket by bucket", "holds": False, "worst_err_over_bound": 40.0}
    crashed = {"item": "Muon on large", "error": "RuntimeError: CUDA error: an illegal memory access"}
    memory = {
        "workloads": [dict(_verdict_document()["parts"]["memory"]["check"]["sections"]["workloads"][0])]
    }
    memory["workloads"][0].update(measured_peak_extra_bytes=200 * 2**20, measured_event_waits=0)
    captured = {"workload": "gpt2", "optimizer": "muon", "bitwise_equal": False, "worst_rel_err": 3e-3}
    captured |= {"eager_ms": 2.0, "replay_ms": 2.5}
    document = _verdict_document(
        correctness={"comparisons": [wrong, crashed], "nonfinite_skip": [{"holds": False}], "fused_sgd": []},
        memory=memory,
        **{"cuda-graph": {"captured": [captured]}},
    )
    rows = {v.claim: v for v in verdicts(document)}
    failed = {v.claim for v in failed_required(list(rows.values()))}
    assert failed == {
        "steps equal the CPU per-parameter fp32 reference (MuSGD, Muon, NorMuon, AdaMuon; NS bf16 and fp32)",
        "a NaN gradient under nonfinite='skip' leaves its parameter and state bitwise untouched",
        "torch's fused SGD (fused=True) equals MuSGD's SGD half (use_muon=False)",
        "a captured step (docs/performance.md's recipe) equals eager (gpt2, muon)",
    }
    correct = next(v for c, v in rows.items() if c.startswith("steps equal the CPU"))
    assert "0/1 within; worst error 40 x its bound; 1 raised (Muon on large: RuntimeError" in correct.measured
    assert (
        rows["NS takes the packed path and the bucket-by-bucket path (>= 64 MiB of NS inputs)"].holds is False
    )
    claim = "no host sync in a default step but its wait for the previous step's flags (gpt2, muon)"
    assert rows[claim].holds is False  # a stream or device synchronize, not the flags' event
    assert rows["peak extra memory <= predicted x 1.25 (gpt2)"].holds is False
    assert rows["a replayed step is faster than an eager one (gpt2, muon)"].holds is False


def test_a_part_that_stopped_early_shows_no_claim_holding_but_refutes_what_it_can():
    from fastmuon.bench.gpu_verdict import verdicts

    wrong = {"model": "large", "path": "bucket by bucket", "holds": False, "worst_err_over_bound": 3.0}
    document = _verdict_document()
    document["parts"]["correctness"]["status"] = "timeout"  # its records so far are kept
    rows = {v.claim: v for v in verdicts(document)}
    nan = rows["a NaN gradient under nonfinite='skip' leaves its parameter and state bitwise untouched"]
    assert nan.holds is None and nan.measured == "1/1 optimizers (part timeout: partial)"
    comparisons = document["parts"]["correctness"]["check"]["sections"]["comparisons"]
    comparisons.append(wrong)
    correct = next(v for v in verdicts(document) if v.claim.startswith("steps equal the CPU"))
    assert correct.holds is False and correct.measured.startswith("2/3 within")


def test_the_document_is_written_after_every_part_and_a_timeout_loses_only_its_part(
    tmp_path, monkeypatch, capsys
):
    parts = [Part(name, name, ["true"], 30) for name in ("first", "slow", "last")]
    outcomes = {"first": {"status": "ok"}, "slow": {"status": "timeout"}, "last": {"status": "ok"}}
    monkeypatch.setattr(gpucheck, "plan_parts", lambda *args: parts)
    monkeypatch.setattr(gpucheck, "run_part", lambda part, limit: dict(outcomes[part.name]))
    written = []
    real_write = gpucheck.write_document

    def write(path, document):
        written.append(list(document["parts"]))
        real_write(path, document)

    monkeypatch.setattr(gpucheck, "write_document", write)
    assert gpucheck.main(["--device", "cpu", "--out", str(tmp_path)]) == 1  # a part timed out
    assert written[:4] == [[], ["first"], ["first", "slow"], ["first", "slow", "last"]]
    document = json.loads((tmp_path / "gpu-check.json").read_text())
    assert {n: p["status"] for n, p in document["parts"].items()} == {
        "first": "ok",
        "slow": "timeout",
        "last": "ok",
    }
    assert document["verdict"] and "verdict:" in capsys.readouterr().out


def test_the_dry_run_runs_every_part_a_cpu_can_and_says_why_not_the_others(tmp_path):
    """scripts/gpu-check.sh --device cpu --quick, as a user runs it: every part ends ok or
    skipped with its reason, the document holds every part's figures and the verdict, and
    every correctness claim holds."""
    env = {**os.environ, "PYTHON": sys.executable}
    proc = subprocess.run(
        ["bash", str(SCRIPT), "--device", "cpu", "--quick", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    document = json.loads((tmp_path / "gpu-check.json").read_text())
    parts = document["parts"]
    assert list(parts) == [p.name for p in plan_parts("cpu", True, tmp_path)]
    for name, part in parts.items():
        assert part["status"] in ("ok", "skipped"), (name, part)
        assert part["status"] == "ok" or part["reason"], name
    for name in ("cuda-graph", "cuda-tests", "yolo26n-musgd-compiled", "gpt2-muon-compiled"):
        assert parts[name]["status"] == "skipped"
    for name in ("correctness", "memory", "distributed", "yolo26n-musgd-eager", "gpt2-muon-eager"):
        assert parts[name]["status"] == "ok", name
    sections = parts["correctness"]["check"]["sections"]
    assert len(sections["comparisons"]) == 16 and all(r["holds"] for r in sections["comparisons"])
    assert [r["mode"] for r in parts["distributed"]["check"]["sections"]["steps"]] == [
        "DDP-style (process_group=)",
        "FSDP2 (fully_shard)",
    ]
    required = [v for v in document["verdict"] if v["required"]]
    assert required and all(v["holds"] in (True, None) for v in required)
    assert all(v["holds"] for v in required if v["part"] == "correctness")
    assert "verdict:" in proc.stdout and "| claim | predicted | measured | holds? |" in proc.stdout


def test_host_waits_leave_out_the_profilers_own(monkeypatch):
    """The profiler waits for the device itself when it stops: a step is charged only with the
    waits beyond those it makes around a call that does nothing."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    from fastmuon.bench import hosttime

    def step():
        return None

    def profiled(run, activities):
        names = ["cudaDeviceSynchronize"] + (["cudaEventSynchronize"] if run is step else [])
        return SimpleNamespace(
            events=lambda: [SimpleNamespace(name=n, device_type=DeviceType.CPU) for n in names]
        )

    monkeypatch.setattr(hosttime, "_profiled", profiled)
    counts = hosttime.cuda_activity(step)
    assert (counts["syncs"], counts["event_waits"]) == (1, 1)


def test_sync_warnings_count_the_syncs_not_the_modes_notice(monkeypatch):
    """Setting the sync debug mode warns, once per process, that it is a prototype; that notice
    mentions synchronizing operations too, and is not a sync the step made."""
    import warnings

    from fastmuon.bench import gpu_shared

    mode = {"now": 0}

    def set_mode(value):
        if value == "warn":
            warnings.warn(
                "Synchronization debug mode is a prototype feature and does not yet detect all synchronizing operations",
                stacklevel=2,
            )
        mode["now"] = value

    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: mode["now"])
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", set_mode)

    def step():
        warnings.warn(
            "called a synchronizing CUDA operation", stacklevel=1
        )  # this line, as torch's name the caller's

    [site] = gpu_shared.sync_warnings(step, torch.device("cuda"))
    assert site.startswith(__file__)
    assert gpu_shared.sync_warnings(lambda: None, torch.device("cuda")) == []
    assert mode["now"] == 0
