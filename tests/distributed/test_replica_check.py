"""The check that a plain tensor beside DTensors has the same gradient on every rank: rounding
differences (kernels summing in another order) pass, a different gradient is refused."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fastmuon.distributed.parts import replica_floor, replica_sketch, replica_tolerance, replicas_differ


def _verdict(grads: list[torch.Tensor]) -> bool:
    """What the all-reduce of every rank's sketch (max, and max of the negatives) decides."""
    sketches = torch.stack([replica_sketch(g)[None] for g in grads])
    high, low = sketches.amax(dim=0), sketches.amin(dim=0)
    floors = [replica_floor(grads[0])]
    return bool(replicas_differ(high, low, replica_tolerance(grads[0].dtype), floors)[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_zero_gradient_beside_subnormal_rounding_passes(dtype):
    """One rank's exact zeros, another's entries a few subnormal steps away (a gradient that
    sums to zero, rounded otherwise): no different gradient, whatever the norms' ratio."""
    zero = torch.zeros(7, dtype=dtype)
    assert not _verdict([zero, _ulps(zero, 1, 4), _ulps(zero, 2, 2)])


def _ulps(g: torch.Tensor, seed: int, count: int) -> torch.Tensor:
    """``g`` with every entry moved by up to ``count`` units in its last place."""
    steps = torch.randint(-count, count + 1, g.shape, generator=torch.Generator().manual_seed(seed))
    out = g.clone()
    for _ in range(count):
        up = torch.nextafter(out, torch.full_like(out, torch.inf))
        down = torch.nextafter(out, torch.full_like(out, -torch.inf))
        out = torch.where(steps > 0, up, torch.where(steps < 0, down, out))
        steps = steps - steps.sign()
    return out


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    numel=st.integers(1, 5000),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    centred=st.booleans(),
)
def test_rounding_differences_pass(seed, numel, dtype, centred):
    """A few units in the last place per entry, even where the gradient sums to about zero
    (the case a relative test of sums refused)."""
    g = torch.randn(numel, generator=torch.Generator().manual_seed(seed)).to(dtype)
    if centred:
        g = (g - g.float().mean()).to(dtype)
    assert not _verdict([g, _ulps(g, seed + 1, 4), _ulps(g, seed + 2, 2)])


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    numel=st.integers(16, 5000),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
)
def test_a_different_gradient_is_refused(seed, numel, dtype):
    """Another rank's batch (an independent gradient of the same size) and a gradient off by a
    tenth of itself in one entry of many."""
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(numel, generator=gen).to(dtype)
    other = torch.randn(numel, generator=gen).to(dtype)
    assert _verdict([g, other])
    spiked = g.clone()
    k = int(g.float().abs().argmax())
    spiked[k] = spiked[k] + g.float().norm().to(dtype)
    assert _verdict([g, spiked])


def test_all_zero_gradients_agree_and_the_sketch_is_deterministic():
    z = torch.zeros(7, 3)
    assert not _verdict([z, z.clone()])
    g = torch.randn(3000, 700)  # more than one chunk
    assert torch.equal(replica_sketch(g), replica_sketch(g.clone()))
    torch.testing.assert_close(replica_sketch(g)[-1], g.double().norm())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_tolerance_is_above_rounding_and_below_a_real_difference(dtype):
    assert 16 * torch.finfo(dtype).eps < replica_tolerance(dtype) < 0.5
