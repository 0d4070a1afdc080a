"""QK-clip in the optimizers: its group options, and the clip a step applies after its update.

Per group: ``qk_clip_tau`` (None: off; else the largest pre-softmax logit a head keeps),
``qk_clip_alpha`` (the share of the clip the queries take, in [0, 1]) and ``attention`` (which
parameters are attention queries and keys, see :mod:`fastmuon.step.qk_clip`). A step takes the
maxima as an argument, ``opt.step(logit_maxima={layer: per-head maxima})``, checked before the
update so that a refused step changes nothing; a step with clipping groups and no maxima updates
as usual, clips nothing, and says so once.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

from ..distributed.dtensor import is_dtensor
from ..distributed.inflight import collective_device
from ..ns import device
from ..step.qk_clip import AttentionPart, clip_, clip_factors, parts_of
from .validation import is_number

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
    """A group that sets QK-clip itself must hold attention parts (the constructor's setting
    applies to the groups that do). A value equal to the optimizer's default is no setting of the
    group's own: torch fills every stored group dict with the defaults, and the same dicts may be
    handed to another optimizer."""
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
    """One optimizer's QK-clip: checks a step's maxima against its groups, and scales the query
    and key rows after the update; warns once where a clipping step is given no maxima."""

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
        """The clip of one step, to run after its update; raises (changing nothing) where the
        maxima do not fit the groups' parts. ``host_reads=False`` (a capturable step) reads no
        value: every part is scaled, by 1 where no head is over τ."""
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
                        # where the maxima are on the host, reading them is free: a layer with no
                        # head over τ is skipped (its factors are all 1, the product unchanged)
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
    """Every rank's maxima combined (their largest): data-parallel ranks see different batches,
    and replicated weights must be clipped alike. The all-reduce runs where the group's backend
    takes tensors (NCCL: on the GPU, whatever device the maxima were recorded on); the
    combined maxima come back to where the first layer's were."""
    names = sorted(layers)
    home = layers[names[0]].device
    flat = torch.cat([layers[n].to(home) for n in names])
    flat = flat.to(collective_device(home, process_group))
    torch.distributed.all_reduce(flat, op=torch.distributed.ReduceOp.MAX, group=process_group)
    return dict(zip(names, flat.to(home).split([layers[n].numel() for n in names])))


def _nothing() -> None:
    return None
