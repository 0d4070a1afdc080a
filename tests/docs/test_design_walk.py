"""docs/design.md's walk of a prepared step is what ``scripts/step_walk.py`` measures now."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import fastmuon

ROOT = Path(__file__).resolve().parents[2]


def step_walk():
    spec = importlib.util.spec_from_file_location("step_walk", ROOT / "scripts" / "step_walk.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("step_walk", module)  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


def test_the_walk_design_md_gives_is_the_one_measured():
    text = " ".join((ROOT / "docs" / "design.md").read_text().split())
    claim = re.search(
        r"Muon (\d+) files, (\d+) crossings, (\d+) frames deep; MuSGD (\d+) files, (\d+) crossings, (\d+) deep",
        text,
    )
    assert claim, "design.md gives no figures of the walk in this form"
    walk = step_walk().walk
    measured = []
    for cls in (fastmuon.Muon, fastmuon.MuSGD):
        seen = walk(cls)
        measured += [len(seen.files), seen.crossings, seen.deepest]
    assert [int(g) for g in claim.groups()] == measured
    assert "optim/base.py" in walk(fastmuon.Muon).files
