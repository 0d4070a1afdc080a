"""The workloads ``fastmuon plan`` knows by name: their Muon matrices' shapes and matrix maps.

The bundled ``gpt2`` and ``llama-1b`` come from :mod:`fastmuon.bench.workloads` (grouped with
:func:`fastmuon.param_groups`; ``gpt2``'s fused q, k and v are three matrices, as
``param_groups`` maps GPT-2's own ``c_attn``). The large ones are written out here from their public
configurations, shapes only (nothing is built or downloaded): a Llama-3-8B-like and a
Llama-3-70B-like decoder, a Mixtral-8x7B-like and a DeepSeek-V3-like Mixture of Experts with each
layer's experts stacked in one ``(E, out, in)`` tensor (mapped ``"experts"``; gate and up fused in
one ``(E, 2·ffn, d)`` tensor mapped ``{"batch_dims": 1, "split": [ffn, ffn]}``, as Transformers
5.x stores them). As with :func:`fastmuon.param_groups`, embeddings, the head and the norms take
the elementwise update and are left out: only the matrices Muon orthogonalises are listed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..bench.workloads import generated_manifest
from ..ns.matrices import MatrixMapSpec, parse

#: how a tensor-parallel plan treats a parameter: split its output dim (column-wise), its input
#: dim (row-wise), or leave it whole (None)
COLWISE, ROWWISE = "colwise", "rowwise"


@dataclass(frozen=True)
class Tensor:
    """One orthogonalised parameter: its name, shape (as stored), matrix map, and how a
    tensor-parallel plan splits it (:data:`COLWISE`, :data:`ROWWISE`, or None); ``experts``:
    an expert stack (dim 0 indexes experts), which expert parallelism shards."""

    name: str
    shape: tuple[int, ...]
    map: MatrixMapSpec = None
    tp: str | None = None
    experts: bool = False

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


@dataclass(frozen=True)
class Workload:
    name: str
    source: str
    tensors: tuple[Tensor, ...]

    @property
    def num_experts(self) -> int:
        return max((t.shape[0] for t in self.tensors if t.experts), default=0)

    def numel(self) -> int:
        return sum(t.numel for t in self.tensors)


# ----- Llama-style decoders ---------------------------------------------------------------------
def _llama_layer(i: int, d: int, heads: int, kv_heads: int, ffn: int, prefix: str = "model.layers") -> list:
    head_dim = d // heads
    p = f"{prefix}.{i}"
    return [
        Tensor(f"{p}.self_attn.q_proj.weight", (heads * head_dim, d), tp=COLWISE),
        Tensor(f"{p}.self_attn.k_proj.weight", (kv_heads * head_dim, d), tp=COLWISE),
        Tensor(f"{p}.self_attn.v_proj.weight", (kv_heads * head_dim, d), tp=COLWISE),
        Tensor(f"{p}.self_attn.o_proj.weight", (d, heads * head_dim), tp=ROWWISE),
        Tensor(f"{p}.mlp.gate_proj.weight", (ffn, d), tp=COLWISE),
        Tensor(f"{p}.mlp.up_proj.weight", (ffn, d), tp=COLWISE),
        Tensor(f"{p}.mlp.down_proj.weight", (d, ffn), tp=ROWWISE),
    ]


def llama(d: int, layers: int, heads: int, kv_heads: int, ffn: int) -> tuple[Tensor, ...]:
    return tuple(t for i in range(layers) for t in _llama_layer(i, d, heads, kv_heads, ffn))


#: meta-llama/Meta-Llama-3-8B config.json: hidden 4096, 32 layers, 32 heads, 8 KV heads,
#: intermediate 14336, vocab 128256 (untied head)
LLAMA3_8B = dict(d=4096, layers=32, heads=32, kv_heads=8, ffn=14336)
#: meta-llama/Meta-Llama-3-70B config.json: hidden 8192, 80 layers, 64 heads, 8 KV heads,
#: intermediate 28672, vocab 128256 (untied head)
LLAMA3_70B = dict(d=8192, layers=80, heads=64, kv_heads=8, ffn=28672)


# ----- Mixture of Experts -----------------------------------------------------------------------
def _experts(p: str, experts: int, d: int, ffn: int) -> list[Tensor]:
    return [
        Tensor(
            f"{p}.mlp.experts.gate_up_proj",
            (experts, 2 * ffn, d),
            {"batch_dims": 1, "split": [ffn, ffn]},
            experts=True,
        ),
        Tensor(f"{p}.mlp.experts.down_proj", (experts, d, ffn), "experts", experts=True),
    ]


def mixtral(d: int, layers: int, heads: int, kv_heads: int, experts: int, ffn: int) -> tuple[Tensor, ...]:
    out: list[Tensor] = []
    for i in range(layers):
        attn = _llama_layer(i, d, heads, kv_heads, ffn)[:4]
        p = f"model.layers.{i}"
        out += [*attn, Tensor(f"{p}.mlp.gate.weight", (experts, d)), *_experts(p, experts, d, ffn)]
    return tuple(out)


#: mistralai/Mixtral-8x7B-v0.1 config.json: hidden 4096, 32 layers, 32 heads, 8 KV heads,
#: 8 local experts of intermediate 14336
MIXTRAL_8X7B = dict(d=4096, layers=32, heads=32, kv_heads=8, experts=8, ffn=14336)


def deepseek_v3(
    d: int,
    layers: int,
    dense_layers: int,
    heads: int,
    q_lora: int,
    kv_lora: int,
    nope: int,
    rope: int,
    v_dim: int,
    dense_ffn: int,
    experts: int,
    moe_ffn: int,
    shared: int,
) -> tuple[Tensor, ...]:
    """Multi-head latent attention (q and kv low-rank projections) and, past the first
    ``dense_layers``, a router, ``experts`` routed experts and ``shared`` shared ones."""
    out: list[Tensor] = []
    for i in range(layers):
        p = f"model.layers.{i}"
        out += [
            Tensor(f"{p}.self_attn.q_a_proj.weight", (q_lora, d)),
            Tensor(f"{p}.self_attn.q_b_proj.weight", (heads * (nope + rope), q_lora), tp=COLWISE),
            Tensor(f"{p}.self_attn.kv_a_proj_with_mqa.weight", (kv_lora + rope, d)),
            Tensor(f"{p}.self_attn.kv_b_proj.weight", (heads * (nope + v_dim), kv_lora), tp=COLWISE),
            Tensor(f"{p}.self_attn.o_proj.weight", (d, heads * v_dim), tp=ROWWISE),
        ]
        ffn = dense_ffn if i < dense_layers else shared * moe_ffn
        mlp = "mlp" if i < dense_layers else "mlp.shared_experts"
        out += [
            Tensor(f"{p}.{mlp}.gate_proj.weight", (ffn, d), tp=COLWISE),
            Tensor(f"{p}.{mlp}.up_proj.weight", (ffn, d), tp=COLWISE),
            Tensor(f"{p}.{mlp}.down_proj.weight", (d, ffn), tp=ROWWISE),
        ]
        if i >= dense_layers:
            out += [Tensor(f"{p}.mlp.gate.weight", (experts, d)), *_experts(p, experts, d, moe_ffn)]
    return tuple(out)


#: deepseek-ai/DeepSeek-V3 config.json: hidden 7168, 61 layers (the first 3 dense, intermediate
#: 18432), 128 heads, q_lora_rank 1536, kv_lora_rank 512, qk_nope_head_dim 128,
#: qk_rope_head_dim 64, v_head_dim 128, 256 routed experts of moe_intermediate 2048, 1 shared
DEEPSEEK_V3 = dict(
    d=7168,
    layers=61,
    dense_layers=3,
    heads=128,
    q_lora=1536,
    kv_lora=512,
    nope=128,
    rope=64,
    v_dim=128,
    dense_ffn=18432,
    experts=256,
    moe_ffn=2048,
    shared=1,
)

_TP_OF = {
    # names in the bundled workloads: q/k/v, gate/up and fused projections column-wise
    "q_proj": COLWISE,
    "k_proj": COLWISE,
    "v_proj": COLWISE,
    "gate_proj": COLWISE,
    "up_proj": COLWISE,
    "attn_qkv": COLWISE,
    "mlp_fc": COLWISE,
    "o_proj": ROWWISE,
    "down_proj": ROWWISE,
    "attn_proj": ROWWISE,
    "mlp_proj": ROWWISE,
}


def _module_of(name: str) -> str | None:
    parts = name.split(".")
    return parts[-2] if len(parts) >= 2 else None


def _tp_of(name: str) -> str | None:
    return _TP_OF.get(_module_of(name) or "")


def _qkv_parts(shape: tuple[int, ...]) -> MatrixMapSpec:
    """q, k and v stacked along the output dim, each its own matrix."""
    d = shape[0] // 3
    return {"split": [d, d, d]}


#: fused projections the bundled workloads keep in one ``nn.Linear``, mapped as
#: :func:`fastmuon.param_groups` maps the models that fuse them (GPT-2's ``c_attn``,
#: ``nn.MultiheadAttention``'s ``in_proj_weight``: q, k and v apart)
_FUSED: dict[str, Callable[[tuple[int, ...]], MatrixMapSpec]] = {"attn_qkv": _qkv_parts}
_FUSED_NOTE = "; attn_qkv mapped {split: [d, d, d]} (q, k and v apart, as param_groups maps GPT-2's c_attn)"


def _map_of(name: str, shape: tuple[int, ...], given: MatrixMapSpec) -> MatrixMapSpec:
    fused = _FUSED.get(_module_of(name) or "")
    return fused(shape) if fused is not None and given is None else given


def from_manifest(name: str) -> Workload:
    """A bundled workload's orthogonalised parameters, as :func:`fastmuon.param_groups` groups
    it, its fused projections (:data:`_FUSED`) mapped in their parts."""
    manifest = generated_manifest(name)
    params = manifest.params
    maps = [_map_of(p.name, p.shape, m) for p, m in zip(params, manifest.map_specs())]
    chosen = set(id(p) for p in manifest.matrices())
    tensors = tuple(
        Tensor(p.name, p.shape, m, _tp_of(p.name), parse(m).batch_dims > 0)
        for p, m in zip(params, maps)
        if id(p) in chosen
    )
    fused = any(_module_of(t.name) in _FUSED for t in tensors)
    return Workload(name, manifest.source + (_FUSED_NOTE if fused else ""), tensors)


def _written(name: str, source: str, build: Callable[..., tuple[Tensor, ...]], config: dict[str, Any]):
    return lambda: Workload(name, source, build(**config))


#: name -> how the workload is made (each call builds it afresh; the large ones in well under a second)
WORKLOADS: dict[str, Callable[[], Workload]] = {
    "gpt2": lambda: from_manifest("gpt2"),
    "llama-1b": lambda: from_manifest("llama-1b"),
    "llama3-8b": _written(
        "llama3-8b", "Llama-3-8B-like: hidden 4096, 32 layers, 32/8 heads, MLP 14336", llama, LLAMA3_8B
    ),
    "llama3-70b": _written(
        "llama3-70b", "Llama-3-70B-like: hidden 8192, 80 layers, 64/8 heads, MLP 28672", llama, LLAMA3_70B
    ),
    "mixtral-8x7b": _written(
        "mixtral-8x7b",
        "Mixtral-8x7B-like: hidden 4096, 32 layers, 32/8 heads, 8 experts of 14336 stacked (E, out, in)",
        mixtral,
        MIXTRAL_8X7B,
    ),
    "deepseek-v3": _written(
        "deepseek-v3",
        "DeepSeek-V3-like: hidden 7168, 61 layers (3 dense), MLA attention, 256 routed experts of 2048 "
        "stacked (E, out, in) + 1 shared",
        deepseek_v3,
        DEEPSEEK_V3,
    ),
}


def workload(name: str) -> Workload:
    """The workload called ``name`` (one of :data:`WORKLOADS`)."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown model {name!r} for --model; choose one of {', '.join(WORKLOADS)}")
    return WORKLOADS[name]()
