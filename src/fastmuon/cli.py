"""The ``fastmuon`` command: each subcommand lives in its own module and is imported on use."""

from __future__ import annotations

import argparse
import importlib
import sys

#: subcommand -> (module, one-line help). Each module defines ``add_arguments(parser)`` and ``run(args)``.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "bench": ("fastmuon.bench.cli", "side-by-side benchmark against the optimizers you would otherwise use"),
    "accuracy": ("fastmuon.accuracy", "how well each NS variant orthogonalises (singular-value bands)"),
    "train": ("fastmuon.train.cli", "MuSGD, Muon, SGD, AdamW trained on small models: losses, curves, time"),
    "yolo": ("fastmuon.ultralytics", "Ultralytics' `yolo` command with fastmuon.MuSGD as its MuSGD"),
}


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = argparse.ArgumentParser(prog="fastmuon", description="Fast Muon-family optimizers.")
    parser.add_argument("--version", action="version", version=f"fastmuon {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=module)
        importlib.import_module(module).add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(importlib.import_module(args._module).run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
