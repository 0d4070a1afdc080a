"""QK-clip with DDP (gloo on CPU): ranks that saw other batches clip by their largest maxima alike."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from test_distributed import launch

pytestmark = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed with gloo"
)


def test_ddp_ranks_clip_by_every_ranks_largest_maxima(tmp_path):
    report = launch(2, tmp_path, timeout=300, script="qk_clip_worker.py")
    assert report.count("QK-clip under DDP: the ranks' largest maxima, replicas equal") == 2
