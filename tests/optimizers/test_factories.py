"""fastmuon.integrations.transformers' factories on their own: the call the Trainer makes, without Transformers."""

import pytest
import torch

import fastmuon
from fastmuon.integrations.transformers import MuonFactory, MuSGDFactory, OptimizerFactory, factory_for


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Embedding(10, 8), torch.nn.Linear(8, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 10)
    )


def test_factories_are_not_optimizer_classes_and_build_from_the_model():
    """The Trainer tells a factory from an optimizer class by subclassing; it calls Factory()(model)."""
    assert not issubclass(MuonFactory, torch.optim.Optimizer)
    opt = MuonFactory()(model(), lr=0.02, adamw_lr=1e-3)
    assert isinstance(opt, fastmuon.Muon)
    assert [g["param_names"] for g in opt.param_groups] == [
        ["1.weight"],
        ["0.weight", "3.weight"],
        ["1.bias", "2.weight", "2.bias", "3.bias"],
    ]
    assert opt.param_groups[1]["lr"] == 1e-3 and opt.param_groups[0]["lr"] == 0.02
    opt = MuonFactory()(model(), head=None, decay_vectors=True)
    assert [g["param_names"] for g in opt.param_groups] == [
        ["1.weight", "3.weight"],
        ["0.weight", "1.bias", "2.weight", "2.bias", "3.bias"],
    ]
    assert isinstance(MuSGDFactory()(model(), lr=0.02), fastmuon.MuSGD)


def test_factory_for_a_subclass_and_its_refusals():
    class Variant(fastmuon.Muon):
        pass

    factory = factory_for(Variant)
    assert factory.__name__ == "VariantFactory" and issubclass(factory, OptimizerFactory)
    assert type(factory()(model(), lr=0.02)) is Variant
    with pytest.raises(TypeError, match="factory_for takes an optimizer class"):
        factory_for(fastmuon.param_groups)
    with pytest.raises(TypeError, match="drop params="):
        MuonFactory()(model(), params=[])
    with pytest.raises(TypeError, match="builds its groups from the model"):
        MuonFactory()(list(model().parameters()))
    with pytest.raises(TypeError, match="names no optimizer class"):
        OptimizerFactory()(model())
