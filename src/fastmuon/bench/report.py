"""Show what a benchmark run measured: a rich table (plain text without rich), JSON, a plot."""

from __future__ import annotations

import contextlib
import datetime
import importlib.metadata
import json
import os
import platform
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from .. import __version__
from ..ns.planner import counted
from ..tools.cli import write_json_output
from ..tools.tables import grid_width, stacked, terminal_width, wrapped
from .contenders import UNUSED_KWARGS, accepted_kwargs
from .cpuclass import cpu_facts, describe_cpu
from .hosttime import HOW
from .lineup import CLASSES
from .runner import HOST_STEPS, Progress, Result, speedups

SCHEMA = "fastmuon-bench/1"


def machine_facts(device: torch.device) -> dict[str, Any]:
    """Where the figures came from: hardware, software versions and the thread count used."""
    facts: dict[str, Any] = {
        "cpu": _cpu_model(),
        **cpu_facts(),
        "cpu_count": os.cpu_count(),
        "num_threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "fastmuon": __version__,
        "device": str(device),
        "time_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    if device.type == "cuda":
        facts["gpu"] = torch.cuda.get_device_name(device)
        facts["cuda"] = torch.version.cuda
    # the installed version, without importing the package (see contenders._ultralytics_musgd)
    for peer in ("ultralytics", "heavyball", "pytorch_optimizer"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            facts[peer] = importlib.metadata.version(peer)
    return facts


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def to_json(
    results: list[Result],
    facts: dict[str, Any],
    workload: dict[str, Any],
    settings: dict[str, Any],
    run: dict,
) -> dict[str, Any]:
    return {
        "schema": SCHEMA,
        "machine": facts,
        "workload": workload,
        "settings": settings,
        "run": run,
        "results": [r.summary() for r in results],
        "speedups": speedups(results),
    }


def write_json(path: str | Path, document: dict[str, Any]) -> None:
    """``document`` to ``path`` (``-``: standard output)."""
    write_json_output(str(path), json.dumps(document, indent=1, default=str))


# ----- text -------------------------------------------------------------------------------------
def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.1f}"


def _flops(r: Result) -> str:
    if r.ns_flops is None:
        return "?" if r.ns_useful_flops is None else f"≥{r.ns_useful_flops / 1e9:.2f}"
    return f"{r.ns_flops / 1e9:.2f}"


def _speedup(base: Result, r: Result) -> str:
    """How many times faster ``r``'s median step is than ``base``'s."""
    b, m = base.median_ms, r.median_ms
    return "-" if b is None or m is None else f"{b / m:.3g}×"


def rows(results: list[Result]) -> tuple[list[str], list[list[str]]]:
    """The main table: one row per contender that ran."""
    timed = [r for r in results if r.times_ms]
    # speedups are read against the plain per-parameter loop: "what you would write yourself"
    base = next((r for r in timed if r.name.startswith("per-parameter")), timed[0] if timed else None)
    header = [
        "contender",
        "NS dtype",
        "ms/step",
        "host ms/step",
        "Python calls/step",
        "min–max",
        "kernels/step",
        "NS GFLOP",
        "padding",
        "state MiB",
        "workspace MiB",
        "peak extra MiB",
        f"speedup vs {base.name}" if base else "speedup",
    ]
    body = []
    for r in timed:
        s = r.summary()
        body.append(
            [
                r.name,
                r.ns_dtype,
                f"{s['median_ms']:.1f}",
                "-" if r.host_ms is None else f"{r.host_ms:.2f}",
                "-" if r.python_calls is None else f"{r.python_calls:,}",
                f"{s['min_ms']:.1f}–{s['max_ms']:.1f}",
                "-" if r.kernels_per_step is None else str(r.kernels_per_step),
                _flops(r),
                "-" if r.padding_overhead is None else f"{100 * r.padding_overhead:.1f}%",
                _mib(r.state_bytes),
                _mib(r.workspace_bytes),
                _mib(r.peak_extra_bytes),
                "-" if base is None else _speedup(base, r),
            ]
        )
    return header, body


#: the README's headline comparison per update rule: the peer's lineup labels, the one at
#: fastmuon's precision first (it runs only where fastmuon's NS does not run in bf16), then as shipped
HEADLINE = {
    "musgd": ("Ultralytics MuSGD (NS in float32)", "Ultralytics MuSGD"),
    "muon": ("torch.optim.Muon (NS in float32)", "torch.optim.Muon"),
}


def baseline(results: list[Result], optimizer: str, bf16_native: bool = False) -> tuple[Result | None, str]:
    """The row the speed-up column is read against, and why that one: the README's headline
    peer, at fastmuon's precision where that row ran; else the per-parameter loop ("what you would
    write yourself"); else the first row that ran."""
    timed = {r.label: r for r in results if r.times_ms}
    equal, shipped = HEADLINE.get(optimizer, ("", ""))
    if equal in timed:
        as_shipped = timed.get(shipped)
        how = ""
        if as_shipped is not None and as_shipped.ns_dtype == "bfloat16":
            emulated = "" if bf16_native else ", which this CPU emulates in software"
            how = f"; {as_shipped.name} as shipped runs bf16{emulated}"
        return timed[equal], f"the fair row: NS at the precision fastmuon computes in here{how}"
    if shipped in timed:
        return timed[shipped], "the README's headline comparison"
    loop = next((r for label, r in timed.items() if label == "per-parameter"), None)
    if loop is not None:
        return loop, "the per-parameter loop, what you would write yourself"
    first = next(iter(timed.values()), None)
    return first, "the first contender that ran"


def _num(value: float | int | None, digits: int = 1) -> str:
    """Every figure of the table alike: thousands separated, a fixed number of decimals."""
    return "-" if value is None else f"{value:,.{digits}f}"


def table_rows(results: list[Result], base: Result | None) -> tuple[list[str], list[list[str]]]:
    """The default table: a row per contender that ran, a column per figure."""
    header = [
        "contender", "NS", "ms/step", "speed-up", "host ms", "kernels", "NS GFLOP", "state MiB", "peak MiB",
    ]  # fmt: skip
    body = []
    for r in results:
        if not r.times_ms:
            continue
        median = r.median_ms
        base_ms = None if base is None else base.median_ms
        speedup = "-" if base_ms is None or not median else f"{base_ms / median:.2f}×"
        flops = r.ns_flops if r.ns_flops is not None else r.ns_useful_flops
        body.append(
            [
                r.name,
                r.ns_dtype,
                _num(median),
                speedup,
                _num(r.host_ms),
                _num(r.kernels_per_step, 0),
                "-" if flops is None else ("≥" if r.ns_flops is None else "") + _num(flops / 1e9, 2),
                _num(None if r.state_bytes is None else r.state_bytes / 2**20),
                _num(None if r.peak_extra_bytes is None else r.peak_extra_bytes / 2**20),
            ]
        )
    return header, body


def headline(document: dict[str, Any]) -> str:
    """The one line above the table: workload, machine class, threads and the NS precision."""
    m, w, s = document["machine"], document["workload"], document["settings"]
    where = (
        f"GPU {m['gpu']}"
        if "gpu" in m
        else f"CPU {m.get('cpu_class', m['cpu'])}" + (f" ({m['cpu']})" if "cpu_class" in m else "")
    )
    asked, runs_in = s["ns_dtype"], m.get("bf16_ns_runs_in", "bfloat16")
    if s["device"] == "cpu" and asked == "bfloat16" and runs_in != "bfloat16":
        precision = f"NS bfloat16 asked: no bf16 matmul units, so fastmuon computes it in {runs_in}"
    else:
        precision = f"NS in {asked}"
    return (
        f"{w['model']} {s['optimizer']} on {where}, {counted(m['num_threads'], 'thread')}, "
        f"torch {m['torch']}; {precision}"
    )


def footer(document: dict[str, Any], results: list[Result], base: Result | None, why: str) -> list[str]:
    """The lines under the default table: what the speed-up is against, skips, a busy machine."""
    lines = []
    if base is not None:
        lines.append(f"speed-up: {base.name}'s ms/step over each row's (above 1: faster); {why}")
    lines += [f"skipped {r['name']}: {r['skipped']}" for r in document["results"] if r["skipped"]]
    m, run = document["machine"], document["run"]
    load, cpus = run.get("load_average_before"), m["cpu_count"]
    if (
        load is not None
        and cpus
        and load + m["num_threads"] > cpus + 0.5
        and document["settings"]["device"] == "cpu"
    ):
        lines.append(f"warning: other processes were using the CPUs (load {load:.1f}): timings are disturbed")
    lines.append("--verbose: the NS floors, every ratio and what each column counts; --json: every figure")
    return lines


def describe(document: dict[str, Any]) -> list[str]:
    """The lines around the table: workload, settings, machine, notes, skips, speedup matrix."""
    m, w, s = document["machine"], document["workload"], document["settings"]
    lines = [
        f"workload {w['model']}: {counted(w['params'], 'tensor')}, {w['numel'] / 1e6:.2f}M values, "
        f"{counted(w['matrices'], 'matrix', 'matrices')} ({w['matrices_over_2d']} with >2 dims)"
        + _mapped_clause(w)
        + (f"; {w['source']}" if w.get("source") else ""),
        f"optimizer {s['optimizer']}, device {s['device']}, ns_dtype {s['ns_dtype']} ({s['ns_dtype_why']}), "
        f"policy {s['policy']}, {counted(s['rounds'], 'interleaved round')}"
        + (f", steps {s['step_mode']}" if s.get("step_mode", "eager") != "eager" else ""),
        f"machine: {m['cpu']}, {counted(m['cpu_count'], 'CPU')}, torch {m['torch']} with "
        f"{counted(m['num_threads'], 'thread')}, "
        f"fastmuon {m['fastmuon']}" + (f", GPU {m['gpu']}" if "gpu" in m else ""),
    ]
    run = document["run"]
    if run.get("load_average_before") is not None:
        lines[-1] += f"; 1-min load average before the run {run['load_average_before']:.2f}"
    lines[-1] += f"; whole run {run['wall_seconds']:.0f} s"
    if "cpu_class" in m:
        lines.append(describe_cpu(m))
    load, cpus = run.get("load_average_before"), m["cpu_count"]
    if load is not None and cpus and load + m["num_threads"] > cpus + 0.5 and s["device"] == "cpu":
        lines.append(
            f"warning: other processes were using the CPUs (load {load:.1f} on {counted(cpus, 'CPU')}): "
            "CPU timings are disturbed; compare ratios from one run"
            + (", or try --threads 1" if m["num_threads"] > 1 else "")
        )
    for r in document["results"]:
        lines += _floor_lines(r)
    warmup = _warmup_line(s)
    if warmup:
        lines.append(warmup)
    for r in document["results"]:
        if r["skipped"]:
            lines.append(f"skipped {r['name']}: {r['skipped']}")
        elif r["note"]:
            lines.append(f"{r['name']}: {r['note']}; {counted(r['steps_timed'], 'step')} timed")
    lines += _unused_kwargs_lines(document)
    lines.append(HOW.format(n=HOST_STEPS))
    lines.append(
        "kernels/step: ATen ops dispatched in one step (views and allocations excluded); "
        "state MiB: the optimizer's state tensors; workspace MiB: what else it keeps between steps "
        "(buffers, indices); peak extra MiB: the most a step "
        "allocates beyond what it started with"
    )
    return lines


def _warmup_line(settings: dict[str, Any]) -> str | None:
    """With ``--warmup 0``, what ran before the figures all the same (None: a warm-up was asked for)."""
    if settings.get("warmup") != 0:
        return None
    line = (
        "--warmup 0: each contender's first step, which builds its state and batching plans, ran all "
        "the same before any figure was taken (the probes and the timed steps need a built step)"
    )
    if settings.get("steps") is None:
        line += "; its time, the building included, set how many steps fit --budget"
    return line


def _unused_kwargs_lines(document: dict[str, Any]) -> list[str]:
    """The manifest's optimizer kwargs fastmuon's contenders ran without, said once for the run."""
    ran = [r for r in document["results"] if not r["skipped"] and UNUSED_KWARGS in r["extra"]]
    if not ran:
        return []
    unused = {k: v for r in ran for k, v in r["extra"][UNUSED_KWARGS].items()}
    return [unused_kwargs_line(document["settings"]["optimizer"], unused, [r["name"] for r in ran])]


def unused_kwargs_line(optimizer: str, unused: dict[str, Any], contenders: list[str]) -> str:
    """What the report says, once, of the manifest's optimizer kwargs that ``optimizer``'s
    fastmuon class does not take and so ``contenders`` run without: a manifest written for
    MuSGD (the bundled yolo26 ones) gives MuSGD's weights of its two halves, ``muon`` and ``sgd``."""
    name = CLASSES[optimizer].__name__
    given = ", ".join(f"{k}={v!r}" for k, v in unused.items())
    ran = f"{' and '.join(contenders)} {'runs' if len(contenders) == 1 else 'run'} without them"
    if optimizer != "musgd" and not accepted_kwargs(CLASSES["musgd"], unused)[1]:
        return (
            f"manifest optimizer kwargs {given} are MuSGD's, not {name}'s "
            f"(the manifest was written for MuSGD): {ran}"
        )
    return f"manifest optimizer kwargs {given} are not {name}'s arguments: {ran}"


def _mapped_clause(workload: dict[str, Any]) -> str:
    """How many matrices Newton–Schulz sees, where the matrix maps make it more than the tensors."""
    n = workload.get("ns_matrices")
    return "" if n is None or n == workload["matrices"] else f", {n} after the matrix maps"


def speedup_rows(document: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    table = document["speedups"]
    names = list(table)
    body = [[a] + ["" if a == b else f"{table[a][b]:.3g}×" for b in names] for a in names]
    return [SPEEDUP_CORNER, *names], body


SPEEDUP_CORNER = "faster than →"


def print_report(
    document: dict[str, Any], results: list[Result], console: Any = None, verbose: bool = False
) -> None:
    """One table, a row per contender and a column per figure, under a line saying the machine
    and the precision; ``verbose`` adds the run's details, the NS floors, the detailed table and
    the speedup matrix. Within the terminal's width (``COLUMNS``); a file or pipe with no width
    asked for gets 160 columns and unwrapped lines."""
    machine = document["machine"]
    bf16_native = machine.get("bf16_ns_runs_in") == "bfloat16" or "gpu" in machine
    base, why = baseline(results, document["settings"]["optimizer"], bf16_native)
    title = f"fastmuon bench: {document['workload']['model']} ({document['settings']['optimizer']})"
    before = [headline(document)]
    tables = [(title, *table_rows(results, base))]
    after = footer(document, results, base, why)
    if verbose:
        before = [*describe(document), *before]
        tables.append((f"{title}, every figure", *rows(results)))
        sp_header, sp_body = speedup_rows(document)
        if len(sp_body) > 1:
            tables.append(("speedup of the median step (row vs column)", sp_header, sp_body))
        after = after[:-1]
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        _print_plain(before, tables, after)
        return
    unwrapped = False
    if console is None:
        console = Console()
        if not console.is_terminal and "COLUMNS" not in os.environ:
            console, unwrapped = Console(width=160), True
    width = console.width

    def say(lines: list[str]) -> None:
        for line in lines:
            for part in [line] if unwrapped else wrapped(line, width):
                console.print(part, highlight=False, markup=False, soft_wrap=True)

    say(before)
    for caption, h, b in tables:
        if grid_width(h, b) <= width:
            table = Table(title=caption)
            for j, heading in enumerate(h):
                left = j < (1 if h[0] == SPEEDUP_CORNER else 2)
                table.add_column(heading, justify="left" if left else "right")
            for row in b:
                table.add_row(*row)
            console.print(table)
            continue
        for line in _stacked_table(caption, h, b, width):
            console.print(line, highlight=False, markup=False, soft_wrap=True)
    say(after)


def _stacked_table(caption: str, header: list[str], body: list[list[str]], width: int) -> list[str]:
    """A table too wide for the terminal, as one block per contender (see fastmuon.tools.tables)."""
    if header[0] == SPEEDUP_CORNER:  # the speedup matrix: each contender against each other one
        caption = "speedup of the median step (each contender against the others)"
        header = ["", *(f"vs {name}" for name in header[1:])]
    return ["", *wrapped(caption, width), *stacked(header, body, width)]


def markdown(document: dict[str, Any], results: list[Result]) -> str:
    """The main table as Markdown, with the lines that say where it came from (for docs)."""
    header, body = rows(results)
    lines = [f"| {' | '.join(header)} |", "|" + " --- |" * len(header)]
    lines += [f"| {' | '.join(row)} |" for row in body]
    return "\n".join(["\n".join(f"- {x}" for x in describe(document)), "", *lines, ""])


def _print_plain(
    before: list[str], tables: list[tuple[str, list[str], list[list[str]]]], after: list[str]
) -> None:
    width = terminal_width()
    for line in before:
        print("\n".join(wrapped(line, width)))
    for caption, h, b in tables:
        widths = [max(len(x) for x in col) for col in zip(h, *b)]
        if sum(widths) + 2 * (len(widths) - 1) > width:
            print("\n".join(_stacked_table(caption, h, b, width)[1:]))
        else:
            for row in (h, *b):
                print("  ".join(x.ljust(n) for x, n in zip(row, widths)))
        print()
    for line in after:
        print("\n".join(wrapped(line, width)))


@contextmanager
def progress_display(enabled: bool = True, console: Any = None) -> Iterator[Progress]:
    """A live progress bar (rich, on a terminal: standard error, or ``console``) fed by the
    runner's progress events; a count shows once the runner has given one."""
    try:
        from rich.console import Console
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
    except ImportError:
        enabled = False
    if not enabled:
        yield lambda event, name, done, total: None
        return
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.fields[count]}"),
        TimeElapsedColumn(),
        transient=True,
        console=console or Console(stderr=True),  # stdout stays clean for the report
    ) as bar:
        warm = bar.add_task("warm-up", total=None, count="")
        timed = bar.add_task("timed steps", total=None, visible=False, count="")

        def update(event: str, name: str, done: int, total: int) -> None:
            if event in ("warmup", "ready"):
                bar.update(warm, description=f"warm-up and probe: {name}")
            else:
                bar.update(warm, visible=False)
                bar.update(
                    timed,
                    visible=True,
                    completed=done,
                    total=total,
                    count=f"{done}/{total}",
                    description=f"timing {name}".strip(),
                )

        yield update


def write_plot(path: str | Path, document: dict[str, Any]) -> bool:
    """Bars for median ms/step (min–max whiskers) and kernels/step; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("--plot needs matplotlib: pip install 'fastmuon[bench]'", file=sys.stderr)
        return False
    fig = plot_figure(document)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def plot_figure(document: dict[str, Any]) -> Any:
    """The figure of :func:`write_plot`. Both axes are logarithmic (the contenders' times and
    kernel counts span orders of magnitude: on a linear axis a slow peer's bar flattens the rest);
    each time label stands past its bar's whisker; each bar's name says the precision its NS ran
    in, which may not be the one requested (a CPU without bf16 units computes bf16 NS in fp32)."""
    import matplotlib.pyplot as plt

    ran = [r for r in document["results"] if r["median_ms"]]
    names = [r["name"] if r.get("ns_dtype", "-") == "-" else f"{r['name']}\nNS {r['ns_dtype']}" for r in ran]
    fig, (ax_t, ax_k) = plt.subplots(1, 2, figsize=(11, 0.7 * len(ran) + 2.2))
    med = [r["median_ms"] for r in ran]
    err = [[m - r["min_ms"] for m, r in zip(med, ran)], [r["max_ms"] - m for m, r in zip(med, ran)]]
    ax_t.barh(names, med, xerr=err, color="tab:blue")
    ax_t.set_xscale("log")
    for y, r in enumerate(ran):  # past the whisker, not over it
        ax_t.annotate(
            f"{r['median_ms']:.1f}", (r["max_ms"], y), xytext=(4, 0), textcoords="offset points",
            va="center", fontsize=8,
        )  # fmt: skip
    ax_t.set_xlim(min(r["min_ms"] for r in ran) / 2, max(r["max_ms"] for r in ran) * 4)
    ax_t.set_xlabel("ms per step (median, min–max, log scale)")
    kernels = [r["kernels_per_step"] or 0 for r in ran]
    ax_k.bar_label(ax_k.barh(names, kernels, color="tab:orange"), padding=3, fontsize=8)
    ax_k.set_xscale("log")
    if any(kernels):
        ax_k.set_xlim(right=max(kernels) * 4)
    ax_k.set_xlabel("kernels per step (ATen ops, log scale)")
    ax_k.set_yticks(range(len(ran)), [""] * len(ran))
    for ax in (ax_t, ax_k):
        ax.invert_yaxis()
    m, w, s = document["machine"], document["workload"], document["settings"]
    fig.suptitle(
        f"{w['model']} {s['optimizer']} on {s['device']} ({m['cpu'] if s['device'] == 'cpu' else m.get('gpu')}), "
        f"NS {s['ns_dtype']} requested, torch {m['torch']}, {m['num_threads']} threads",
        fontsize=9,
    )
    fig.tight_layout()
    return fig


def _floor_lines(r: dict[str, Any]) -> list[str]:
    """How a contender's step compares with its NS floor (see bench.probe), both ways measured."""
    extra, median, fastest = r.get("extra", {}), r.get("median_ms"), r.get("min_ms")
    lines = []
    run = extra.get("ns_floor_run_ms")
    if run and median:
        lines.append(
            f"{r['name']}: NS floor {run:.1f} ms (its plan's matrix products run back to back as bare "
            "bmm into kept buffers, any eigendecomposition likewise, right before each step, timed as "
            f"often as the steps; median): median step {median / run:.2f}× the floor, fastest step "
            f"{fastest / extra['ns_floor_run_ms_best']:.2f}× the fastest floor run"
        )
    ideal = extra.get("ns_floor_ms")
    if ideal and median:
        lines.append(
            f"{r['name']}: ideal NS floor {ideal:.1f} ms (each of those products timed alone, best of "
            f">= 3 repeats, summed; median over the rounds): median step {median / ideal:.2f}× it, "
            f"fastest step {fastest / extra.get('ns_floor_ms_best', ideal):.2f}× its lowest"
        )
    return lines
