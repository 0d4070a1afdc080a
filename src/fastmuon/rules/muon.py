"""The Muon rule: orthogonalised EMA momentum for matrices, AdamW for everything else. The maths
of ``torch.optim.Muon`` (EMA and Nesterov via ``lerp``, decoupled weight decay
``p ← (1 − lr·wd)·p``, its learning-rate adjustments), extended to >2D weights and mapped matrices."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

from torch import Tensor

from ..ns.engine import ns_config
from ..ns.matrices import MatrixMap
from ..step.adamw import (
    AdamWClasses,
    AdamWItem,
    AdamWProgram,
    AdamWScalars,
    adamw_state,
    single_tensor_adamw,
)
from ..step.collecting import CollectEnv, live_params
from ..step.contracts import COUNT, LIKE_PARAM, AfterNSKind, AfterNSStage, EngineFor
from ..step.driver import TwoHalves, classes_each
from ..step.elementwise import Scalar
from ..step.matrix import (
    MatrixProgram,
    MatrixScalars,
    lr_factor,
    matrix_items,
    matrix_structure,
    single_tensor_matrix_update,
)
from ..step.matrix_item import MatrixItem
from ..step.options import Options
from ..step.state_dtype import group_state_dtype
from .roles import ADAM_AVG, ADAM_AVG_SQ, ADAM_STEP, EMA, MUON

family = MUON
other_update = "AdamW"  # what the parameters it does not orthogonalise take
state_keys: Mapping[str, str] = {
    "momentum_buffer": LIKE_PARAM,
    "exp_avg": LIKE_PARAM,
    "exp_avg_sq": LIKE_PARAM,
    "step": COUNT,
}


class Items(NamedTuple):
    matrices: list[MatrixItem]
    elementwise: list[AdamWItem]


class Pattern(NamedTuple):
    """The equality classes of a step's hyperparameters across groups, and the groups' structure:
    a prepared program fits every step with an equal pattern."""

    beta: tuple[int, ...]
    nesterov: tuple[int, ...]
    lr: tuple[int, ...]
    betas: tuple[int, ...]
    eps: tuple[int, ...]  # AdamW's: a use_muon=False group's eps, else its adamw_eps
    weight_decay: tuple[int, ...]
    structure: tuple[
        Any, ...
    ]  # per group: use_muon, (adjust_lr_fn, rms_scale), NS settings, maps, cautious decay


class Scalars(NamedTuple):
    matrices: MatrixScalars
    elementwise: AdamWScalars


def is_matrix(group: dict[str, Any], p: Tensor) -> bool:
    use_muon = group.get("use_muon")
    return (use_muon if use_muon is not None else p.ndim >= 2) and p.numel() > 0


def state_roles(group: dict[str, Any], p: Tensor) -> dict[str, str]:
    """What each state buffer of ``p`` holds, as :func:`collect` creates them."""
    if is_matrix(group, p):
        return {"momentum_buffer": EMA}
    if group.get("use_muon") is True:
        return {}
    return {"step": ADAM_STEP, "exp_avg": ADAM_AVG, "exp_avg_sq": ADAM_AVG_SQ}


def state_shapes(group: dict[str, Any], p: Tensor, m: MatrixMap) -> dict[str, tuple[int, ...]]:
    """The shape of each buffer not simply shaped like ``p`` (``step`` is a count): none."""
    return {}


def adamw_eps(groups: Sequence[Mapping[str, Any]]) -> list[float]:
    """AdamW's eps: a ``use_muon=False`` group's ``eps``, else ``adamw_eps`` (``eps`` is NS's)."""
    return [g["eps"] if g.get("use_muon") is False else g["adamw_eps"] for g in groups]


def collect(
    groups: Sequence[dict[str, Any]],
    grads: Sequence[Tensor | None],
    env: CollectEnv,
    variant: AfterNSKind | None = None,
) -> Items:
    """The step's items; a ``variant`` gives each group's lr factor mode and its matrices' state."""
    matrices: list[MatrixItem] = []
    others: list[AdamWItem] = []
    for gi, group, members in live_params(groups, grads, env):
        lr, wd = env.lr_value(group["lr"]), group["weight_decay"]
        use_muon = group.get("use_muon")
        config = ns_config(group)
        adjust, rms_scale = lr_factor(group, gi, "original")
        if variant is not None:
            adjust = variant.adjust(group)
        cautious = group.get("cautious_weight_decay", False)
        (eps,) = adamw_eps([group])
        maps = env.maps(group, gi)
        state_dtype = group_state_dtype(group, gi)
        for j, p, grad, index in members:
            state = env.state[p]
            if is_matrix(group, p):
                made = matrix_items(
                    maps[j],
                    p,
                    grad,
                    state,
                    beta=group["momentum"],
                    nesterov=bool(group["nesterov"]),
                    base=lr,
                    adjust=adjust,
                    rms_scale=rms_scale,
                    config=config,
                    group=gi,
                    index=index,
                    decay=1 - lr * wd,
                    parts=env.parts_of(p),
                    cautious=cautious,
                    state_dtype=state_dtype,
                )
                if variant is not None:
                    variant.attach(group, p, maps[j], state, made, env)
                matrices += made
            elif use_muon is not True:
                exp_avg, exp_avg_sq, step = adamw_state(state, p, env.capturable, state_dtype)
                others.append(
                    AdamWItem(
                        p,
                        grad,
                        exp_avg,
                        exp_avg_sq,
                        step,
                        lr,
                        tuple(group["betas"]),
                        eps,
                        wd,
                        group=gi,
                        index=index,
                    )
                )
    return Items(matrices, others)


def scalars(groups: Sequence[dict[str, Any]], lr_value: Callable[[Any], Scalar]) -> tuple[Pattern, Scalars]:
    lr = [lr_value(g["lr"]) for g in groups]
    wd = [g["weight_decay"] for g in groups]
    beta = [g["momentum"] for g in groups]
    nesterov = [bool(g["nesterov"]) for g in groups]  # a group may hold an integer, as torch's do
    decay = [1 - r * w for r, w in zip(lr, wd)]
    betas = [tuple(g["betas"]) for g in groups]
    eps = adamw_eps(groups)
    structure = tuple(
        (matrix_structure(g, i, "original"), g.get("cautious_weight_decay", False))
        for i, g in enumerate(groups)
    )
    beta_c, nesterov_c, lr_c, betas_c, eps_c, wd_c = classes_each(beta, nesterov, lr, betas, eps, wd)
    pattern = Pattern(beta_c, nesterov_c, lr_c, betas_c, eps_c, wd_c, structure)
    return pattern, Scalars(MatrixScalars(beta, nesterov, lr, decay), AdamWScalars(lr, betas, eps, wd))


def build(
    items: Items,
    pattern: Pattern,
    engine_for: EngineFor,
    options: Options,
    stage: Callable[[list[MatrixItem]], AfterNSStage] | None = None,
) -> TwoHalves:
    """The batched program; ``stage``: a variant's stage after NS over the program's matrices."""
    adamw_classes = AdamWClasses(pattern.lr, pattern.betas, pattern.eps, pattern.weight_decay)
    return TwoHalves(
        MatrixProgram(items.matrices, pattern.lr, engine_for, stage, flagged=options.nonfinite != "ignore"),
        AdamWProgram(items.elementwise, adamw_classes, options.capturable, options.nonfinite != "ignore"),
    )


def reference(items: Items, after_ns: Callable[[MatrixItem, Tensor], Tensor] | None = None) -> None:
    """The same update, one parameter at a time (``after_ns``: a variant's stage)."""
    single_tensor_matrix_update(items.matrices, after_ns)
    single_tensor_adamw(items.elementwise)
