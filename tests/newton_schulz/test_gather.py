"""Gather: the fixed picks a prepared step makes out of each step's lists."""

from __future__ import annotations

from fastmuon.ns.engine import Gather


def test_a_gather_picks_its_positions_in_order():
    seq = ["a", "b", "c", "d"]
    assert Gather([2, 0, 2])(seq) == ["c", "a", "c"]
    assert Gather([1])(seq) == ["b"]
    assert Gather([])(seq) == []
    assert len(Gather([3, 1])) == 2 and Gather([])  # always true, as a callable
