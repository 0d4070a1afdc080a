"""param_groups decides what is a matrix by the layer that owns it: real torchvision and
Transformers models, small modules with the same layouts, wrappers around the model, and the
warnings and errors that keep Muon from silently orthogonalising nothing.

The torchvision tests build the real models (``weights=None``) and skip where torchvision does
not import; each has a small module with the same layout, so the behaviour is covered on every
torch the suite runs on.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from integration_support import import_offline, require_torchvision
from torch import nn

from fastmuon import Muon, param_groups
from fastmuon.groups.build import output_layers


def split(groups):
    """``{"muon": names, "other": names, "no_decay": names}`` of param_groups' result."""
    out = {"muon": [], "other": [], "no_decay": []}
    for g in groups:
        key = "muon" if g["use_muon"] else "no_decay" if g.get("weight_decay") == 0.0 else "other"
        out[key] += g["param_names"]
    return out


def quiet(model, **kwargs):
    """param_groups, failing on any warning it gives."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return split(param_groups(model, **kwargs))


# ----- small modules with the layouts of torchvision's models ---------------------------------


class TinyViT(nn.Module):
    """torchvision's ViT layout: a patch conv, a bare class token on the model, a bare
    positional table on the encoder, attention blocks named ``encoder_layer_<i>``, ``heads.head``."""

    def __init__(self, d=16, patches=4):
        super().__init__()
        self.conv_proj = nn.Conv2d(3, d, 4, stride=4)
        self.class_token = nn.Parameter(torch.zeros(1, 1, d))
        self.encoder = nn.Module()
        self.encoder.pos_embedding = nn.Parameter(torch.randn(1, patches + 1, d) * 0.02)
        self.encoder.layers = nn.Sequential()
        for i in range(2):
            block = nn.Module()
            block.ln_1 = nn.LayerNorm(d)
            block.self_attention = nn.MultiheadAttention(d, 2, batch_first=True)
            block.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
            self.encoder.layers.add_module(f"encoder_layer_{i}", block)
        self.encoder.ln = nn.LayerNorm(d)
        self.heads = nn.Sequential()
        self.heads.add_module("head", nn.Linear(d, 10))

    def forward(self, x):
        x = self.conv_proj(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.class_token.expand(x.shape[0], -1, -1), x], 1) + self.encoder.pos_embedding
        for block in self.encoder.layers:
            h = block.ln_1(x)
            x = x + block.self_attention(h, h, h, need_weights=False)[0]
            x = x + block.mlp(x)
        return self.heads(self.encoder.ln(x)[:, 0])


class TinyConvNeXt(nn.Module):
    """ConvNeXt's block: a depthwise conv, two linears and a bare layer scale ``(C, 1, 1)``."""

    def __init__(self, c=16):
        super().__init__()
        self.stem = nn.Conv2d(3, c, 4, stride=4)
        self.block = nn.Module()
        self.block.dw = nn.Conv2d(c, c, 7, padding=3, groups=c)
        self.block.norm = nn.LayerNorm(c)
        self.block.up, self.block.down = nn.Linear(c, 4 * c), nn.Linear(4 * c, c)
        self.block.layer_scale = nn.Parameter(torch.full((c, 1, 1), 1e-6))
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(c, 10))

    def forward(self, x):
        x = self.stem(x)
        h = self.block.dw(x).permute(0, 2, 3, 1)
        h = self.block.down(F.gelu(self.block.up(self.block.norm(h)))).permute(0, 3, 1, 2)
        x = x + self.block.layer_scale * h
        return self.classifier(x.mean((2, 3), keepdim=True))


class WindowAttention(nn.Module):
    """Swin's attention: qkv and proj linears, a bare relative-position bias table."""

    def __init__(self, d=16, heads=3, window=7):
        super().__init__()
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.relative_position_bias_table = nn.Parameter(torch.zeros((2 * window - 1) ** 2, heads))


def test_vit_tokens_and_positional_table_are_not_matrices():
    model = TinyViT()
    got = quiet(model)
    layer = "encoder.layers.encoder_layer_0."
    assert "class_token" in got["no_decay"]  # (1, 1, d): one vector, not decayed
    assert "encoder.pos_embedding" in got["other"]  # (1, 5, d): a table, with the embeddings
    assert {"conv_proj.weight", layer + "self_attention.in_proj_weight", layer + "mlp.0.weight"} <= set(
        got["muon"]
    )
    assert layer + "self_attention.out_proj.weight" in got["muon"]  # a hidden out_proj is no head
    assert "heads.head.weight" in got["other"] and "heads.head.weight" not in got["muon"]


def test_layer_scale_is_a_vector_and_one_muon_step_keeps_it_small():
    model = TinyConvNeXt()
    got = quiet(model)
    assert "block.layer_scale" in got["no_decay"]
    assert {"stem.weight", "block.dw.weight", "block.up.weight", "block.down.weight"} == set(got["muon"])
    assert got["other"] == ["classifier.1.weight"]
    opt = Muon(param_groups(model), lr=0.02, ns_dtype=torch.float32)
    model(torch.randn(4, 3, 16, 16)).square().mean().backward()
    opt.step()
    # AdamW moves each entry by about its lr (3e-4); orthogonalised, a 1e-6 scale became ~1e-2
    assert model.block.layer_scale.abs().max() < 1e-3


def test_relative_position_bias_table_is_not_a_matrix():
    model = nn.Module()
    model.attn = WindowAttention()
    model.head = nn.Linear(16, 10)
    got = quiet(model)
    assert got["muon"] == ["attn.qkv.weight", "attn.proj.weight"]
    assert got["other"] == ["attn.relative_position_bias_table", "head.weight"]


# ----- the real torchvision models --------------------------------------------------------------


@pytest.fixture(scope="module")
def torchvision():
    require_torchvision()
    import torchvision

    return torchvision


def test_torchvision_vit_b_16(torchvision):
    model = torchvision.models.vit_b_16(weights=None)
    got = quiet(model)
    assert "class_token" in got["no_decay"] and "encoder.pos_embedding" in got["other"]
    assert got["other"] == ["encoder.pos_embedding", "heads.head.weight"]
    shapes = dict(model.named_parameters())
    assert all(shapes[n].ndim >= 2 for n in got["muon"]) and len(got["muon"]) == 1 + 12 * 4
    assert "conv_proj.weight" in got["muon"]


def test_torchvision_convnext_tiny(torchvision):
    model = torchvision.models.convnext_tiny(weights=None)
    got = quiet(model)
    scales = [n for n in dict(model.named_parameters()) if n.endswith("layer_scale")]
    assert len(scales) == 18 and set(scales) <= set(got["no_decay"])
    assert got["other"] == ["classifier.2.weight"]
    assert not any(n.endswith("layer_scale") for n in got["muon"])


def test_torchvision_swin_t(torchvision):
    model = torchvision.models.swin_t(weights=None)
    got = quiet(model)
    tables = [n for n in dict(model.named_parameters()) if n.endswith("relative_position_bias_table")]
    assert len(tables) == 12 and got["other"] == [*tables, "head.weight"]
    assert all(n.endswith(("qkv.weight", "proj.weight", ".weight")) for n in got["muon"])
    assert not any("bias_table" in n for n in got["muon"])


# ----- the head through wrappers ----------------------------------------------------------------


def mlp(head="fc"):
    model = nn.Module()
    model.body = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 16))
    setattr(model, head, nn.Linear(16, 3))
    return model


def test_head_found_through_torch_compile():
    compiled = torch.compile(mlp())  # nothing is compiled until it runs
    got = quiet(compiled)
    assert got["other"] == ["_orig_mod.fc.weight"]
    assert got["muon"] == ["_orig_mod.body.0.weight", "_orig_mod.body.2.weight"]
    seq = torch.compile(nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 3)))
    assert quiet(seq)["other"] == ["_orig_mod.2.weight"]
    # names given by the caller match with or without the wrapper's prefix
    renamed = torch.compile(mlp(head="proj"))
    assert split(param_groups(renamed, head="proj"))["other"] == ["_orig_mod.proj.weight"]


def test_head_found_through_data_parallel_wrappers(tmp_path):
    got = quiet(nn.DataParallel(nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 3))))
    assert got["other"] == ["module.2.weight"]
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        ddp = nn.parallel.DistributedDataParallel(mlp(head="lm_head"))
        got = quiet(ddp)
        assert got["other"] == ["module.lm_head.weight"]
        assert got["muon"] == ["module.body.0.weight", "module.body.2.weight"]
        compiled_ddp = nn.parallel.DistributedDataParallel(torch.compile(mlp()))
        assert quiet(compiled_ddp)["other"] == ["module._orig_mod.fc.weight"]
    finally:
        dist.destroy_process_group()


def test_head_found_through_activation_checkpointing_wrappers():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model = mlp(head="lm_head")
    model.body = checkpoint_wrapper(model.body)
    model.lm_head = checkpoint_wrapper(model.lm_head)  # the head itself wrapped, as FSDP1 does
    got = quiet(model)
    assert got["other"] == ["lm_head._checkpoint_wrapped_module.weight"]
    assert len(got["muon"]) == 2


class HoldsNet(nn.Module):
    """A module holding its network as ``self.net`` (as LightningModules do): no parameter of
    its own, a loss module without parameters beside it."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
        self.loss = nn.CrossEntropyLoss()


def test_head_of_a_network_held_as_self_net():
    got = quiet(HoldsNet())
    assert got["other"] == ["net.4.weight"] and got["muon"] == ["net.0.weight", "net.2.weight"]
    assert quiet(torch.compile(HoldsNet()))["other"] == ["_orig_mod.net.4.weight"]


def test_lightning_module_holding_a_sequential(tmp_path):
    with pytest.MonkeyPatch.context() as mp:
        pl = import_offline(mp, "lightning.pytorch", str(tmp_path))

        class Classifier(pl.LightningModule):
            def __init__(self):
                super().__init__()
                self.net = nn.Sequential(
                    nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 3)
                )

            def configure_optimizers(self):
                return Muon(param_groups(self), lr=0.02)

        module = Classifier()
        got = quiet(module)
        assert got["other"] == ["net.4.weight"] and got["muon"] == ["net.0.weight", "net.2.weight"]
        opt = module.configure_optimizers()
        assert opt.param_groups[0]["param_names"] == ["net.0.weight", "net.2.weight"]


def test_head_registered_first_as_out_proj():
    model = nn.Module()
    model.out_proj = nn.Linear(16, 10)
    model.attn = nn.MultiheadAttention(16, 2)  # its own out_proj is a hidden layer
    model.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(2))
    assert output_layers(model) == [model.out_proj]
    got = quiet(model)
    assert got["other"] == ["out_proj.weight"]
    assert got["muon"] == [
        "attn.in_proj_weight",
        "attn.out_proj.weight",
        "blocks.0.weight",
        "blocks.1.weight",
    ]


def test_no_head_found_warns_and_says_how_to_name_it():
    model = nn.Module()
    model.inp, model.hidden, model.last = nn.Linear(4, 8), nn.Linear(8, 8), nn.Linear(8, 2)
    with pytest.warns(UserWarning, match=r"found no output layer.*head='<module name>'.*head=None"):
        groups = param_groups(model)
    assert split(groups)["muon"] == ["inp.weight", "hidden.weight", "last.weight"]
    assert quiet(model, head="last")["other"] == ["last.weight"]
    assert quiet(model, head=None)["muon"] == ["inp.weight", "hidden.weight", "last.weight"]


# ----- Mixture-of-Experts routers ---------------------------------------------------------------


@pytest.fixture(scope="module")
def transformers(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        yield import_offline(mp, "transformers", str(tmp_path_factory.mktemp("hf_home")))


SMALL = dict(
    hidden_size=16,
    intermediate_size=8,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    vocab_size=50,
)


def test_mixtral_router_goes_to_the_other_part_unless_asked(transformers):
    config = transformers.MixtralConfig(**SMALL, num_local_experts=4)
    with torch.device("meta"):
        model = transformers.MixtralForCausalLM(config)
    routers = [f"model.layers.{i}.mlp.gate.weight" for i in range(2)]
    got = quiet(model)
    assert set(routers) <= set(got["other"]) and not set(routers) & set(got["muon"])
    assert got["other"] == ["model.embed_tokens.weight", *routers, "lm_head.weight"]
    assert "model.layers.0.mlp.experts.gate_up_proj" in got["muon"]
    got = quiet(model, routers="muon")
    assert set(routers) <= set(got["muon"])
    with pytest.raises(ValueError, match="routers= is 'other'"):
        param_groups(model, routers="adamw")


def test_qwen_moe_shared_expert_gate_is_a_router_too(transformers):
    config = transformers.Qwen2MoeConfig(
        **SMALL, num_experts=3, moe_intermediate_size=8, shared_expert_intermediate_size=8
    )
    with torch.device("meta"):
        model = transformers.Qwen2MoeForCausalLM(config)
    got = quiet(model)
    assert "model.layers.0.mlp.gate.weight" in got["other"]
    assert "model.layers.0.mlp.shared_expert_gate.weight" in got["other"]
    assert "model.layers.0.mlp.shared_expert.gate_proj.weight" in got["muon"]  # an MLP's gate_proj


def test_routers_of_a_custom_moe_block():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.router = nn.Linear(16, 4, bias=False)
            self.experts = nn.ModuleList(nn.Linear(16, 16) for _ in range(4))

    model = nn.Module()
    model.blocks = nn.ModuleList(Block() for _ in range(2))
    model.lm_head = nn.Linear(16, 50)
    got = quiet(model)
    assert got["other"] == ["blocks.0.router.weight", "blocks.1.router.weight", "lm_head.weight"]
    assert len(got["muon"]) == 8


# ----- custom layers, include=, and no silent fall-back ----------------------------------------


class OwnLinear(nn.Module):
    """A layer computing with its own bare parameter: not recognised as a matrix layer."""

    def __init__(self, n_in, n_out):
        super().__init__()
        self.w = nn.Parameter(torch.randn(n_out, n_in) / n_in**0.5)
        self.b = nn.Parameter(torch.zeros(n_out))

    def forward(self, x):
        return F.linear(x, self.w, self.b)


def custom_net():
    model = nn.Module()
    model.blocks = nn.ModuleList(OwnLinear(16, 16) for _ in range(3))
    model.proj = nn.Linear(16, 16)
    model.head = nn.Linear(16, 4)
    return model


def test_custom_layers_left_out_warn_with_counts_names_and_the_fix():
    model = custom_net()
    with pytest.warns(UserWarning, match=r"leaves 768 of the 1,024 parameters .* \(75%.*include=") as record:
        groups = param_groups(model)
    (message,) = [str(w.message) for w in record]
    assert (
        "'blocks.0.w' (16, 16)" in message and "Muon orthogonalises only 1 tensor (256 parameters)" in message
    )
    got = split(groups)
    assert got["muon"] == ["proj.weight"] and got["other"] == [
        "blocks.0.w",
        "blocks.1.w",
        "blocks.2.w",
        "head.weight",
    ]
    assert {"blocks.0.b", "proj.bias"} <= set(got["no_decay"])  # vectors as before
    # include= orthogonalises them; exclude= says they are meant to stay out; both are quiet
    got = quiet(model, include="blocks.*.w")
    assert got["muon"] == ["blocks.0.w", "blocks.1.w", "blocks.2.w", "proj.weight"]
    assert quiet(model, exclude="blocks")["muon"] == ["proj.weight"]


def test_include_is_checked():
    model = custom_net()
    with pytest.raises(
        ValueError, match=r"include= names 'blocks.0.b' of shape \(16,\): Muon orthogonalises"
    ):
        param_groups(model, include="blocks.0")
    with pytest.raises(ValueError, match=r"'head.weight' is named by both include= and head="):
        param_groups(model, include="head.weight", head="head")
    with pytest.raises(ValueError, match="include='blok' matches no module or parameter"):
        param_groups(model, include="blok")
    # the automatic head and embeddings give way to include=
    assert quiet(model, include=["head.weight", "blocks.*.w"])["other"] == []


def test_nothing_for_muon_is_an_error_naming_where_everything_went():
    model = nn.Module()
    model.emb = nn.Embedding(10, 8)
    model.w = nn.Parameter(torch.randn(8, 8))
    model.norm = nn.LayerNorm(8)
    with pytest.raises(ValueError, match=r"put no parameter into Muon") as info:
        param_groups(model)
    text = str(info.value)
    assert "an embedding table: 1 tensor (80 parameters), e.g. 'emb.weight' (10, 8)" in text
    assert "not a recognised layer's weight" in text and "'w' (8, 8)" in text
    assert "include=" in text and "torch.optim.AdamW" in text
    assert quiet(model, include="w", head=None)["muon"] == ["w"]
    with pytest.raises(ValueError, match="put no parameter into Muon"):
        param_groups(nn.Sequential(nn.Linear(4, 2)))  # its only layer is its head


def test_parametrised_weights_are_still_matrices():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.Linear(8, 2))
    nn.utils.parametrizations.weight_norm(model[0])
    nn.utils.parametrizations.orthogonal(model[2])
    got = quiet(model)
    assert got["muon"] == ["0.parametrizations.weight.original1", "2.parametrizations.weight.original"]
    assert "0.parametrizations.weight.original0" in got["no_decay"]  # the norm g, (8, 1)
