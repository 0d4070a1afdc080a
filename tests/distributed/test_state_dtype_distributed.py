"""``state_dtype`` under DDP and FSDP2 on CPU with gloo (2 ranks of ``state_dtype_worker.py``)."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from test_distributed import launch

pytestmark = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed with gloo"
)


def test_bf16_state_under_ddp_and_fsdp2(tmp_path):
    report = launch(2, tmp_path, script="state_dtype_worker.py")
    for cls in ("MuSGD", "Muon"):
        assert f"DDP {cls} with bf16 state: equal to one process" in report, report
        assert f"FSDP2 {cls} with bf16 state: equal to one process" in report, report
        assert f"FSDP2 {cls} with bf16 state: checkpoint save/load/resume identical" in report, report
    print(report)
