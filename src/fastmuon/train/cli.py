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
    plot_format_problem,
    require_packages,
    write_json_output,
)
from .contenders import WARMUP_FRACTION, parse_optimizers
from .loop import RunResult, train_run
from .options import BAR_LOSS, NS_DTYPE_NAMES
from .tasks import TASKS, make_task

NS_DTYPES = dict(zip(NS_DTYPE_NAMES, (torch.float32, torch.bfloat16)))


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
