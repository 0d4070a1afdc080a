"""Interleaved parts under DDP, FSDP2, tensor and expert parallelism (gloo on CPU), against one
process and the de-interleaved per-matrix reference; see ``interleave_worker.py``."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from test_distributed import launch

pytestmark = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed with gloo"
)


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_interleaved_parts_under_every_layout(world, tmp_path):
    report = launch(world, tmp_path, script="interleave_worker.py")
    for opt in ("muon", "musgd"):
        for layout in ("ddp", "fsdp2", "tp", "ep"):
            assert f"{layout} {opt}: equal to one process" in report, (layout, opt, report)
        assert f"tp {opt}: equal to one process" in report
    assert report.count("and the reference") == 4, report
    assert "tp muon: equal to one process and the reference; 13 exchanged matrices" in report, report
