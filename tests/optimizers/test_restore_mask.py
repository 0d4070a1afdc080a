"""The masked restore over one (device, dtype) group: each owner's run padded to whole blocks,
one flag per block. Whatever the sizes, the rejected owners' tensors come back exactly as
saved and the kept owners' keep their new values."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fastmuon.step import nonfinite


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.lists(st.integers(0, 150), min_size=1, max_size=3), min_size=1, max_size=12),
    data=st.data(),
)
@pytest.mark.parametrize("host", [True, False], ids=["cat", "foreach-copy"])
def test_restore_puts_back_exactly_the_rejected_owners(sizes, data, host):
    with mock.patch.object(nonfinite.device, "is_host", lambda where: host):
        _check_restore(sizes, data)


def _check_restore(sizes, data):
    # owner k holds a parameter of sizes[k][0] elements and state tensors of the other sizes
    params = [torch.randn(ns[0]) for ns in sizes]
    states = [{f"s{j}": torch.randn(n) for j, n in enumerate(ns[1:])} for ns in sizes]
    plan = nonfinite.SkipPlan(params, states, range(len(sizes)))
    before = [[p.clone(), *(v.clone() for v in s.values())] for p, s in zip(params, states)]
    saved = plan.snapshot()
    for p, s in zip(params, states):
        p.fill_(float("nan"))
        for v in s.values():
            v.add_(1)
    after = [[p.clone(), *(v.clone() for v in s.values())] for p, s in zip(params, states)]
    keep = torch.tensor(data.draw(st.lists(st.booleans(), min_size=len(sizes), max_size=len(sizes))))
    plan.restore(saved, keep)
    for k, (p, s) in enumerate(zip(params, states)):
        expected = after[k] if keep[k] else before[k]
        for got, want in zip([p, *s.values()], expected):
            assert torch.equal(got, want) or (got.isnan().all() and want.isnan().all())


@pytest.mark.parametrize(
    ("total", "owners", "block"),
    [(100, 1, 8), (2_000_000, 1, 4096), (7_700_000, 366, 512), (10_000, 5_000, 8), (60_000, 100, 16)],
)
def test_blocks_keep_the_padding_small(total, owners, block):
    """A block as large as keeps the padding (under one block per owner) within the share."""
    assert nonfinite.block_size(total, owners) == block
    low, high = nonfinite.BLOCK_RANGE
    assert block == low or owners * block <= total // nonfinite.PAD_SHARE
