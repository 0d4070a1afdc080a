"""What ``help()`` and docs/optimizers.md say of the optimizers: no file paths, examples that run,
and what the docstrings and the docs claim matches what the constructors do."""

from __future__ import annotations

import doctest
import inspect
import pydoc
import re
from pathlib import Path

import pytest
import torch
from torch import nn

import fastmuon
from fastmuon import rules
from fastmuon.ns.newton_schulz import PRESETS

ROOT = Path(__file__).resolve().parents[2]
OPTIMIZERS = [fastmuon.Muon, fastmuon.MuSGD, fastmuon.NorMuon, fastmuon.AdaMuon]
RULES = {
    fastmuon.Muon: rules.muon,
    fastmuon.MuSGD: rules.musgd,
    fastmuon.NorMuon: rules.second_moment.NORMUON,
    fastmuon.AdaMuon: rules.second_moment.ADAMUON,
}


@pytest.mark.parametrize("cls", OPTIMIZERS, ids=lambda c: c.__name__)
def test_help_shows_the_rule_without_a_module_path(cls):
    text = pydoc.render_doc(cls, renderer=pydoc.plaintext)
    assert "<module" not in text and str(ROOT) not in text
    assert re.search(r"\|  rule\n \|      The update rule", text)
    opt = cls([{"params": [nn.Parameter(torch.randn(4, 4))], "use_muon": True}])
    assert opt.rule is RULES[cls]


@pytest.mark.parametrize("cls", OPTIMIZERS, ids=lambda c: c.__name__)
def test_every_optimizer_docstring_has_examples_that_run(cls):
    assert "\n    Examples:\n" in cls.__doc__
    (test,) = doctest.DocTestFinder(recurse=False).find(cls, globs={})
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    runner.run(test)
    result = runner.summarize(verbose=False)
    assert result.attempted >= 5 and result.failed == 0


def test_normuon_docstring_says_what_rescale_rms_accepts_as_adjust_lr_fn():
    doc = " ".join(fastmuon.NorMuon.__doc__.split())
    assert '(``adjust_lr_fn`` must be None or ``"none"``)' in doc
    p = nn.Parameter(torch.randn(6, 4))
    for accepted in (None, "none"):
        fastmuon.NorMuon([p], rescale="rms", adjust_lr_fn=accepted)
    with pytest.raises(ValueError, match=r"set adjust_lr_fn=None \(or 'none'\)"):
        fastmuon.NorMuon([p], rescale="rms", adjust_lr_fn="original")
    assert '``adjust_lr_fn`` must be None or ``"none"``' in " ".join(fastmuon.AdaMuon.__doc__.split())


def test_docs_give_ns_coefficients_default_as_the_signatures_show_it():
    """The shared-options table names each constructor's default as its signature writes it."""
    row = next(
        line
        for line in (ROOT / "docs" / "optimizers.md").read_text().splitlines()
        if line.startswith("| `ns_coefficients` |")
    )
    default = row.split(" | ")[1]
    written = {value: owners for value, owners in re.findall(r"`([^`]+)` \(([^)]*)\)", default)}
    for cls in OPTIMIZERS:
        value = inspect.signature(cls).parameters["ns_coefficients"].default
        shown = f'"{value}"' if isinstance(value, str) else str(value)
        assert cls.__name__ in written[shown], (cls.__name__, shown, written)
        coefficients = PRESETS[value] if isinstance(value, str) else (value,)
        assert coefficients == PRESETS["jordan"]
    assert '`"jordan"` preset' in default
