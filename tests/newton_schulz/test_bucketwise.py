"""A CPU step runs the plan one bucket at a time in one shared workspace: what it keeps between
steps, and that its steps are bit for bit those of running every bucket in one engine call."""

from __future__ import annotations

import gc

import pytest
import torch
from helpers import make_grads, make_params, run_optimizer
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import fastmuon

# convs (channels_last among them), tall and wide matrices, enough shape ratios for more lr
# factors than one fused add_ each takes (the apply then scales in the parameters' dtype), and
# more matrices of one shape than one bucket holds (a variant's class of them spans buckets)
SHAPES = [
    (32, 16, 3, 3),
    (16, 16, 3, 3),
    (24, 8, 1, 1),
    (64, 32),
    (64, 32),
    (64, 32),
    (64, 32),
    (32, 64),
    (48, 16),
    (40, 8),
    (36, 12),
    (30, 6),
    (28, 4),
    (27, 3),
    (22, 2),
    (21, 7),
    (50, 5),
    (96, 96),
]
CHANNELS_LAST = (0, 1)


#: small enough that the plan has several buckets, of several shapes
CAP = 16_384
#: the hyperparameters of the optimizer-level tests here
OPTIMIZER_KW = dict(lr=0.02, momentum=0.9, nesterov=True, weight_decay=1e-3, ns_dtype=torch.float32)


def _optimizers(**kw):
    kw = dict(max_bucket_bytes=CAP, **kw)
    return {
        "MuSGD": lambda ps: fastmuon.MuSGD(ps, lr=0.02, momentum=0.9, weight_decay=1e-2, use_muon=True, **kw),
        "Muon": lambda ps: fastmuon.Muon(ps, lr=0.02, weight_decay=0.1, adjust_lr_fn="original", **kw),
        "Muon-cautious": lambda ps: fastmuon.Muon(
            ps, lr=torch.tensor(0.02), weight_decay=0.1, cautious_weight_decay=True, **kw
        ),
        "NorMuon": lambda ps: fastmuon.NorMuon(ps, lr=0.02, weight_decay=0.1, **kw),
        "AdaMuon": lambda ps: fastmuon.AdaMuon(ps, lr=0.02, weight_decay=0.1, **kw),
    }


#: NS in fp32 where the planner prices it faster ("auto"), or in bf16 throughout ("standard"):
#: results in the parameters' dtype, or narrower (applied as they are, or cast first)
METHODS = ["auto", "standard"]


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


class _NewStorages(TorchDispatchMode):
    """Every storage an op made while active."""

    def __init__(self):
        super().__init__()
        self.made: dict[int, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.made.setdefault(_storage(t), t.untyped_storage().nbytes())
        return out


def _kept_after_two_steps(make, params, grads) -> tuple[int, object]:
    """Bytes of every live storage the optimizer made (built and stepped twice) that is
    neither a parameter nor a gradient: its state and whatever else it keeps between steps."""
    with _NewStorages() as made:
        opt = make(params)
        for step_grads in grads:
            for p, g in zip(params, step_grads):
                p.grad = g
            opt.step()
    gc.collect()
    outside = {_storage(p) for p in params} | {_storage(p.grad) for p in params}
    alive = {}
    for o in gc.get_objects():
        if issubclass(type(o), torch.Tensor) and not issubclass(type(o), torch.nn.Parameter):
            key = _storage(o)
            if key in made.made and key not in outside:
                alive[key] = o.untyped_storage().nbytes()
    return sum(alive.values()), opt


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("name", ["MuSGD", "Muon", "NorMuon", "AdaMuon"])
def test_kept_between_steps_is_state_and_four_largest_buckets(name, method):
    """What a CPU step keeps besides the per-parameter state is one workspace, within four of
    the largest bucket's stacked input (its input, the kernel's temporaries, a cast of its
    results), however many buckets the plan has; and an index of the parameters (8 bytes
    each)."""
    torch.manual_seed(0)
    params = make_params(SHAPES, channels_last=CHANNELS_LAST)
    grads = make_grads(params, steps=2)
    kept, opt = _kept_after_two_steps(_optimizers(ns_method=method)[name], params, grads)
    buckets = opt.plan().buckets
    assert len(buckets) > 3 and len({b.shape for b in buckets}) > 1
    largest = max(b.nbytes() for b in buckets)
    state = sum(
        t.untyped_storage().nbytes() for s in opt.state.values() for t in s.values() if torch.is_tensor(t)
    )
    assert state < kept <= state + 4 * largest + 8 * len(params), (kept, state, largest)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("name", list(_optimizers()))
def test_bucket_by_bucket_steps_are_those_of_one_engine_call(name, method):
    """The same three steps, bit for bit, whether each bucket is applied before the next runs
    (the CPU's path) or every bucket runs in one engine call first (the path an NS hook gets)."""
    torch.manual_seed(0)
    base = make_params(SHAPES, channels_last=CHANNELS_LAST)
    grads = make_grads(base, steps=3)
    finals = []
    for hooked in (False, True):
        params = [torch.nn.Parameter(p.detach().clone(memory_format=torch.preserve_format)) for p in base]
        opt = _optimizers(ns_method=method)[name](params)
        if hooked:
            opt.register_orthogonalize_hook(lambda call: call())
        for step_grads in grads:
            for p, g in zip(params, step_grads):
                p.grad = g.clone()
            opt.step()
        (engine,) = opt.orthogonalizers()
        assert (engine._shared is None) == hooked  # the path taken
        assert len(engine.plan.buckets) > 3
        spanned = [
            b
            for b in engine.plan.buckets
            if any(engine.layouts[m.index].shape == (64, 32) for m in b.members)
        ]
        assert len(spanned) > 1
        state = [t for p in params for t in opt.state[p].values() if torch.is_tensor(t)]
        finals.append([p.detach() for p in params] + state)
    assert len(finals[0]) == len(finals[1])
    for ours, reference in zip(*finals):
        assert torch.equal(ours, reference)


def test_the_cpu_workspace_persists_and_a_bucket_opens_with_zero_padding():
    """The CPU step's one workspace is kept from step to step; a bucket opened in it has zeros
    around each matrix (the padding NS needs) and the matrix in its corner."""
    params = make_params([(8, 30), (16, 40)])
    opt = fastmuon.MuSGD(params, **OPTIMIZER_KW, use_muon=True, policy="min_launches")
    grads = make_grads(params, steps=3)
    run_optimizer(opt, params, grads[:2])  # the first steps size it
    (engine,) = opt.orthogonalizers()
    kept = [t.untyped_storage().data_ptr() for t in engine.workspaces()]
    run_optimizer(opt, params, grads[2:])
    assert [t.untyped_storage().data_ptr() for t in engine.workspaces()] == kept
    (small,) = [k for k, m in enumerate(engine.plan.buckets[0].members) if m.rows == 8]
    inputs = engine.open_bucket(0)
    buf = engine.records[0].shared.batch()
    assert buf.shape == (2, 16, 40)
    slot = engine.plan.buckets[0].members[small].slot
    inputs[small].copy_(torch.ones(8, 30))
    assert torch.count_nonzero(buf[slot, 8:, :]) == 0 and torch.count_nonzero(buf[slot, :, 30:]) == 0
    assert torch.count_nonzero(buf[slot, :8, :30]) == 8 * 30
