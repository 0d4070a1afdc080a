"""Off the host, a masked bucket keeps its members' momentum in the bucket's layout (one buffer,
the state entries its views): bit for bit the matrix-by-matrix step, through rejected
gradients, loaded state dicts, state replaced by hand and steps prepared for other gradients.

Run on CPU tensors with :func:`fastmuon.ns.device.is_host` answering "no" (the accelerator's
paths, as in ``test_masked_variants``) and the plan's size from which a step runs bucket by
bucket lowered; the matrix-by-matrix twin has :meth:`Orthogonalizer.frame` answering None.
"""

from __future__ import annotations

import pytest
import torch
from helpers import clone_params, make_grads, make_params, run_optimizer

from fastmuon import Muon
from fastmuon.ns import device as ns_device
from fastmuon.ns import engine as fastmuon_engine
from fastmuon.ns.planner import COST_MODELS
from fastmuon.step import bucket_momentum

# tall ones are packed transposed beside the wide ones: a bucket of both orientations
SHAPES = [(24, 40), (24, 40), (40, 24), (24, 40), (40, 24), (24, 40), (16,)]
CAP = 3 * 24 * 40 * 4  # three matrices a bucket


@pytest.fixture
def accelerator_paths(monkeypatch):
    monkeypatch.setattr(ns_device, "is_host", lambda device: False)
    monkeypatch.setattr(fastmuon_engine, "BY_BUCKET_MIN_BYTES", 0)


@pytest.fixture
def per_matrix():
    """Turns the bucket's layout off (on: True) for the optimizers built and stepped meanwhile."""
    patch = pytest.MonkeyPatch()

    def switch(on: bool) -> None:
        if on:
            patch.setattr(fastmuon_engine.Orthogonalizer, "frame", lambda self, b: None)
        else:
            patch.undo()

    yield switch
    patch.undo()


def _muon(params, **kw):
    groups = [{"params": params[:6], "use_muon": True}, {"params": params[6:], "use_muon": False}]
    kw = {"lr": 0.02, "weight_decay": 0.1, "nonfinite": "skip", **kw}
    return Muon(groups, max_bucket_bytes=CAP, ns_dtype=torch.float32, cost_model=COST_MODELS["cuda"], **kw)


def _bucketed(opt, params):
    """The matrices' momentum buffers, and whether they are views of bucket buffers (one
    storage per bucket of three)."""
    bufs = [opt.state[p]["momentum_buffer"] for p in params[:6]]
    storages = {b.untyped_storage().data_ptr() for b in bufs}
    return bufs, len(storages) == 2


def _twins(params, grads, per_matrix, steps=None, **kw):
    ours, theirs = clone_params(params), clone_params(params)
    opt = _muon(ours, **kw)
    run_optimizer(opt, ours, grads if steps is None else grads[:steps])
    per_matrix(True)
    ref = _muon(theirs, **kw)
    run_optimizer(ref, theirs, grads if steps is None else grads[:steps])
    per_matrix(False)
    return (opt, ours), (ref, theirs)


def _equal(a, b):
    (opt, ours), (ref, theirs) = a, b
    for p, q in zip(ours, theirs):
        assert torch.equal(p.detach(), q.detach())
        for key, value in ref.state[q].items():
            assert torch.equal(opt.state[p][key], value), key


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("nonfinite", ["skip", "raise"])
def test_momentum_in_the_buckets_layout_is_bitwise_the_matrix_by_matrix_step(
    accelerator_paths, per_matrix, nesterov, nonfinite
):
    params = make_params(SHAPES)
    grads = make_grads(params, steps=3)
    ours, theirs = _twins(params, grads, per_matrix, nesterov=nesterov, nonfinite=nonfinite)
    _equal(ours, theirs)
    bufs, bucketed = _bucketed(*ours)
    assert bucketed
    assert not _bucketed(*theirs)[1]
    assert [tuple(b.shape) for b in bufs] == [s for s in SHAPES[:6]]


def test_without_keep_flags_each_matrix_keeps_its_own_buffer(accelerator_paths):
    """ "ignore" masks nothing: the foreach momentum step over the parameters' own buffers
    reads each gradient once, where a stack into the layout would read and write it again."""
    params = make_params(SHAPES)
    opt = _muon(params, nonfinite="ignore")
    run_optimizer(opt, params, make_grads(params, steps=2))
    assert not _bucketed(opt, params)[1]


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_a_rejected_gradient_leaves_its_slot_of_the_buffer_as_it_was(accelerator_paths, per_matrix, value):
    params = make_params(SHAPES)
    grads = make_grads(params, steps=3)
    grads[1][2][3, 5] = value  # a tall (transposed) member's
    ours, theirs = _twins(params, grads, per_matrix)
    _equal(ours, theirs)
    mine = clone_params(params)
    opt = _muon(mine)
    run_optimizer(opt, mine, grads[:1])
    before, buf = mine[2].detach().clone(), opt.state[mine[2]]["momentum_buffer"].clone()
    others = [opt.state[p]["momentum_buffer"].clone() for p in mine[:6]]
    run_optimizer(opt, mine, grads[1:2])
    assert torch.equal(mine[2].detach(), before)
    assert torch.equal(opt.state[mine[2]]["momentum_buffer"], buf)
    assert all(
        not torch.equal(opt.state[p]["momentum_buffer"], o)
        for k, (p, o) in enumerate(zip(mine[:6], others))
        if k != 2
    )


def test_a_loaded_state_dict_moves_into_the_buckets_buffer(accelerator_paths, per_matrix):
    params = make_params(SHAPES)
    grads = make_grads(params, steps=4)
    ours, theirs = _twins(params, grads, per_matrix)
    resumed = clone_params(params)
    first = _muon(resumed)
    run_optimizer(first, resumed, grads[:2])
    saved = first.state_dict()
    again = _muon(resumed)
    again.load_state_dict(saved)
    run_optimizer(again, resumed, grads[2:])
    _equal((again, resumed), theirs)
    assert _bucketed(again, resumed)[1]


def test_a_momentum_buffer_replaced_by_hand_is_stepped_from_its_values(accelerator_paths, per_matrix):
    params = make_params(SHAPES)
    grads = make_grads(params, steps=4)
    runs = []
    for flat in (True, False):
        per_matrix(not flat)
        ps = clone_params(params)
        opt = _muon(ps)
        run_optimizer(opt, ps, grads[:2])
        opt.state[ps[2]]["momentum_buffer"] = opt.state[ps[2]]["momentum_buffer"] * 0.5
        if not flat:
            opt.invalidate()  # the matrix-by-matrix step reads the buffers it was prepared with
        run_optimizer(opt, ps, grads[2:])
        per_matrix(False)
        runs.append((opt, ps))
    _equal(*runs)
    assert _bucketed(*runs[0])[1]


def test_steps_prepared_for_other_gradients_share_the_buffers_values(accelerator_paths, per_matrix):
    """A step without one matrix's gradient is prepared apart (other buckets, other buffers);
    alternating the two, each step starts from the momentum the last one left."""
    params = make_params(SHAPES)
    grads = make_grads(params, steps=6)
    for k in (1, 3, 4):
        grads[k][1] = None
    ours, theirs = _twins(params, grads, per_matrix)
    _equal(ours, theirs)
    assert len(ours[0]._driver.cache.programs) == 2


def test_a_bucket_a_member_does_not_fill_keeps_its_momentum_per_matrix(accelerator_paths):
    """Padding in a slot: no frame, so the members' buffers stay their own tensors."""
    params = make_params([(24, 40), (20, 40), (24, 36), (16,)])
    opt = Muon(
        [{"params": params[:3], "use_muon": True}, {"params": params[3:], "use_muon": False}],
        lr=0.02,
        nonfinite="skip",
        max_bucket_bytes=3 * 24 * 40 * 4,
        ns_dtype=torch.float32,
        cost_model=COST_MODELS["cuda"],
    )
    run_optimizer(opt, params, make_grads(params, steps=2))
    bufs = [opt.state[p]["momentum_buffer"] for p in params[:3]]
    assert len({b.untyped_storage().data_ptr() for b in bufs}) == 3
    assert all(b.is_contiguous() for b in bufs)
    assert bucket_momentum.KEY == "momentum_buffer"


def test_the_buffers_moved_out_of_are_freed(accelerator_paths):
    """Nothing keeps the parameters' former buffers alive: what the optimizer holds between
    steps is the buckets' buffers, as much as the buffers they replaced."""
    import gc
    import weakref

    params = make_params(SHAPES)
    opt = _muon(params)
    opt.init_state()
    former = [weakref.ref(opt.state[p]["momentum_buffer"]) for p in params[:6]]
    run_optimizer(opt, params, make_grads(params, steps=2))
    gc.collect()
    assert _bucketed(opt, params)[1]
    assert all(ref() is None for ref in former)


def test_a_bucket_moves_in_while_the_buckets_before_it_have_freed_theirs(accelerator_paths, monkeypatch):
    """Moving the buffers at preparation holds one bucket's worth more at a time, not a second
    copy of every matrix's momentum."""
    import gc
    import weakref

    params = make_params(SHAPES)
    opt = _muon(params)
    opt.init_state()
    former = [weakref.ref(opt.state[p]["momentum_buffer"]) for p in params[:6]]
    alive_at_each = []
    over = bucket_momentum.BucketMomentum.over.__func__

    def counting(cls, frame, items, *args):
        gc.collect()
        alive_at_each.append(sum(ref() is not None for ref in former))
        return over(cls, frame, items, *args)

    monkeypatch.setattr(bucket_momentum.BucketMomentum, "over", classmethod(counting))
    run_optimizer(opt, params, make_grads(params, steps=1))
    assert alive_at_each == [6, 3]
