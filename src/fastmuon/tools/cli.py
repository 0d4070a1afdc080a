"""The ``fastmuon`` command: each subcommand lives in its own module and is imported on use.

Mistakes are reported on one line, before any work is done where they can be seen up front,
with argparse's exit status for every usage mistake (2); a missing optional package exits 1.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys

#: subcommand -> (module, one-line help). Each module defines ``add_arguments(parser)`` and ``run(args)``.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "bench": ("fastmuon.bench.cli", "side-by-side benchmark against the optimizers you would otherwise use"),
    "accuracy": ("fastmuon.tools.accuracy", "how well each NS variant orthogonalises (singular-value bands)"),
    "train": ("fastmuon.train.cli", "each optimizer trained on small models: losses, curves, time"),
    "plan": (
        "fastmuon.scale.cli",
        "NS FLOPs, bytes and memory per rank at 8 to 1,024 ranks, per layout, beside the peers",
    ),
    "yolo": (
        "fastmuon.integrations.ultralytics",
        "Ultralytics' `yolo` command with fastmuon.MuSGD as its MuSGD",
    ),
}

#: optional packages a subcommand may need -> the extra that installs them
OPTIONAL_PACKAGES = {"rich": "bench", "matplotlib": "bench", "sklearn": "train"}

USAGE_EXIT = 2  # what argparse exits with on a parse error
MISSING_PACKAGE_EXIT = 1


#: ``--json -``: the figures go to standard output, in place of the table
STDOUT = "-"


def json_help(what: str) -> str:
    """The one meaning of ``--json`` in every subcommand: also write the figures to a file."""
    return f"also write {what} as JSON to FILE ('-': to standard output, in place of the table)"


def write_json_output(path: str, text: str) -> None:
    """``text`` to the ``--json`` file, or to standard output for ``-``."""
    if path == STDOUT:
        sys.stdout.write(text + "\n")
    else:
        with open(path, "w") as f:
            f.write(text + "\n")


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` shows each option's default, except where there is none (None, or a flag's
    False) or the help text already says it in words."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        help_text = action.help or ""
        if any(action.default is none for none in (None, False, argparse.SUPPRESS)) or "default" in help_text:
            return action.help
        if not action.option_strings:
            return action.help
        return super()._get_help_string(action)


class UsageError(Exception):
    """A flag value the parser accepted but the command cannot use (reported like argparse's errors)."""


def check_output_file(flag: str, path: str) -> None:
    """Refuse an output path that cannot be written, before the run whose results it would hold."""
    if flag == "--json" and path == STDOUT:
        return
    directory = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise UsageError(f"{flag} {path}: is a directory; give a file name")
    if not os.path.isdir(directory):
        raise UsageError(f"{flag} {path}: directory {directory} does not exist")
    if not os.access(directory, os.W_OK):
        raise UsageError(f"{flag} {path}: directory {directory} is not writable")


def plot_format_problem(path: str) -> str | None:
    """Why matplotlib cannot save a figure as ``path`` (None: it can, or matplotlib is missing,
    which the caller reports): the file's suffix names the format, as ``savefig`` reads it."""
    try:
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:
        return None
    formats = FigureCanvasBase.get_supported_filetypes()
    suffix = os.path.splitext(path)[1].lower().removeprefix(".")
    if suffix in formats:
        return None
    known = ", ".join(f".{f}" for f in sorted(formats))
    what = (
        f"'.{suffix}' is not a format matplotlib writes"
        if suffix
        else "the name has no suffix to tell matplotlib the format"
    )
    return f"{what}; give a name ending in one of {known} (e.g. plot.png)"


def require_packages(*names: str) -> None:
    """Fail now, not after the run, if an optional package a requested output needs is missing."""
    for name in names:
        if importlib.util.find_spec(name) is None:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)


def build_parser() -> argparse.ArgumentParser:
    from .. import __version__

    parser = argparse.ArgumentParser(prog="fastmuon", description="Fast Muon-family optimizers.")
    parser.add_argument("--version", action="version", version=f"fastmuon {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text, formatter_class=DefaultsHelpFormatter)
        p.set_defaults(_module=module)
        importlib.import_module(module).add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    prog = f"fastmuon {args.command}"
    try:
        return int(importlib.import_module(args._module).run(args) or 0)
    except UsageError as e:
        return _fail(prog, str(e), USAGE_EXIT)
    except SystemExit as e:
        if not isinstance(e.code, str):
            raise
        # a subcommand that exits with a message has found a usage mistake
        return _fail(prog, e.code.removeprefix(f"{prog}: "), USAGE_EXIT)
    except ModuleNotFoundError as e:
        top = (e.name or "").partition(".")[0]
        if top not in OPTIONAL_PACKAGES:
            raise
        extra = "train" if args.command == "train" else OPTIONAL_PACKAGES[top]
        hint = f"pip install 'fastmuon[{extra}]'"
        return _fail(
            prog, f"needs the optional package {top!r}, which is not installed ({hint})", MISSING_PACKAGE_EXIT
        )


def _fail(prog: str, message: str, status: int) -> int:
    print(f"{prog}: error: {message}", file=sys.stderr)
    return status


if __name__ == "__main__":
    sys.exit(main())
