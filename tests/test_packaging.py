"""What an installed fastmuon tells about itself: one version everywhere, typed, licensed."""

from __future__ import annotations

import importlib.metadata
import pathlib

import pytest

import fastmuon
from fastmuon.cli import main

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_one_version_everywhere(capsys):
    assert importlib.metadata.version("fastmuon") == fastmuon.__version__
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"fastmuon {fastmuon.__version__}"


def test_ships_type_marker_and_licence():
    assert (pathlib.Path(fastmuon.__file__).parent / "py.typed").is_file()
    assert "Apache License" in (ROOT / "LICENSE").read_text()
