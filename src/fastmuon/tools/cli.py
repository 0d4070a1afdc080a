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
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Subcommand:
    """A subcommand: its options live in a module that imports no torch (so that ``--help``
    answers at once), its work in another, imported only to run it."""

    options: str  # module defining ``add_arguments(parser)``
    runner: str  # module defining ``run(args)``
    help: str
    examples: tuple[str, ...]


SUBCOMMANDS: dict[str, Subcommand] = {
    "bench": Subcommand(
        "fastmuon.bench.options",
        "fastmuon.bench.cli",
        "side-by-side benchmark against the optimizers you would otherwise use",
        (
            "fastmuon bench                          # yolo26n's MuSGD beside Ultralytics' and the others",
            "fastmuon bench --optimizer muon --threads 1",
            "fastmuon bench --model gpt2 --json bench.json --verbose",
        ),
    ),
    "accuracy": Subcommand(
        "fastmuon.tools.accuracy_options",
        "fastmuon.tools.accuracy",
        "how well each NS variant orthogonalises (singular-value bands)",
        ("fastmuon accuracy", "fastmuon accuracy --rows 128 --cols 1152 --json accuracy.json"),
    ),
    "train": Subcommand(
        "fastmuon.train.options",
        "fastmuon.train.cli",
        "each optimizer trained on small models: losses, curves, time",
        (
            "fastmuon train --model digits --optimizer musgd,sgd",
            "fastmuon train --steps 60 --plot curves.png",
        ),
    ),
    "plan": Subcommand(
        "fastmuon.tools.plan_options",
        "fastmuon.scale.cli",
        "NS FLOPs, bytes and memory per rank at 8 to 1,024 ranks, per layout, beside the peers",
        (
            "fastmuon plan                           # llama3-70b under FSDP on 1,024 H100s",
            "fastmuon plan --model deepseek-v3 --layout ep:64 --world 256",
            "fastmuon plan --targets",
        ),
    ),
    "yolo": Subcommand(
        "fastmuon.integrations.yolo_options",
        "fastmuon.integrations.ultralytics",
        "Ultralytics' `yolo` command with fastmuon.MuSGD as its MuSGD",
        ("fastmuon yolo train model=yolo26n.yaml data=coco8.yaml epochs=3 optimizer=MuSGD",),
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


EXAMPLES = "examples:"


def examples(*lines: str) -> str:
    """An epilog of example invocations, kept one a line by :class:`DefaultsHelpFormatter`."""
    return "\n".join((EXAMPLES, *(f"  {line}" for line in lines)))


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` shows each option's default, except where there is none (None, or a flag's
    False) or the help text already says it in words."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if text.startswith(EXAMPLES):  # one invocation a line, as typed
            return "".join(indent + line + "\n" for line in text.splitlines())
        return super()._fill_text(text, width, indent)

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


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The whole command line, or (``command``) only that subcommand's options: the others'
    modules are then not imported at all."""
    from .. import __version__

    parser = argparse.ArgumentParser(
        prog="fastmuon",
        description="Fast Muon-family optimizers: benchmark, accuracy, training and at-scale figures.",
        epilog=examples(
            "fastmuon bench                 # the README's comparison on this machine",
            "fastmuon bench --help          # every option of one subcommand, with examples",
            "fastmuon plan --model llama3-8b --world 64",
        ),
        formatter_class=DefaultsHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"fastmuon {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, spec in SUBCOMMANDS.items():
        p = sub.add_parser(
            name,
            help=spec.help,
            description=spec.help,
            epilog=examples(*spec.examples),
            formatter_class=DefaultsHelpFormatter,
        )
        p.set_defaults(_module=spec.runner)
        if command is None or command == name:
            importlib.import_module(spec.options).add_arguments(p)
    return parser


def named_command(argv: Sequence[str]) -> str | None:
    """The subcommand ``argv`` names (its first word that is one), if any."""
    return next((word for word in argv if word in SUBCOMMANDS), None)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = named_command(argv)
    args = build_parser(command or "").parse_args(argv)
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
