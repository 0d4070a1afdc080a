"""MuSGD: a Muon step and an SGD step on every matrix, SGD alone on everything else.

The hybrid Ultralytics trains YOLO26 detectors with, implemented from its update rule (see the
README's table) with batched Newton–Schulz and fused elementwise work.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ._base import ArgumentTypeError, MatrixOptimizer, check_foreach, check_nonnegative, state_buffer
from .checkpoint import EMA, HEAVY_BALL
from .matrix_update import (
    MatrixItem,
    NSInputs,
    Orthogonalize,
    multi_tensor_matrix_update,
    single_tensor_matrix_update,
)
from .nonfinite import DEFAULT_NONFINITE
from .planner import DEFAULT_MAX_BUCKET_BYTES, CostModel
from .transforms import ADJUST_LR, lr_scale, partition, sgd_momentum_step_


@dataclass
class SGDItem:
    """One tensor's SGD step with coupled weight decay: ``p ← p − lr·(heavy-ball momentum)``."""

    param: Tensor
    grad: Tensor
    buf: Tensor
    beta: float
    nesterov: bool
    weight_decay: float
    lr: float


class MuSGD(MatrixOptimizer):
    """Muon + SGD hybrid (a drop-in for Ultralytics' MuSGD), batched across all matrices.

    A matrix (>=2D parameter) in a ``use_muon=True`` group takes, each step, ``lr·muon`` times its
    orthogonalised EMA momentum and then ``lr·sgd`` times an SGD step with coupled weight decay;
    a vector in such a group takes the SGD step alone at ``lr·sgd``; every parameter of a
    ``use_muon=False`` group takes plain SGD at ``lr`` (see the README's "Update rules"). As in
    Ultralytics, a group that does not set ``use_muon`` takes the constructor's ``use_muon``
    (default False), so ``MuSGD(model.parameters())`` is plain SGD; :func:`fastmuon.param_groups`
    builds the usual split.

    The positional arguments are Ultralytics' MuSGD's, in its order and with its defaults; the
    rest are keyword-only. ``opt.muon`` and ``opt.sgd`` read and set the mixing factors of every
    group, as Ultralytics' attributes of the same names do.

    Args:
        params: parameters, ``(name, parameter)`` pairs, or param groups (dicts); a group may set
            any of the hyperparameters below except the optimizer-wide ones (policy, foreach,
            compile, max_bucket_bytes, cost_model, process_group, nonfinite).
        lr: learning rate (a float, or a 1-element tensor).
        momentum: ``β`` in [0, 1): of the Muon EMA and of the SGD heavy-ball momentum alike.
        weight_decay: coupled (L2) weight decay of the SGD step, ``g' = g + weight_decay·p``.
        nesterov: Nesterov momentum in both halves (a bool).
        use_muon: the ``use_muon`` of groups that do not set it.
        muon: the factor on ``lr`` for the Muon half.
        sgd: the factor on ``lr`` for the SGD half of parameters in ``use_muon`` groups.
        ns_steps, ns_coefficients, eps: the Newton–Schulz iteration count, coefficients (a
            preset name such as "jordan", one ``(a, b, c)`` or one per step) and the norm's eps.
        ns_dtype: the dtype the iteration runs in (bf16 by default, as Ultralytics).
        ns_method: "auto" (the cheapest accurate formulation per bucket: Gram-space NS for wide
            fp32 buckets; on CPUs, where bf16 NS runs in fp32, the eigendecomposition route where
            it costs less, e.g. from 256 rows on 1 thread; see planner.choose_method),
            "standard", "gram", "eigh".
        policy: how matrices are batched ("auto", "exact", "min_launches"); optimizer-wide.
        adjust_lr: the per-matrix factor ``s``: "ultralytics", "original", "match_rms_adamw",
            "spectral_unclamped", "none".
        foreach: ``None`` or ``True``: the batched path; ``False``: the plain per-parameter loop
            (the reference path).
        compile: run each bucket's NS through ``torch.compile`` (worth it on GPUs; compiles
            once per bucket shape).
        max_bucket_bytes, cost_model: planner memory cap and cost constants (``None``: the
            built-in constants per device type; ``"calibrate"``: measured once on this machine).
        process_group: with DDP (replicated parameters), each rank orthogonalises only its share
            of the matrices and the results are exchanged; FSDP2 DTensor parameters need nothing.
        nonfinite: a NaN/Inf gradient "raise"s (default, naming the parameter), "skip"s that
            parameter for the step (weights and state untouched, no host sync) or is "ignore"d.

    ``load_state_dict`` also takes state dicts of Ultralytics' MuSGD, ``torch.optim`` SGD, Muon
    and AdamW (see :mod:`fastmuon.checkpoint`); what it saves loads into Ultralytics' MuSGD.
    """

    def __init__(
        self,
        params,
        lr: float | Tensor = 1e-3,
        momentum: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        use_muon: bool = False,
        muon: float = 0.5,
        sgd: float = 0.5,
        *,
        ns_steps: int = 5,
        ns_coefficients: Any = "jordan",
        ns_dtype: torch.dtype = torch.bfloat16,
        eps: float = 1e-7,
        ns_method: str = "auto",
        policy: str = "auto",
        adjust_lr: str = "ultralytics",
        foreach: bool | None = None,
        max_bucket_bytes: int = DEFAULT_MAX_BUCKET_BYTES,
        cost_model: CostModel | str | None = None,
        compile: bool = False,
        process_group=None,
        nonfinite: str = DEFAULT_NONFINITE,
    ):
        defaults = dict(
            lr=lr,
            momentum=momentum,
            weight_decay=weight_decay,
            nesterov=nesterov,
            use_muon=use_muon,
            muon=muon,
            sgd=sgd,
            ns_steps=ns_steps,
            ns_coefficients=ns_coefficients,
            ns_dtype=ns_dtype,
            ns_method=ns_method,
            eps=eps,
            adjust_lr=adjust_lr,
        )
        self.foreach = check_foreach(foreach)
        super().__init__(
            params,
            defaults,
            policy=policy,
            max_bucket_bytes=max_bucket_bytes,
            cost_model=cost_model,
            compile=compile,
            process_group=process_group,
            nonfinite=nonfinite,
        )

    # Ultralytics keeps ``muon`` and ``sgd`` as optimizer attributes; here they are group values
    # (so one group may differ), and these properties read the default and set every group.
    @property
    def muon(self) -> float:
        return self.defaults["muon"]

    @muon.setter
    def muon(self, value: float) -> None:
        self._set_everywhere("muon", value)

    @property
    def sgd(self) -> float:
        return self.defaults["sgd"]

    @sgd.setter
    def sgd(self, value: float) -> None:
        self._set_everywhere("sgd", value)

    def _set_everywhere(self, key: str, value: float) -> None:
        check_nonnegative(key, value, f"{type(self).__name__}.{key}")
        self.defaults[key] = value
        for group in self.param_groups:
            group[key] = value

    def validate_group(self, group: dict[str, Any], where: str) -> None:
        super().validate_group(group, where)
        if not isinstance(group["use_muon"], bool):
            raise ArgumentTypeError(f"use_muon in {where} must be True or False, got {group['use_muon']!r}")
        check_nonnegative("muon", group["muon"], where)
        check_nonnegative("sgd", group["sgd"], where)
        if group["adjust_lr"] not in ADJUST_LR:
            raise ValueError(
                f"unknown adjust_lr {group['adjust_lr']!r} in {where}; choose one of {ADJUST_LR}"
            )

    @staticmethod
    def state_roles(group: dict[str, Any], p: Tensor) -> dict[str, str]:
        """What each state buffer of ``p`` holds (see :mod:`fastmuon.checkpoint`), as ``_collect``
        creates them."""
        if not group["use_muon"]:
            return {"momentum_buffer": HEAVY_BALL}
        if p.ndim >= 2 and p.numel() > 0:
            return {"momentum_buffer": EMA, "momentum_buffer_SGD": HEAVY_BALL}
        return {"momentum_buffer_SGD": HEAVY_BALL}

    def _collect(self) -> tuple[list[MatrixItem], list[SGDItem]]:
        matrices: list[MatrixItem] = []
        elementwise: list[SGDItem] = []
        for group in self.param_groups:
            lr, beta, nesterov = self.float_lr(group), group["momentum"], group["nesterov"]
            muon_group = group["use_muon"]
            config = self.ns_config(group)
            for j, p in enumerate(group["params"]):
                grad = self.grad_of(p)
                if grad is None:
                    continue
                self.check_grad(group, j, grad)
                state = self.state[p]
                if muon_group and p.ndim >= 2 and p.numel() > 0:
                    matrices.append(
                        MatrixItem(
                            p,
                            grad,
                            state_buffer(state, "momentum_buffer", p),
                            beta,
                            nesterov,
                            lr * group["muon"] * lr_scale(group["adjust_lr"], p.shape),
                            config,
                        )
                    )
                key = "momentum_buffer_SGD" if muon_group else "momentum_buffer"
                elementwise.append(
                    SGDItem(
                        p,
                        grad,
                        state_buffer(state, key, p),
                        beta,
                        nesterov,
                        group["weight_decay"],
                        lr * (group["sgd"] if muon_group else 1.0),
                    )
                )
        return matrices, elementwise

    def _apply(self, matrices: list[MatrixItem], elementwise: list[SGDItem]) -> None:
        if self.foreach is not False:
            _multi_tensor_musgd(matrices, elementwise, self.orthogonalize, self.ns_inputs)
        else:
            _single_tensor_musgd(matrices, elementwise)


def _multi_tensor_musgd(
    matrices: list[MatrixItem],
    elementwise: list[SGDItem],
    orthogonalize: Orthogonalize,
    ns_inputs: NSInputs | None = None,
) -> None:
    multi_tensor_matrix_update(matrices, orthogonalize, ns_inputs)
    # the SGD half (and plain SGD parameters), on p after the Muon update
    for items in partition(
        elementwise, lambda i: (i.beta, i.nesterov, i.weight_decay, i.param.device, i.param.dtype)
    ).values():
        first = items[0]
        sgd_momentum_step_(
            [i.param for i in items],
            [i.grad for i in items],
            [i.buf for i in items],
            [i.lr for i in items],
            first.beta,
            first.nesterov,
            first.weight_decay,
        )


def _single_tensor_musgd(matrices: list[MatrixItem], elementwise: list[SGDItem]) -> None:
    """The same update, one parameter at a time: the per-parameter reference path."""
    single_tensor_matrix_update(matrices)
    for it in elementwise:
        g = it.grad + it.weight_decay * it.param if it.weight_decay else it.grad
        if it.beta == 0:
            it.buf.copy_(g)
        else:
            it.buf.mul_(it.beta).add_(g)
        u = g + it.beta * it.buf if it.nesterov else it.buf
        it.param.sub_(u * it.lr)
