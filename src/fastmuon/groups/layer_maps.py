"""Which parameters are matrices, and the matrix maps of known layer types, read off the module
that owns each parameter, so that ``param_groups`` orthogonalises an MoE stack expert by expert and
a fused projection part by part without being told. Each rule states the layout it relies on, read
from the layer's forward (and tested against it), not guessed from names; others stay "flatten".
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator

from torch import Tensor, nn
from torch.nn.utils import parametrize

from ..ns.matrices import MatrixMap

#: One rule: the (parameter, map) pairs it knows for one module (its own or its children's).
Rule = Callable[[nn.Module], Iterator[tuple[Tensor, MatrixMap]]]

#: Transformers' fused-expert classes without the ``use_experts_implementation`` flags, with the
#: ``(is_transposed, is_concatenated)`` their forward implies (Llama-4 multiplies
#: ``x @ gate_up_proj[e]`` and ``chunk``s it; Step-3.7 and LongCat-Flash are like Mixtral).
UNFLAGGED_EXPERTS = {
    "Llama4TextExperts": (True, True),
    "Step3p7Experts": (False, True),
    "LongcatFlashExperts": (False, True),
}


def detected_maps(model: nn.Module) -> dict[int, MatrixMap]:
    """``id(param) -> map`` for the parameters a rule recognises; rules run generic first, so one
    knowing a whole layer (GPT-2's attention) overrides one knowing its parts (each ``Conv1D``)."""
    maps: dict[int, MatrixMap] = {}
    modules = list(model.modules())
    for rule in RULES:
        for module in modules:
            for p, m in rule(module):
                maps[id(p)] = m
    return maps


def experts_by_class_name(module: nn.Module) -> Iterator[tuple[Tensor, MatrixMap]]:
    """Any 3-D parameter of a module whose class name ends in "Experts" is a stack of expert
    matrices, one per leading index (Transformers' and most MoE code's convention). Whether
    each is stored (out, in) or (in, out) is not known here, so only the batch dim is set."""
    if type(module).__name__.endswith("Experts"):
        for p in module.parameters(recurse=False):
            if p.ndim == 3:
                yield p, MatrixMap(batch_dims=1)


def fused_experts(module: nn.Module) -> Iterator[tuple[Tensor, MatrixMap]]:
    """Transformers' fused experts (``gate_up_proj`` ``(E, 2I, H)``, transposed ``(E, H, 2I)``;
    ``up_proj``, ``down_proj``), one matrix per expert, as their flags say: ``is_transposed``
    (stored (in, out), used as ``x @ W``) and ``is_concatenated`` (``gate_up_proj``'s output is
    ``[gate; up]``, split by ``chunk(2)``; else gate and up alternate, as GPT-OSS's ``_apply_gate``
    reads them with ``[..., ::2]`` and ``[..., 1::2]``: interleaved parts)."""
    flags = experts_flags(module)
    if flags is None:
        return
    transposed, concatenated = flags
    for name, p in module.named_parameters(recurse=False):
        if p.ndim != 3:
            continue  # biases (E, out)
        out_size = p.shape[2] if transposed else p.shape[1]
        if name == "gate_up_proj" and out_size % 2 == 0:
            half = out_size // 2
            parts = MatrixMap(
                batch_dims=1, split=(half, half), transposed=transposed, interleaved=not concatenated
            )
            yield p, parts
        else:
            yield p, MatrixMap(batch_dims=1, transposed=transposed)


def experts_flags(module: nn.Module) -> tuple[bool, bool] | None:
    """``(is_transposed, is_concatenated)`` of a Transformers fused-experts module, else None."""
    flags = getattr(module, "is_transposed", None), getattr(module, "is_concatenated", None)
    if all(isinstance(f, bool) for f in flags) and isinstance(getattr(module, "has_gate", None), bool):
        return flags  # type: ignore[return-value]
    return UNFLAGGED_EXPERTS.get(type(module).__name__)


def dbrx_experts(module: nn.Module) -> Iterator[tuple[Tensor, MatrixMap]]:
    """DBRX keeps its experts as 2-D stacks ``(E·F, H)``: its forward views each as
    ``(E, F, H)`` and computes ``x @ w1[e].T``, ``x @ v1[e].T`` (so each block is (out, in))
    but ``h @ w2[e]`` (so ``w2``'s blocks are stored (in, out))."""
    if type(module).__name__ != "DbrxExpertGLU":
        return
    experts, ffn = getattr(module, "moe_num_experts", None), getattr(module, "ffn_hidden_size", None)
    w1, v1, w2 = (_tensor(module, name) for name in ("w1", "v1", "w2"))
    if not isinstance(experts, int) or not isinstance(ffn, int) or w1 is None or v1 is None or w2 is None:
        return  # another layout: not this rule's
    blocks = (ffn,) * experts
    yield w1, MatrixMap(split=blocks)
    yield v1, MatrixMap(split=blocks)
    yield w2, MatrixMap(split=blocks, dim=1, transposed=True)


def conv1d(module: nn.Module) -> Iterator[tuple[Tensor, MatrixMap]]:
    """Transformers' ``Conv1D`` (GPT-2, OpenAI GPT, ImageGPT) stores its weight (in, out)."""
    weight = _tensor(module, "weight")
    if is_conv1d(module) and weight is not None:
        yield weight, MatrixMap(transposed=True)


def conv1d_attention(module: nn.Module) -> Iterator[tuple[Tensor, MatrixMap]]:
    """GPT-2-style attention: the forward splits the output of ``c_attn`` (a ``Conv1D``) into parts
    of ``split_size`` (q, k, v; k, v in cross-attention, where ``q_attn`` makes q), a matrix each."""
    c_attn, size = getattr(module, "c_attn", None), getattr(module, "split_size", None)
    if not is_conv1d(c_attn) or not isinstance(size, int) or size <= 0:
        return
    nf, weight = getattr(c_attn, "nf", None), _tensor(c_attn, "weight")
    if isinstance(nf, int) and nf % size == 0 and weight is not None:
        yield weight, MatrixMap(split=(size,) * (nf // size), transposed=True)


def _tensor(module: object, name: str) -> Tensor | None:
    """``module.name`` where it is a tensor (a rule checks the layout it relies on)."""
    value = getattr(module, name, None)
    return value if isinstance(value, Tensor) else None


def is_conv1d(module: object) -> bool:
    # The class is looked up where it lives, never imported: a model holding one has loaded it.
    pytorch_utils = sys.modules.get("transformers.pytorch_utils")
    conv1d_class = getattr(pytorch_utils, "Conv1D", None)
    return conv1d_class is not None and isinstance(module, conv1d_class)


def multihead_attention(module: nn.Module) -> Iterator[tuple[Tensor, MatrixMap]]:
    """``nn.MultiheadAttention`` with equal q/k/v dims packs their projections in
    ``in_proj_weight`` ``(3E, E)``, rows in the order query, key, value."""
    if isinstance(module, nn.MultiheadAttention):
        weight = module.in_proj_weight  # None where the dims differ (q, k and v weights apart)
        if weight is not None:
            e = module.embed_dim
            yield weight, MatrixMap(split=(e, e, e))


RULES: tuple[Rule, ...] = (
    experts_by_class_name,
    conv1d,
    fused_experts,
    dbrx_experts,
    conv1d_attention,
    multihead_attention,
)


#: Module types (subclasses too) whose ``weight`` is a matrix, conv weights as ``(out, in·k…)``.
MATRIX_LAYERS: tuple[type[nn.Module], ...] = (
    nn.Linear,
    nn.Bilinear,
    nn.Conv1d,
    nn.Conv2d,
    nn.Conv3d,
    nn.ConvTranspose1d,
    nn.ConvTranspose2d,
    nn.ConvTranspose3d,
)

#: Class-name endings of an MoE router (Transformers' ``...TopKRouter``, ``Llama4Router``, ...).
ROUTER_CLASS_ENDINGS = ("Router",)


def matrix_weights(model: nn.Module) -> set[int]:
    """The ids of the parameters that are a layer's matrix, recognised by module type or map: the
    ``weight`` of :data:`MATRIX_LAYERS` and Transformers' ``Conv1D`` (:func:`layer_weight`),
    ``nn.MultiheadAttention``'s input projections, every parameter a rule of :func:`detected_maps`
    speaks for; nothing else, however many dims it has."""
    ids: set[int] = set()
    for module in model.modules():
        if isinstance(module, MATRIX_LAYERS) or is_conv1d(module):
            ids |= {id(p) for p in layer_weight(module)}
        elif isinstance(module, nn.MultiheadAttention):
            for name in ("in_proj_weight", "q_proj_weight", "k_proj_weight", "v_proj_weight"):
                p = getattr(module, name, None)
                if isinstance(p, nn.Parameter):
                    ids.add(id(p))
    ids |= set(detected_maps(model))
    return ids


def layer_weight(module: nn.Module) -> list[Tensor]:
    """The parameter(s) holding a matrix layer's ``weight`` (if parametrised, e.g. weight or spectral
    norm, the tensors of its shape it is computed from)."""
    parametrizations = getattr(module, "parametrizations", None)
    if parametrize.is_parametrized(module, "weight") and isinstance(parametrizations, nn.ModuleDict):
        shape = module.weight.shape
        return [p for p in parametrizations["weight"].parameters() if p.shape == shape]
    found: list[Tensor] = [
        p
        for name in ("weight_orig", "weight_v")
        if isinstance(p := getattr(module, name, None), nn.Parameter)
    ]
    weight = dict(module.named_parameters(recurse=False)).get("weight")
    if weight is not None and not isinstance(weight, nn.parameter.UninitializedParameter):
        found.append(weight)
    return found


def router_weights(model: nn.Module) -> set[int]:
    """The ids of the >=2-D parameters of MoE routers: modules of :data:`ROUTER_CLASS_ENDINGS`, and
    children named ``gate``, ``router``, ``*_gate``, ``*_router`` (Qwen-MoE's ``shared_expert_gate``)
    of a module holding experts (a child ``experts`` or a stack): no dense MLP's ``gate_proj``."""
    routers: list[nn.Module] = []
    for module in model.modules():
        if type(module).__name__.endswith(ROUTER_CLASS_ENDINGS):
            routers.append(module)
        children = dict(module.named_children())
        if not any(name == "experts" or is_experts(child) for name, child in children.items()):
            continue
        routers += [
            child
            for name, child in children.items()
            if name in ("gate", "router") or name.endswith(("_gate", "_router"))
        ]
    return {id(p) for r in routers for p in r.parameters() if p.ndim >= 2}


def is_experts(module: nn.Module) -> bool:
    return type(module).__name__.endswith("Experts") or experts_flags(module) is not None
