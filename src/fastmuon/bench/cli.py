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
from ..ns.planner import POLICIES
from ..step.nonfinite import NONFINITE_MODES
from ..tools.cli import STDOUT, DefaultsHelpFormatter, json_help, plot_format_problem
from ..tools.tables import terminal_width, wrapped
from .fake_cuda import fake_cuda_problem
from .gpu_cost import GpuModel
from .lineup import CLASSES, CONTENDER_LABELS, CONTENDERS, OPTIMIZERS
from .manifest import Manifest, ManifestError
from .probe import choose_ns_dtype
from .report import machine_facts, markdown, print_report, progress_display, to_json, write_json, write_plot
from .runner import COMPILE_MODE, STEP_MODES, Settings, run_benchmark, selected
from .workloads import WORKLOADS, gpu_only_problem, resolve_workload

#: ``--json``'s schema for a trace (the timed run's is report.SCHEMA)
TRACE_SCHEMA = "fastmuon-bench-trace/1"

NS_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

#: --max-step-seconds when neither it nor --steps is given
DEFAULT_MAX_STEP_SECONDS = 15.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    """All of ``bench``'s options; extensions (e.g. ``--nproc``) add theirs after these."""
    p.formatter_class = DefaultsHelpFormatter
    p.add_argument("--model", default="yolo26n", help=f"workload: {', '.join(WORKLOADS)} or a manifest .json")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="musgd", help="update rule to compare")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the parameters live")
    p.add_argument(
        "--ns-dtype",
        choices=("auto", *NS_DTYPES),
        default="auto",
        help="Newton–Schulz precision for fastmuon and the per-parameter loop; auto: the "
        "optimizers' bfloat16, except on a CPU where it would really run in bf16 (bf16 matmul "
        "units, or --cpu-low-precision native): there whichever of bfloat16/float32 multiplies "
        "faster (measured)",
    )
    p.add_argument(
        "--cpu-low-precision",
        choices=("auto", "native", "fp32"),
        default=None,
        help="how fastmuon runs bf16/fp16 NS on a CPU (fastmuon.ns.device): native forces the "
        "requested dtype, e.g. to compare at equal precision with a native-bf16 peer; unset: "
        "FASTMUON_CPU_LOW_PRECISION or auto",
    )
    p.add_argument("--policy", choices=POLICIES, default="auto", help="fastmuon's batching policy")
    p.add_argument(
        "--cost-model",
        choices=("device", "cpu", "cuda", "calibrate"),
        default="device",
        help="the planner's cost constants for policy=auto: the device's built-in ones, another "
        "device type's (e.g. to see what auto picks for a GPU), or measured on this machine",
    )
    p.add_argument(
        "--ns-method",
        choices=("auto", "standard", "gram", "eigh"),
        default="auto",
        help="fastmuon's NS formulation: auto picks the cheapest accurate one per bucket (Gram-space "
        "NS for wide fp32 buckets; on CPUs where bf16 NS runs in fp32, the eigh route where it costs less)",
    )
    p.add_argument(
        "--steps", type=int, default=None, help="timed steps per round; unset: as many as fit --budget"
    )
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (A B C A B C ...)")
    p.add_argument(
        "--warmup",
        type=int,
        default=2,
        help="untimed steps per contender before measuring (the first builds state and plans, and runs "
        "even with 0; the last one's time sets how many steps fit the budget)",
    )
    p.add_argument(
        "--budget", type=float, default=3.0, help="timed seconds per contender when --steps is unset"
    )
    p.add_argument(
        "--max-step-seconds",
        type=float,
        default=None,
        help="skip a contender whose step is estimated (NS FLOPs / measured matmul rate) to take longer; "
        f"0: no limit; unset: {DEFAULT_MAX_STEP_SECONDS:g} s, or no limit when --steps is given (the "
        "steps asked for are run)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch.set_num_threads; unset: torch's default, fewer if other processes already keep CPUs busy",
    )
    p.add_argument(
        "--step-mode",
        choices=STEP_MODES,
        default="eager",
        help=f"compiled: every contender's step wrapped in torch.compile(mode={COMPILE_MODE!r}), which "
        "on CUDA captures it in CUDA graphs; a contender that cannot be compiled is listed as not supported",
    )
    p.add_argument(
        "--contenders",
        metavar="NAMES",
        default=None,
        help="comma-separated contenders to run (name prefixes, any case, e.g. 'fastmuon,ultralytics'); "
        "unset: all of the optimizer's lineup",
    )
    p.add_argument(
        "--trace",
        action="store_true",
        help="with --device cuda: trace each contender's step on fake cuda tensors instead of timing it "
        "(kernels, host syncs, Python calls, NS FLOPs, memory: counts, not times; no GPU needed); "
        "implied where this torch sees no CUDA device",
    )
    p.add_argument(
        "--nonfinite",
        choices=NONFINITE_MODES,
        default=None,
        help="nonfinite= for fastmuon's rows (what a NaN/Inf gradient does: see fastmuon.Muon); "
        "unset: the class's default",
    )
    gpu = GpuModel()
    p.add_argument(
        "--gpu-model",
        metavar="NAME",
        default=gpu.name,
        help="a trace's modelled time: the GPU it is for, named in the report (its rates are the --gpu-* options)",
    )
    p.add_argument(
        "--gpu-tflops",
        type=float,
        default=gpu.matmul_tflops,
        help="a trace's modelled time: dense bf16/fp16 matmul TFLOP/s",
    )
    p.add_argument(
        "--gpu-fp32-tflops",
        type=float,
        default=gpu.fp32_tflops,
        help="a trace's modelled time: fp32 matmul TFLOP/s (torch's default: no TF32)",
    )
    p.add_argument(
        "--gpu-bandwidth", type=float, default=gpu.bandwidth_tbs, help="a trace's modelled time: memory TB/s"
    )
    p.add_argument(
        "--gpu-launch-us",
        type=float,
        default=gpu.launch_us,
        help="a trace's modelled time: µs added per kernel launch",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic parameters and gradients")
    p.add_argument("--json", metavar="FILE", help=json_help("every figure and the machine facts"))
    p.add_argument("--markdown", metavar="FILE.md", help="write the table as Markdown (for docs)")
    p.add_argument("--plot", metavar="FILE.png", help="bar chart of time and kernels per step (matplotlib)")
    p.add_argument("--quiet", action="store_true", help="no progress display")

    p.add_argument(
        "--nproc",
        type=int,
        default=1,
        help="ranks (N > 1: the multi-rank benchmark of fastmuon's --optimizer, gloo on CPU, NCCL on CUDA): "
        "NS time per rank, bytes exchanged, NS speedup per rank against every rank doing every matrix",
    )
    p.add_argument(
        "--dist-mode",
        choices=("ddp", "fsdp", "hsdp"),
        default="ddp",
        help="with --nproc: replicated params, Shard(0) DTensors on a 1-D mesh, or HSDP "
        "(Replicate over 2 groups, Shard(0) within; an even --nproc); NorMuon and AdaMuon: ddp only",
    )


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
        print_report(document, results)
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
