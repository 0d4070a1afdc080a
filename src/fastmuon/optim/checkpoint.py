"""Loading state dicts saved by other optimizers, and by older fastmuon versions.

torch's ``load_state_dict`` pairs saved buffers with parameters by position, so another optimizer's
or an older fastmuon's state dict would break or mislead the next step; :func:`adapt_state_dict`
makes it one this optimizer steps from, or refuses it before anything changes.

**Groups.** The saved values win (they carry the run's schedule); a missing key comes from the
optimizer's own group at the same index, then its defaults (a filled ``momentum`` is also the ``β``
the buffers are judged by). Dropped: keys of the source's algorithm alone (SGD's ``dampening``,
AdamW's ``amsgrad``, a variant's ``beta2``), the lr factor between Muon and MuSGD (their factors
scale different learning rates), and keys whose meaning differs: ``weight_decay`` between coupled
(SGD, MuSGD, Adam) and decoupled (AdamW, Muon) decay, ``eps`` between Newton–Schulz's and AdamW's
(AdamW's becomes ``adamw_eps`` in a Muon group holding matrices).

**Buffers.** Each buffer follows one recurrence, its role (:mod:`fastmuon.rules.roles`): ``EMA``,
``M ← β·M + (1−β)·g`` (Muon's ``momentum_buffer``); ``HEAVY_BALL``, ``B ← β·B + g + wd·p`` (torch's
SGD at dampening 0, MuSGD's SGD half); AdamW's ``exp_avg``, ``exp_avg_sq`` and ``step``. A buffer
is carried only where the target's recurrence, run over the same gradients from zeros, would have
produced it: the same role and ``β``; AdamW's ``exp_avg`` as an ``EMA`` when ``betas[0]`` is the
momentum; ``HEAVY_BALL`` ↔ ``EMA`` with the same ``β`` where the heavy ball saw no weight decay,
``B = M / (1−β)`` (both are sums of ``βᵏ·g`` from zero); AdamW's three entries together or not at
all (its bias correction counts from ``step``); a second moment from the same variant with the same
``β₂`` (and AdaMuon's ``sign_momentum``) only. Anything else restarts from zero.

**Which optimizer wrote it.** A fastmuon state dict names its rule under :data:`FAMILY_TAG`; one
without it (another optimizer's, or one through a loader keeping only ``state`` and
``param_groups``, as DCP's) is told by the keys only each family's groups have. fastmuon's MuSGD
saves ``use_muon`` in every group and Ultralytics' buffer names, so Ultralytics' MuSGD loads it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import Tensor

from ..rules import muon as muon_rule
from ..rules import musgd as musgd_rule
from ..rules.roles import (
    ADAM,
    ADAM_AVG,
    ADAM_AVG_SQ,
    ADAM_STEP,
    ELEMENT_MOMENT,
    EMA,
    HEAVY_BALL,
    MUON,
    MUSGD,
    ROW_MOMENT,
    SGD,
)
from ..rules.second_moment import ADAMUON, MOMENTS, NORMUON, StagedRule
from ..step.contracts import Rule
from .state import check_state_layout, state_kinds
from .validation import is_number

_ADAM_ROLES = (ADAM_AVG, ADAM_AVG_SQ, ADAM_STEP)

# The group keys each known optimizer family's step reads.
FAMILY_KEYS = {
    SGD: frozenset(
        {
            "lr",
            "momentum",
            "dampening",
            "weight_decay",
            "nesterov",
            "maximize",
            "foreach",
            "differentiable",
            "fused",
        }
    ),
    ADAM: frozenset(
        {
            "lr",
            "betas",
            "eps",
            "weight_decay",
            "amsgrad",
            "maximize",
            "foreach",
            "capturable",
            "differentiable",
            "fused",
            "decoupled_weight_decay",
        }
    ),
    MUON: frozenset(
        {
            "lr",
            "weight_decay",
            "momentum",
            "nesterov",
            "ns_coefficients",
            "eps",
            "ns_steps",
            "adjust_lr_fn",
            "ns_dtype",
            "ns_method",
            "betas",
            "adamw_eps",
            "use_muon",
            "rms_scale",
            "cautious_weight_decay",
            "qk_clip_tau",
            "qk_clip_alpha",
            # NorMuon's and AdaMuon's: their state dicts are Muon's with a second moment
            "beta2",
            "moment_eps",
            "rescale",
            "sign_momentum",
            "state_dtype",
        }
    ),
    MUSGD: frozenset(
        {
            "lr",
            "momentum",
            "weight_decay",
            "nesterov",
            "use_muon",
            "muon",
            "sgd",
            "ns_steps",
            "ns_coefficients",
            "ns_dtype",
            "ns_method",
            "eps",
            "adjust_lr",  # the name fastmuon's MuSGD saved its lr factor under before adjust_lr_fn
            "adjust_lr_fn",
            "rms_scale",
            "state_dtype",
        }
    ),
}
_LR_ALIAS = "adjust_lr"
_STATE_DTYPE = "state_dtype"
_LR_FACTOR_KEYS = frozenset({"adjust_lr_fn", _LR_ALIAS, "rms_scale"})
# the rules whose state dicts load, and each entry they declare (how it may be shaped)
_RULES: tuple[Rule, ...] = (muon_rule, musgd_rule, NORMUON, ADAMUON)
_STATE_KINDS = state_kinds(_RULES)
_MOMENT_ROLES = tuple(MOMENTS)  # each variant's second moment, by its role
#: the state dict entry naming the rule that wrote it
FAMILY_TAG = "fastmuon_family"
_TAGGED: dict[str, Rule] = {"muon": muon_rule, "musgd": musgd_rule, "normuon": NORMUON, "adamuon": ADAMUON}


@dataclass(frozen=True)
class Writer:
    """Who wrote a state dict's groups: the family, and its Muon groups' second moment's role."""

    family: str
    moment: str | None = None


def with_family_tag(saved: dict[str, Any], rule: Rule) -> dict[str, Any]:
    """``saved`` naming ``rule`` under :data:`FAMILY_TAG` (torch's loader, so any other, ignores it)."""
    tag = next((tag for tag, known in _TAGGED.items() if known is rule), None)
    if tag is not None:
        saved[FAMILY_TAG] = tag
    return saved


def tagged_writer(state_dict: dict[str, Any]) -> Writer | None:
    """The writer :data:`FAMILY_TAG` names (None: no tag); ``ValueError`` for an unknown tag."""
    if FAMILY_TAG not in state_dict:
        return None
    tag = state_dict[FAMILY_TAG]
    rule = _TAGGED.get(tag) if isinstance(tag, str) else None
    if rule is None:
        raise ValueError(
            f"state_dict[{FAMILY_TAG!r}] is {tag!r}, not one of {sorted(_TAGGED)}: it was written by "
            "another optimizer or a newer fastmuon; load it there, or delete that entry to have the "
            "groups' keys say which optimizer wrote them"
        )
    return Writer(rule.family, rule.stage.role if isinstance(rule, StagedRule) else None)


# every buffer name a known optimizer writes: the declared ones and torch Adam's amsgrad maximum
_BUFFER_NAMES = frozenset({*_STATE_KINDS, "max_exp_avg_sq"})


class LoadTarget(NamedTuple):
    """What loading needs of the optimizer it loads into (never the optimizer itself)."""

    family: str  # MUSGD or MUON: the rule the buffers must fit
    defaults: dict[str, Any]
    groups: list[dict[str, Any]]  # its param groups, which the saved ones replace
    param_name: Callable[[dict[str, Any], int], str]  # names a parameter in errors
    validate: Callable[[dict[str, Any], str], None]  # raises for a group it would refuse
    state_roles: Callable[[dict[str, Any], Tensor], dict[str, str]]  # the buffers a step keeps
    # per parameter of a group (named by the second argument), the shapes not simply the parameter's
    state_shapes: Callable[[dict[str, Any], str], list[dict[str, tuple[int, ...]]]]


def source_family(saved_group: dict[str, Any], saved_states: list[dict[str, Any]], default: str) -> str:
    """Which optimizer wrote a group of an untagged state dict, from the keys only its family has."""
    if "dampening" in saved_group:
        return SGD
    if "amsgrad" in saved_group:
        return ADAM
    if {"muon", "sgd", "adjust_lr"} & saved_group.keys() or any(
        "momentum_buffer_SGD" in s for s in saved_states
    ):
        return MUSGD  # before Muon's keys: MuSGD saves adjust_lr_fn too
    if {"adjust_lr_fn", "betas", "adamw_eps"} & saved_group.keys():
        return MUON
    if "use_muon" in saved_group:  # Ultralytics' MuSGD saves only this of its own keys
        return MUSGD
    return default  # an older fastmuon of the same class


def _decay_kind(family: str, group: dict[str, Any]) -> str:
    if family == ADAM:  # torch's Adam and AdamW share a class since 2.6; before, the key is absent
        kinds: dict[Any, str] = {True: "decoupled", False: "coupled"}
        return kinds.get(group.get("decoupled_weight_decay"), "unknown")
    return "decoupled" if family == MUON else "coupled"


def _eps_kind(family: str, group: dict[str, Any]) -> str | None:
    if family == SGD:
        return None
    if family == ADAM or (family == MUON and group.get("use_muon") is False):
        return "adamw"
    return "ns"


def adapt_group(into: LoadTarget, saved: dict[str, Any], family: str, own: dict[str, Any]) -> dict[str, Any]:
    """The saved group as the target's group ``own`` (``params`` kept as saved ids)."""
    target = into.family
    keys = into.defaults.keys()
    if family != target:
        saved = {k: v for k, v in saved.items() if k not in _LR_FACTOR_KEYS}
    elif _LR_ALIAS in saved:  # an older fastmuon MuSGD's name for it
        alias = saved[_LR_ALIAS]
        saved = {k: v for k, v in saved.items() if k != _LR_ALIAS}
        saved.setdefault("adjust_lr_fn", alias)
    group = {k: v for k, v in saved.items() if not (k in FAMILY_KEYS.get(family, ()) and k not in keys)}
    if group.get("use_muon", False) is None:
        del group["use_muon"]  # "not set"
    if "weight_decay" in group and _decay_kind(family, saved) != _decay_kind(target, own):
        del group["weight_decay"]
    if "eps" in group and family != target:
        source_eps = _eps_kind(family, saved)
        target_eps = _eps_kind(target, {**own, **group})
        if source_eps != target_eps:
            eps = group.pop("eps")
            if source_eps == "adamw" and "adamw_eps" in keys and "adamw_eps" not in group:
                group["adamw_eps"] = eps
    for key, value in own.items():
        if key != "params":
            group.setdefault(key, value)
    for key, value in into.defaults.items():
        group.setdefault(key, value)
    if _STATE_DTYPE in keys:  # how this optimizer holds its state, not part of the saved run
        group[_STATE_DTYPE] = own.get(_STATE_DTYPE, into.defaults[_STATE_DTYPE])
    return group


def sniffed_writer(saved_group: dict[str, Any], saved_states: list[dict[str, Any]], default: str) -> Writer:
    """:func:`source_family`, with a Muon group's variant: ``beta2`` (AdaMuon: ``sign_momentum``)."""
    family = source_family(saved_group, saved_states, default)
    if family != MUON or "beta2" not in saved_group:
        return Writer(family)
    return Writer(family, ELEMENT_MOMENT if "sign_momentum" in saved_group else ROW_MOMENT)


def _source_roles(writer: Writer, group: dict[str, Any], state: dict[str, Any]) -> dict[str, tuple[str, Any]]:
    """``name -> (role, β)`` of the buffers whose recurrence is known; others: not carried."""
    family = writer.family
    if family == SGD:
        if group.get("maximize") or group.get("dampening", 0) != 0:
            return {}
        return {"momentum_buffer": (HEAVY_BALL, group.get("momentum"))}
    if family == ADAM:
        if group.get("maximize") or (
            _decay_kind(ADAM, group) != "decoupled" and group.get("weight_decay", 0) != 0
        ):
            return {}
        return _adam_roles(group)
    if family == MUON:
        return {
            "momentum_buffer": (EMA, group.get("momentum")),
            **_adam_roles(group),
            **_moment_roles(writer.moment, group),
        }
    muon_half = "momentum_buffer_SGD" in state or group.get("use_muon") is True
    beta = group.get("momentum")
    if muon_half:
        return {"momentum_buffer": (EMA, beta), "momentum_buffer_SGD": (HEAVY_BALL, beta)}
    return {"momentum_buffer": (HEAVY_BALL, beta)}


def _adam_roles(group: dict[str, Any]) -> dict[str, tuple[str, Any]]:
    beta1, beta2 = _betas(group)
    return {"step": (ADAM_STEP, None), "exp_avg": (ADAM_AVG, beta1), "exp_avg_sq": (ADAM_AVG_SQ, beta2)}


def _moment_roles(role: str | None, group: dict[str, Any]) -> dict[str, tuple[str, Any]]:
    """The second moment of a NorMuon or AdaMuon group (``role``; None: Muon's, which keeps none)."""
    if role is None:
        return {}
    return {MOMENTS[role].key: (role, _moment_key(role, group))}


def _moment_key(role: str, group: dict[str, Any]) -> Any:
    """What a second moment's recurrence depends on: ``β₂``, and AdaMuon's ``sign_momentum``."""
    if role == ELEMENT_MOMENT:
        return (group.get("beta2"), group.get("sign_momentum"))
    return group.get("beta2")


def _betas(group: dict[str, Any]) -> tuple[Any, Any]:
    betas = group.get("betas", (0.9, 0.95))
    return tuple(betas) if isinstance(betas, (tuple, list)) and len(betas) == 2 else (None, None)


def carry_buffers(
    source: dict[str, Tensor],
    roles: dict[str, tuple[str, Any]],
    wanted: dict[str, str],
    group: dict[str, Any],
    source_decay: Any,
) -> dict[str, Any]:
    """The target's buffers (name -> tensor) that the source's determine exactly."""
    # a None entry (torch's SGD at momentum 0 wrote one) holds no buffer: it restarts
    by_role = {
        role: (source[name], beta) for name, (role, beta) in roles.items() if source.get(name) is not None
    }
    beta = group.get("momentum")
    out: dict[str, Any] = {}
    for name, role in wanted.items():
        if role == EMA:
            if EMA in by_role and by_role[EMA][1] == beta:
                out[name] = by_role[EMA][0]
            elif ADAM_AVG in by_role and by_role[ADAM_AVG][1] == beta:
                out[name] = by_role[ADAM_AVG][0]
            elif HEAVY_BALL in by_role and by_role[HEAVY_BALL][1] == beta and source_decay == 0:
                out[name] = by_role[HEAVY_BALL][0] * (1 - beta)
        elif role == HEAVY_BALL:
            if HEAVY_BALL in by_role and by_role[HEAVY_BALL][1] == beta:
                out[name] = by_role[HEAVY_BALL][0]
            elif EMA in by_role and by_role[EMA][1] == beta and group.get("weight_decay") == 0:
                out[name] = by_role[EMA][0] / (1 - beta)
        elif role in _MOMENT_ROLES and role in by_role and by_role[role][1] == _moment_key(role, group):
            out[name] = by_role[role][0]
    adam = {role: name for name, role in wanted.items() if role in _ADAM_ROLES}
    betas = _betas(group)
    if (
        adam
        and all(r in by_role for r in _ADAM_ROLES)
        and (by_role[ADAM_AVG][1], by_role[ADAM_AVG_SQ][1]) == betas
    ):
        for role, name in adam.items():
            value = by_role[role][0]
            if role == ADAM_STEP:
                value = (
                    value.detach().to("cpu", torch.float32).reshape(())
                    if isinstance(value, Tensor)
                    else value
                )
                value = (
                    torch.tensor(float(value), dtype=torch.float32)
                    if not isinstance(value, Tensor)
                    else value
                )
            out[name] = value
    # copies: the caller's state dict must not share storage with buffers updated in place
    return {name: v.clone() if isinstance(v, Tensor) else v for name, v in out.items()}


def adapt_state_dict(into: LoadTarget, state_dict: Any) -> dict[str, Any]:
    """``state_dict`` translated for the optimizer ``into`` describes; ``ValueError`` naming the
    group or parameter and the fix where it cannot be used. Changes nothing it reads."""
    check_state_layout(into.groups, into.param_name, state_dict, _STATE_KINDS)
    tagged = tagged_writer(state_dict)
    saved_groups, saved_state = state_dict["param_groups"], state_dict["state"]
    default = into.family
    groups: list[dict[str, Any]] = []
    state: dict[Any, Any] = {}
    owned = set()
    for index, (saved, own) in enumerate(zip(saved_groups, into.groups)):
        where = f"param group {index} of the state dict"
        ids = saved["params"]
        states = [saved_state.get(pid, {}) for pid in ids]
        for j, s in enumerate(states):
            if not isinstance(s, dict):
                raise ValueError(
                    f"{into.param_name(own, j)}: its saved state is a {type(s).__name__}, not a dict "
                    "of buffers; pass an optimizer's state_dict() unchanged"
                )
        writer = tagged or sniffed_writer(saved, states, default)
        family = writer.family
        group = adapt_group(into, saved, family, own)
        candidate = {**group, "params": own["params"]}
        try:
            into.validate(candidate, where)
        except (TypeError, ValueError) as e:
            raise type(e)(
                f"cannot load the state dict: {e}; correct that value in state_dict['param_groups'][{index}], "
                "or load a state dict saved for this model"
            ) from None
        source_decay = saved.get("weight_decay", 0)
        judged = saved if "momentum" in saved else {**saved, "momentum": group.get("momentum")}
        shapes = into.state_shapes(candidate, where)
        for j, (pid, saved_buffers, p) in enumerate(zip(ids, states, own["params"])):
            owned.add(pid)
            roles = _source_roles(writer, judged, saved_buffers)
            _check_buffers(into.param_name(own, j), saved_buffers, roles)
            wanted = into.state_roles(candidate, p)
            carried = carry_buffers(saved_buffers, roles, wanted, group, source_decay)
            _check_shapes(into.param_name(own, j), carried, shapes[j])
            known = roles.keys() | wanted.keys() | _BUFFER_NAMES
            extra = {
                k: v.clone() if isinstance(v, Tensor) else v
                for k, v in saved_buffers.items()
                if k not in known
            }
            merged = {**extra, **carried}
            if merged:  # in the saved order, so a same-optimizer round trip is the same dict
                in_saved_order = {k: merged[k] for k in saved_buffers if k in merged}
                state[pid] = {**in_saved_order, **merged}
        groups.append(group)
    for key, value in saved_state.items():
        if key not in owned:
            state[key] = value  # kept as torch keeps state of no parameter
    return {"state": state, "param_groups": groups}


def _check_buffers(owner: str, buffers: dict[str, Any], roles: dict[str, tuple[str, Any]]) -> None:
    """Every buffer read here must be a real floating tensor (``step``: a number)."""
    for name in roles.keys() | (_BUFFER_NAMES & buffers.keys()):
        value = buffers.get(name)
        if value is None:
            continue
        where = f"{owner}: saved state {name!r}"
        if name == "step":
            ok = is_number(value) or (
                isinstance(value, Tensor) and value.numel() == 1 and not value.is_complex()
            )
            if not ok:
                raise ValueError(f"{where} is {value!r}, not a step count; drop it to restart AdamW's count")
        elif not (isinstance(value, Tensor) and value.is_floating_point()):
            kind = f"a {value.dtype} tensor" if isinstance(value, Tensor) else repr(value)
            raise ValueError(
                f"{where} is {kind}, not a floating-point buffer; drop that entry to restart it from zero"
            )


def _check_shapes(owner: str, carried: dict[str, Any], shapes: dict[str, tuple[int, ...]]) -> None:
    """Refuse a carried buffer of a shape the target's step would refuse, before anything changes."""
    for name, shape in shapes.items():
        value = carried.get(name)
        if isinstance(value, Tensor) and tuple(value.shape) != shape:
            raise ValueError(
                f"{owner}: saved state {name!r} has shape {tuple(value.shape)} but the group's matrix "
                f"map needs {shape}; load it with the matrices= map it was saved with, or drop that "
                "entry to restart it from zeros"
            )
