"""Every rank enters the same collectives in the same order: through a caught
``FloatingPointError`` (a NaN on one rank only, raised at once on the host's CPU or one step
later on an accelerator's path, ``zero_grad`` between), and through engines evicted and
rebuilt; ``new_group`` is entered by every rank, once per set of ranks (a rebuilt engine makes
no new group)."""

from __future__ import annotations

import json

import pytest
import torch.distributed as dist
from test_distributed import run_world, world_report

pytestmark = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed with gloo"
)


def test_every_rank_enters_the_same_collectives(tmp_path):
    ranks = run_world(2, tmp_path, 600, "collectives_worker.py", [])
    assert all(code == 0 for code, _ in ranks), world_report(ranks)
    runs = [json.loads((tmp_path / f"log{r}.json").read_text()) for r in range(2)]
    assert runs[0]["log"] == runs[1]["log"]
    assert runs[0]["outcomes"] == runs[1]["outcomes"]
    outcomes = runs[0]["outcomes"]
    raised = [k for k, o in enumerate(outcomes) if o.startswith("raised")]
    per_run = len(outcomes) // 2
    # on the host's CPU the bad step raises; on the accelerator's path the step after it
    assert raised == [2, per_run + 3], outcomes
    log = runs[0]["log"]
    new_groups = [line for line in log if line.startswith("new_group")]
    assert len(new_groups) == len(set(new_groups)), new_groups
    # the owner groups asked for at the end, each rank set twice: made once each, by both ranks
    owners = log[log.index("-- owner groups") + 1 :]
    assert [line for line in owners if line.startswith("new_group")] == owners and len(owners) == 3, owners
    steps = [line for line in log if line.startswith("-- step")]
    assert len(steps) == len(outcomes)
