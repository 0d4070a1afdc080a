"""Corners a new user meets: torch's constructor convention, checkpoints saved by other
optimizers with keys or buffers missing, and matrix maps given or edited by hand."""

from __future__ import annotations

import pytest
import torch

import fastmuon

OPTIMIZERS = [fastmuon.MuSGD, fastmuon.Muon]


@pytest.mark.parametrize("cls", OPTIMIZERS, ids=lambda c: c.__name__)
def test_constructor_checks_its_arguments_before_reading_params(cls):
    # the call torch's generic optimizer tests (test_errors) make for every optimizer
    with pytest.raises(ValueError, match="Tensor lr must be 1-element"):
        cls(None, lr=torch.tensor([0.001, 0.001]))
