"""The MuSGD rule, Ultralytics' update: a Muon step and then an SGD step on every matrix, SGD
alone on the rest (the factors are in :class:`fastmuon.MuSGD`'s docstring)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

from torch import Tensor

from ..ns.engine import ns_config
from ..ns.matrices import MatrixMap
from ..step.collecting import CollectEnv, live_params
from ..step.contracts import LIKE_PARAM, EngineFor
from ..step.driver import TwoHalves, classes_each
from ..step.elementwise import Scalar
from ..step.matrix import (
    MatrixProgram,
    MatrixScalars,
    lr_factor,
    matrix_items,
    matrix_structure,
    single_tensor_matrix_update,
    state_buffer,
)
from ..step.matrix_item import MatrixItem
from ..step.options import Options
from ..step.sgd import SGDItem, SGDProgram, SGDScalars, single_tensor_sgd
from ..step.state_dtype import group_state_dtype
from .roles import EMA, HEAVY_BALL, MUSGD

family = MUSGD
other_update = "SGD"  # what the parameters it does not orthogonalise take
state_keys: Mapping[str, str] = {"momentum_buffer": LIKE_PARAM, "momentum_buffer_SGD": LIKE_PARAM}


class Items(NamedTuple):
    matrices: list[MatrixItem]
    elementwise: list[SGDItem]


class Pattern(NamedTuple):
    """As :class:`fastmuon.rules.muon.Pattern`: equal patterns share a prepared program."""

    beta: tuple[int, ...]
    nesterov: tuple[int, ...]
    weight_decay: tuple[int, ...]
    muon_lr: tuple[int, ...]  # of lr·muon, the Muon half's scale before its per-matrix factor
    sgd_lr: tuple[int, ...]  # over Scalars.elementwise.lr: every group's lr·sgd, then every group's lr
    zero_beta: tuple[bool, ...]
    structure: tuple[Any, ...]  # per group: use_muon, (adjust_lr_fn, rms_scale), NS settings, matrix maps


class Scalars(NamedTuple):
    matrices: MatrixScalars
    elementwise: SGDScalars


def is_matrix(group: dict[str, Any], p: Tensor) -> bool:
    return bool(group["use_muon"]) and p.ndim >= 2 and p.numel() > 0


def state_roles(group: dict[str, Any], p: Tensor) -> dict[str, str]:
    """What each state buffer of ``p`` holds, as :func:`collect` creates them."""
    if not group["use_muon"]:
        return {"momentum_buffer": HEAVY_BALL}
    if is_matrix(group, p):
        return {"momentum_buffer": EMA, "momentum_buffer_SGD": HEAVY_BALL}
    return {"momentum_buffer_SGD": HEAVY_BALL}


def state_shapes(group: dict[str, Any], p: Tensor, m: MatrixMap) -> dict[str, tuple[int, ...]]:
    """The shape of each buffer not simply shaped like ``p`` (``step`` is a count): none."""
    return {}


def collect(groups: Sequence[dict[str, Any]], grads: Sequence[Tensor | None], env: CollectEnv) -> Items:
    matrices: list[MatrixItem] = []
    elementwise: list[SGDItem] = []
    num_groups = len(groups)
    for gi, group, members in live_params(groups, grads, env):
        lr, beta, nesterov = env.lr_value(group["lr"]), group["momentum"], bool(group["nesterov"])
        muon_group = group["use_muon"]
        config = ns_config(group)
        adjust, rms_scale = lr_factor(group, gi, "ultralytics")
        maps = env.maps(group, gi)
        key = "momentum_buffer_SGD" if muon_group else "momentum_buffer"
        state_dtype = group_state_dtype(group, gi)
        for j, p, grad, index in members:
            state = env.state[p]
            if is_matrix(group, p):
                matrices += matrix_items(
                    maps[j],
                    p,
                    grad,
                    state,
                    beta=beta,
                    nesterov=nesterov,
                    base=lr * group["muon"],
                    adjust=adjust,
                    rms_scale=rms_scale,
                    config=config,
                    group=gi,
                    index=index,
                    parts=env.parts_of(p),
                    state_dtype=state_dtype,
                )
            elementwise.append(
                SGDItem(
                    p,
                    grad,
                    state_buffer(state, key, p, state_dtype),
                    beta,
                    nesterov,
                    group["weight_decay"],
                    lr * (group["sgd"] if muon_group else 1.0),
                    group=gi,
                    index=index,
                    lr_slot=gi if muon_group else num_groups + gi,
                )
            )
    return Items(matrices, elementwise)


def scalars(groups: Sequence[dict[str, Any]], lr_value: Callable[[Any], Scalar]) -> tuple[Pattern, Scalars]:
    lr = [lr_value(g["lr"]) for g in groups]
    beta = [g["momentum"] for g in groups]
    nesterov = [bool(g["nesterov"]) for g in groups]  # a group may hold an integer, as torch's do
    wd = [g["weight_decay"] for g in groups]
    base = [r * g["muon"] for r, g in zip(lr, groups)]
    sgd_lr = [r * g["sgd"] for r, g in zip(lr, groups)] + [r * 1.0 for r in lr]
    structure = tuple(matrix_structure(g, i, "ultralytics") for i, g in enumerate(groups))
    beta_c, nesterov_c, wd_c, base_c, sgd_c = classes_each(beta, nesterov, wd, base, sgd_lr)
    pattern = Pattern(beta_c, nesterov_c, wd_c, base_c, sgd_c, tuple(b == 0 for b in beta), structure)
    return pattern, Scalars(MatrixScalars(beta, nesterov, base), SGDScalars(beta, nesterov, wd, sgd_lr))


def build(items: Items, pattern: Pattern, engine_for: EngineFor, options: Options) -> TwoHalves:
    # a step may be given keep flags; the SGD half masks a tensor by torch's fused kernel only
    masking = options.nonfinite != "ignore" and not options.capturable
    return TwoHalves(
        MatrixProgram(
            items.matrices,
            pattern.muon_lr,
            engine_for,
            mask_packed=masking,
            flagged=options.nonfinite != "ignore",
        ),
        SGDProgram(items.elementwise, pattern.sgd_lr, fused_ok=not options.capturable, masking=masking),
    )


def reference(items: Items) -> None:
    """The same update, one parameter at a time."""
    single_tensor_matrix_update(items.matrices)
    single_tensor_sgd(items.elementwise)
