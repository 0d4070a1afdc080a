"""The element mask of a masked restore: each element of a (device, dtype) group gets its
owner's keep flag, whether made by the fused repeat or by the scan that large groups take."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fastmuon.step import nonfinite


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.lists(st.integers(0, 7), min_size=1, max_size=3), min_size=1, max_size=12),
    data=st.data(),
)
def test_the_scan_mask_is_the_repeat_mask(sizes, data):
    # owner k holds tensors of ``sizes[k]`` elements here (none where all are 0); a leaf tensor
    # per entry, as the views of a group are
    entries = [(torch.zeros(n), k) for k, ns in enumerate(sizes) for n in ns if n]
    if not entries:
        return
    group = nonfinite._Group(torch.device("cpu"), entries, len(sizes))
    keep = torch.tensor(data.draw(st.lists(st.booleans(), min_size=len(sizes), max_size=len(sizes))))
    expected = torch.repeat_interleave(keep, group.repeats, output_size=group.total)
    owners = [k for k, ns in enumerate(sizes) for n in ns for _ in range(n)]
    assert expected.tolist() == [bool(keep[k]) for k in owners]
    scanned = group.scanned_mask(keep)
    assert scanned.dtype == torch.bool
    assert torch.equal(scanned, expected)
