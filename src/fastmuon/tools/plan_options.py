"""``fastmuon plan``'s options. Imports no torch, so that ``fastmuon plan --help`` answers at
once; the names it offers are the registries' (tests hold them equal)."""

from __future__ import annotations

import argparse

from .cli import json_help

#: fastmuon.scale.models.WORKLOADS
WORKLOAD_NAMES = ("gpt2", "llama-1b", "llama3-8b", "llama3-70b", "mixtral-8x7b", "deepseek-v3")
#: fastmuon.scale.designs.DESIGNS
DESIGNS = ("fastmuon", "keller", "dion", "torchtitan", "megatron", "emerging", "plain")
#: fastmuon.scale.devices.DEVICE_NAMES
DEVICE_NAMES = ("h100", "h200", "b200", "cpu-measured")
#: the layouts --layout takes (fastmuon.scale.layouts parses them)
LAYOUT_HELP = "ddp | fsdp | hsdp:RxS | fsdp+tp:DxT | ep[:E]"
#: ``--expert-shard``'s choices: torchtitan's rule, or the dim FSDP2 shards expert stacks on
EXPERT_SHARDS = ("auto", "0", "1")
#: timed runs of each NS call under --measure (after one warm-up), their median kept
ROUNDS = 3
SWEEP = (8, 64, 256, 1024)
#: --world where neither it nor a mesh naming both dims gives one
DEFAULT_WORLD = 1024
#: --max-measure-seconds by default
DEFAULT_MAX_MEASURE_SECONDS = 120.0
#: --ns-dtype and --param-dtype, in fastmuon.scale.cli.DTYPES's order
DTYPE_NAMES = ("bf16", "fp32", "fp16")
SHOWN_CLASSES = 6
DEFAULT_MODEL, DEFAULT_LAYOUT = "llama3-70b", "fsdp"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL, choices=WORKLOAD_NAMES, help="the workload")
    p.add_argument(
        "--world",
        type=int,
        default=None,
        help="ranks (default: R·S where --layout names both mesh dims, as hsdp:RxS or fsdp+tp:DxT; "
        f"else {DEFAULT_WORLD})",
    )
    p.add_argument("--layout", default=DEFAULT_LAYOUT, help=f"how parameters lie on the ranks: {LAYOUT_HELP}")
    p.add_argument(
        "--expert-shard",
        default="auto",
        choices=EXPERT_SHARDS,
        help="the dim FSDP2 shards expert stacks on: 0 (experts), 1 (their rows, as fully_shard's "
        "shard_placement_fn gives), or auto (default): torchtitan's rule, 1 where the FSDP ranks "
        "outnumber the experts",
    )
    p.add_argument("--design", default="all", choices=("all", *DESIGNS), help="whose step to compute")
    p.add_argument(
        "--device", default="h100", choices=DEVICE_NAMES, help="the device times are predicted for"
    )
    p.add_argument(
        "--ns-dtype",
        default=None,
        choices=DTYPE_NAMES,
        help="NS dtype (default: bf16 on the GPU devices, fp32 for cpu-measured)",
    )
    p.add_argument("--param-dtype", default="fp32", choices=DTYPE_NAMES, help="the parameters' dtype")
    p.add_argument("--classes", type=int, default=SHOWN_CLASSES, help="rank classes shown per design")
    p.add_argument("--json", metavar="FILE", help=json_help("every design's summary and rank classes"))
    p.add_argument(
        "--plot",
        metavar="FILE",
        help=f"plot imbalance and bytes against world size ({', '.join(map(str, SWEEP))}; those the "
        "layout's inner dim or ep size does not divide are left out)",
    )
    p.add_argument(
        "--measure", action="store_true",
        help="with --device cpu-measured: run the busiest rank's NS here and print measured against predicted",
    )  # fmt: skip
    p.add_argument(
        "--targets", action="store_true",
        help="compute the at-scale targets instead: 33 configurations of llama3-8b, llama3-70b, mixtral-8x7b "
        "and deepseek-v3 at 8, 64 and 1,024 ranks, fastmuon against the balanced ideal, the peers and its "
        "buffer bound, as one table (see docs/scale.md)",
    )  # fmt: skip
    p.add_argument(
        "--max-measure-seconds",
        type=float,
        default=DEFAULT_MAX_MEASURE_SECONDS,
        help="with --measure: refuse to measure what the prediction says takes longer (the busiest "
        f"rank's NS, once to warm up and {ROUNDS} times timed); 0: no limit; default "
        f"{DEFAULT_MAX_MEASURE_SECONDS:g} s",
    )
