"""Bad input is refused with an error that names the parameter or group and the fix: invalid
hyperparameters, complex parameters, sparse gradients, vectors in a Muon group; an empty one is fine."""

import pytest
import torch
from helpers import clone_params, make_grads, make_params, run_optimizer

from fastmuon import Muon, MuSGD

SHAPES = [(16, 8, 3, 3), (24, 40), (40, 24), (12,)]
KW = dict(lr=0.02, momentum=0.9, nesterov=True, weight_decay=1e-3, ns_dtype=torch.float32)


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
    opt = MuSGD([{"params": list(emb.named_parameters()), "use_muon": True}])
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
