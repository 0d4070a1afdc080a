"""What an installed fastmuon tells about itself: one version everywhere, typed, licensed."""

from __future__ import annotations

import importlib.metadata
import pathlib

import pytest

import fastmuon
from fastmuon.tools.cli import main

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_one_version_everywhere(capsys):
    assert importlib.metadata.version("fastmuon") == fastmuon.__version__
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"fastmuon {fastmuon.__version__}"


def test_ships_type_marker_and_licence():
    assert (pathlib.Path(fastmuon.__file__).parent / "py.typed").is_file()
    assert "Apache License" in (ROOT / "LICENSE").read_text()


def _tested_releases() -> list[str]:
    listed = (ROOT / "scripts" / "requirements-torch-tested.txt").read_text().splitlines()
    return [line.removeprefix("torch==") for line in listed if line.startswith("torch==")]


def _torch_requirement():
    import ast

    from packaging.requirements import Requirement

    text = (ROOT / "pyproject.toml").read_text()  # tomllib is 3.11+; the list is a Python literal
    listed = "[" + text.split("\ndependencies = [", 1)[1].split("]", 1)[0] + "]"
    deps = ast.literal_eval(listed)
    (torch_req,) = [r for r in map(Requirement, deps) if r.name == "torch"]
    return torch_req


def test_the_running_torch_satisfies_the_declared_requirement():
    """Installing fastmuon beside this torch must not swap it for another release."""
    import torch
    from packaging.version import Version

    running = Version(torch.__version__.split("+")[0])
    assert _torch_requirement().specifier.contains(running), (torch.__version__, str(_torch_requirement()))


def test_the_torch_bound_is_one_release_past_the_newest_tested():
    from packaging.version import Version

    tested = [Version(v) for v in _tested_releases()]
    assert tested, "test.sh names no torch release"
    newest = max(tested)
    spec = _torch_requirement().specifier
    assert all(spec.contains(v) for v in tested)
    # every patch of the newest tested release is allowed, the next (untested) release is not
    assert spec.contains(Version(f"{newest.major}.{newest.minor}.99"))
    assert not spec.contains(Version(f"{newest.major}.{newest.minor + 1}.0"))
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    for v in _tested_releases():
        assert f"  {v})" in setup, f"scripts/setup.sh has no case for torch {v}"


def test_the_torch_lower_bound_is_the_oldest_tested_release():
    from packaging.version import Version

    oldest = min(Version(v) for v in _tested_releases())
    assert _torch_requirement().specifier.contains(oldest)
    assert not _torch_requirement().specifier.contains(Version(f"{oldest.major}.{oldest.minor - 1}.0"))
