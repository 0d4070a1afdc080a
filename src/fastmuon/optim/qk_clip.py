"""QK-clip, MuonClip's stabiliser (Kimi K2 technical report, arXiv 2507.20534), in one place: after
an update, each attention head ``h`` whose largest pre-softmax logit ``S_h`` in the step exceeded
``τ`` has its query and key rows scaled so that its logits shrink by ``γ_h = τ / S_h``.

**Attention parts.** A parameter's entry in the group key ``attention`` names the layer whose
logits it feeds, its side, and how its rows (dim 0; a bias's entries alike) split into heads:

- ``{"layer": L, "part": "query", "heads": H}``: each query head's rows scaled by ``γ_h^α``;
- ``{"layer": L, "part": "key", "heads": K}``: a key head serves ``H/K`` query heads (GQA) and
  takes ``(min γ over them)^(1−α)``, so that every head's logits end at or below ``τ``;
- ``{"layer": L, "part": "mla_query", "heads": H, "nope_dim": n, "rope_dim": r}``: multi-head
  latent attention's query (DeepSeek-V3's ``q_b_proj``), each head ``n`` content rows taking
  ``γ_h^α``, then ``r`` rotary rows taking ``γ_h`` (the shared rotary key is not scaled);
- ``{"layer": L, "part": "mla_key_value", "heads": H, "nope_dim": n, "v_dim": v}``: MLA's
  ``kv_b_proj``, each head ``n`` content-key rows taking ``γ_h^(1−α)``, then ``v`` value rows.

With ``α = 1/2`` the MLA rule is the report's: ``√γ`` on ``q_C`` and ``k_C``, ``γ`` on ``q_R``,
nothing on the shared ``k_R``. Parts are plain dicts, so they travel in ``state_dict()``.

**Parts read off known models** (:func:`detected_parts`, by 🤗 Transformers' forward): Llama-family
``q_proj``/``k_proj`` as ``(heads, head_dim)`` per token, with ``config.num_attention_heads`` query
and ``config.num_key_value_heads`` key heads, but not where queries and keys are normalised per
head (Qwen3, Gemma 3, OLMo 2), as scaling the projection would not change their logits; DeepSeek-V3
(and V2) MLA's ``q_b_proj`` (or ``q_proj``) and ``kv_b_proj``. A part's ``layer`` is the attention
module's name, the key of its maxima in :class:`~fastmuon.qk_clip.LogitMaxRecorder`'s.

``opt.step(logit_maxima=...)`` checks the maxima before the update, so that a refused step changes
nothing; a clipping step given no maxima updates as usual, clips nothing, and says so once.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from ..distributed.dtensor import is_dtensor
from ..distributed.inflight import collective_device
from ..ns import device
from .validation import is_number

#: The sides a parameter can take in QK-clip.
PARTS = ("query", "key", "mla_query", "mla_key_value")

#: The keys of a part beyond ``layer``, ``part`` and ``heads``, by side.
_DIMS = {
    "query": (),
    "key": (),
    "mla_query": ("nope_dim", "rope_dim"),
    "mla_key_value": ("nope_dim", "v_dim"),
}


@dataclass(frozen=True)
class AttentionPart:
    """A parsed attention part; ``dims``: MLA's per-head row counts (content, then rotary or value)."""

    layer: str
    part: str
    heads: int
    dims: tuple[int, ...] = ()

    @property
    def is_query(self) -> bool:
        """A query side: its heads are the logits' heads, one maximum each."""
        return self.part in ("query", "mla_query")

    def check(self, shape: tuple[int, ...]) -> None:
        """Refuse a part whose heads do not tile dim 0 of a tensor of ``shape``."""
        if not shape:
            raise ValueError("a scalar has no rows to split into heads")
        rows = shape[0]
        per_head = sum(self.dims)
        if self.dims and rows != self.heads * per_head:
            names = " + ".join(_DIMS[self.part])
            raise ValueError(
                f"its {rows} rows are not {self.heads} heads of {names} = {per_head} rows: "
                "give the layer's head count and per-head dims"
            )
        if not self.dims and rows % self.heads:
            raise ValueError(f"its {rows} rows do not split into {self.heads} heads of equal size")

    def check_maxima(self, count: int) -> None:
        """Refuse a layer's maxima (``count`` query heads) that this part cannot be scaled by."""
        if self.is_query and count != self.heads:
            raise ValueError(f"{count} per-head maxima for a part of {self.heads} query heads")
        if not self.is_query and count % self.heads:
            raise ValueError(
                f"{count} per-head maxima: not a whole number of query heads for each of its "
                f"{self.heads} key heads"
            )

    def row_factors(self, gamma: Tensor, alpha: float, rows: int) -> Tensor:
        """Each row's factor, ``(rows,)``, from the layer's per-query-head ``γ`` (float32)."""
        if self.part == "query":
            return (gamma**alpha).repeat_interleave(rows // self.heads)
        if self.part == "key":
            shared = gamma.view(self.heads, -1).amin(dim=1)  # each key head's query heads
            return (shared ** (1 - alpha)).repeat_interleave(rows // self.heads)
        first, second = self.dims
        content = gamma ** (alpha if self.part == "mla_query" else 1 - alpha)
        rest = gamma if self.part == "mla_query" else torch.ones_like(gamma)
        blocks = [content[:, None].expand(-1, first), rest[:, None].expand(-1, second)]
        return torch.cat(blocks, dim=1).reshape(-1)

    def plain(self) -> dict[str, Any]:
        """The part as the dict it parses from."""
        spec: dict[str, Any] = {"layer": self.layer, "part": self.part, "heads": self.heads}
        spec.update(zip(_DIMS[self.part], self.dims))
        return spec


def parse_part(spec: Any) -> AttentionPart | None:
    """The part a group's ``attention`` entry describes (None: the parameter takes no part)."""
    if spec is None:
        return None
    if isinstance(spec, AttentionPart):
        return spec
    if not isinstance(spec, Mapping):
        raise ValueError(
            f"an attention entry is a dict such as {{'layer': 'model.layers.0.self_attn', 'part': "
            f"'query', 'heads': 8}}, or None; got {spec!r}"
        )
    part = spec.get("part")
    if part not in PARTS:
        raise ValueError(f"attention entry {dict(spec)!r}: 'part' must be one of {PARTS}")
    wanted = ("layer", "part", "heads", *_DIMS[part])
    unknown = sorted(set(spec) - set(wanted), key=str)
    missing = [k for k in wanted if k not in spec]
    if unknown or missing:
        raise ValueError(
            f"attention entry {dict(spec)!r}: a {part!r} part takes exactly the keys {wanted}"
            + (f"; unknown {unknown}" if unknown else "")
            + (f"; missing {missing}" if missing else "")
        )
    layer = spec["layer"]
    if not isinstance(layer, str) or not layer:
        raise ValueError(f"attention entry {dict(spec)!r}: 'layer' must be the attention layer's name")
    counts = [spec[k] for k in ("heads", *_DIMS[part])]
    if not all(isinstance(c, int) and not isinstance(c, bool) and c > 0 for c in counts):
        raise ValueError(f"attention entry {dict(spec)!r}: {', '.join(wanted[2:])} must be positive integers")
    return AttentionPart(layer, part, counts[0], tuple(counts[1:]))


def parts_of(entries: Any, count: int) -> list[AttentionPart | None]:
    """A group's ``attention`` value (absent, or a list with one entry per parameter) parsed."""
    if entries is None:
        return [None] * count
    if not isinstance(entries, (list, tuple)) or len(entries) != count:
        raise ValueError(
            f"attention must be a list with one entry per parameter ({count}), each a part dict or "
            f"None; got {entries!r}"
        )
    return [parse_part(e) for e in entries]


def clip_factors(maxima: Tensor, tau: float) -> Tensor:
    """``γ_h = τ/S_h`` where ``S_h > τ``, else 1 (float32). A maximum that is not finite (an
    overflowed forward) leaves its head alone: ``τ/∞`` would zero the head's weights."""
    maxima = maxima.to(torch.float32)
    over = torch.isfinite(maxima) & (maxima > tau)
    return torch.where(over, tau / maxima, torch.ones_like(maxima))


def clip_(param: Tensor, part: AttentionPart, gamma: Tensor, alpha: float) -> None:
    """Scale ``param``'s rows in place by the part's factors (1 where no head was over ``τ``:
    an exact no-op, so the clip needs no host read to decide)."""
    factors = part.row_factors(gamma.to(param.device), alpha, param.shape[0])
    param.mul_(factors.view(-1, *([1] * (param.ndim - 1))))


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
    """Llama-family attention: see the module docstring's parts read off known models."""
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
    """DeepSeek's multi-head latent attention: see the module docstring's parts read off known models."""
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


TAU, ALPHA, ATTENTION = "qk_clip_tau", "qk_clip_alpha", "attention"
DEFAULT_ALPHA = 0.5

#: How a step's maxima are handed in, as the fixes in messages name it.
HOW_TO_PASS = (
    "pass opt.step(logit_maxima=...) or attach a recorder: fastmuon.qk_clip.LogitMaxRecorder(model)"
    ".attach(opt)"
)
GROUPS_FIX = (
    "build the groups with fastmuon.param_groups(model, attention=True) (Llama-family and "
    "DeepSeek-V3 attention), or give each query/key parameter's part in the group's 'attention' list"
)


def check_group(group: dict[str, Any], where: str, param_name: Callable[[int], str]) -> None:
    """``qk_clip_tau``, ``qk_clip_alpha`` and the ``attention`` parts of a (filled) group."""
    tau = group.get(TAU)
    if tau is not None and not (is_number(tau) and tau > 0):
        raise ValueError(
            f"invalid {TAU} {tau!r} in {where}: it must be a finite number > 0 (the largest "
            "pre-softmax attention logit a head keeps; Kimi K2 used 100), or None to turn QK-clip off"
        )
    alpha = group.get(ALPHA, DEFAULT_ALPHA)
    if not (is_number(alpha) and 0 <= alpha <= 1):
        raise ValueError(
            f"invalid {ALPHA} {alpha!r} in {where}: it must be a number in [0, 1] (the share of the "
            f"clip the queries take, the keys the rest; {DEFAULT_ALPHA} splits it evenly)"
        )
    try:
        parts = parts_of(group.get(ATTENTION), len(group["params"]))
    except ValueError as e:
        raise ValueError(f"{e} ({ATTENTION} in {where})") from None
    for j, (p, part) in enumerate(zip(group["params"], parts)):
        if part is None:
            continue
        try:
            part.check(tuple(p.shape))
        except ValueError as e:
            raise ValueError(f"{param_name(j)} in {where}: attention part {part.plain()}: {e}") from None
        if is_dtensor(p):
            raise ValueError(
                f"{param_name(j)} in {where} is an FSDP2-sharded (DTensor) parameter with an attention "
                "part; QK-clip scales whole heads' rows and does not run on shards: drop its "
                f"'{ATTENTION}' entry (no clip), or replicate the attention weights (DDP)"
            )


def has_parts(group: Mapping[str, Any]) -> bool:
    entries = group.get(ATTENTION)
    return isinstance(entries, (list, tuple)) and any(e is not None for e in entries)


def refuse_settings_without_parts(
    param_group: Mapping[str, Any], defaults: Mapping[str, Any], where: str
) -> None:
    """A group that sets QK-clip itself must hold attention parts; a value equal to the default is
    not its own (torch fills groups with the defaults, and the dicts may reach another optimizer)."""
    given = [
        k
        for k in (TAU, ALPHA)
        if k in param_group
        and not (k == TAU and param_group[k] is None)
        and not _same(param_group[k], defaults.get(k))
    ]
    if given and not has_parts(param_group):
        raise ValueError(
            f"{given[0]}={param_group[given[0]]!r} in {where}: this group holds no attention query or "
            f"key weights (no '{ATTENTION}' entries), so QK-clip has nothing to scale here; set it on the "
            f"optimizer (it applies to the groups with attention parts) or on those groups, and "
            f"{GROUPS_FIX}"
        )


def _same(value: Any, default: Any) -> bool:
    try:
        return bool(value == default)
    except (TypeError, RuntimeError):  # a tensor of several values: never a default
        return False


def refuse_unreached_default(defaults: Mapping[str, Any], groups: list[dict[str, Any]], name: str) -> None:
    """A constructor's ``qk_clip_tau`` must reach some group's attention parts."""
    tau = defaults.get(TAU)
    if tau is not None and not any(has_parts(g) for g in groups):
        raise ValueError(
            f"{name}({TAU}={tau!r}): no param group holds attention query or key weights (no "
            f"'{ATTENTION}' entries), so QK-clip would scale nothing; {GROUPS_FIX}"
        )


class QKClip:
    """One optimizer's QK-clip; it warns once where a clipping step is given no maxima."""

    def __init__(self) -> None:
        self.warned = False

    def prepare(
        self,
        groups: list[dict[str, Any]],
        maxima: Any,
        param_name: Callable[[dict[str, Any], int], str],
        process_group: Any = None,
        host_reads: bool = True,
    ) -> Callable[[], None]:
        """The step's clip, run after its update; raises, changing nothing, where the maxima do not fit."""
        work = [(g, _parts(g)) for g in groups if g.get(TAU) is not None]
        work = [(g, items) for g, items in work if items]
        if not work:
            return _nothing
        if maxima is None or (isinstance(maxima, Mapping) and not maxima):
            if not self.warned:
                self.warned = True
                warnings.warn(
                    "no attention logit maxima for this step: QK-clip (qk_clip_tau is set) scaled "
                    f"nothing; {HOW_TO_PASS}. Said once per optimizer",
                    UserWarning,
                    stacklevel=5,  # the caller of step(), past torch's hook wrapper and no_grad's
                )
            return _nothing
        layers = self._checked_maxima(work, maxima, param_name)
        if process_group is not None:
            layers = _agreed(layers, process_group)

        def clip() -> None:
            factors: dict[tuple[str, float], Tensor | None] = {}
            for group, items in work:
                tau, alpha = float(group[TAU]), float(group.get(ALPHA, DEFAULT_ALPHA))
                for _, p, part in items:
                    key = (part.layer, tau)
                    if key not in factors:
                        gamma = clip_factors(layers[part.layer], tau)
                        # maxima on the host are free to read: skip a layer with no head over τ
                        idle = host_reads and device.is_host(gamma.device) and not bool((gamma < 1).any())
                        factors[key] = None if idle else gamma
                    factor = factors[key]
                    if factor is not None:
                        clip_(p, part, factor, alpha)

        return clip

    @staticmethod
    def _checked_maxima(
        work: list[tuple[dict[str, Any], list[tuple[int, Tensor, AttentionPart]]]],
        maxima: Any,
        param_name: Callable[[dict[str, Any], int], str],
    ) -> dict[str, Tensor]:
        if not isinstance(maxima, Mapping):
            raise TypeError(
                "logit_maxima must be a dict {attention layer name: per-head maxima} (what "
                f"LogitMaxRecorder.take() returns), got {type(maxima).__name__}"
            )
        layers: dict[str, Tensor] = {}
        for group, items in work:
            for j, _, part in items:
                if part.layer not in maxima:
                    known = ", ".join(repr(k) for k in list(maxima)[:3]) + (
                        ", ..." if len(maxima) > 3 else ""
                    )
                    raise ValueError(
                        f"logit_maxima has no entry for attention layer {part.layer!r} ({param_name(group, j)} is its "
                        f"{part.part}); it has {known}: record every layer the groups name, e.g. with "
                        "LogitMaxRecorder(model) on the model the groups were built from"
                    )
                if part.layer not in layers:
                    layers[part.layer] = _as_maxima(maxima[part.layer], part.layer)
                try:
                    part.check_maxima(layers[part.layer].numel())
                except ValueError as e:
                    raise ValueError(
                        f"logit_maxima[{part.layer!r}] for {param_name(group, j)}: {e}"
                    ) from None
        return layers


def _parts(group: dict[str, Any]) -> list[tuple[int, Tensor, AttentionPart]]:
    """``(index, parameter, part)`` of a group's parameters that take part in QK-clip."""
    parts = parts_of(group.get(ATTENTION), len(group["params"]))
    return [(j, p, part) for j, (p, part) in enumerate(zip(group["params"], parts)) if part is not None]


def _as_maxima(value: Any, layer: str) -> Tensor:
    try:
        t = torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError):
        t = None
    if t is None or t.ndim != 1 or not (t.is_floating_point() or t.dtype in (torch.int32, torch.int64)):
        raise ValueError(
            f"logit_maxima[{layer!r}] must be a 1-D tensor with one maximum per query head, got {value!r}"
        )
    return t.detach().to(torch.float32)


def _agreed(layers: dict[str, Tensor], process_group: Any) -> dict[str, Tensor]:
    """Every rank's maxima combined (largest): ranks see different batches, replicas must clip alike."""
    names = sorted(layers)
    home = layers[names[0]].device
    flat = torch.cat([layers[n].to(home) for n in names])
    flat = flat.to(collective_device(home, process_group))
    torch.distributed.all_reduce(flat, op=torch.distributed.ReduceOp.MAX, group=process_group)
    return dict(zip(names, flat.to(home).split([layers[n].numel() for n in names])))


def _nothing() -> None:
    return None
