"""The ``fastmuon`` command's mistakes: one line on stderr, before any work, argparse's exit status."""

from __future__ import annotations

import argparse
import sys

import pytest

import fastmuon.tools.accuracy
import fastmuon.train.cli
from fastmuon.tools.cli import build_parser, main


def run_cli(argv: list[str], capsys) -> tuple[int, list[str]]:
    """Exit status and stderr lines of ``fastmuon argv`` (argparse's own errors raise SystemExit)."""
    try:
        status = main(argv)
    except SystemExit as e:
        status = e.code
    return status, capsys.readouterr().err.strip().splitlines()


@pytest.fixture
def no_work(monkeypatch):
    """Any training or accuracy run fails the test: mistakes must be found before the work."""

    def refuse(*args, **kwargs):
        raise AssertionError("the command did the work before refusing its arguments")

    monkeypatch.setattr(fastmuon.train.cli, "train_run", refuse)
    monkeypatch.setattr(fastmuon.tools.accuracy, "run_accuracy", refuse)


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["train", "--plot", "/no/such/dir/p.png"],
            "--plot /no/such/dir/p.png: directory /no/such/dir does not exist",
        ),
        (["train", "--device", "tpu"], "--device tpu: not a device to train on"),
        (["train", "--steps", "0"], "--steps must be at least 1, got 0"),
        (["train", "--threads", "0"], "--threads must be at least 1, got 0"),
        (["train", "--optimizer", "bogus"], "unknown optimizer 'bogus'"),
        (["accuracy", "--rows", "0"], "--rows and --cols must be at least 1, got 0×576"),
        (["accuracy", "--rows", "9", "--cols", "4"], "--rows 9 is more than --cols 4"),
        (["accuracy", "--json", "/no/such/dir/a.json"], "--json /no/such/dir/a.json: directory /no/such/dir"),
        (["train", "--json", "/no/such/dir/t.json"], "--json /no/such/dir/t.json: directory /no/such/dir"),
    ],
)
def test_usage_mistakes_are_one_line_exit_2_and_nothing_runs(argv, message, capsys, no_work):
    status, err = run_cli(argv, capsys)
    assert status == 2
    assert len(err) == 1 and err[0].startswith(f"fastmuon {argv[0]}: error: {message}"), err


def test_an_output_path_that_is_a_directory_is_refused(tmp_path, capsys, no_work):
    status, err = run_cli(["train", "--plot", str(tmp_path)], capsys)
    assert status == 2 and err == [
        f"fastmuon train: error: --plot {tmp_path}: is a directory; give a file name"
    ]


def test_a_value_checked_after_parsing_exits_like_a_parse_error(capsys):
    """The same kind of mistake gets the same status, found by argparse or by the command."""
    parse_status, _ = run_cli(["train", "--model", "nope"], capsys)
    rounds_status, err = run_cli(["bench", "--rounds", "0", "--quiet"], capsys)
    assert parse_status == rounds_status == 2
    assert err[-1] == "fastmuon bench: error: --rounds must be at least 1, got 0"


def test_train_without_rich_says_what_to_install(monkeypatch, capsys, no_work):
    for name in [m for m in sys.modules if m == "rich" or m.startswith("rich.")] + ["rich"]:
        monkeypatch.setitem(sys.modules, name, None)  # an import of it now fails as if not installed
    status, err = run_cli(["train", "--steps", "1"], capsys)
    assert status == 1
    assert err == [
        "fastmuon train: error: needs the optional package 'rich', which is not installed "
        "(pip install 'fastmuon[train]')"
    ]


def subcommand_parsers() -> dict[str, argparse.ArgumentParser]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


@pytest.mark.parametrize("name", ["bench", "accuracy", "train", "yolo"])
def test_every_option_has_help_and_help_shows_defaults(name):
    parser = subcommand_parsers()[name]
    for action in parser._actions:
        assert action.help, f"fastmuon {name} {action.dest} has no help text"
        formatter = parser._get_formatter()
        formatter.add_argument(action)
        shown = " ".join(formatter.format_help().split())  # this option's lines in --help
        no_default = any(action.default is none for none in (None, False, argparse.SUPPRESS))
        if action.option_strings and not no_default:
            assert "default" in shown, f"fastmuon {name} --help does not show {action.dest}'s default"


@pytest.mark.parametrize("name", ["bench", "accuracy", "train"])
def test_json_means_a_file_in_every_subcommand(name):
    json_flag = next(a for a in subcommand_parsers()[name]._actions if "--json" in a.option_strings)
    assert json_flag.metavar == "FILE" and json_flag.nargs is None and json_flag.default is None
    assert json_flag.help.startswith("also write ") and "'-': to standard output" in json_flag.help
