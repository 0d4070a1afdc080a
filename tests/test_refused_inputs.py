import pytest
import torch
from helpers import clone_params, make_grads, make_params, run_optimizer

from fastmuon import Muon, MuSGD

SHAPES = [(16, 8, 3, 3), (24, 40), (40, 24), (12,)]
KW = dict(lr=0.02, momentum=0.9, nesterov=True, weight_decay=1e-3, ns_dtype=torch.float32)


@pytest.mark.parametrize("cls", [MuSGD, Muon])
def test_state_dict_resume_is_identical(cls):
    params = make_params(SHAPES)
    grads = make_grads(params, steps=4)
    straight = clone_params(params)
    run_optimizer(cls(straight, **KW), straight, grads)

    first = clone_params(params)
    opt = cls(first, **KW)
    run_optimizer(opt, first, grads[:2])
    saved = opt.state_dict()
    resumed = clone_params(first)
    opt2 = cls(resumed, **KW)
    opt2.load_state_dict(saved)
    run_optimizer(opt2, resumed, grads[2:])
    for a, b in zip(straight, resumed):
        assert torch.equal(a, b)
    assert "plan" not in str(saved.keys())


@pytest.mark.parametrize("cls", [MuSGD, Muon])
def test_fp16_checkpoint_is_cast_back(cls):
    params = make_params(SHAPES)
    opt = cls(params, **KW)
    run_optimizer(opt, params, make_grads(params, steps=1))
    sd = opt.state_dict()
    for st in sd["state"].values():
        for k, v in st.items():
            if torch.is_tensor(v) and v.is_floating_point() and k != "step":
                st[k] = v.half()
    opt2 = cls(params, **KW)
    opt2.load_state_dict(sd)
    for p in params:
        for k, v in opt2.state[p].items():
            if k != "step":
                assert v.dtype == p.dtype
    run_optimizer(opt2, params, make_grads(params, steps=1, seed=3))
    assert all(torch.isfinite(p).all() for p in params)


def test_plan_cached_and_invalidated():
    params = make_params([(8, 16), (16, 8), (4, 4)])
    opt = MuSGD(params, **KW, use_muon=True)
    run_optimizer(opt, params, make_grads(params, steps=1))
    plan = opt.plan()
    assert plan is not None and plan.num_matrices == 3
    run_optimizer(opt, params, make_grads(params, steps=1, seed=2))
    assert opt.plan() is plan  # same set of matrices: reused
    # a parameter without a gradient this step: a different plan
    run_optimizer(opt, params, [[torch.randn(8, 16), None, torch.randn(4, 4)]])
    assert opt.plan() is not plan and opt.plan().num_matrices == 2
    # adding a param group clears the cache
    extra = make_params([(5, 7)])
    opt.add_param_group({"params": extra})
    run_optimizer(opt, params + extra, make_grads(params + extra, steps=1))
    assert opt.plan().num_matrices == 4


def test_the_cpu_workspace_persists_and_a_bucket_opens_with_zero_padding():
    """The CPU step's one workspace is kept from step to step; a bucket opened in it has zeros
    around each matrix (the padding NS needs) and the matrix in its corner."""
    params = make_params([(8, 30), (16, 40)])
    opt = MuSGD(params, **KW, use_muon=True, policy="min_launches")
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


def test_dtypes_bucketed_apart():
    params = [torch.nn.Parameter(torch.randn(8, 16)), torch.nn.Parameter(torch.randn(8, 16).double())]
    opt = MuSGD(params, **KW, use_muon=True, policy="min_launches")
    run_optimizer(opt, params, make_grads(params, steps=1))
    plan = opt.plan()
    assert len(plan.buckets) == 2
    assert params[1].dtype == torch.float64


# ----- bad input ----------------------------------------------------------------------------
@pytest.mark.parametrize("cls", [MuSGD, Muon])
@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"lr": -1.0}, "invalid learning rate"),
        ({"momentum": -0.1}, "invalid momentum"),
        ({"momentum": 1.0}, "must be in \\[0, 1\\)"),
        ({"weight_decay": -1e-4}, "invalid weight_decay"),
        ({"ns_steps": 0}, "ns_steps must be an integer >= 1"),
        ({"ns_coefficients": "fancy"}, "unknown Newton-Schulz coefficient preset 'fancy'"),
        ({"eps": -1.0}, "invalid eps"),
        ({"policy": "fastest"}, "invalid policy 'fastest'"),
        ({"ns_dtype": torch.int32}, "ns_dtype must be a floating"),
        ({"ns_method": "svd"}, "unknown ns_method 'svd'"),
    ],
)
def test_invalid_hyperparameters(cls, kwargs, match):
    with pytest.raises(ValueError, match=match):
        cls([torch.nn.Parameter(torch.randn(4, 4))], **kwargs)


def test_invalid_group_values_name_the_group():
    p, q = torch.nn.Parameter(torch.randn(4, 4)), torch.nn.Parameter(torch.randn(3))
    with pytest.raises(ValueError, match="param group 1"):
        MuSGD([{"params": [p]}, {"params": [q], "lr": -0.1}])
    with pytest.raises(ValueError, match="unknown adjust_lr_fn 'sqrt'"):
        MuSGD([p], adjust_lr="sqrt")
    with pytest.raises(ValueError, match="unknown adjust_lr_fn 'sqrt'"):
        Muon([p], adjust_lr_fn="sqrt")
    with pytest.raises(ValueError, match="invalid muon"):
        MuSGD([p], muon=-1)


def test_complex_parameter_rejected_with_name():
    p = torch.nn.Parameter(torch.randn(4, 4, dtype=torch.complex64))
    with pytest.raises(ValueError, match="parameter 'w' .* is complex.*view_as_real"):
        MuSGD([("w", p)])
    with pytest.raises(ValueError, match="parameter 0 of param group 0 .* is complex"):
        Muon([p])


def test_sparse_gradient_rejected_with_name():
    emb = torch.nn.Embedding(10, 4, sparse=True)
    opt = MuSGD(list(emb.named_parameters()))
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(RuntimeError, match="parameter 'weight' .* sparse gradient"):
        opt.step()


def test_vector_in_muon_true_group_rejected_by_muon():
    with pytest.raises(ValueError, match="parameter 'bias' .* use_muon=True .* use_muon=False"):
        Muon([{"params": [("bias", torch.nn.Parameter(torch.randn(3)))], "use_muon": True}])


def test_use_muon_must_be_bool():
    with pytest.raises(ValueError, match="use_muon"):
        MuSGD([{"params": [torch.nn.Parameter(torch.randn(3, 3))], "use_muon": "yes"}])


def test_zero_size_parameter_is_fine():
    params = make_params([(0, 4), (4, 6), (0,)])
    ref = clone_params(params)
    opt = MuSGD(params, **KW, use_muon=True)
    run_optimizer(opt, params, make_grads(params, steps=2))
    assert params[0].shape == (0, 4)
    assert not torch.equal(params[1], ref[1]) and torch.isfinite(params[1]).all()
