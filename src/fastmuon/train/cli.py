"""``fastmuon train``: train small models from scratch with each contender and compare."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import torch

from ..tools.cli import (
    STDOUT,
    UsageError,
    check_output_file,
    json_help,
    plot_format_problem,
    require_packages,
    write_json_output,
)
from .contenders import CONTENDERS, WARMUP_FRACTION, parse_optimizers
from .loop import RunResult, train_run
from .report import BAR_LOSS, LOSSES
from .tasks import TASKS, make_task

NS_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def default_threads() -> int:
    """Half the cores: on a small shared machine two busy intra-op threads fight other work."""
    return max(1, (os.cpu_count() or 2) // 2)


def description() -> str:
    """``fastmuon train --help``'s description: every contender, as the registry holds them."""
    *others, last = [c.label for c in CONTENDERS.values()]
    return (
        f"Train small models from scratch with each of {', '.join(others)} and {last}, with the same "
        f"seed, batches and learning-rate schedule; compare their losses, curves and time. {LOSSES}"
    )


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = description()
    p.add_argument("--model", default="all", choices=[*TASKS, "all"], help="which task(s) to train")
    p.add_argument(
        "--optimizer",
        action="append",
        metavar="NAME[,NAME]",
        help=f"{', '.join(CONTENDERS)} or all (repeatable or comma list; default all)",
    )
    p.add_argument(
        "--steps", type=int, help="training steps per run (default: per model, 120 for both models)"
    )
    p.add_argument(
        "--seed", type=int, default=0, help="seed for weights and batches, shared by all contenders"
    )
    p.add_argument(
        "--threads", type=int, default=default_threads(), help="torch CPU threads (default: half the cores)"
    )
    p.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda, cuda:N")
    p.add_argument(
        "--ns-dtype",
        default="auto",
        choices=["auto", *NS_DTYPES],
        help="Newton-Schulz dtype of the fastmuon optimizers; auto = bfloat16 on CUDA, float32 on CPU "
        "(the same figures on every CPU; a CPU without bf16 matmul computes bfloat16 NS in float32 anyway)",
    )
    p.add_argument("--json", metavar="FILE", help=json_help("the settings, final figures and curves"))
    p.add_argument("--plot", metavar="FILE.png", help="save loss-vs-step and loss-vs-time curves")


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise UsageError(f"--device {name}: not a device to train on; use auto, cpu, cuda or cuda:N")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise UsageError(f"--device {name}: CUDA is not available here; use --device cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise UsageError(f"--device {name}: there are {torch.cuda.device_count()} CUDA device(s)")
    return device


def resolve_ns_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return NS_DTYPES[name]


def run(args: argparse.Namespace) -> int:
    # every mistake that can be seen before training is refused before training
    if args.steps is not None and args.steps < 1:
        raise UsageError(f"--steps must be at least 1, got {args.steps}")
    if args.threads < 1:
        raise UsageError(f"--threads must be at least 1, got {args.threads}")
    try:
        contenders = parse_optimizers(args.optimizer)
    except ValueError as e:
        raise UsageError(str(e)) from None
    device = resolve_device(args.device)
    if args.json:
        check_output_file("--json", args.json)
    if args.plot:
        check_output_file("--plot", args.plot)
        require_packages("matplotlib")
        problem = plot_format_problem(args.plot)
        if problem:
            raise UsageError(f"--plot {args.plot}: {problem}")
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from . import report

    torch.set_num_threads(args.threads)
    ns_dtype = resolve_ns_dtype(args.ns_dtype, device)
    tasks = [make_task(n) for n in (TASKS if args.model == "all" else (args.model,))]

    console = Console(stderr=True)
    results: list[RunResult] = []
    columns = (
        TextColumn("{task.description:34s}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn(f"{BAR_LOSS} {{task.fields[loss]:.3f}}"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console) as progress:
        for task in tasks:
            task.setup(device)
            steps = args.steps or task.default_steps
            for c in contenders:
                bar = progress.add_task(f"{task.name} · {c.label}", total=steps, loss=float("nan"))

                def on_step(step: int, loss: float, bar=bar) -> None:
                    progress.update(bar, completed=step, loss=loss)

                results.append(
                    train_run(
                        task,
                        c,
                        steps=steps,
                        seed=args.seed,
                        device=device,
                        ns_dtype=ns_dtype,
                        on_step=on_step,
                    )
                )

    config = {
        "models": [t.name for t in tasks],
        "optimizers": [c.name for c in contenders],
        "steps": {t.name: args.steps or t.default_steps for t in tasks},
        "seed": args.seed,
        "threads": args.threads,
        "device": str(device),
        "ns_dtype": str(ns_dtype).removeprefix("torch."),
        "schedule": f"linear warm-up {WARMUP_FRACTION:.0%} of steps, then cosine to 0",
        "task_configs": {
            t.name: {f.name: getattr(t, f.name) for f in dataclasses.fields(t) if not f.name.startswith("_")}
            for t in tasks
        },
        "torch": torch.__version__,
    }
    if args.plot:
        report.plot(results, args.plot, title=_title(config))
        console.print(f"saved the curves to {args.plot}")
    if args.json != STDOUT:
        # piped output, with no COLUMNS asked for, gets a width that fits the table rather than
        # rich's 80-column default
        wide = sys.stdout.isatty() or "COLUMNS" in os.environ
        report.print_table(results, Console(width=None if wide else 120))
    if args.json:
        write_json_output(args.json, report.to_json(results, config))
    return 0


def _title(config: dict) -> str:
    steps = ", ".join(f"{k} {v} steps" for k, v in config["steps"].items())
    return (
        f"fastmuon train — seed {config['seed']}, {steps}, {config['device']} ({config['threads']} thread(s))"
    )
