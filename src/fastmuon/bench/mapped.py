"""Workloads whose tensors are not one matrix each, with their matrix maps written out.

- A Mixture-of-Experts decoder laid out as Transformers 5.x stores GraniteMoe (and Mixtral,
  OLMoE, Qwen2-MoE): each layer's experts fused into two 3-D parameters, ``gate_up_proj``
  ``(E, 2·ffn, d)`` (gate and up stacked along the output dim) and ``down_proj`` ``(E, d, ffn)``;
  the router a plain ``(E, d)`` matrix; attention q/k/v/o as ``nn.Linear``. Mapped
  ``{"batch_dims": 1, "split": [ffn, ffn]}`` (2·E matrices) and ``"experts"`` (E matrices).
- The same decoder with its experts as GPT-OSS stores them (Transformers' ``GptOssExperts``):
  ``gate_up_proj`` ``(E, d, 2·ffn)`` stored (in, out) with gate and up columns interleaved,
  ``down_proj`` ``(E, ffn, d)`` (in, out), a bias per expert output. Mapped ``{"batch_dims": 1,
  "split": [ffn, ffn], "interleaved": True, "transposed": True}`` (2·E matrices, strided views)
  and ``{"batch_dims": 1, "transposed": True}``: the same matrices as the first, so the two
  workloads time contiguous against interleaved parts.
- GPT-2 as its reference code stores it: ``Conv1D`` weights ``(in, out)``, the attention's
  q, k and v fused in ``c_attn`` ``(d, 3d)``. Mapped ``{"split": [d, d, d], "transposed": True}``
  (three matrices) and ``"transposed"``.

The groups are written here rather than detected, so that a workload says exactly which
matrices it benchmarks.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

#: ibm-granite/granite-3.0-1b-a400m-base, config.json on the Hugging Face Hub
GRANITE_1B_A400M = {
    "vocab": 49152,
    "d": 1024,
    "layers": 24,
    "heads": 16,
    "kv_heads": 8,
    "experts": 32,
    "ffn": 512,
    "tied": True,
}


def attention_config(heads: int, kv_heads: int) -> SimpleNamespace:
    """The head counts a Transformers attention layer reads from its ``config``, where
    :func:`fastmuon.optim.qk_clip.detected_parts` finds them (the qk-clip contender's queries and keys)."""
    return SimpleNamespace(num_attention_heads=heads, num_key_value_heads=kv_heads)


# ----- a MoE decoder (Transformers' GraniteMoe parameter layout) -----------------------------
class _Attention(nn.Module):
    def __init__(self, d: int, heads: int, kv_heads: int):
        super().__init__()
        head_dim = d // heads
        self.head_dim, self.config = head_dim, attention_config(heads, kv_heads)  # as Transformers' layers
        self.q_proj = nn.Linear(d, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(d, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(d, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, d, bias=False)


class _Router(nn.Module):
    def __init__(self, d: int, experts: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(experts, d))


class _Experts(nn.Module):
    """The experts as two fused 3-D parameters (gate and up stacked along the output dim)."""

    def __init__(self, d: int, experts: int, ffn: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(experts, 2 * ffn, d))
        self.down_proj = nn.Parameter(torch.empty(experts, d, ffn))


class _SparseMoE(nn.Module):
    def __init__(self, d: int, experts: int, ffn: int, experts_layer: type[nn.Module] = _Experts):
        super().__init__()
        self.router = _Router(d, experts)
        self.experts = experts_layer(d, experts, ffn)


class _MoELayer(nn.Module):
    """Attention, its norms, and the expert block under the name its model gives it."""

    def __init__(self, d: int, heads: int, kv_heads: int, block_name: str, block: nn.Module):
        super().__init__()
        self.self_attn = _Attention(d, heads, kv_heads)
        self.input_layernorm = nn.RMSNorm(d)
        self.post_attention_layernorm = nn.RMSNorm(d)
        self.add_module(block_name, block)


class _MoEBody(nn.Module):
    def __init__(self, vocab: int, d: int, layers: int, heads: int, kv_heads: int, block_name: str, block):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(_MoELayer(d, heads, kv_heads, block_name, block()) for _ in range(layers))
        self.norm = nn.RMSNorm(d)


class MoEDecoder(nn.Module):
    """A MoE causal LM's parameters, named as Transformers names GraniteMoe's
    (``model.layers.0.block_sparse_moe.experts.gate_up_proj``)."""

    #: the expert block's name in each layer, and the experts' layout
    block_name = "block_sparse_moe"
    experts_layer: type[nn.Module] = _Experts

    def __init__(self, vocab, d, layers, heads, kv_heads, experts, ffn, tied=True):
        super().__init__()
        self.ffn = ffn
        make = lambda: _SparseMoE(d, experts, ffn, self.experts_layer)  # noqa: E731
        self.model = _MoEBody(vocab, d, layers, heads, kv_heads, self.block_name, make)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        if tied:
            self.lm_head.weight = self.model.embed_tokens.weight


def moe_decoder(layers: int = 1, **config: Any) -> MoEDecoder:
    """granite-3.0-1b-a400m's widths (:data:`GRANITE_1B_A400M`) with ``layers`` layers;
    ``config`` overrides any of its values (e.g. a small model for tests)."""
    return MoEDecoder(**{**GRANITE_1B_A400M, **config, "layers": layers})


def moe_groups(model: MoEDecoder) -> list[dict[str, Any]]:
    """Muon for attention, router and experts (each expert's gate, up and down its own matrix);
    AdamW/SGD for the embedding (tied to the head) and, undecayed, for the norms."""
    ffn = model.ffn
    return _decoder_groups(model, [{"batch_dims": 1, "split": [ffn, ffn]}, "experts"])


def _decoder_groups(model: MoEDecoder, expert_maps: list[Any]) -> list[dict[str, Any]]:
    """Muon for attention, router and the experts (``gate_up_proj`` and ``down_proj`` mapped by
    ``expert_maps``); AdamW/SGD for the embedding and, undecayed, for the norms and biases."""
    matrices, maps, names = [], [], []
    for i, layer in enumerate(model.model.layers):
        prefix = f"model.layers.{i}"
        attn = layer.self_attn
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            matrices.append(getattr(attn, proj).weight)
            maps.append("flatten")
            names.append(f"{prefix}.self_attn.{proj}.weight")
        block = getattr(layer, model.block_name)
        matrices += [block.router.weight, block.experts.gate_up_proj, block.experts.down_proj]
        maps += ["flatten", *expert_maps]
        names += [f"{prefix}.{model.block_name}.{n}" for n in ("router.weight", "experts.gate_up_proj")]
        names.append(f"{prefix}.{model.block_name}.experts.down_proj")
    undecayed = [(n, p) for n, p in model.named_parameters() if p.ndim == 1 or n.endswith("_bias")]
    return [
        {"params": matrices, "param_names": names, "use_muon": True, "matrices": maps},
        {
            "params": [model.model.embed_tokens.weight],
            "param_names": ["model.embed_tokens.weight"],
            "use_muon": False,
        },
        {
            "params": [p for _, p in undecayed],
            "param_names": [n for n, _ in undecayed],
            "use_muon": False,
            "weight_decay": 0.0,
        },
    ]


# ----- the same decoder with GPT-OSS's expert layout ---------------------------------------------
class _GptOssExperts(nn.Module):
    """Experts as Transformers' ``GptOssExperts`` keeps them: (in, out), gate and up columns
    alternating (gate ``[..., 0::2]``, up ``[..., 1::2]``), biased."""

    def __init__(self, d: int, experts: int, ffn: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(experts, d, 2 * ffn))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(experts, 2 * ffn))
        self.down_proj = nn.Parameter(torch.empty(experts, ffn, d))
        self.down_proj_bias = nn.Parameter(torch.empty(experts, d))


class GptOssLikeDecoder(MoEDecoder):
    """:class:`MoEDecoder`'s widths with its experts laid out as GPT-OSS lays them out, named as
    Transformers names GPT-OSS's parameters (``model.layers.0.mlp.experts.gate_up_proj``)."""

    block_name = "mlp"
    experts_layer = _GptOssExperts


def gpt_oss_like_decoder(layers: int = 1, **config: Any) -> GptOssLikeDecoder:
    """granite-3.0-1b-a400m's widths (:data:`GRANITE_1B_A400M`), as :func:`moe_decoder`, with
    GPT-OSS's expert layout; ``config`` overrides any of its values."""
    return GptOssLikeDecoder(**{**GRANITE_1B_A400M, **config, "layers": layers})


def gpt_oss_like_groups(model: GptOssLikeDecoder) -> list[dict[str, Any]]:
    """As :func:`moe_groups`: Muon for attention, router and experts (each expert's gate, up and
    down its own matrix, gate and up cut out of their interleaved columns); AdamW/SGD for the
    embedding and, undecayed, for the norms and the experts' biases."""
    ffn = model.ffn
    gate_up = {"batch_dims": 1, "split": [ffn, ffn], "interleaved": True, "transposed": True}
    return _decoder_groups(model, [gate_up, {"batch_dims": 1, "transposed": True}])


# ----- GPT-2 with its Conv1D layout ----------------------------------------------------------
class Conv1D(nn.Module):
    """GPT-2's linear layer: ``y = x @ weight + bias`` with ``weight`` stored ``(in, out)``."""

    def __init__(self, nx: int, nf: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(nx, nf))
        self.bias = nn.Parameter(torch.empty(nf))


class _GPT2Attention(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.c_attn = Conv1D(d, 3 * d)
        self.c_proj = Conv1D(d, d)


class _GPT2MLP(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.c_fc = Conv1D(d, 4 * d)
        self.c_proj = Conv1D(4 * d, d)


class _GPT2Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.ln_1 = nn.LayerNorm(d)
        self.attn = _GPT2Attention(d)
        self.ln_2 = nn.LayerNorm(d)
        self.mlp = _GPT2MLP(d)


class _GPT2Body(nn.Module):
    def __init__(self, vocab: int, context: int, d: int, layers: int):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(context, d)
        self.h = nn.ModuleList(_GPT2Block(d) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)


class GPT2Conv1D(nn.Module):
    """GPT-2's parameters as its reference code names and stores them (the 124M "small" config
    by default: vocab 50257, context 1024, d 768, 12 layers), tied head."""

    def __init__(self, vocab: int = 50257, context: int = 1024, d: int = 768, layers: int = 12):
        super().__init__()
        self.d = d
        self.transformer = _GPT2Body(vocab, context, d, layers)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.transformer.wte.weight


def gpt2_conv1d_groups(model: GPT2Conv1D) -> list[dict[str, Any]]:
    """Muon for the Conv1D weights, q, k and v of ``c_attn`` as three matrices; AdamW/SGD for the
    embeddings and, undecayed, for biases and norms."""
    d = model.d
    matrices, maps, names = [], [], []
    for i, block in enumerate(model.transformer.h):
        assert isinstance(block, _GPT2Block)
        for path, conv in (
            ("attn.c_attn", block.attn.c_attn),
            ("attn.c_proj", block.attn.c_proj),
            ("mlp.c_fc", block.mlp.c_fc),
            ("mlp.c_proj", block.mlp.c_proj),
        ):
            matrices.append(conv.weight)
            names.append(f"transformer.h.{i}.{path}.weight")
            maps.append({"split": [d, d, d], "transposed": True} if path == "attn.c_attn" else "transposed")
    body = model.transformer
    vectors = [(n, p) for n, p in model.named_parameters() if p.ndim == 1]
    return [
        {"params": matrices, "param_names": names, "use_muon": True, "matrices": maps},
        {
            "params": [body.wte.weight, body.wpe.weight],
            "param_names": ["transformer.wte.weight", "transformer.wpe.weight"],
            "use_muon": False,
        },
        {
            "params": [p for _, p in vectors],
            "param_names": [n for n, _ in vectors],
            "use_muon": False,
            "weight_decay": 0.0,
        },
    ]
