"""fastmuon.param_groups: which parameters Muon orthogonalises, decay, names, and the AdamW part."""

import pytest
import torch
from torch import nn

from fastmuon import Muon, MuSGD, param_groups
from fastmuon.groups.build import output_layers
from fastmuon.ns.planner import counted


def names(groups):
    return [(g["use_muon"], g.get("weight_decay"), g["param_names"]) for g in groups]


def test_split_into_muon_other_and_no_decay():
    model = nn.Sequential(
        nn.Embedding(50, 16),
        nn.Linear(16, 32),
        nn.LayerNorm(32),
        nn.Conv1d(32, 32, 3),
        nn.Linear(32, 50),
    )
    model[1].bias.requires_grad_(False)
    groups = param_groups(model, lr=0.5, weight_decay=0.3)
    assert names(groups) == [
        (True, 0.3, ["1.weight", "3.weight"]),
        (False, 0.3, ["0.weight", "4.weight"]),  # embedding; the Sequential's last Linear is its head
        (False, 0.0, ["2.weight", "2.bias", "3.bias", "4.bias"]),  # not decayed
    ]
    assert all(g["lr"] == 0.5 for g in groups)
    opt = Muon(groups)
    assert [len(g["params"]) for g in opt.param_groups] == [2, 2, 4]


def test_decay_vectors_puts_them_with_the_other_parameters():
    model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 3))
    groups = param_groups(model, decay_vectors=True)
    assert names(groups) == [
        (True, None, ["0.weight"]),
        (False, None, ["0.bias", "1.weight", "1.bias", "2.weight", "2.bias"]),
    ]


class HeadFirst(nn.Module):
    """An output layer registered before the blocks: found by its name, not its position."""

    def __init__(self, head_name="classifier"):
        super().__init__()
        setattr(self, head_name, nn.Linear(16, 10))
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16)) for _ in range(2))
        self.fc_out = nn.Linear(16, 16)


@pytest.mark.parametrize("head_name", ["classifier", "lm_head", "head", "fc", "score", "output"])
def test_head_found_by_name_wherever_it_is_registered(head_name):
    model = HeadFirst(head_name)
    muon, other, _ = param_groups(model)
    assert other["param_names"] == [f"{head_name}.weight"]
    assert muon["param_names"] == ["blocks.0.0.weight", "blocks.1.0.weight", "fc_out.weight"]


def test_layers_inside_repeated_blocks_are_not_heads():
    """``fc``/``output`` inside a stack of blocks (BERT's ``layer.N.output``) are hidden layers."""

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.output = nn.Linear(8, 8), nn.Linear(8, 8)

    model = nn.Module()
    model.table = nn.Embedding(8, 8)  # shaped like every block's Linear
    model.layers = nn.ModuleList(Block() for _ in range(2))
    model.proj = nn.Linear(8, 3)
    assert output_layers(model) == []
    with pytest.warns(UserWarning, match=r"found no output layer .* head='<module name>'"):
        muon, other, _ = param_groups(model)
    assert len(muon["params"]) == 5 and other["param_names"] == ["table.weight"]


def test_tied_and_untied_lm_heads():
    class LM(nn.Module):
        def __init__(self, tied):
            super().__init__()
            self.tok = nn.Embedding(100, 16)
            self.mix = nn.Linear(16, 16, bias=False)
            self.to_logits = nn.Linear(16, 100, bias=False)  # shaped like the table
            if tied:
                self.to_logits.weight = self.tok.weight

    muon, other = param_groups(LM(tied=False))
    assert (muon["param_names"], other["param_names"]) == (["mix.weight"], ["tok.weight", "to_logits.weight"])
    muon, other = param_groups(LM(tied=True))
    assert (muon["param_names"], other["param_names"]) == (["mix.weight"], ["tok.weight"])


def test_head_and_exclude_given_by_the_caller():
    model = HeadFirst("proj")  # no recognisable name: found by nothing
    assert output_layers(model) == []
    by = {
        "module": model.proj,
        "name": "proj",
        "parameter": model.proj.weight,
        "parameter name": "proj.weight",
        "glob": "pro*",
        "predicate": lambda name, p: name.startswith("proj."),
        "list": [model.proj, "fc_out"],
    }
    for how, selector in by.items():
        muon, other, _ = param_groups(model, head=selector)
        assert "proj.weight" in other["param_names"] and "proj.weight" not in muon["param_names"], how
    muon, other, _ = param_groups(model, head="proj", exclude=["blocks.*.0"])
    assert muon["param_names"] == ["fc_out.weight"]
    assert other["param_names"] == ["proj.weight", "blocks.0.0.weight", "blocks.1.0.weight"]
    # head=None: nothing but embeddings leaves Muon
    model = HeadFirst("classifier")
    muon, _ = param_groups(model, head=None)
    assert "classifier.weight" in muon["param_names"]


def test_bad_selectors_are_refused_clearly():
    model = HeadFirst()
    with pytest.raises(ValueError, match=r"exclude='clasifier' matches no module or parameter"):
        param_groups(model, exclude="clasifier")
    with pytest.raises(ValueError, match="head= got a Linear that is not a submodule"):
        param_groups(model, head=nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"exclude= got a tensor of shape \(3,\) that is not a parameter"):
        param_groups(model, exclude=nn.Parameter(torch.zeros(3)))
    with pytest.raises(TypeError, match="exclude= takes modules, parameters, names"):
        param_groups(model, exclude=[3])
    with pytest.raises(ValueError, match="param_groups sets use_muon itself"):
        param_groups(model, use_muon=True)


def test_shared_and_frozen_parameters():
    lin = nn.Linear(8, 8)
    model = nn.Sequential(lin, nn.ReLU(), lin, nn.Linear(8, 8), nn.Linear(8, 2))
    model[3].weight.requires_grad_(False)
    muon, other, no_decay = param_groups(model)
    assert muon["param_names"] == ["0.weight"]
    assert other["param_names"] == ["4.weight"]
    assert no_decay["param_names"] == ["0.bias", "3.bias", "4.bias"]


@pytest.mark.parametrize("opt_cls", [Muon, MuSGD])
def test_add_param_group_after_param_groups(opt_cls):
    """Named groups from param_groups and plain groups live in one optimizer, both ways round."""
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    extra, more = nn.Linear(3, 3), nn.Linear(2, 2)
    opt = opt_cls(param_groups(model))
    opt.add_param_group({"params": extra.parameters(), "use_muon": False})
    assert opt.param_groups[-1]["param_names"] == ["param_groups[3][0]", "param_groups[3][1]"]
    opt.add_param_group({"params": list(more.named_parameters())})
    assert opt.param_groups[-1]["param_names"] == ["weight", "bias"]
    # the constructor too: a plain group first, named ones after it
    opt = opt_cls([{"params": extra.parameters(), "use_muon": False}, *param_groups(model)])
    assert opt.param_groups[0]["param_names"] == ["param_groups[0][0]", "param_groups[0][1]"]
    assert opt.param_groups[1]["param_names"] == ["0.weight"]
    # a refused add leaves the existing groups' names as they were
    opt = opt_cls([{"params": [extra.weight], "use_muon": True}, {"params": [extra.bias], "use_muon": False}])
    with pytest.raises(ValueError, match="more than one parameter group"):
        opt.add_param_group({"params": list(extra.named_parameters())})
    assert ["param_names" in g for g in opt.param_groups] == [False, False]
    extra(torch.randn(5, 3)).square().mean().backward()
    before = extra.weight.detach().clone()
    opt.step()  # still usable
    assert not torch.equal(extra.weight, before)


def test_names_survive_a_state_dict_round_trip():
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    extra = nn.Linear(3, 3)
    opt = Muon(param_groups(model))
    opt.add_param_group({"params": [extra.weight], "use_muon": True})
    model(torch.randn(5, 4)).square().mean().backward()
    extra(torch.randn(2, 3)).square().mean().backward()
    opt.step()
    fresh = Muon(param_groups(model))
    fresh.add_param_group({"params": [extra.weight], "use_muon": True})
    fresh.load_state_dict(opt.state_dict())
    assert [g["param_names"] for g in fresh.param_groups] == [g["param_names"] for g in opt.param_groups]


def test_muon_gives_its_adamw_groups_their_own_learning_rate():
    model = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 10))
    opt = Muon(param_groups(model), lr=0.02, weight_decay=0.1)
    muon, other, no_decay = opt.param_groups
    assert muon["lr"] == 0.02 and other["lr"] == no_decay["lr"] == 3e-4
    assert muon["weight_decay"] == other["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0
    opt = Muon(param_groups(model), lr=0.02, adamw_lr=1e-3)
    assert [g["lr"] for g in opt.param_groups] == [0.02, 1e-3, 1e-3]
    # a group's own lr wins; a group holding matrices and vectors shares its lr
    opt = Muon(
        [{"params": model[1].parameters()}, {"params": model[3].parameters(), "use_muon": False, "lr": 0.1}]
    )
    assert [g["lr"] for g in opt.param_groups] == [1e-3, 0.1]
    # schedulers scale the AdamW groups from their own learning rate
    opt = Muon(param_groups(model), lr=0.02)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5)
    assert [g["lr"] for g in opt.param_groups] == [0.01, 1.5e-4, 1.5e-4]
    del sched
    with pytest.raises(ValueError, match="invalid adamw_lr -1"):
        Muon(param_groups(model), adamw_lr=-1)


def test_readme_recipe_trains_a_small_language_model():
    """``Muon(param_groups(model), lr=0.02, weight_decay=0.1)``: embeddings, head, norms and
    biases take AdamW at its own learning rate, the hidden matrices Muon."""
    torch.manual_seed(0)
    vocab, dim = 32, 32

    class TinyLM(nn.Module):
        def __init__(self):
            super().__init__()
            self.lm_head = nn.Linear(dim, vocab)
            self.tok = nn.Embedding(vocab, dim)
            self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
            self.norm = nn.LayerNorm(dim)

        def forward(self, idx):
            x = self.tok(idx)
            return self.lm_head(self.norm(x + self.mlp(x)))

    model = TinyLM()
    opt = Muon(param_groups(model), lr=0.02, weight_decay=0.1, ns_dtype=torch.float32)
    assert opt.param_groups[0]["param_names"] == ["mlp.0.weight", "mlp.2.weight"]
    idx = torch.randint(0, vocab, (64,))
    target = (idx * 7 + 3) % vocab  # a fixed token -> token map to learn
    table = model.tok.weight.detach().clone()
    losses = []
    steps = 25
    for _ in range(steps):
        loss = nn.functional.cross_entropy(model(idx), target)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses == sorted(losses, reverse=True) and losses[-1] < 0.6 * losses[0]
    # AdamW moves an element by about lr per step: the table moved at 3e-4, not Muon's 0.02
    assert (model.tok.weight - table).abs().max() <= 2 * steps * 3e-4


def test_repr_shows_each_groups_settings_and_counts_not_names():
    model = nn.Sequential(*(nn.Linear(8, 8) for _ in range(30)))
    opt = MuSGD(param_groups(model, lr=0.02), momentum=0.9)
    text = repr(opt)
    assert text.startswith("MuSGD (\n") and text.endswith("\n)")
    assert text.count("Parameter Group ") == len(opt.param_groups)
    for group in opt.param_groups:
        assert f"    params: {counted(len(group['params']), 'tensor')}\n" in text
        assert f"    param_names: {counted(len(group['param_names']), 'name')}\n" in text
    assert "    params: 1 tensor\n" in text  # the head's group
    assert "    lr: 0.02" in text and "    momentum: 0.9" in text
    assert "0.weight" not in text and "29.bias" not in text  # no parameter is listed by name
    small = MuSGD(param_groups(nn.Sequential(*(nn.Linear(8, 8) for _ in range(3))), lr=0.02), momentum=0.9)
    assert len(text.splitlines()) == len(repr(small).splitlines())  # the model's size does not grow it


def test_top_level_api_is_what_users_need():
    import fastmuon

    assert set(fastmuon.__all__) == {
        "MuSGD", "Muon", "NorMuon", "AdaMuon", "param_groups", "newton_schulz", "orthogonalize",
        "PRESETS", "CostModel", "Plan", "__version__",
    }  # fmt: skip
    assert all(hasattr(fastmuon, name) for name in fastmuon.__all__)
    assert isinstance(MuSGD(nn.Linear(4, 4).parameters(), use_muon=True).plan(), fastmuon.Plan)
