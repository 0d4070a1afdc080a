"""``fastmuon accuracy``'s options (no torch imported: ``--help`` answers at once)."""

from __future__ import annotations

import argparse

from .cli import json_help


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rows", type=int, default=64, help="rows of each test matrix (the shorter side)")
    p.add_argument(
        "--cols",
        type=int,
        default=576,
        help="columns of each test matrix (default: 576, a 64→64 3×3 conv flattened)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the random test matrices")
    p.add_argument("--json", metavar="FILE", help=json_help("every variant's figures"))
