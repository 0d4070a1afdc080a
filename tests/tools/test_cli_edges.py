"""The command line's corners: output formats, odd input files, what the reports print."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

import fastmuon.bench.cli
import fastmuon.train.cli
from fastmuon.tools.cli import main


def refuse_work(*args, **kwargs):
    raise AssertionError("the command did the work before refusing its arguments")


@pytest.mark.parametrize("name", ["out.txt", "out"])
def test_bench_plot_to_a_format_matplotlib_cannot_write_is_refused_first(tmp_path, capsys, monkeypatch, name):
    pytest.importorskip("matplotlib")
    monkeypatch.setattr(fastmuon.bench.cli, "run_benchmark", refuse_work)
    assert main(["bench", "--model", "yolo26n", "--quiet", "--plot", str(tmp_path / name)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1 and captured.err.startswith("fastmuon bench: error: --plot ")
    assert ".png" in captured.err and "matplotlib" in captured.err


def test_train_plot_to_a_format_matplotlib_cannot_write_is_refused_first(tmp_path, capsys, monkeypatch):
    pytest.importorskip("matplotlib")
    pytest.importorskip("rich")
    monkeypatch.setattr(fastmuon.train.cli, "train_run", refuse_work)
    assert main(["train", "--plot", str(tmp_path / "curves.txt")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("fastmuon train: error: --plot ")
    assert "'.txt' is not a format matplotlib writes" in err


def test_bench_model_file_that_is_not_text_is_a_clean_error(tmp_path, capsys, monkeypatch):
    picture = tmp_path / "x.png"
    picture.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\xff\xfe")
    monkeypatch.setattr(fastmuon.bench.cli, "run_benchmark", refuse_work)
    assert main(["bench", "--model", str(picture), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "x.png" in err and "not a UTF-8 text file" in err


def test_yolo_without_an_importable_torchvision_says_so_in_one_line(tmp_path):
    """Run where torchvision is not there (its import and its package record blocked in a child
    interpreter, whatever is installed here): the error names torchvision and the fix, with no
    traceback."""
    if importlib.util.find_spec("ultralytics") is None:
        pytest.skip("ultralytics is not installed (pip install --no-deps ultralytics)")
    if importlib.util.find_spec("cv2") is None:
        pytest.skip("Ultralytics' OpenCV is not installed: its import stops there, before torchvision")
    child = (
        "import importlib.metadata as m, sys\n"
        "sys.modules['torchvision'] = None\n"
        "real = m.version\n"
        "def version(name):\n"
        "    if name == 'torchvision':\n"
        "        raise m.PackageNotFoundError(name)\n"
        "    return real(name)\n"
        "m.version = version\n"
        "from fastmuon.tools.cli import main; sys.exit(main(['yolo', 'version']))"
    )
    env = {**os.environ, "YOLO_CONFIG_DIR": str(tmp_path), "YOLO_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 1
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fastmuon yolo: error: Ultralytics needs torchvision")
    assert "install the torchvision paired with your torch" in lines[0]


def _distributed_figures(speedup: float) -> dict:
    rank = dict(flop_share=0.5, ns_seconds=0.01, comm_seconds=0.002, step_seconds=0.02)
    rank.update(bytes_sent=1.5e6, bytes_received=1.5e6)
    return dict(
        model="yolo26n", optimizer="MuSGD", mode="ddp", nproc=2, device="cpu", backend="gloo", ns_dtype="float32",
        threads_per_rank=1, steps=5, single_process_ns_seconds=0.029, ns_speedup=speedup,
        ideal_ns_speedup=2.0, bytes_per_step=3e6, ranks=[{"rank": k, **rank} for k in range(2)],
    )  # fmt: skip


@pytest.mark.parametrize("speedup", [1.8, 2.9])
def test_distributed_report_fits_80_columns_and_explains_a_speedup_above_its_bound(speedup):
    from fastmuon.bench.multirank import format_table

    text = format_table(_distributed_figures(speedup), width=80)
    assert max(map(len, text.splitlines())) <= 80, text
    flat = " ".join(text.split())
    assert f"NS speedup per rank: {speedup:.2f}x (FLOP-balance bound 2.00x)" in flat
    assert ("above the bound" in flat) == (speedup > 2.0)


def test_distributed_report_counts_one_thread_and_one_step_in_the_singular():
    from fastmuon.bench.multirank import format_table

    first = " ".join(format_table(_distributed_figures(1.8), width=200).splitlines()[0].split())
    assert first.startswith("yolo26n MuSGD, ddp: 2 ranks on cpu (gloo)")
    assert first.endswith("ns_dtype=float32, 1 thread per rank, median of 5 steps")


@pytest.mark.slow
def test_bench_nproc_steps_the_optimizer_asked_for_on_every_rank():
    """Each rank builds the optimizer of --optimizer (AdaMuon takes none of the yolo manifest's
    MuSGD kwargs) and says which class it stepped; the report's first line names it."""
    from fastmuon.bench.multirank import format_table, run_multirank_bench

    figures = run_multirank_bench("yolo26n", 2, "cpu", torch.float32, steps=1, warmup=1, optimizer="adamuon")
    assert figures["optimizer"] == "AdaMuon" and len(figures["ranks"]) == 2
    assert all(r["ns_seconds"] > 0 and r["bytes_received"] > 0 for r in figures["ranks"])
    assert format_table(figures, width=200).startswith("yolo26n AdaMuon, ddp: 2 ranks on cpu (gloo)")


@pytest.mark.parametrize("optimizer", ["musgd", "muon", "normuon", "adamuon"])
def test_bench_nproc_hands_the_optimizer_to_the_multirank_benchmark(monkeypatch, capsys, optimizer):
    import fastmuon.bench.multirank

    asked = {}

    def run_multirank_bench(*args, **kwargs):
        asked.update(kwargs)
        return {**_distributed_figures(1.8), "optimizer": optimizer}

    monkeypatch.setattr(fastmuon.bench.multirank, "run_multirank_bench", run_multirank_bench)
    assert main(["bench", "--optimizer", optimizer, "--nproc", "2", "--quiet"]) == 0
    assert asked["optimizer"] == optimizer
    assert capsys.readouterr().out.startswith(f"yolo26n {optimizer}, ddp")


@pytest.mark.parametrize("optimizer, name", [("normuon", "NorMuon"), ("adamuon", "AdaMuon")])
@pytest.mark.parametrize("mode", ["fsdp", "hsdp"])
def test_bench_nproc_refuses_sharding_for_an_optimizer_that_refuses_sharded_matrices(
    monkeypatch, capsys, optimizer, name, mode
):
    import fastmuon.bench.multirank

    monkeypatch.setattr(fastmuon.bench.multirank, "run_multirank_bench", refuse_work)
    argv = ["bench", "--optimizer", optimizer, "--nproc", "2", "--dist-mode", mode, "--quiet"]
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1
    assert captured.err.startswith(
        f"fastmuon bench: error: --optimizer {optimizer} with --dist-mode {mode}: {name} refuses sharded"
    )
    assert "run it with --dist-mode ddp, or benchmark" in captured.err


def test_bench_nproc_hsdp_on_an_odd_number_of_ranks_is_refused_before_anything_runs(monkeypatch, capsys):
    import fastmuon.bench.multirank

    monkeypatch.setattr(fastmuon.bench.multirank, "run_multirank_bench", refuse_work)
    assert main(["bench", "--nproc", "3", "--dist-mode", "hsdp", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert (
        err
        == "fastmuon bench: error: --dist-mode hsdp replicates over 2 groups: give an even --nproc, not 3\n"
    )


def _tiny_manifest(tmp_path) -> str:
    from fastmuon.bench import manifest_from_module

    path = tmp_path / "tiny.json"
    manifest_from_module(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))).save(path)
    return str(path)


@pytest.mark.parametrize(
    "extra, skips",
    [
        (["--steps", "1"], False),  # the steps asked for are run
        (["--steps", "1", "--max-step-seconds", "0"], False),  # 0: no limit
        (["--steps", "1", "--max-step-seconds", "5"], True),  # a limit given applies
        (["--budget", "0.05", "--max-step-seconds", "0"], False),
        (["--budget", "0.05"], True),  # the default limit, when --steps is unset
    ],
)
def test_max_step_seconds_skips_only_where_asked(tmp_path, monkeypatch, extra, skips):
    import fastmuon.bench.runner

    # every step is then estimated at far more than any limit
    monkeypatch.setattr(fastmuon.bench.runner, "matmul_rate", lambda device, dtype: 1.0)
    out = tmp_path / "out.json"
    argv = ["bench", "--model", _tiny_manifest(tmp_path), "--ns-dtype", "float32", "--rounds", "1"]
    assert (
        main([*argv, "--warmup", "1", "--contenders", "fastmuon", "--quiet", "--json", str(out), *extra]) == 0
    )
    (fast,) = [r for r in json.loads(out.read_text())["results"] if r["name"].startswith("fastmuon")]
    assert bool(fast["skipped"]) == skips, fast["skipped"]
    assert (fast["median_ms"] is None) == skips


def test_bench_progress_shows_no_count_it_does_not_have():
    pytest.importorskip("rich")
    import io

    from rich.console import Console

    from fastmuon.bench.report import progress_display

    screen = io.StringIO()
    console = Console(file=screen, force_terminal=True, width=100)
    with progress_display(enabled=True, console=console) as update:
        update("warmup", "fastmuon MuSGD", 0, 1)
        update("step", "fastmuon MuSGD", 3, 12)
    shown = screen.getvalue()  # the first frame (the warm-up, before any count) and the last
    assert "warm-up" in shown and "3/12" in shown
    assert "None" not in shown


def test_bench_modules_run_with_python_m_without_runpy_warnings():
    done = subprocess.run(
        [sys.executable, "-W", "error::RuntimeWarning", "-m", "fastmuon.bench.hosttime", "--help"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert "found in sys.modules" not in done.stderr and done.stdout.startswith("usage:")


def test_the_bench_package_exports_each_name_of_its_all_from_the_module_that_defines_it():
    import importlib

    import fastmuon.bench as bench

    assert len(set(bench.__all__)) == len(bench.__all__), "a name listed twice in fastmuon.bench.__all__"
    star: dict[str, object] = {}
    exec("from fastmuon.bench import *", star)
    assert set(star) - {"__builtins__"} == set(bench.__all__)
    for name in bench.__all__:
        value = getattr(bench, name)
        home = getattr(value, "__module__", None)
        if home is not None:  # a class or function: the defining module's own object
            assert home.startswith("fastmuon.bench."), (name, home)
            assert getattr(importlib.import_module(home), name) is value, (name, home)
    from fastmuon.bench import Settings, manifest_from_module, run_benchmark

    assert isinstance(Settings, type) and callable(manifest_from_module) and callable(run_benchmark)


def test_accuracy_table_shows_every_name_whole_with_its_columns_apart(capsys):
    from fastmuon.tools.accuracy import VARIANTS, print_table

    results = [
        dict(input=name, variant=v.name, sv_min=0.682, sv_max=1.042, rel_err_vs_fp64=2.68e-06)
        for name in ("random", "ill-conditioned (1 .. 1e-6)")
        for v in VARIANTS
    ]
    print_table(results, 64, 576)
    lines = capsys.readouterr().out.splitlines()
    assert max(map(len, lines)) <= 80
    assert lines[1].split("  ")[-1].strip() == "err vs fp64"  # not run into the column before it
    for v in VARIANTS:
        assert any(f" {v.name} " in line for line in lines[2:]), v.name


def test_bench_plot_reads_across_orders_of_magnitude_and_says_each_bars_precision():
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from fastmuon.bench.report import plot_figure

    rows = [("fastmuon MuSGD", 150.2, "bfloat16→float32"), ("Ultralytics MuSGD", 8339.0, "bfloat16")]
    rows += [("torch.optim.SGD foreach", 6.6, "-")]
    results = [
        dict(name=n, median_ms=t, min_ms=0.95 * t, max_ms=1.1 * t, ns_dtype=d, kernels_per_step=500)
        for n, t, d in rows
    ]
    document = dict(
        results=results,
        machine=dict(cpu="a CPU", torch="2.13.0", num_threads=2),
        workload=dict(model="yolo26n"),
        settings=dict(optimizer="musgd", device="cpu", ns_dtype="bfloat16"),
    )
    fig = plot_figure(document)
    try:
        ax_t, ax_k = fig.axes
        assert ax_t.get_xscale() == "log" and ax_k.get_xscale() == "log"
        names = [t.get_text() for t in ax_t.get_yticklabels()]
        assert names[0] == "fastmuon MuSGD\nNS bfloat16→float32" and names[2] == "torch.optim.SGD foreach"
        assert "requested" in fig._suptitle.get_text()
        labels = [t for t in ax_t.texts if t.get_text()]
        assert len(labels) == 3
        for label, r in zip(labels, results):  # past the whisker, inside the axis
            assert label.xy[0] >= r["max_ms"] and label.xy[0] * 2 < ax_t.get_xlim()[1]
    finally:
        plt.close(fig)
