"""Turn run results into the table, the JSON document and the loss curves."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..tools.tables import grid_width, stacked, wrapped
from .loop import RunResult
from .options import LOSSES

#: one colour per contender, the same in every panel
COLOURS = {
    "musgd": "tab:red",
    "muon": "tab:orange",
    "normuon": "tab:purple",
    "adamuon": "tab:brown",
    "sgd": "tab:blue",
    "adamw": "tab:green",
    # the same optimizer with its state in bf16: its colour, dashed
    "musgd-bf16": "tab:red",
    "muon-bf16": "tab:orange",
}
DASHED = frozenset({"musgd-bf16", "muon-bf16"})


def _fmt(value: float | None, spec: str) -> str:
    if value is None:
        return "-"
    return "nan" if not math.isfinite(value) else format(value, spec)


def table_rows(results: Sequence[RunResult]) -> list[list[str]]:
    rows = []
    for r in results:
        acc = r.final.get("val_acc")
        rows.append(
            [
                r.task,
                r.label + (" (diverged)" if r.diverged else ""),
                _fmt(r.final.get("train_loss"), ".4f"),
                _fmt(r.final.get("val_loss"), ".4f"),
                _fmt(100 * acc, ".1f") if acc is not None else "-",
                f"{r.wall_s:.1f}",
                f"{1e3 * r.wall_s / max(1, len(r.step_loss)):.1f}",
                f"{100 * r.step_share:.0f}%",
            ]
        )
    return rows


HEADERS = ["model", "optimizer", "train loss", "val loss", "val acc %", "wall s", "ms/step", "opt step share"]


def print_table(results: Sequence[RunResult], console: Any = None) -> None:
    """A rich table of the final figures (one block per run where the terminal is too narrow for
    it), what its losses are, then each contender's hyperparameters."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    title = "fastmuon train: final figures (same seed, steps and schedule per model)"
    body = table_rows(results)
    if grid_width(HEADERS, body) <= console.width:
        table = Table(title=title)
        for i, h in enumerate(HEADERS):
            table.add_column(h, justify="left" if i < 2 else "right")
        for row in body:
            table.add_row(*row)
        console.print(table)
    else:
        for line in [*wrapped(title, console.width), *stacked(HEADERS, body, console.width, name_columns=2)]:
            console.print(line, highlight=False, markup=False, soft_wrap=True)
    for line in wrapped(LOSSES, console.width):
        console.print(line, highlight=False, markup=False, soft_wrap=True)
    seen = set()
    for r in results:
        if (r.task, r.optimizer) not in seen:
            seen.add((r.task, r.optimizer))
            lead = f"  {r.task:6s} {r.label:22s} "
            for part in wrapped(lead + str(r.hparams), console.width, indent=len(lead)):
                console.print(part, highlight=False, markup=False, soft_wrap=True)


def markdown_table(results: Sequence[RunResult]) -> str:
    """The same table as GitHub markdown (for the README)."""
    lines = ["| " + " | ".join(HEADERS) + " |", "|" + " --- |" * len(HEADERS)]
    lines += ["| " + " | ".join(row) + " |" for row in table_rows(results)]
    return "\n".join(lines)


def to_json(results: Sequence[RunResult], config: dict[str, Any]) -> str:
    """``{"config": ..., "runs": [...]}``; each run carries its final figures and curves."""
    return json.dumps({"config": config, "runs": [r.to_dict() for r in results]}, indent=2)


def _smooth(values: list[float], beta: float = 0.9) -> list[float]:
    """Bias-corrected exponential moving average: batch losses are noisy."""
    out, avg = [], 0.0
    for i, v in enumerate(values, 1):
        avg = beta * avg + (1 - beta) * v
        out.append(avg / (1 - beta**i))
    return out


def plot(results: Sequence[RunResult], path: str | Path, title: str = "") -> None:
    """Loss versus step (left) and versus training wall time (right), one row per model.

    Thin lines: smoothed training-batch loss; dots joined by a thick line: validation loss.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = list(dict.fromkeys(r.task for r in results))
    fig, axes = plt.subplots(len(tasks), 2, figsize=(11, 3.6 * len(tasks)), squeeze=False)
    for row, task in enumerate(tasks):
        for col, xkey in enumerate(("step", "time_s")):
            ax = axes[row][col]
            for r in (r for r in results if r.task == task):
                colour = COLOURS.get(r.optimizer)
                xs = list(range(1, len(r.step_loss) + 1)) if xkey == "step" else r.step_time_s
                ax.plot(xs, _smooth(r.step_loss), color=colour, alpha=0.35, linewidth=1)
                ax.plot(
                    [e[xkey] for e in r.evals],
                    [e["val_loss"] for e in r.evals],
                    color=colour,
                    marker="o",
                    markersize=3,
                    linewidth=2,
                    linestyle="--" if r.optimizer in DASHED else "-",
                    label=r.label,
                )
            losses = [v for r in results if r.task == task for v in r.step_loss if math.isfinite(v) and v > 0]
            if losses and max(losses) > 20 * min(losses):  # digits: from 2.3 down to ~0.01
                ax.set_yscale("log")
            ax.set_xlabel("step" if xkey == "step" else "training wall time (s)")
            ax.set_ylabel(f"{task} loss")
            ax.grid(True, which="both", alpha=0.3)
            if row == 0 and col == 0:
                ax.legend(fontsize=8)
        axes[row][0].set_title(f"{task}: validation (thick) and smoothed train (thin) loss", fontsize=9)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
