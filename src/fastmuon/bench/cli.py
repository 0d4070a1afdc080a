"""``fastmuon bench``: the side-by-side benchmark (options, then run, report, JSON, plot)."""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from ..ns.device import set_cpu_low_precision
from ..tools.cli import STDOUT, plot_format_problem
from ..tools.tables import terminal_width, wrapped
from .fake_cuda import fake_cuda_problem
from .gpu_cost import GpuModel
from .lineup import CLASSES, CONTENDER_LABELS, CONTENDERS
from .manifest import Manifest, ManifestError
from .options import DEFAULT_MAX_STEP_SECONDS, NS_DTYPE_NAMES
from .probe import choose_ns_dtype
from .report import machine_facts, markdown, print_report, progress_display, to_json, write_json, write_plot
from .runner import Settings, run_benchmark, selected
from .workloads import gpu_only_problem, resolve_workload

#: ``--json``'s schema for a trace (the timed run's is report.SCHEMA)
TRACE_SCHEMA = "fastmuon-bench-trace/1"

NS_DTYPES = dict(zip(NS_DTYPE_NAMES, (torch.float32, torch.bfloat16, torch.float16)))


def settings_from(args: argparse.Namespace, device: torch.device) -> tuple[Settings, str]:
    """The run's settings, and why its NS dtype was chosen."""
    if args.ns_dtype == "auto":
        ns_dtype, why = choose_ns_dtype(device)
        why = "auto: " + why
    else:
        ns_dtype, why = NS_DTYPES[args.ns_dtype], "chosen with --ns-dtype"
    settings = Settings(
        optimizer=args.optimizer,
        device=str(device),
        ns_dtype=ns_dtype,
        policy=args.policy,
        ns_method=args.ns_method,
        cost_model=args.cost_model,
        steps=args.steps,
        rounds=args.rounds,
        warmup=args.warmup,
        budget_s=args.budget,
        max_step_s=max_step_seconds(args.max_step_seconds, args.steps),
        seed=args.seed,
        step_mode=args.step_mode,
        contenders=_chosen(args.contenders),
        nonfinite=args.nonfinite,
    )
    return settings, why


def max_step_seconds(given: float | None, steps: int | None) -> float | None:
    """The estimated step time above which a contender is skipped (None: none is): the option
    as given (0: no limit), else the default unless ``--steps`` asks for a number of steps."""
    if given is not None:
        return given or None
    return None if steps is not None else DEFAULT_MAX_STEP_SECONDS


def choose_threads(requested: int | None, load: float | None) -> tuple[int, str]:
    """``--threads`` or, by default, torch's count less the CPUs other processes already occupy.

    More compute threads than free cores make every op's thread team wait for a descheduled
    member; on a busy 2-core machine that slows small ops tenfold and makes timings erratic.
    """
    if requested is not None:
        return requested, "--threads"
    default, cpus = torch.get_num_threads(), os.cpu_count() or 1
    if load is None or load < 0.5:
        return default, "torch's default"
    free = max(1, cpus - round(load))
    if free >= default:
        return default, "torch's default"
    return (
        free,
        f"auto: 1-min load average {load:.1f} on {cpus} CPUs leaves {free} free; --threads N to override",
    )


def usage_error(args: argparse.Namespace) -> str | None:
    """What is wrong with the options, checked before any work (None: nothing).

    Everything a run would only trip over at its end (an output file that cannot be written, a
    plot without matplotlib) is caught here, so that no measurement is lost to it.
    """
    at_least = {"steps": 1, "rounds": 1, "warmup": 0, "threads": 1, "nproc": 1}
    for name, low in at_least.items():
        value = getattr(args, name)
        if value is not None and value < low:
            return f"--{name} must be at least {low}, got {value}"
    if not args.budget > 0:
        return f"--budget must be a positive number of seconds, got {args.budget}"
    if args.max_step_seconds is not None and not args.max_step_seconds >= 0:
        return f"--max-step-seconds must be 0 or more, got {args.max_step_seconds}"
    if args.nproc > 1:
        from .multirank import setup_problem

        problem = setup_problem(args.optimizer, args.dist_mode, args.nproc)
        if problem:
            return problem
    if args.trace and args.device != "cuda":
        return "--trace traces the CUDA step on fake cuda tensors: give --device cuda with it"
    problem = gpu_only_problem(args.model, args.device)
    if problem:
        return problem
    if args.device == "cuda" and not torch.cuda.is_available():
        problem = fake_cuda_problem()
        if problem:
            return (
                "--device cuda, but this torch sees no CUDA device and cannot trace the step on fake "
                f"cuda tensors instead: {problem} (run on a GPU machine, or --device cpu)"
            )
    if tracing(args):
        problem = trace_usage_error(args)
        if problem:
            return problem
    else:
        given = [f"--{k.replace('_', '-')}" for k, v in _gpu_options(args).items() if v != GPU_DEFAULTS[k]]
        if given:
            return f"{', '.join(given)} set a trace's modelled time: give --device cuda (with --trace on a GPU machine)"
    try:
        gpu_model(args)
    except ValueError as e:
        return str(e)
    for option in ("json", "markdown", "plot"):
        if option == "json" and args.json == STDOUT:
            continue
        problem = output_path_problem(getattr(args, option))
        if problem:
            return f"--{option} {getattr(args, option)}: {problem}"
    labels = [CONTENDER_LABELS[f] for f in CONTENDERS[args.optimizer]]
    if _chosen(args.contenders) == ():
        return f"--contenders names none; give some of: {', '.join(labels)}"
    for name in _chosen(args.contenders) or ():
        if not any(selected(label, (name,)) for label in labels):
            return f"--contenders: {name!r} is none of --optimizer {args.optimizer}'s: {', '.join(labels)}"
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        return "--plot needs matplotlib: pip install 'fastmuon[bench]'"
    if args.plot and plot_format_problem(args.plot):
        return f"--plot {args.plot}: {plot_format_problem(args.plot)}"
    return None


def tracing(args: argparse.Namespace) -> bool:
    """Whether this run traces on fake cuda tensors rather than timing: ``--trace``, or
    ``--device cuda`` where torch sees no CUDA device."""
    return args.device == "cuda" and (args.trace or not torch.cuda.is_available())


def trace_usage_error(args: argparse.Namespace) -> str | None:
    """What a trace cannot do (None: nothing): it counts one eager step, on one rank."""
    why = "" if args.trace else " (this torch sees no CUDA device, so --device cuda traces the step)"
    if args.nproc > 1:
        return f"--nproc {args.nproc} measures ranks on real devices; a trace runs one{why}"
    if args.step_mode != "eager":
        return f"--step-mode {args.step_mode}: a trace follows eager steps only{why}"
    if args.cost_model == "calibrate":
        return f"--cost-model calibrate measures the device; a trace has none: choose device or cuda{why}"
    if args.plot:
        return f"--plot draws measured times; a trace has none (use --json or --markdown){why}"
    return None


#: ``--gpu-*`` option -> the GpuModel field it sets
_GPU_FIELDS = {
    "gpu_model": "name",
    "gpu_tflops": "matmul_tflops",
    "gpu_fp32_tflops": "fp32_tflops",
    "gpu_bandwidth": "bandwidth_tbs",
    "gpu_launch_us": "launch_us",
}
GPU_DEFAULTS = {option: getattr(GpuModel(), name) for option, name in _GPU_FIELDS.items()}


def _gpu_options(args: argparse.Namespace) -> dict[str, Any]:
    return {option: getattr(args, option, GPU_DEFAULTS[option]) for option in _GPU_FIELDS}


def gpu_model(args: argparse.Namespace) -> GpuModel:
    """The GPU a trace's time is modelled on, from the ``--gpu-*`` options (ValueError naming
    the option when a rate is not positive)."""
    values = _gpu_options(args)
    for option, value in values.items():
        if option == "gpu_model":
            continue
        zero_ok = option == "gpu_launch_us"
        if not (value >= 0 if zero_ok else value > 0):
            wanted = "0 or more" if zero_ok else "a positive number"
            raise ValueError(f"--{option.replace('_', '-')} must be {wanted}, got {value}")
    return GpuModel(**{_GPU_FIELDS[k]: v for k, v in values.items()})


def _chosen(names: str | None) -> tuple[str, ...] | None:
    return None if names is None else tuple(n.strip() for n in names.split(",") if n.strip())


def output_path_problem(path: str | None) -> str | None:
    """Why ``path`` cannot be written (None: it can, or no path was given)."""
    if not path:
        return None
    target = Path(path)
    if target.is_dir():
        return "is a directory; give a file name"
    parent = target.parent
    if not parent.is_dir():
        return f"folder {str(parent)!r} does not exist; create it or choose another path"
    if not os.access(parent, os.W_OK) or (target.exists() and not os.access(target, os.W_OK)):
        return "not writable here; choose another path"
    return None


def run(args: argparse.Namespace) -> int:
    problem = usage_error(args)
    if problem:
        print(f"fastmuon bench: error: {problem}", file=sys.stderr)
        return 2
    if args.nproc > 1:
        return _run_multirank(args)
    if tracing(args):
        return _run_trace(args)
    started = time.perf_counter()
    # other processes competing for the CPUs move CPU timings: the report shows how busy it was
    load_before = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    threads, why_threads = choose_threads(args.threads, load_before)
    torch.set_num_threads(threads)
    # with --json -, standard output carries the JSON alone
    info = sys.stderr if args.json == STDOUT else sys.stdout
    say = lambda text: print("\n".join(wrapped(text, terminal_width())), file=info, flush=True)  # noqa: E731
    say(f"threads: {threads} ({why_threads})")  # the CPU class is the report's (machine_facts)
    device = torch.device(args.device)
    try:
        manifest = resolve_workload(args.model)
    except ManifestError as e:
        print(f"fastmuon bench: {e}", file=sys.stderr)
        return 2
    if args.cpu_low_precision:
        set_cpu_low_precision(args.cpu_low_precision)
    settings, why = settings_from(args, device)
    say(f"ns_dtype: {str(settings.ns_dtype).removeprefix('torch.')} ({why})")
    with progress_display(enabled=not args.quiet and sys.stderr.isatty()) as progress:
        results, run_facts = run_benchmark(manifest, settings, progress)
    run_facts["wall_seconds"] = round(time.perf_counter() - started, 2)
    run_facts["load_average_before"] = load_before
    workload = workload_facts(manifest)
    settings_doc = {
        **settings.__dict__,
        "ns_dtype": str(settings.ns_dtype).removeprefix("torch."),
        "ns_dtype_why": why,
    }
    document = to_json(results, machine_facts(device), workload, settings_doc, run_facts)
    if args.json != STDOUT:
        print_report(document, results, verbose=args.verbose)
    if args.json:
        write_json(args.json, document)
    if args.markdown:
        Path(args.markdown).write_text(markdown(document, results))
    if args.plot:
        write_plot(args.plot, document)
    return 0


def workload_facts(manifest: Manifest) -> dict[str, Any]:
    matrices = manifest.matrices()
    return {
        "model": manifest.model,
        "source": manifest.source,
        "params": len(manifest.params),
        "numel": manifest.numel(),
        "matrices": len(matrices),
        "matrices_over_2d": sum(len(p.shape) > 2 for p in matrices),
        "ns_matrices": manifest.ns_matrices(),
    }


def _run_trace(args: argparse.Namespace) -> int:
    """Trace every contender of the lineup on fake cuda tensors (see fastmuon.bench.trace)."""
    from .contenders import Workbench
    from .manifest import materialize
    from .trace import LABEL, factories_for, markdown_table, table_lines, trace_lineup

    info = sys.stderr if args.json == STDOUT else sys.stdout
    try:
        manifest = resolve_workload(args.model)
    except ManifestError as e:
        print(f"fastmuon bench: {e}", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    if args.ns_dtype == "auto":
        ns_dtype, why = choose_ns_dtype(device)
        why = "auto: " + why
    else:
        ns_dtype, why = NS_DTYPES[args.ns_dtype], "chosen with --ns-dtype"
    if not torch.cuda.is_available():
        print("fastmuon bench: this torch sees no CUDA device: tracing the CUDA step instead", file=info)
    started = time.perf_counter()

    def workbench() -> Workbench:
        params = materialize(manifest, device, args.seed)
        return Workbench(
            manifest,
            params,
            device,
            args.optimizer,
            ns_dtype,
            args.policy,
            args.ns_method,
            args.cost_model,
            fastmuon=CLASSES[args.optimizer],
            nonfinite=args.nonfinite,
        )

    gpu = gpu_model(args)
    traces = trace_lineup(workbench, factories_for(args.optimizer, _chosen(args.contenders)), gpu=gpu)
    settings = {
        "optimizer": args.optimizer,
        "device": "cuda (fake tensors)",
        "ns_dtype": str(ns_dtype).removeprefix("torch."),
        "ns_dtype_why": why,
        "policy": args.policy,
        "ns_method": args.ns_method,
        "cost_model": args.cost_model,
        "seed": args.seed,
        "contenders": _chosen(args.contenders),
        "nonfinite": args.nonfinite,
        "modelled_gpu": gpu.__dict__,
    }
    machine = machine_facts(torch.device("cpu")) | {"device": "cuda (fake tensors)"}
    document = {
        "schema": TRACE_SCHEMA,
        "label": LABEL,
        "machine": machine,
        "workload": workload_facts(manifest),
        "settings": settings,
        "run": {"wall_seconds": round(time.perf_counter() - started, 2)},
        "results": [t.summary() for t in traces],
    }
    title = f"fastmuon bench --trace: {manifest.model}, {args.optimizer}, NS in {settings['ns_dtype']}"
    if args.json != STDOUT:
        print("\n".join(table_lines(traces, title)))
    if args.json:
        write_json(args.json, document)
    if args.markdown:
        Path(args.markdown).write_text(markdown_table(traces, title))
    return 0


def _run_multirank(args: argparse.Namespace) -> int:
    """``--nproc N``: spawn N ranks and report the shared NS work of fastmuon's ``--optimizer``
    (see fastmuon.bench.multirank)."""
    from .multirank import format_table, run_multirank_bench

    ns_dtype = NS_DTYPES.get(args.ns_dtype, torch.bfloat16 if args.device == "cuda" else torch.float32)
    try:
        figures = run_multirank_bench(
            args.model,
            args.nproc,
            args.device,
            ns_dtype,
            args.steps or 5,
            args.dist_mode,
            optimizer=args.optimizer,
        )
    except ValueError as e:
        print(f"fastmuon bench: {e}", file=sys.stderr)
        return 2
    if args.json != STDOUT:
        print(format_table(figures))
    if args.json:
        write_json(args.json, figures)
    return 0
