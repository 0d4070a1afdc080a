"""A compiled step is one graph: dynamo traces all of it, so it compiles once.

A graph break inside ``Optimizer.step`` (torch wraps it in a profiler context that a break
cannot cross) makes dynamo give up on the whole frame and compile every function it calls on
its own, each bucket's call again until its recompile limit (a YOLO model's step: minutes).
"""

from __future__ import annotations

import pytest
import torch

import fastmuon

SHAPES = [(16, 3, 3, 3), (32, 16, 3, 3), (32, 32, 3, 3), (64, 32, 1, 1), (64, 64, 3, 3), (10, 64)]


def _graph_breaks(cls: type, **options) -> list[str]:
    gen = torch.Generator().manual_seed(0)
    matrices = [torch.nn.Parameter(0.1 * torch.randn(s, generator=gen)) for s in SHAPES]
    matrices[1].data = matrices[1].data.contiguous(memory_format=torch.channels_last)
    vectors = [torch.nn.Parameter(torch.zeros(n)) for n in (8, 32)]
    for p in matrices + vectors:
        p.grad = torch.randn(p.shape, generator=gen)
    groups = [{"params": matrices, "use_muon": True}, {"params": vectors, "use_muon": False}]
    opt = cls(groups, lr=0.01, **options)
    opt.step()
    torch._dynamo.reset()
    try:
        explained = torch._dynamo.explain(opt.step)()
    finally:
        torch._dynamo.reset()
    return [str(b.reason).strip().splitlines()[0][:200] for b in explained.break_reasons] + [
        "break" for _ in range(explained.graph_break_count - len(explained.break_reasons))
    ]


@pytest.mark.slow  # dynamo traces two steps: seconds
@pytest.mark.parametrize("capturable", [False, True])
def test_a_musgd_skip_step_compiles_as_one_graph(capturable):
    """No graph break where nothing needs the host ("skip" masks a bad gradient on the device),
    channels-last parameters among them. (Muon's AdamW half reads its step counts on the host
    unless ``capturable``: a break there.)"""
    assert _graph_breaks(fastmuon.MuSGD, nonfinite="skip", capturable=capturable) == []
