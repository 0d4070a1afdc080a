"""``fastmuon train``'s options. Imports no torch, so that ``fastmuon train --help`` answers at
once; the names it offers are the registries' (tests hold them equal)."""

from __future__ import annotations

import argparse
import os

from ..tools.cli import json_help

#: fastmuon.train.contenders.CONTENDERS: name -> label
CONTENDER_LABELS = {
    "musgd": "fastmuon MuSGD",
    "muon": "fastmuon Muon",
    "normuon": "fastmuon NorMuon",
    "adamuon": "fastmuon AdaMuon",
    "musgd-bf16": "fastmuon MuSGD (bf16 state)",
    "muon-bf16": "fastmuon Muon (bf16 state)",
    "sgd": "torch SGD (Nesterov)",
    "adamw": "torch AdamW",
}
#: fastmuon.train.tasks.TASKS
TASK_NAMES = ("digits", "chars")
#: --ns-dtype's names, in fastmuon.train.cli.NS_DTYPES's order
NS_DTYPE_NAMES = ("float32", "bfloat16")
#: the progress bars' loss, as they label it: the loss of each step's training batch
BAR_LOSS = "batch loss"
#: what the table's losses are (the report prints it under the table)
LOSSES = (
    "Train loss and val loss are the final model's losses (in eval mode) on a fixed subset of the "
    f"training data and on the validation set; the progress bars' {BAR_LOSS} is the loss of each "
    "step's training batch, before that step's update."
)


def default_threads() -> int:
    """Half the cores: on a small shared machine two busy intra-op threads fight other work."""
    return max(1, (os.cpu_count() or 2) // 2)


def description() -> str:
    """``fastmuon train --help``'s description: every contender, as the registry holds them."""
    *others, last = CONTENDER_LABELS.values()
    return (
        f"Train small models from scratch with each of {', '.join(others)} and {last}, with the same "
        f"seed, batches and learning-rate schedule; compare their losses, curves and time. {LOSSES}"
    )


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = description()
    p.add_argument("--model", default="all", choices=[*TASK_NAMES, "all"], help="which task(s) to train")
    p.add_argument(
        "--optimizer",
        action="append",
        metavar="NAME[,NAME]",
        help=f"{', '.join(CONTENDER_LABELS)} or all (repeatable or comma list; default all)",
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
        choices=["auto", *NS_DTYPE_NAMES],
        help="Newton-Schulz dtype of the fastmuon optimizers; auto = bfloat16 on CUDA, float32 on CPU "
        "(the same figures on every CPU; a CPU without bf16 matmul computes bfloat16 NS in float32 anyway)",
    )
    p.add_argument("--json", metavar="FILE", help=json_help("the settings, final figures and curves"))
    p.add_argument("--plot", metavar="FILE.png", help="save loss-vs-step and loss-vs-time curves")
