"""QK-clip, MuonClip's stabiliser (Kimi K2 technical report, arXiv 2507.20534): after an update,
each attention head ``h`` whose largest pre-softmax logit ``S_h`` in the step exceeded ``τ``
has its query and key rows scaled so that its logits shrink by ``γ_h = τ / S_h``.

A parameter takes part through its *attention part* (the group key ``attention``, one entry per
parameter): the attention layer whose logits it feeds, which side it is, and how its rows
(dim 0: a projection's output rows, and a bias's entries alike) split into heads:

- ``{"layer": L, "part": "query", "heads": H}``: ``H`` query heads of equal rows, each scaled by
  ``γ_h^α``;
- ``{"layer": L, "part": "key", "heads": K}``: ``K`` key heads; with grouped-query attention a
  key head serves ``H/K`` query heads and is scaled by ``(min γ over them)^(1−α)``, the factor of
  the largest of their logits (so that every head's logits end at or below ``τ``);
- ``{"layer": L, "part": "mla_query", "heads": H, "nope_dim": n, "rope_dim": r}``: multi-head
  latent attention's query (DeepSeek-V3's ``q_b_proj``), each head ``n`` content rows then ``r``
  rotary rows; content rows take ``γ_h^α``, rotary rows ``γ_h`` (the shared rotary key is not
  scaled, so the rotary query carries the whole factor);
- ``{"layer": L, "part": "mla_key_value", "heads": H, "nope_dim": n, "v_dim": v}``: MLA's
  key/value up-projection (``kv_b_proj``), each head ``n`` content-key rows, scaled by
  ``γ_h^(1−α)``, then ``v`` value rows, left alone.

With ``α = 1/2`` the MLA rule is the report's: ``√γ`` on ``q_C`` and ``k_C``, ``γ`` on ``q_R``,
nothing on the shared ``k_R``. Parts are plain dicts, so they travel in ``state_dict()``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

#: The sides a parameter can take in QK-clip (see the module docstring).
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
    """A parsed attention part: see the module docstring. ``dims`` are MLA's per-head row counts
    (content then rotary for a query, content then value for a key/value projection)."""

    layer: str
    part: str
    heads: int
    dims: tuple[int, ...] = ()

    @property
    def is_query(self) -> bool:
        """Whether the part is a query side (its heads are the logits' heads, one maximum each)."""
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
