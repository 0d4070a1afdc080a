"""Device meshes on CPU with gloo: HSDP, tensor parallel, FSDP + TP, expert parallel and expert
stacks FSDP2-sharded on dim 1, each against one process and the per-parameter reference, with
the matrices exchanged and the bytes sent counted; a checkpoint saved on one layout resumed on
another and on one process; the ways in of accelerate (FSDP2 preparation) and Transformers'
Trainer (a param group per mesh).

Each test launches one world of ``mesh_worker.py`` processes (4 ranks: 2×2 meshes; 2 ranks:
2×1 and 1×2) that runs every check; see that file for what each compares.
"""

from __future__ import annotations

import pytest
import torch.distributed as dist
from test_distributed import launch

pytestmark = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed with gloo"
)

LAYOUTS = ("hsdp", "tp", "tp+heads", "fsdp+tp", "ep", "hsdp+ep", "fsdp-experts-dim1", "ep+fsdp-experts-dim1")


@pytest.mark.parametrize("world", [pytest.param(4, marks=pytest.mark.slow), 2])
def test_mesh_layouts(world, tmp_path):
    report = launch(world, tmp_path, script="mesh_worker.py")
    for layout in LAYOUTS:
        for opt in ("muon", "musgd"):
            assert f"{layout} " in report and f" {opt}: equal to one process" in report, (layout, opt)
    assert report.count(": equal to one process;") == 2 * len(LAYOUTS), report
    assert "resumed under FSDP + TP: the same updates" in report
    assert "resumed under 1-D FSDP2: the same updates" in report
    assert "resumed in one process: the same updates" in report
    assert (
        "accelerate's FSDP2 preparation (parameters swapped after construction): equal to one process"
        in report
    )
    assert "Trainer, groups per device mesh (fastmuon.Muon and MuonFactory): equal to one process" in report
    print(report)
