"""Which parameters are attention queries and keys, read off the attention layers of known models,
for QK-clip (the group key ``attention``; see :mod:`fastmuon.step.qk_clip` for what a part says).

Each rule states the layout it relies on, read from the layer's forward in 🤗 Transformers:

- Llama-family attention (Llama, Mistral, Qwen2, Gemma, ...): ``q_proj`` and ``k_proj`` are
  ``nn.Linear``s whose outputs the forward views as ``(heads, head_dim)`` per token, with
  ``config.num_attention_heads`` query and ``config.num_key_value_heads`` key heads; their
  biases, where present, follow their rows. Layers that normalise queries and keys per head
  after the projection (``q_norm``/``k_norm``: Qwen3, Gemma 3, OLMo 2) are left out: scaling
  the projection would not change the normalised logits.
- DeepSeek-V3 (and V2) multi-head latent attention: ``q_b_proj`` (``q_proj`` without a query
  LoRA) holds per head ``qk_nope_head_dim`` content rows then ``qk_rope_head_dim`` rotary rows,
  ``kv_b_proj`` per head ``qk_nope_head_dim`` key rows then ``v_head_dim`` value rows; the
  shared rotary key (part of ``kv_a_proj_with_mqa``) takes no part.

A part's ``layer`` is the attention module's name in the model, the name under which
:class:`fastmuon.qk_clip.LogitMaxRecorder` reports the layer's maxima.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch import Tensor, nn

#: Names of the per-head query/key normalisations that make scaling a projection moot.
QK_NORMS = ("q_norm", "k_norm", "q_layernorm", "k_layernorm", "query_layernorm", "key_layernorm")


def detected_parts(model: nn.Module) -> dict[int, dict[str, Any]]:
    """``id(param) -> part`` for the query and key parameters of every recognised attention layer."""
    parts: dict[int, dict[str, Any]] = {}
    for name, module in model.named_modules():
        for rule in (llama_attention, latent_attention):
            for p, part in rule(module):
                parts[id(p)] = {"layer": name, **part}
    return parts


def _linear(module: nn.Module, name: str) -> nn.Linear | None:
    child = getattr(module, name, None)
    return child if isinstance(child, nn.Linear) else None


def _count(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _rows(layer: nn.Linear, part: dict[str, Any]) -> Iterator[tuple[Tensor, dict[str, Any]]]:
    yield layer.weight, part
    if layer.bias is not None:
        yield layer.bias, part


def llama_attention(module: nn.Module) -> Iterator[tuple[Tensor, dict[str, Any]]]:
    """Llama-family attention: see the module docstring."""
    q, k = _linear(module, "q_proj"), _linear(module, "k_proj")
    head_dim = _count(getattr(module, "head_dim", None))
    config = getattr(module, "config", None)
    if q is None or k is None or head_dim is None or config is None:
        return
    if any(getattr(module, n, None) is not None for n in QK_NORMS):
        return
    heads = _count(getattr(config, "num_attention_heads", None))
    kv_heads = _count(getattr(config, "num_key_value_heads", None) or heads)
    if heads is None or kv_heads is None or heads % kv_heads:
        return
    if q.out_features != heads * head_dim or k.out_features != kv_heads * head_dim:
        return  # another layout (a gated query, a per-layer head count): not this rule's
    yield from _rows(q, {"part": "query", "heads": heads})
    yield from _rows(k, {"part": "key", "heads": kv_heads})


def latent_attention(module: nn.Module) -> Iterator[tuple[Tensor, dict[str, Any]]]:
    """DeepSeek's multi-head latent attention: see the module docstring."""
    kv = _linear(module, "kv_b_proj")
    q = _linear(module, "q_b_proj") or _linear(module, "q_proj")
    heads, nope, rope, v_dim = (
        _count(getattr(module, n, None))
        for n in ("num_heads", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
    )
    if kv is None or q is None or heads is None or nope is None or rope is None or v_dim is None:
        return
    if q.out_features != heads * (nope + rope) or kv.out_features != heads * (nope + v_dim):
        return
    yield from _rows(q, {"part": "mla_query", "heads": heads, "nope_dim": nope, "rope_dim": rope})
    yield from _rows(kv, {"part": "mla_key_value", "heads": heads, "nope_dim": nope, "v_dim": v_dim})
