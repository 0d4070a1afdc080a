"""A distributed step's agreement on which parameters have gradients reads nothing of the device.

The ranks' has-gradient flags are the host's (Python booleans): they go through a group that
carries host tensors and come back as host values, so the host waits for the other ranks but
never for the device's queue. Checked on fake cuda tensors (a CUDA build of torch, no GPU)
with a one-rank gloo world: every read of a device value on the host, and every blocking copy
between the host and the device, is counted, as ``fastmuon bench --device cuda`` counts them.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from fastmuon.bench.fake_cuda import fake_cuda_problem
from fastmuon.distributed.context import begin_step
from fastmuon.distributed.inflight import InFlight

PROBLEM = fake_cuda_problem() if torch.cuda.is_available() is False else None
pytestmark = [
    pytest.mark.skipif(PROBLEM is not None, reason=str(PROBLEM)),
    pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo"),
]


def test_the_agreement_on_gradients_reads_no_device_value(one_rank_world):
    from fastmuon.bench.trace import TraceCounter, fake_cuda

    with fake_cuda():
        params = [torch.nn.Parameter(torch.zeros(16, 8, device="cuda")) for _ in range(3)]
        params[0].grad = torch.ones(16, 8, device="cuda")
        params[2].grad = torch.ones(16, 8, device="cuda")
    inflight = InFlight()
    counter = TraceCounter()
    with counter:
        zeros = begin_step(params, one_rank_world, inflight)
    inflight.settle()
    assert counter.syncs == []
    assert set(zeros) == set()  # one rank: the flags it has are the agreed ones


def test_only_a_group_without_a_host_twin_reads_the_flags_back_from_the_device(one_rank_world, monkeypatch):
    """The one case left: an accelerator-only group over some of the ranks has no host twin
    (see ``host_group``), so its flags go through the device and are read back, which waits for
    the device's queue: the counter sees that wait."""
    from fastmuon.bench.trace import TraceCounter, fake_cuda
    from fastmuon.distributed import context

    monkeypatch.setattr(context, "host_group", lambda group: None)
    monkeypatch.setattr(context, "collective_device", lambda device, group: device)
    with fake_cuda():
        params = [torch.nn.Parameter(torch.zeros(16, 8, device="cuda")) for _ in range(2)]
        params[0].grad = torch.ones(16, 8, device="cuda")
        inflight = InFlight()
        counter = TraceCounter()
        with counter:
            context.begin_step(params, one_rank_world, inflight)
        inflight.settle()
    reads = [s.what for s in counter.syncs]
    assert reads[0] == "blocking copy cpu→cuda"  # the flags to the device
    assert reads[1:] == ["item (_local_scalar_dense)"] * len(params)  # and each read back
