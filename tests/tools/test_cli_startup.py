"""The command answers ``--help`` without importing torch, every example it shows parses, and
``import fastmuon`` leaves ``torch._dynamo`` alone until something compiles."""

import json
import shlex
import subprocess
import sys

import pytest

import fastmuon.bench.options
import fastmuon.tools.plan_options
import fastmuon.train.options
from fastmuon.tools.cli import SUBCOMMANDS, build_parser, named_command

SRC = str(__import__("pathlib").Path(fastmuon.bench.options.__file__).parents[2])


def modules_after(code: str) -> set[str]:
    """The modules a fresh interpreter has loaded after running ``code`` (help output discarded)."""
    probe = (
        "import contextlib, io, json, sys\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        f"    {code}\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    env = {"PYTHONPATH": SRC, "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, check=True)
    return set(json.loads(out.stdout.splitlines()[-1]))


HELP = "from fastmuon.tools.cli import main\n    try: main({argv!r})\n    except SystemExit: pass"


@pytest.mark.parametrize("argv", [["--help"], *([name, "--help"] for name in SUBCOMMANDS)], ids=" ".join)
def test_help_imports_no_torch(argv):
    loaded = modules_after(HELP.format(argv=argv))
    assert "fastmuon.tools.cli" in loaded  # the probe did run the command
    assert "torch" not in loaded


def test_help_imports_only_the_named_subcommands_options():
    loaded = modules_after(HELP.format(argv=["plan", "--help"]))
    assert "fastmuon.tools.plan_options" in loaded
    assert not {"fastmuon.bench.options", "fastmuon.train.options", "fastmuon.scale.cli"} & loaded


def test_every_public_name_loads_without_dynamo():
    # torch.compiler.disable at import time would load torch._dynamo (torch.optim's own
    # constructors load it later, on first use)
    loaded = modules_after("import fastmuon\n    [getattr(fastmuon, n) for n in fastmuon.__all__]")
    assert "torch._dynamo" not in loaded
    assert "fastmuon.optim.musgd" in loaded


def test_an_unknown_name_is_an_attribute_error():
    import fastmuon

    with pytest.raises(AttributeError, match="no attribute 'MuSDG'"):
        fastmuon.MuSDG  # noqa: B018


@pytest.mark.parametrize(
    ("name", "example"),
    [(n, e) for n, s in SUBCOMMANDS.items() for e in s.examples],
    ids=lambda v: str(v)[:40],
)
def test_every_example_parses(name, example):
    argv = shlex.split(example, comments=True)[1:]
    assert named_command(argv) == name
    args = build_parser(name).parse_args(argv)
    assert args.command == name


def test_each_help_shows_its_examples(capsys):
    for name, spec in SUBCOMMANDS.items():
        with pytest.raises(SystemExit):
            build_parser(name).parse_args([name, "--help"])
        out = capsys.readouterr().out
        assert "examples:" in out
        assert all(example in out for example in spec.examples), name


def test_the_options_name_what_the_registries_hold():
    from fastmuon.bench.lineup import OPTIMIZERS
    from fastmuon.bench.workloads import WORKLOADS
    from fastmuon.ns.planner import POLICIES
    from fastmuon.scale.designs import DESIGNS
    from fastmuon.scale.devices import DEVICE_NAMES
    from fastmuon.scale.models import WORKLOADS as SCALE_WORKLOADS
    from fastmuon.step.nonfinite import NONFINITE_MODES
    from fastmuon.train.contenders import CONTENDERS
    from fastmuon.train.tasks import TASKS

    bench, scale, train = fastmuon.bench.options, fastmuon.tools.plan_options, fastmuon.train.options
    assert tuple(WORKLOADS) == bench.WORKLOAD_NAMES
    assert bench.OPTIMIZERS == OPTIMIZERS
    assert bench.POLICIES == POLICIES
    assert bench.NONFINITE_MODES == NONFINITE_MODES
    assert tuple(SCALE_WORKLOADS) == scale.WORKLOAD_NAMES
    assert scale.DESIGNS == DESIGNS
    assert scale.DEVICE_NAMES == DEVICE_NAMES
    assert {name: c.label for name, c in CONTENDERS.items()} == train.CONTENDER_LABELS
    assert train.TASK_NAMES == TASKS
