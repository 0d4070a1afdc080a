"""param_groups on LLM layers: which matrices a fused tensor holds, detected and overridden.

Each detected map is checked against the real layer: the matrices it cuts out of a weight,
multiplied the way the map says (``x @ W.T``, or ``x @ W`` where stored transposed), must give
what the layer's own forward computes. Tiny configs of real 🤗 Transformers models, built on CPU.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import rel_err
from integration_support import import_offline
from reference_impl import muon_reference_pieces
from torch import nn

from fastmuon import Muon, param_groups
from fastmuon.ns.matrices import parse

H, I, E = 16, 8, 3  # hidden size, expert width, experts
TOKENS = 5
ALL = slice(None)
SMALL = dict(
    hidden_size=H,
    intermediate_size=I,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
    vocab_size=50,
)


@pytest.fixture(scope="module")
def transformers(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        yield import_offline(mp, "transformers", str(tmp_path_factory.mktemp("hf_home")))


def muon_maps(groups):
    """``{name: spec}`` of the Muon group ("flatten" where it has no ``matrices`` entry)."""
    (muon,) = [g for g in groups if g["use_muon"]]
    specs = muon.get("matrices", ["flatten"] * len(muon["params"]))
    assert len(specs) == len(muon["params"])
    return dict(zip(muon["param_names"], specs))


def matrices_of(groups, name):
    """The matrices the Muon group's map for parameter ``name`` cuts out of it, each turned
    (out, in) as the map says (transposed back where it says they are stored (in, out))."""
    (muon,) = [g for g in groups if g["use_muon"]]
    k = muon["param_names"].index(name)
    m = parse(muon.get("matrices", ["flatten"] * len(muon["params"]))[k])
    return [w.T if m.transposed else w for w in m.views(muon["params"][k].detach())]


def linear(x, w):
    """``x`` times the (out, in) matrix ``w``, as ``nn.Linear`` does."""
    return x @ w.T


def seeded(build):
    torch.manual_seed(0)
    model = build()
    with torch.no_grad():  # some layers start at zero or uninitialised: make every entry count
        for p in model.parameters():
            p.normal_(0, 0.5)
    return model


# ----- Mixture-of-Experts stacks ---------------------------------------------------------------

MOE = {
    "mixtral": ("MixtralForCausalLM", "MixtralConfig", dict(num_local_experts=E)),
    "qwen2_moe": (
        "Qwen2MoeForCausalLM",
        "Qwen2MoeConfig",
        dict(num_experts=E, moe_intermediate_size=I, shared_expert_intermediate_size=I),
    ),
    "qwen3_moe": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig", dict(num_experts=E, moe_intermediate_size=I)),
    "olmoe": ("OlmoeForCausalLM", "OlmoeConfig", dict(num_experts=E)),
    "deepseek_v3": (
        "DeepseekV3ForCausalLM",
        "DeepseekV3Config",
        dict(
            n_routed_experts=4,
            moe_intermediate_size=I,
            first_k_dense_replace=0,
            n_group=1,
            topk_group=1,
            num_experts_per_tok=2,
            q_lora_rank=8,
            kv_lora_rank=8,
            qk_rope_head_dim=4,
            qk_nope_head_dim=4,
            v_head_dim=4,
        ),
    ),
}


def build_moe(transformers, which):
    model_class, config_class, extra = MOE[which]
    config = getattr(transformers, config_class)(**SMALL, **extra)
    return seeded(lambda: getattr(transformers, model_class)(config))


def all_to_expert(e, tokens=TOKENS, top_k=1):
    """Routing that sends every token to expert ``e`` with weight 1 (the rest weight 0)."""
    index = torch.full((tokens, top_k), e)
    weights = torch.zeros(tokens, top_k)
    weights[:, 0] = 1.0
    return index, weights


@pytest.mark.parametrize("implementation", ["eager", "grouped_mm"])
@pytest.mark.parametrize("which", list(MOE))
def test_fused_experts_are_one_matrix_per_expert_with_gate_and_up_apart(transformers, which, implementation):
    model = build_moe(transformers, which)
    groups = param_groups(model)
    maps = muon_maps(groups)
    prefix = "model.layers.0.mlp.experts."
    assert maps[prefix + "gate_up_proj"] == {"batch_dims": 1, "split": [I, I]}
    assert maps[prefix + "down_proj"] == "experts"
    assert all(spec == "flatten" for name, spec in maps.items() if not name.startswith(prefix))
    experts = model.model.layers[0].mlp.experts
    experts.config._experts_implementation = implementation
    gate_up = matrices_of(groups, prefix + "gate_up_proj")
    down = matrices_of(groups, prefix + "down_proj")
    assert len(gate_up) == 2 * experts.num_experts and len(down) == experts.num_experts
    x = torch.randn(TOKENS, H)
    for e in range(experts.num_experts):
        gate, up = gate_up[2 * e], gate_up[2 * e + 1]
        assert gate.shape == up.shape == (I, H) and down[e].shape == (H, I)
        expected = linear(experts.act_fn(linear(x, gate)) * linear(x, up), down[e])
        with torch.no_grad():
            got = experts(x, *all_to_expert(e))
        assert rel_err(got, expected) < 1e-5, (which, e)


def test_gpt_oss_experts_are_transposed_with_gate_and_up_interleaved(transformers):
    """GPT-OSS stores experts (in, out) and interleaves gate and up columns (gate 0::2, up 1::2):
    each expert's gate and up are their own matrices, multiplied as ``x @ W``."""
    config = transformers.GptOssConfig(**SMALL, num_local_experts=E, head_dim=8)
    model = seeded(lambda: transformers.GptOssForCausalLM(config))
    groups = param_groups(model)
    maps = muon_maps(groups)
    prefix = "model.layers.0.mlp.experts."
    assert maps[prefix + "gate_up_proj"] == {
        "batch_dims": 1,
        "split": [I, I],
        "interleaved": True,
        "transposed": True,
    }
    assert maps[prefix + "down_proj"] == {"batch_dims": 1, "transposed": True}
    experts = model.model.layers[0].mlp.experts
    assert experts.is_concatenated is False  # the flag the rule reads
    gate_up = matrices_of(groups, prefix + "gate_up_proj")
    down = matrices_of(groups, prefix + "down_proj")
    assert len(gate_up) == 2 * E
    x = torch.randn(TOKENS, H)
    limit, alpha = experts.limit, experts.alpha
    for implementation in ("eager", "batched_mm"):
        experts.config._experts_implementation = implementation
        for e in range(E):
            gate, up = gate_up[2 * e], gate_up[2 * e + 1]
            assert gate.shape == up.shape == (I, H) and down[e].shape == (H, I)
            bias = experts.gate_up_proj_bias[e]
            # GPT-OSS's gated unit, written from its forward, on the two matrices the map cuts out
            g = (linear(x, gate) + bias[0::2]).clamp(max=limit)
            u = (linear(x, up) + bias[1::2]).clamp(-limit, limit)
            expected = linear((u + 1) * g * torch.sigmoid(alpha * g), down[e]) + experts.down_proj_bias[e]
            with torch.no_grad():
                got = experts(x, *all_to_expert(e))
            assert rel_err(got, expected) < 1e-5, (implementation, e)


def test_llama4_experts_stored_in_by_out_with_gate_and_up_halves(transformers):
    config = transformers.Llama4TextConfig(**SMALL, intermediate_size_mlp=I, num_local_experts=E, head_dim=8)
    model = seeded(lambda: transformers.Llama4ForCausalLM(config))
    groups = param_groups(model)
    maps = muon_maps(groups)
    prefix = "model.layers.0.feed_forward.experts."
    pass
    assert maps[prefix + "down_proj"] == {"batch_dims": 1, "transposed": True}
    assert maps["model.layers.0.feed_forward.shared_expert.up_proj.weight"] == "flatten"
    experts = model.model.layers[0].feed_forward.experts
    gate_up = matrices_of(groups, prefix + "gate_up_proj")
    down = matrices_of(groups, prefix + "down_proj")
    x = torch.randn(E, TOKENS, H)  # the forward takes tokens already grouped by expert
    with torch.no_grad():
        got = experts(x.reshape(-1, H)).view(E, TOKENS, H)
    for e in range(E):
        gate, up = gate_up[2 * e], gate_up[2 * e + 1]
        assert gate.shape == up.shape == (I, H) and down[e].shape == (H, I)
        expected = linear(experts.act_fn(linear(x[e], gate)) * linear(x[e], up), down[e])
        assert rel_err(got[e], expected) < 1e-5, e


def test_dbrx_experts_are_blocks_of_two_dim_stacks(transformers):
    """DBRX stores experts as ``(E·F, H)`` stacks: w1 and v1 blocks (out, in), w2 blocks (in, out)."""
    config = transformers.DbrxConfig(
        d_model=H,
        n_heads=2,
        n_layers=1,
        vocab_size=50,
        max_seq_len=8,
        ffn_config=dict(ffn_hidden_size=I, moe_num_experts=E, moe_top_k=1),
        attn_config=dict(kv_n_heads=1, rope_theta=10000.0),
    )
    model = seeded(lambda: transformers.DbrxForCausalLM(config))
    groups = param_groups(model)
    maps = muon_maps(groups)
    prefix = "transformer.blocks.0.ffn.experts.mlp."
    assert maps[prefix + "w1"] == maps[prefix + "v1"] == {"split": [I] * E}
    assert maps[prefix + "w2"] == {"split": [I] * E, "dim": 1, "transposed": True}
    experts = model.transformer.blocks[0].ffn.experts
    w1, v1, w2 = (matrices_of(groups, prefix + n) for n in ("w1", "v1", "w2"))
    x = torch.randn(1, TOKENS, H)
    for e in range(E):
        assert w1[e].shape == v1[e].shape == (I, H) and w2[e].shape == (H, I)
        act = experts.mlp.activation_fn
        expected = linear(act(linear(x[0], w1[e])) * linear(x[0], v1[e]), w2[e])
        with torch.no_grad():
            got = experts(x, *all_to_expert(e))
        assert rel_err(got.view(TOKENS, H), expected) < 1e-5, e


def test_unknown_expert_stacks_are_batched_by_their_class_name():
    """A module class named "...Experts" that no rule knows: its 3-D tensors are per-expert
    stacks; which way each matrix is stored is unknown, so only the batch dim is set."""

    class ToyExperts(nn.Module):
        def __init__(self):
            super().__init__()
            self.w_in = nn.Parameter(torch.randn(4, 6, 5))
            self.scale = nn.Parameter(torch.ones(4, 6))

    model = nn.Module()
    model.moe = ToyExperts()
    model.proj = nn.Linear(5, 5)
    groups = param_groups(model, head=None)
    assert muon_maps(groups) == {"moe.w_in": "experts", "proj.weight": "flatten"}
    # a 2-D tensor of an experts module that no rule reads as matrices is not orthogonalised
    assert [(g["use_muon"], g["param_names"]) for g in groups[1:]] == [
        (False, ["moe.scale"]),
        (False, ["proj.bias"]),
    ]


# ----- fused projections ------------------------------------------------------------------------


def capture_attention(mp, transformers):
    """Record the (module, query, key, value) that attention layers hand to SDPA."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    seen = []
    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]

    def recording(module, query, key, value, *args, **kwargs):
        seen.append((module, query, key, value))
        return sdpa(module, query, key, value, *args, **kwargs)

    mp.setitem(ALL_ATTENTION_FUNCTIONS._global_mapping, "sdpa", recording)
    return seen


def heads_first(t, heads):
    """``(B, T, heads·d)`` as attention layers hand it on: ``(B, heads, T, d)``."""
    b, n, _ = t.shape
    return t.view(b, n, heads, -1).transpose(1, 2)


def test_gpt2_conv1d_weights_are_transposed_and_c_attn_is_query_key_value(transformers):
    config = transformers.GPT2Config(
        n_embd=H,
        n_layer=1,
        n_head=2,
        vocab_size=50,
        n_positions=8,
        add_cross_attention=True,
        bos_token_id=0,
        eos_token_id=0,
    )
    config._attn_implementation = "sdpa"
    model = seeded(lambda: transformers.GPT2LMHeadModel(config))
    groups = param_groups(model)
    maps = muon_maps(groups)
    block = "transformer.h.0."
    assert maps == {
        block + "attn.c_attn.weight": {"split": [H, H, H], "transposed": True},
        block + "attn.c_proj.weight": "transposed",
        block + "crossattention.c_attn.weight": {"split": [H, H], "transposed": True},
        block + "crossattention.q_attn.weight": "transposed",
        block + "crossattention.c_proj.weight": "transposed",
        block + "mlp.c_fc.weight": "transposed",
        block + "mlp.c_proj.weight": "transposed",
    }
    for name, spec in maps.items():  # the factor reads (out, in): c_fc is (4H, H), c_proj (H, 4H)
        shape = dict(model.named_parameters())[name].shape
        out_in = parse(spec).shapes(shape)
        assert all(s == (shape[1] // len(out_in), shape[0]) for s in out_in), name
    layer = model.transformer.h[0]
    inputs = {}
    for name in ("attn.c_attn", "crossattention.c_attn", "crossattention.q_attn"):
        layer.get_submodule(name).register_forward_pre_hook(
            lambda m, a, name=name: inputs.setdefault(name, a[0])
        )
    encoder = torch.randn(2, 6, H)
    with pytest.MonkeyPatch.context() as mp:
        seen = capture_attention(mp, transformers)
        with torch.no_grad():
            model(torch.randint(0, 50, (2, 4)), encoder_hidden_states=encoder)
    assert [m for m, *_ in seen] == [layer.attn, layer.crossattention]
    (self_q, self_k, self_v), (cross_q, cross_k, cross_v) = [qkv for _, *qkv in seen]

    def parts(name, module_name):
        """Each matrix times the layer's input, plus the bias entries of its output columns."""
        conv = layer.get_submodule(module_name)
        views = matrices_of(groups, block + name)
        boxes = parse(maps[block + name]).boxes(conv.weight.shape)
        x = inputs[module_name]
        return [
            heads_first(linear(x, w) + conv.bias[box[-1] if box else ALL], 2) for w, box in zip(views, boxes)
        ]

    q, k, v = parts("attn.c_attn.weight", "attn.c_attn")
    assert rel_err(self_q, q) < 1e-5 and rel_err(self_k, k) < 1e-5 and rel_err(self_v, v) < 1e-5
    k, v = parts("crossattention.c_attn.weight", "crossattention.c_attn")
    assert torch.equal(inputs["crossattention.c_attn"], encoder)
    (q,) = parts("crossattention.q_attn.weight", "crossattention.q_attn")
    assert rel_err(cross_q, q) < 1e-5 and rel_err(cross_k, k) < 1e-5 and rel_err(cross_v, v) < 1e-5


def test_multihead_attention_in_proj_is_query_key_value():
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(H, 2, batch_first=True)
    groups = param_groups(nn.ModuleDict({"attn": mha}), head=None)
    assert muon_maps(groups) == {
        "attn.in_proj_weight": {"split": [H, H, H]},
        "attn.out_proj.weight": "flatten",
    }
    wq, wk, wv = matrices_of(groups, "attn.in_proj_weight")
    bq, bk, bv = mha.in_proj_bias.split(H)
    x, memory = torch.randn(2, 4, H), torch.randn(2, 6, H)
    q = heads_first(linear(x, wq) + bq, 2)
    k = heads_first(linear(memory, wk) + bk, 2)
    v = heads_first(linear(memory, wv) + bv, 2)
    attended = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(2, 4, H)
    with torch.no_grad():
        got, _ = mha(x, memory, memory, need_weights=False)
        assert rel_err(got, mha.out_proj(attended)) < 1e-5
    # separate q/k/v weights (different key/value dims) are plain matrices
    separate = nn.MultiheadAttention(H, 2, kdim=6, vdim=6)
    assert set(muon_maps(param_groups(separate, head=None)).values()) == {"flatten"}


def test_transformer_encoder_layer_and_plain_models_keep_their_groups():
    layer = nn.TransformerEncoderLayer(H, 2, 32)
    assert muon_maps(param_groups(layer, head=None)) == {  # a lone layer has no output layer
        "self_attn.in_proj_weight": {"split": [H, H, H]},
        "self_attn.out_proj.weight": "flatten",
        "linear1.weight": "flatten",
        "linear2.weight": "flatten",
    }
    plain = nn.Sequential(nn.Conv2d(3, 8, 3), nn.Flatten(), nn.Linear(8, 8), nn.Linear(8, 2))
    assert all("matrices" not in g for g in param_groups(plain))
    assert all("matrices" not in g for g in param_groups(plain, matrices={"0": "flatten"}))


# ----- the caller's maps ----------------------------------------------------------------------


def tiny_llama(transformers):
    return seeded(lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL)))


def test_per_head_maps_and_which_selector_wins(transformers):
    model = tiny_llama(transformers)
    attn = "model.layers.0.self_attn."
    maps = muon_maps(param_groups(model, matrices={"*.q_proj": {"heads": 2}, "*k_proj*": {"heads": 1}}))
    assert maps[attn + "q_proj.weight"] == {"heads": 2}
    assert maps[attn + "k_proj.weight"] == {"heads": 1}
    assert maps[attn + "v_proj.weight"] == "flatten"
    # later entries win over earlier ones; every kind of selector; a tuple of selectors
    layer = model.model.layers[0]
    maps = muon_maps(
        param_groups(
            model,
            matrices={
                "*.self_attn": {"heads": 2, "dim": 1},
                layer.self_attn.v_proj: {"split": [4, 4]},
                layer.self_attn.o_proj.weight: "flatten",
                (layer.mlp.up_proj, "*.gate_proj"): {"heads": 4},
                lambda name, p: name.endswith("down_proj.weight"): {"heads": 4, "dim": 1},
            },
        )
    )
    assert maps[attn + "q_proj.weight"] == maps[attn + "k_proj.weight"] == {"heads": 2, "dim": 1}
    assert maps[attn + "v_proj.weight"] == {"split": [4, 4]}
    assert maps[attn + "o_proj.weight"] == "flatten"
    assert maps["model.layers.0.mlp.up_proj.weight"] == maps["model.layers.0.mlp.gate_proj.weight"]
    assert maps["model.layers.0.mlp.down_proj.weight"] == {"heads": 4, "dim": 1}


def test_the_caller_overrides_detection(transformers):
    model = build_moe(transformers, "mixtral")
    prefix = "model.layers.0.mlp.experts."
    maps = muon_maps(
        param_groups(model, matrices={"*.experts": "flatten", prefix + "down_proj": {"batch_dims": 1}})
    )
    assert maps[prefix + "gate_up_proj"] == "flatten" and maps[prefix + "down_proj"] == "experts"
    maps = muon_maps(param_groups(model, matrices={"*.experts": "flatten"}))
    assert set(maps.values()) == {"flatten"}
    assert all("matrices" not in g for g in param_groups(model, matrices={"*.experts": "flatten"}))


def test_bad_maps_are_refused_naming_the_parameter_and_the_fix(transformers):
    model = tiny_llama(transformers)
    with pytest.raises(ValueError, match=r"matrices='\*\.qproj' matches no module or parameter"):
        param_groups(model, matrices={"*.qproj": {"heads": 2}})
    with pytest.raises(ValueError, match="names no parameter that Muon orthogonalises"):
        param_groups(model, matrices={"lm_head": "experts"})  # the head is AdamW's
    with pytest.raises(ValueError, match="<predicate <lambda>> names no parameter"):
        param_groups(model, matrices={lambda n, p: False: "experts"})
    with pytest.raises(ValueError, match=r"matrices= entry for '\*\.q_proj': unknown matrix map 'expert'"):
        param_groups(model, matrices={"*.q_proj": "expert"})
    q = "model.layers.0.self_attn.q_proj.weight"
    with pytest.raises(
        ValueError,
        match=rf"parameter '{q}' of shape \(16, 16\), as given: .*give a head count that divides 16",
    ):
        param_groups(model, matrices={"*.q_proj": {"heads": 3}})
    with pytest.raises(ValueError, match=rf"'{q}' .* needs at least 3 dims .* matrices=\{{'{q}': \.\.\.\}}"):
        param_groups(model, matrices={q: "experts"})
    with pytest.raises(TypeError, match=r"matrices= takes a dict \{selector: matrix map\}"):
        param_groups(model, matrices="experts")


def test_a_detected_map_that_does_not_fit_is_refused_naming_where_it_came_from():
    """A layer whose attributes contradict its weight (split sizes that do not add up)."""
    mha = nn.MultiheadAttention(8, 2)
    mha.embed_dim = 5  # as if the layer had been altered after construction
    with pytest.raises(ValueError, match=r"'m\.in_proj_weight' of shape \(24, 8\), detected from its layer"):
        param_groups(nn.ModuleDict({"m": mha}), head=None)
    maps = muon_maps(param_groups(nn.ModuleDict({"m": mha}), head=None, matrices={"m": "flatten"}))
    assert maps == {"m.in_proj_weight": "flatten", "m.out_proj.weight": "flatten"}


def test_muon_steps_detected_maps_like_the_per_matrix_reference(transformers):
    """One Muon step on a tiny Mixtral with the groups as param_groups makes them: the experts'
    matrices (written out here from the forward: gate rows, then up rows, of each expert) are
    orthogonalised one by one."""
    model = build_moe(transformers, "mixtral")
    hp = dict(lr=0.02, momentum=0.95, nesterov=True, weight_decay=0.1)
    groups = param_groups(model)
    (muon,) = [g for g in groups if g["use_muon"]]
    names = muon["param_names"]
    torch.manual_seed(1)
    grads = {n: torch.randn_like(p) for n, p in zip(names, muon["params"])}
    pieces = {n: [((), False)] for n in names}
    prefix = "model.layers.0.mlp.experts."
    pieces[prefix + "gate_up_proj"] = [((e, slice(a, a + I)), False) for e in range(E) for a in (0, I)]
    pieces[prefix + "down_proj"] = [((e,), False) for e in range(E)]
    expected = {}
    for n, p in zip(names, muon["params"]):
        ref = p.detach().clone()
        muon_reference_pieces(ref, grads[n], {}, pieces[n], **hp)
        expected[n] = ref
    opt = Muon([muon], ns_dtype=torch.float32, **hp)
    for n, p in zip(names, muon["params"]):
        p.grad = grads[n].clone()
    opt.step()
    for n, p in zip(names, muon["params"]):
        assert rel_err(p.detach(), expected[n]) < 1e-5, n
