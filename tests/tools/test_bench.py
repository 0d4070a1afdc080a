"""fastmuon bench: kernel counter, allocation tracker, manifests, workloads and a smoke run."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from fastmuon.bench import (
    AllocationTracker,
    KernelCounter,
    ManifestError,
    load_manifest,
    manifest_from_module,
    resolve_workload,
)
from fastmuon.bench.fake_cuda import fake_cuda_problem
from fastmuon.tools.cli import main
from fastmuon.tools.tables import grid_width, stacked


# ----- kernel counter ------------------------------------------------------------------------
def test_counter_counts_a_known_sequence_exactly():
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    with KernelCounter() as kc:
        c = a + b  # add
        c.view(-1)  # view: not counted
        a.t()  # view: not counted
        torch.empty(3)  # allocation: not counted
        torch.mm(a, b)  # mm
        c.mul_(2)  # mul_
        torch._foreach_add_([a, b], 1.0)  # one dispatch for the whole list
        c.reshape(16).sum()  # reshape of a contiguous tensor is a view; sum
    assert kc.count == 5
    assert kc.ops == {"add": 1, "mm": 1, "mul_": 1, "_foreach_add_": 1, "sum": 1}


def test_counter_ignores_torch_optim_profiler_markers():
    p = nn.Parameter(torch.randn(3))
    p.grad = torch.randn(3)
    opt = torch.optim.SGD([p], lr=0.1, foreach=True)
    with KernelCounter() as kc:
        opt.step()
    assert kc.count == 1 and kc.ops == {"_foreach_add_": 1}


def test_allocation_tracker_peak_and_retained():
    a = torch.randn(100, 100)  # 40_000 bytes, allocated before: not counted
    kept = []
    with AllocationTracker() as mem:
        b = a * 2  # +40_000
        c = b + 1  # +40_000 -> peak 80_000
        del b
        d = c.view(-1)  # a view keeps c's storage alive
        del c
        e = d * 3  # 80_000 live again
        del d
        kept.append(e[:10])  # e's storage survives the block
        del e
        a.add_(1)  # in place: nothing new
    assert mem.peak_bytes == 80_000
    assert mem.retained_bytes == 40_000


# ----- manifests ------------------------------------------------------------------------------
def _manifest_dict():
    return {
        "model": "tiny",
        "optimizer_kwargs": {"muon": 0.2, "sgd": 1.0},
        "param_groups": [
            {"lr": 0.01, "momentum": 0.9, "nesterov": True, "weight_decay": 0.0, "use_muon": False},
            {"lr": 0.02, "momentum": 0.9, "nesterov": True, "weight_decay": 5e-4, "use_muon": True},
        ],
        "params": [
            {"name": "conv.weight", "shape": [8, 4, 3, 3], "group": 1},
            {"name": "fc.weight", "shape": [16, 8], "group": 1},
            {"name": "fc2.weight", "shape": [16, 8], "group": 1},
            {"name": "bn.weight", "shape": [8], "group": 0},
            {"name": "fc.bias", "shape": [16], "group": 0},
        ],
    }


def test_manifest_errors_name_the_file_and_the_entry(tmp_path):
    missing = tmp_path / "nope.json"
    with pytest.raises(ManifestError, match="cannot read manifest .*nope.json"):
        load_manifest(missing)

    broken = tmp_path / "broken.json"
    broken.write_text('{"params": [')
    with pytest.raises(ManifestError, match=r"broken.json.*not valid JSON.*line 1"):
        load_manifest(broken)

    data = _manifest_dict()
    data["params"][1]["shape"] = [16, -8]
    bad_shape = tmp_path / "bad_shape.json"
    bad_shape.write_text(json.dumps(data))
    with pytest.raises(
        ManifestError, match=r"bad_shape.json: params\[1\] \('fc.weight'\) has shape \[16, -8\]"
    ):
        load_manifest(bad_shape)

    data = _manifest_dict()
    data["params"][0]["group"] = 5
    bad_group = tmp_path / "bad_group.json"
    bad_group.write_text(json.dumps(data))
    with pytest.raises(ManifestError, match=r"bad_group.json: params\[0\] \('conv.weight'\) has group 5"):
        load_manifest(bad_group)

    with pytest.raises(ManifestError, match="unknown workload 'yolo99'"):
        resolve_workload("yolo99")


def test_module_manifest_round_trip(tmp_path):
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.Flatten(), nn.Linear(8, 10), nn.Linear(10, 4)
    )
    manifest = manifest_from_module(model, name="mine")
    path = tmp_path / "mine.json"
    manifest.save(path)
    loaded = load_manifest(path)
    assert loaded.to_dict() == manifest.to_dict()
    by_name = {p.name: p for p in loaded.params}
    assert set(by_name) == {n for n, _ in model.named_parameters()}
    assert by_name["0.weight"].shape == (8, 3, 3, 3)
    # fastmuon.param_groups: conv and the hidden Linear are matrices; the output Linear is not
    assert {p.name for p in loaded.matrices()} == {"0.weight", "3.weight"}
    assert loaded.numel() == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize(
    ("name", "numel", "matrices"),
    [
        ("gpt2", 124_439_808, 48),
        ("gpt2-blocks", 84_934_656, 48),
        ("llama-1b", 1_235_814_400, 112),
        ("resnet50", 25_557_032, 53),
    ],
)
def test_generated_workloads_match_their_public_sizes(name, numel, matrices):
    m = resolve_workload(name)
    assert m.numel() == numel
    assert len(m.matrices()) == matrices


def test_bundled_yolo_manifest():
    m = resolve_workload("yolo26n")
    assert len(m.params) == 366 and len(m.matrices()) == 126
    assert m.optimizer_kwargs == {"muon": 0.2, "sgd": 1.0}


# ----- a smoke run of the command ------------------------------------------------------------
@pytest.mark.parametrize("verbose", [False, True])
def test_bench_report_fits_an_80_column_terminal(tmp_path, capsys, monkeypatch, verbose):
    monkeypatch.setenv("COLUMNS", "80")
    manifest = tmp_path / "tiny.json"
    manifest.write_text(json.dumps(_manifest_dict()))  # a manifest without a "source"
    args = ["bench", "--model", str(manifest), "--ns-dtype", "float32", "--contenders", "fastmuon,per-param"]
    args += ["--steps", "1", "--rounds", "1", "--threads", "1", "--quiet"] + ["--verbose"] * verbose
    assert main(args) == 0
    lines = capsys.readouterr().out.splitlines()
    assert max(len(line) for line in lines) <= 80, [line for line in lines if len(line) > 80]
    # the details only with --verbose (there, no stray "; " where the manifest has no source)
    workload = "workload tiny: 5 tensors, 0.00M values, 3 matrices (1 with >2 dims)"
    assert (workload in lines) == verbose
    for name in ("fastmuon MuSGD", "per-parameter MuSGD"):  # each contender's block, every figure
        block = lines[lines.index(name) + 1 :][:8]
        assert any("ms/step: " in line for line in block) and any("kernels: " in line for line in block)
        assert any("speed-up: " in line for line in block)
    assert any(line.startswith("speed-up: per-parameter MuSGD's ms/step") for line in lines)


def test_bench_default_report_is_one_table_against_the_headline_peer(tmp_path, capsys):
    options = ["--steps", "1", "--contenders", "fastmuon,ultralytics,per-param"]
    lines, doc = _tiny_bench(tmp_path, capsys, *options, verbose=False)
    ran = {r["label"]: r for r in doc["results"] if r["median_ms"]}
    if "Ultralytics MuSGD" not in ran:
        pytest.skip("ultralytics is not installed here")
    text = " ".join(" ".join(lines).split())  # wrapped lines joined again
    # one line above the table says the machine class and the precision
    above = text[text.index("tiny musgd on ") :]
    assert above.index(doc["machine"]["cpu_class"]) < above.index("NS in float32") < above.index("contender")
    # --ns-dtype float32: the peer with its NS swapped to float32 is the fair baseline
    base = ran["Ultralytics MuSGD (NS in float32)"]
    assert f"speed-up: {base['name']}'s ms/step over each row's" in text
    for r in ran.values():
        assert f"{base['median_ms'] / r['median_ms']:.2f}×" in text
    assert ": NS floor" not in text and "faster than →" not in text  # those are --verbose's


def test_the_fair_row_is_the_baseline_where_bf16_is_emulated():
    from fastmuon.bench.report import baseline
    from fastmuon.bench.runner import Result

    shipped = Result(
        "Ultralytics MuSGD 8.4.190", ns_dtype="bfloat16", label="Ultralytics MuSGD", times_ms=[90.0]
    )
    fair = Result(
        "Ultralytics MuSGD 8.4.190 (NS in float32)",
        ns_dtype="float32",
        label="Ultralytics MuSGD (NS in float32)",
        times_ms=[3.0],
    )
    ours = Result("fastmuon MuSGD", ns_dtype="bfloat16→float32", label="fastmuon", times_ms=[1.0])
    base, why = baseline([ours, shipped, fair], "musgd")
    assert base is fair and "fair row" in why and "emulates" in why
    assert "emulates" not in baseline([ours, shipped, fair], "musgd", bf16_native=True)[1]
    assert baseline([ours, shipped], "musgd")[0] is shipped
    loop = Result("per-parameter Muon", label="per-parameter", times_ms=[2.0])
    assert baseline([ours, loop], "muon")[0] is loop  # no torch.optim.Muon row ran
    assert baseline([ours, Result("x", label="x", skipped="no")], "normuon")[0] is ours


def _tiny_bench(tmp_path, capsys, *options: str, verbose: bool = True) -> tuple[list[str], dict]:
    """The printed report's lines (with the details of ``--verbose``, by default) and the JSON of
    a one-step run on the tiny manifest."""
    manifest, out = tmp_path / "tiny.json", tmp_path / "out.json"
    manifest.write_text(json.dumps(_manifest_dict()))  # MuSGD's kwargs: muon=0.2, sgd=1.0
    args = ["bench", "--model", str(manifest), "--ns-dtype", "float32", "--rounds", "1", "--threads", "1"]
    assert main([*args, "--json", str(out), "--quiet", *options] + ["--verbose"] * verbose) == 0
    return capsys.readouterr().out.splitlines(), json.loads(out.read_text())


def test_bench_says_the_cpu_class_once_and_nothing_of_the_kwargs_musgd_takes(tmp_path, capsys):
    lines, doc = _tiny_bench(tmp_path, capsys, "--steps", "1", "--contenders", "fastmuon,per-param")
    (cpu_line,) = [line for line in lines if line.startswith("CPU class ")]
    assert doc["machine"]["cpu_class"] in cpu_line
    assert not [line for line in lines if "manifest optimizer kwargs" in line or "ignored" in line]
    assert all("manifest_kwargs_not_taken" not in r["extra"] for r in doc["results"])


def test_bench_report_counts_one_round_thread_and_step_in_the_singular(tmp_path, capsys):
    lines, _ = _tiny_bench(tmp_path, capsys, "--steps", "1", "--contenders", "fastmuon")
    text = "\n".join(lines)
    assert ", 1 interleaved round\n" in text and " with 1 thread, fastmuon " in text
    (note,) = [line for line in lines if line.startswith("fastmuon MuSGD: policy=")]
    assert note.endswith("; 1 step timed")


@pytest.mark.parametrize("optimizer, name", [("adamuon", "AdaMuon"), ("muon", "Muon")])
def test_bench_says_once_that_its_contenders_run_without_musgds_manifest_kwargs(
    tmp_path, capsys, optimizer, name
):
    options = ["--optimizer", optimizer, "--steps", "1", "--contenders", "fastmuon,per-param"]
    lines, doc = _tiny_bench(tmp_path, capsys, *options)
    (said,) = [line for line in lines if "muon=0.2, sgd=1.0" in line]
    assert said == (
        f"manifest optimizer kwargs muon=0.2, sgd=1.0 are MuSGD's, not {name}'s (the manifest was "
        f"written for MuSGD): fastmuon {name} and per-parameter {name} run without them"
    )
    assert not [line for line in lines if "ignored manifest kwargs" in line]
    for r in doc["results"]:  # the JSON keeps it per contender
        assert r["extra"]["manifest_kwargs_not_taken"] == {"muon": 0.2, "sgd": 1.0}, r["name"]


def test_a_manifest_kwarg_no_optimizer_takes_is_named_as_not_the_classes_argument():
    from fastmuon.bench.report import unused_kwargs_line

    assert unused_kwargs_line("muon", {"ns_stpes": 4}, ["fastmuon Muon"]) == (
        "manifest optimizer kwargs ns_stpes=4 are not Muon's arguments: fastmuon Muon runs without them"
    )
    assert unused_kwargs_line("musgd", {"betas": (0.9, 0.95)}, ["fastmuon MuSGD", "per-parameter MuSGD"]) == (
        "manifest optimizer kwargs betas=(0.9, 0.95) are not MuSGD's arguments: fastmuon MuSGD and "
        "per-parameter MuSGD run without them"
    )


WARMUP_0 = (
    "--warmup 0: each contender's first step, which builds its state and batching plans, ran all the "
    "same before any figure was taken (the probes and the timed steps need a built step)"
)


@pytest.mark.parametrize(
    "options, said",
    [
        (["--warmup", "0", "--steps", "1"], WARMUP_0),
        (
            ["--warmup", "0", "--budget", "0.01"],
            WARMUP_0 + "; its time, the building included, set how many steps fit --budget",
        ),
        (["--warmup", "1", "--steps", "1"], None),
    ],
)
def test_bench_warmup_0_says_that_the_plan_building_step_ran_before_the_figures(
    tmp_path, capsys, options, said
):
    lines, doc = _tiny_bench(tmp_path, capsys, "--contenders", "fastmuon", *options)
    assert [line for line in lines if line.startswith("--warmup")] == ([said] if said else [])
    (fast,) = doc["results"]
    assert fast["steps_timed"] >= 1 and fast["kernels_per_step"] > 0


def test_a_table_that_fits_stays_a_grid_and_one_that_does_not_is_stacked():
    header, body = (
        ["contender", "ms/step", "kernels/step"],
        [["fastmuon MuSGD", "1.5", "12"], ["loop", "9.0", ""]],
    )
    assert grid_width(header, body) == 14 + 7 + 12 + 3 * 3 + 1
    assert stacked(header, body, 80) == [
        "fastmuon MuSGD",
        "  ms/step: 1.5, kernels/step: 12",
        "loop",
        "  ms/step: 9.0",
    ]
    narrow = stacked(header, body, 20)
    assert narrow[:3] == ["fastmuon MuSGD", "  ms/step: 1.5,", "  kernels/step: 12"]  # pairs stay whole


def test_bench_json_to_stdout_is_the_json_alone(tmp_path, capsys):
    manifest = tmp_path / "tiny.json"
    manifest.write_text(json.dumps(_manifest_dict()))
    args = ["bench", "--model", str(manifest), "--ns-dtype", "float32", "--contenders", "fastmuon"]
    assert main([*args, "--steps", "1", "--rounds", "1", "--threads", "1", "--json", "-", "--quiet"]) == 0
    captured = capsys.readouterr()
    doc = json.loads(captured.out)  # the settings lines and the table went elsewhere or nowhere
    assert doc["workload"]["model"] == "tiny" and [r["name"] for r in doc["results"]][0].startswith(
        "fastmuon"
    )
    assert "threads: 1" in captured.err


@pytest.mark.parametrize("optimizer", ["musgd", "muon"])
def test_bench_smoke(tmp_path, optimizer, capsys):
    manifest = tmp_path / "tiny.json"
    manifest.write_text(json.dumps(_manifest_dict()))
    out = tmp_path / "out.json"
    args = ["bench", "--model", str(manifest), "--optimizer", optimizer, "--ns-dtype", "float32"]
    args += ["--steps", "1", "--rounds", "1", "--threads", "1", "--json", str(out), "--quiet"]
    assert main([*args, "--verbose", "--markdown", str(tmp_path / "table.md")]) == 0
    assert "| fastmuon" in (tmp_path / "table.md").read_text()
    doc = json.loads(out.read_text())
    assert doc["machine"]["num_threads"] == 1 and doc["machine"]["torch"] == torch.__version__
    assert doc["workload"] == {
        "model": "tiny",
        "source": "",
        "params": 5,
        "numel": 8 * 36 + 2 * 128 + 8 + 16,
        "matrices": 3,
        "matrices_over_2d": 1,
        "ns_matrices": 3,
    }
    assert doc["run"]["params_finite"] and doc["run"]["grads_unchanged"]
    results = {r["name"]: r for r in doc["results"]}
    ours = results["fastmuon MuSGD" if optimizer == "musgd" else "fastmuon Muon"]
    loop = results["per-parameter MuSGD" if optimizer == "musgd" else "per-parameter Muon"]
    sgd = results["torch.optim.SGD foreach"]
    for r in (ours, loop, sgd):
        assert r["skipped"] is None and r["steps_timed"] == 1
        assert r["host_ms"] > 0  # Python around the ops, profiled
        assert r["python_calls"] > 1  # the step and what it calls
        assert 0 < r["min_ms"] <= r["median_ms"] <= r["max_ms"]
        assert r["kernels_per_step"] > 0 and r["state_bytes"] > 0 and r["peak_extra_bytes"] >= 0
    useful = sum(5 * (4 * m * m * n + 2 * m**3) for m, n in [(8, 36), (8, 16), (8, 16)])
    assert loop["ns_flops"] == loop["ns_useful_flops"] == useful  # standard NS, one matrix at a time
    # the batched plan may choose cheaper NS forms (Gram space); padding only adds to its own count
    assert 0 < ours["ns_useful_flops"] <= ours["ns_flops"] and ours["buckets"] >= 1
    assert ours["padding_overhead"] == pytest.approx(ours["ns_flops"] / ours["ns_useful_flops"] - 1)
    assert ours["kernels_per_step"] < loop["kernels_per_step"]  # three matrices, one loop each
    assert sgd["ns_flops"] == 0
    # the floors are measured in every round next to the steps: median and lowest; the run of the
    # plan's products back to back as often as the steps, the ideal one once per round
    assert 0 < ours["extra"]["ns_floor_ms_best"] <= ours["extra"]["ns_floor_ms"]
    assert 0 < ours["extra"]["ns_floor_run_ms_best"] <= ours["extra"]["ns_floor_run_ms"]
    assert "ns_floor_ms" not in loop["extra"] and "ns_floor_run_ms" not in loop["extra"]  # no plan
    names = [r["name"] for r in doc["results"] if r["median_ms"]]
    assert set(doc["speedups"]) == set(names)
    assert doc["speedups"][names[0]][names[1]] == pytest.approx(
        results[names[1]]["median_ms"] / results[names[0]]["median_ms"]
    )
    if optimizer == "muon":
        torch_muon = results["torch.optim.Muon"]
        if hasattr(torch.optim, "Muon"):
            assert torch_muon["extra"]["flattened_weights"] == 1
            assert "; 1 >2D weight flattened to (out, rest) views" in torch_muon["note"]
    else:
        # run, or listed as skipped with the reason
        assert any(r["name"].startswith("Ultralytics") for r in doc["results"])
    for r in doc["results"]:  # every contender that ran has its host time
        assert r["skipped"] is not None or r["host_ms"] > 0, r["name"]
    assert doc["machine"]["cpu_class"] and doc["machine"]["bf16_ns_runs_in"] in ("bfloat16", "float32")
    printed = capsys.readouterr().out
    assert "fastmuon bench: tiny" in printed
    assert f"CPU class {doc['machine']['cpu_class']}" in printed and "host ms/step: torch.profiler" in printed
    name = ours["name"]
    run_ratio = ours["median_ms"] / ours["extra"]["ns_floor_run_ms"]
    assert f"{name}: NS floor" in printed and f"median step {run_ratio:.2f}× the floor" in printed
    assert f"{name}: ideal NS floor" in printed


def test_bench_plot(tmp_path):
    pytest.importorskip("matplotlib")
    manifest = tmp_path / "tiny.json"
    manifest.write_text(json.dumps(_manifest_dict()))
    png = tmp_path / "bench.png"
    args = ["bench", "--model", str(manifest), "--ns-dtype", "float32", "--steps", "1", "--rounds", "1"]
    assert main([*args, "--plot", str(png), "--quiet"]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_reports_a_bad_manifest(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("[]")
    assert main(["bench", "--model", str(bad), "--quiet"]) == 2
    assert "bad.json: a manifest must be a JSON object" in capsys.readouterr().err


def test_bench_skips_contenders_estimated_too_slow_and_fits_steps_to_the_budget(tmp_path):
    manifest = tmp_path / "tiny.json"
    manifest.write_text(json.dumps(_manifest_dict()))
    out = tmp_path / "out.json"
    args = ["bench", "--model", str(manifest), "--ns-dtype", "float32", "--rounds", "2", "--budget", "0.01"]
    assert main([*args, "--max-step-seconds", "1e-9", "--json", str(out), "--quiet"]) == 0
    results = {r["name"]: r for r in json.loads(out.read_text())["results"]}
    for name in ("fastmuon MuSGD", "per-parameter MuSGD"):
        assert "raise --max-step-seconds" in results[name]["skipped"] and results[name]["steps_timed"] == 0
    sgd = results["torch.optim.SGD foreach"]
    assert sgd["skipped"] is None and sgd["steps_timed"] % 2 == 0 and 2 <= sgd["steps_timed"] <= 40


def test_threads_default_leaves_busy_cpus_alone(monkeypatch):
    from fastmuon.bench.cli import choose_threads

    monkeypatch.setattr("os.cpu_count", lambda: 4)
    default = torch.get_num_threads()
    assert choose_threads(None, 0.1) == (default, "torch's default")
    assert choose_threads(None, 9.0)[0] == 1  # every CPU busy: one thread, not a thrashing team
    assert choose_threads(None, 2.0)[0] == min(default, 2)
    assert choose_threads(3, 9.0) == (3, "--threads")


# ----- host time --------------------------------------------------------------------------------
def test_host_time_counts_the_python_around_the_ops_and_not_the_ops():
    import time

    from fastmuon.bench.hosttime import host_ms

    a = torch.randn(64, 64)

    def step():
        time.sleep(0.003)  # host work: counted in full
        torch.mm(a, a)  # an op: not counted

    assert host_ms(step) >= 3.0

    p = nn.Parameter(torch.randn(8, 8))
    p.grad = torch.randn(8, 8)
    opt = torch.optim.SGD([p], lr=0.1, foreach=True)
    assert host_ms(opt.step) > 0  # torch's own "Optimizer.step#SGD.step" region is looked through


def test_python_calls_counts_every_call_a_step_makes_from_python():
    import sys

    from fastmuon.bench.hosttime import python_calls

    a = torch.randn(4, 4)

    def helper():
        return torch.mm(a, a)  # a built-in: one call

    def step():
        helper()
        helper()
        len(())

    # step, twice (helper + torch.mm), len
    assert python_calls(step) == 1 + 2 * 2 + 1
    assert python_calls(lambda: None) == 1
    previous = sys.getprofile()
    python_calls(step)
    assert sys.getprofile() is previous  # the caller's profiler, if any, is back in place


# ----- CPU class ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("machine", "flags", "label"),
    [
        ("x86_64", {"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"}, "x86-64 AVX512-BF16/AMX"),
        ("x86_64", {"avx2", "avx512f", "avx512_bf16"}, "x86-64 AVX512-BF16"),
        ("x86_64", {"avx2", "avx512f"}, "x86-64 AVX512 (no BF16)"),
        ("x86_64", {"avx", "avx2", "fma"}, "x86-64 AVX2-only"),
        ("x86_64", {"sse4_2"}, "x86-64 (no AVX2)"),
        ("x86_64", None, "x86-64 (flags unknown)"),
        ("aarch64", {"fp", "asimd", "sve", "bf16"}, "aarch64 BF16 SVE"),
        ("arm64", {"fp", "asimd"}, "aarch64"),
    ],
)
def test_cpu_class_from_the_flags(machine, flags, label):
    from fastmuon.bench.cpuclass import cpu_label

    assert cpu_label(machine, flags) == label


def test_cpu_facts_say_where_bf16_ns_really_runs():
    from fastmuon.bench.cpuclass import cpu_facts, describe_cpu
    from fastmuon.ns.device import compute_dtype

    facts = cpu_facts()
    runs_in = compute_dtype(torch.bfloat16, "cpu")
    assert facts["bf16_ns_runs_in"] == str(runs_in).removeprefix("torch.")
    assert facts["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    line = describe_cpu(facts)
    assert facts["cpu_class"] in line
    assert ("natively in bf16" in line) == (runs_in == torch.bfloat16)


# ----- usage mistakes: refused before any work, exit 2, one line ---------------------------------
@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            ["--json", "/no/such/dir/x.json"],
            "--json /no/such/dir/x.json: folder '/no/such/dir' does not exist",
        ),
        (["--markdown", "{tmp}"], "is a directory"),
        (["--plot", "/no/such/dir/p.png"], "--plot /no/such/dir/p.png: folder"),
        (["--budget", "-5"], "--budget must be a positive number of seconds, got -5.0"),
        (["--budget", "0"], "--budget must be a positive"),
        (["--rounds", "0"], "--rounds must be at least 1, got 0"),
        (["--steps", "0"], "--steps must be at least 1, got 0"),
        (["--threads", "0"], "--threads must be at least 1, got 0"),
        (["--warmup", "-1"], "--warmup must be at least 0, got -1"),
        (["--nproc", "0"], "--nproc must be at least 1, got 0"),
        (["--max-step-seconds", "-1"], "--max-step-seconds must be 0 or more"),
        (["--contenders", " , "], "--contenders names none; give some of: fastmuon, per-parameter"),
        (["--contenders", "fastmuon,adam"], "--contenders: 'adam' is none of --optimizer musgd's: fastmuon,"),
    ],
)
def test_bench_usage_mistakes_exit_2_before_running(tmp_path, capsys, extra, message):
    extra = [x.replace("{tmp}", str(tmp_path)) for x in extra]
    assert main(["bench", "--model", "yolo26n", "--quiet", *extra]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""  # nothing ran: not even the thread count was set and printed
    assert captured.err.count("\n") == 1 and captured.err.startswith("fastmuon bench: error: ")
    assert message in captured.err


@pytest.mark.skipif(
    torch.cuda.is_available() or fake_cuda_problem() is None,
    reason="checks a torch that sees no GPU and cannot trace on fake cuda tensors instead",
)
def test_bench_device_cuda_without_cuda_is_a_usage_mistake(capsys):
    assert main(["bench", "--device", "cuda", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--device cuda, but this torch sees no CUDA device" in err
    assert "cannot trace the step on fake cuda tensors" in err and torch.__version__ in err


def test_bench_help_shows_the_defaults(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--help"])
    assert exit_info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "(default: 3)" in text and "(default: yolo26n)" in text and "(default: eager)" in text


def test_a_step_that_cannot_be_compiled_is_a_not_supported_row(tmp_path, monkeypatch):
    from fastmuon.bench import runner

    def refuse(fn, mode=None):
        def compiled():
            raise RuntimeError("capture refused\nsecond line")

        return compiled

    monkeypatch.setattr(runner.torch, "compile", refuse)
    manifest = tmp_path / "tiny.json"
    manifest.write_text(json.dumps(_manifest_dict()))
    out = tmp_path / "out.json"
    args = ["bench", "--model", str(manifest), "--ns-dtype", "float32", "--steps", "1", "--rounds", "1"]
    assert main([*args, "--step-mode", "compiled", "--json", str(out), "--quiet"]) == 0
    doc = json.loads(out.read_text())
    assert doc["settings"]["step_mode"] == "compiled"
    for r in doc["results"]:
        if r["name"].startswith(("fastmuon", "per-parameter", "torch.optim.SGD")):
            assert r["skipped"] == (
                "not supported with torch.compile(mode='reduce-overhead') of its step: "
                "RuntimeError: capture refused"
            )


def test_bench_runs_only_the_chosen_contenders(tmp_path):
    manifest = tmp_path / "tiny.json"
    manifest.write_text(json.dumps(_manifest_dict()))
    out = tmp_path / "out.json"
    args = ["bench", "--model", str(manifest), "--ns-dtype", "float32", "--steps", "1", "--rounds", "1"]
    assert main([*args, "--contenders", "FastMuon, torch.optim.sgd", "--json", str(out), "--quiet"]) == 0
    doc = json.loads(out.read_text())
    assert [r["name"] for r in doc["results"]] == ["fastmuon MuSGD", "torch.optim.SGD foreach"]
    assert doc["settings"]["contenders"] == ["FastMuon", "torch.optim.sgd"]


@pytest.mark.parametrize("optimizer", ["musgd", "muon"])
def test_bench_shows_the_bf16_state_row_at_half_the_state_bytes(tmp_path, optimizer):
    """The ``bf16-state`` row steps the same tensors with ``state_dtype=torch.bfloat16``: its
    state bytes are half of fastmuon's (AdamW's step counts aside) and its time is measured."""
    manifest = tmp_path / "tiny.json"
    manifest.write_text(json.dumps(_manifest_dict()))
    out = tmp_path / "out.json"
    args = ["bench", "--model", str(manifest), "--optimizer", optimizer, "--ns-dtype", "float32"]
    args += ["--steps", "1", "--rounds", "1", "--contenders", "fastmuon,bf16-state"]
    args += ["--json", str(out), "--quiet"]
    assert main(args) == 0
    results = {r["name"]: r for r in json.loads(out.read_text())["results"]}
    name = "MuSGD" if optimizer == "musgd" else "Muon"
    ours, narrow = results[f"fastmuon {name}"], results[f"bf16-state {name}"]
    counts = 4 * 2 if optimizer == "muon" else 0  # two AdamW step counts, float32 scalars
    assert 2 * (narrow["state_bytes"] - counts) == ours["state_bytes"] - counts > 0
    assert narrow["median_ms"] > 0 and narrow["note"].startswith("state_dtype=torch.bfloat16")
    assert narrow["ns_flops"] == ours["ns_flops"] and narrow["buckets"] == ours["buckets"]
