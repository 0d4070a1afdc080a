"""MuSGD: a Muon step and an SGD step on every matrix, SGD alone on everything else.

The hybrid Ultralytics trains YOLO26 detectors with, implemented from its update rule (see
"Update rules" in docs/optimizers.md) with batched Newton–Schulz and fused elementwise work.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from torch.optim.optimizer import ParamsT

from ._base import ArgumentTypeError, MatrixOptimizer, check_foreach, check_nonnegative, state_buffer
from .checkpoint import EMA, HEAVY_BALL
from .matrices import MatrixMapSpec, maps_key
from .matrix_update import (
    MatrixItem,
    MatrixProgram,
    MatrixScalars,
    single_tensor_matrix_update,
)
from .nonfinite import DEFAULT_NONFINITE
from .planner import DEFAULT_MAX_BUCKET_BYTES, CostModel
from .program import Gather, Scalar, apply_scaled_, classes, scale_limit, strides_of
from .transforms import ADJUST_LR, foreach_scalar, fusable, partition

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


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
    group: int = 0  # the param group it belongs to (whose hyperparameters a program reads)
    index: int = 0  # its position among the step's parameters with gradients
    muon_group: bool = False  # lr·sgd (a Muon-group parameter's SGD half) rather than lr


class MuSGD(MatrixOptimizer):
    """Muon + SGD hybrid (a drop-in for Ultralytics' MuSGD), batched across all matrices.

    A matrix (>=2D parameter) in a ``use_muon=True`` group takes, each step, ``lr·muon`` times its
    orthogonalised EMA momentum and then ``lr·sgd`` times an SGD step with coupled weight decay;
    a vector in such a group takes the SGD step alone at ``lr·sgd``; every parameter of a
    ``use_muon=False`` group takes plain SGD at ``lr`` (see "Update rules" in docs/optimizers.md). As in
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
        matrices: how each tensor maps to the matrices NS orthogonalises: "flatten" (conv
            kernels, linear weights), "experts", "transposed" or a dict (see
            :mod:`fastmuon.matrices`); per group, or a list with one per parameter.
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
        capturable: read nothing on the host during a step (a tensor ``lr`` stays a tensor, no
            fused CPU kernel, no host-side NS range check), so that with ``nonfinite`` "skip" or
            "ignore" a step can be captured in a CUDA graph (see "Host time" in docs/performance.md).

    The batched step runs a program built on the first step and reused while the parameters
    with gradients, their layouts and the equality classes of the groups' hyperparameters stay
    the same; the hyperparameters' values are read from the groups at every step.

    ``load_state_dict`` also takes state dicts of Ultralytics' MuSGD, ``torch.optim`` SGD, Muon
    and AdamW (see :mod:`fastmuon.checkpoint`); what it saves loads into Ultralytics' MuSGD.
    """

    def __init__(
        self,
        params: ParamsT,
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
        matrices: MatrixMapSpec | list = "flatten",
        policy: str = "auto",
        adjust_lr: str = "ultralytics",
        foreach: bool | None = None,
        max_bucket_bytes: int = DEFAULT_MAX_BUCKET_BYTES,
        cost_model: CostModel | str | None = None,
        compile: bool = False,
        process_group: ProcessGroup | None = None,
        nonfinite: str = DEFAULT_NONFINITE,
        capturable: bool = False,
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
            matrices=matrices,
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
            capturable=capturable,
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

    def _validate_group(self, group: dict[str, Any], where: str) -> None:
        super()._validate_group(group, where)
        if not isinstance(group["use_muon"], bool):
            raise ArgumentTypeError(f"use_muon in {where} must be True or False, got {group['use_muon']!r}")
        check_nonnegative("muon", group["muon"], where)
        check_nonnegative("sgd", group["sgd"], where)
        if group["adjust_lr"] not in ADJUST_LR:
            raise ValueError(
                f"unknown adjust_lr {group['adjust_lr']!r} in {where}; choose one of {ADJUST_LR}"
            )
        self._check_matrix_maps(group, where)

    @staticmethod
    def _is_matrix(group: dict[str, Any], p: Tensor) -> bool:
        return group["use_muon"] and p.ndim >= 2 and p.numel() > 0

    @staticmethod
    def _state_roles(group: dict[str, Any], p: Tensor) -> dict[str, str]:
        """What each state buffer of ``p`` holds (see :mod:`fastmuon.checkpoint`), as ``_collect``
        creates them."""
        if not group["use_muon"]:
            return {"momentum_buffer": HEAVY_BALL}
        if MuSGD._is_matrix(group, p):
            return {"momentum_buffer": EMA, "momentum_buffer_SGD": HEAVY_BALL}
        return {"momentum_buffer_SGD": HEAVY_BALL}

    def _collect(
        self, params: list[Tensor], grads: list[Tensor | None]
    ) -> tuple[list[MatrixItem], list[SGDItem]]:
        matrices: list[MatrixItem] = []
        elementwise: list[SGDItem] = []
        flat = 0
        live = 0
        for gi, group in enumerate(self.param_groups):
            lr, beta, nesterov = self._lr_value(group["lr"]), group["momentum"], group["nesterov"]
            muon_group = group["use_muon"]
            config = self._ns_config(group)
            maps = self._check_matrix_maps(group, f"param group {gi}")
            for j, p in enumerate(group["params"]):
                grad = grads[flat]
                flat += 1
                if grad is None:
                    continue
                index, live = live, live + 1
                self._check_grad(group, j, grad)
                state = self.state[p]
                if self._is_matrix(group, p):
                    matrices += self._matrix_items(
                        maps[j],
                        p,
                        grad,
                        state,
                        beta=beta,
                        nesterov=nesterov,
                        base=lr * group["muon"],
                        adjust=group["adjust_lr"],
                        config=config,
                        group=gi,
                        index=index,
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
                        group=gi,
                        index=index,
                        muon_group=muon_group,
                    )
                )
        return matrices, elementwise

    def _step_scalars(self) -> tuple[Hashable, MuSGDScalars]:
        groups = self.param_groups
        lr = [self._lr_value(g["lr"]) for g in groups]
        beta = [g["momentum"] for g in groups]
        nesterov = [g["nesterov"] for g in groups]
        wd = [g["weight_decay"] for g in groups]
        base = [r * g["muon"] for r, g in zip(lr, groups)]
        lr_sgd = [r * g["sgd"] for r, g in zip(lr, groups)]
        lr_plain = [r * 1.0 for r in lr]
        structure = tuple(
            (g.get("use_muon"), g["adjust_lr"], self._ns_config(g), maps_key(g.get("matrices")))
            for g in groups
        )
        pattern = (
            classes(beta),
            classes(nesterov),
            classes(wd),
            classes(base),
            classes(lr_sgd + lr_plain),
            tuple(b == 0 for b in beta),
            structure,
        )
        return pattern, MuSGDScalars(
            MatrixScalars(beta, nesterov, base), beta, nesterov, wd, lr_sgd, lr_plain
        )

    def _build_program(self, items, pattern, engine_for) -> MuSGDProgram:
        matrices, elementwise = items
        base_class, lr_class = pattern[3], pattern[4]
        return MuSGDProgram(
            MatrixProgram(matrices, base_class, engine_for),
            SGDProgram(elementwise, lr_class, len(self.param_groups), fused_ok=not self.capturable),
        )

    def _apply_reference(self, matrices: list[MatrixItem], elementwise: list[SGDItem]) -> None:
        _single_tensor_musgd(matrices, elementwise)


@dataclass
class MuSGDScalars:
    """This step's hyperparameters, one entry per param group."""

    matrices: MatrixScalars
    beta: list[float]
    nesterov: list[bool]
    weight_decay: list[float]
    lr_sgd: list[Scalar]  # lr·sgd: the SGD half of a Muon-group parameter
    lr_plain: list[Scalar]  # lr: a plain SGD parameter


class SGDProgram:
    """The SGD half (and plain SGD) prepared once: per (β, nesterov, wd, device, dtype), torch's
    fused kernel per learning rate where it is exact (:func:`~fastmuon.transforms.fusable`),
    else foreach calls with one scale class per learning rate."""

    def __init__(self, items: list[SGDItem], lr_class: Sequence[int], num_groups: int, fused_ok: bool):
        def lr_key(i: SGDItem) -> int:  # classes over lr_sgd + lr_plain, as _step_scalars lists them
            return lr_class[i.group + (0 if i.muon_group else num_groups)]

        self.fused: list[tuple[int, list[Tensor], Gather, list[Tensor], int, list, list]] = []
        self.rest: list[tuple[int, list[Tensor], Gather, list[Tensor], list, list]] = []
        parts = partition(
            items, lambda i: (i.beta, i.nesterov, i.weight_decay, i.param.device, i.param.dtype)
        )
        for part in parts.values():
            by_kernel = partition(
                part, lambda i: fused_ok and bool(i.beta) and fusable(i.param, i.grad, i.buf)
            )
            g = part[0].group
            for by_lr in partition(by_kernel.get(True, []), lr_key).values():
                first = by_lr[0]
                self.fused.append(
                    (
                        g,
                        [i.param for i in by_lr],
                        Gather([i.index for i in by_lr]),
                        [i.buf for i in by_lr],
                        lr_key(first),
                        [i.grad.stride() for i in by_lr],
                        [i.param.stride() for i in by_lr],
                    )
                )
            rest = by_kernel.get(False, [])
            if rest:
                by_lr = partition(range(len(rest)), lambda k, rest=rest: lr_key(rest[k]))
                self.rest.append(
                    (
                        g,
                        [i.param for i in rest],
                        Gather([i.index for i in rest]),
                        [i.buf for i in rest],
                        [(Gather(idx), [rest[k].param for k in idx]) for idx in by_lr.values()],
                        [lr_key(rest[idx[0]]) for idx in by_lr.values()],
                    )
                )
        self.num_groups = num_groups
        self.limit = scale_limit(items[0].param.device) if items else 0

    def fits(self, grads: Sequence[Tensor]) -> bool:
        """The fused kernel walks memory without looking at strides: gradients and parameters
        must still have the layouts it was chosen for."""
        for _, params, pick, _, _, grad_strides, param_strides in self.fused:
            if strides_of(pick(grads)) != grad_strides or strides_of(params) != param_strides:
                return False
        return True

    def run(self, grads: Sequence[Tensor], s: MuSGDScalars) -> None:
        lr_of = [*s.lr_sgd, *s.lr_plain]  # a class is the index of its first member's value
        for g, params, pick, bufs, c, _, _ in self.fused:
            torch._fused_sgd_(
                params,
                pick(grads),
                bufs,
                weight_decay=s.weight_decay[g],
                momentum=s.beta[g],
                lr=lr_of[c],
                dampening=0.0,
                nesterov=s.nesterov[g],
                maximize=False,
                is_first_step=False,  # B starts at zeros, so β·B + g' is g' on the first step anyway
            )
        for g, params, pick, bufs, by_lr, lr_classes in self.rest:
            foreach_sgd_step_(
                params,
                pick(grads),
                bufs,
                by_lr,
                [lr_of[c] for c in lr_classes],
                s.beta[g],
                s.nesterov[g],
                s.weight_decay[g],
                self.limit,
            )


class MuSGDProgram:
    """A MuSGD step prepared once: the Muon half, then the SGD half on ``p`` after it."""

    def __init__(self, matrices: MatrixProgram, sgd: SGDProgram):
        self.matrices = matrices
        self.sgd = sgd

    def fits(self, grads: Sequence[Tensor]) -> bool:
        return self.sgd.fits(grads)

    def run(self, grads: Sequence[Tensor], scalars: MuSGDScalars, keep: Tensor | None, ns) -> None:
        self.matrices.run(grads, scalars.matrices, ns, keep)
        self.sgd.run(grads, scalars)


def foreach_sgd_step_(
    params: list[Tensor],
    grads: list[Tensor],
    bufs: list[Tensor],
    by_lr: list[tuple[Gather, list[Tensor]]],
    lrs: list[Scalar],
    beta: float,
    nesterov: bool,
    weight_decay: float,
    limit: int,
) -> None:
    """SGD with heavy-ball momentum and coupled weight decay, in place, with foreach ops: with
    ``g' = g + wd·p``, ``B ← β·B + g'`` and ``p ← p − lr·u``, ``u = g' + β·B`` (Nesterov) or ``B``.
    ``by_lr`` picks each learning rate's tensors out of the part (one scale class each).

    Written to allocate at most one list, the decayed gradients, which then take the Nesterov
    update in place; without decay the Nesterov update is applied as two passes over ``p``.
    A fresh list as large as the model costs more than a pass over it on a CPU (yolo26n, 1
    thread: 17 ms for this step against 27 ms with two fresh lists, measured).
    """
    owned = bool(weight_decay)
    if owned:  # g' as new tensors: the gradients themselves are never touched
        grads = torch._foreach_add(grads, params, alpha=weight_decay)
    if beta == 0:  # B = g' exactly (a stale buffer must not leak in)
        torch._foreach_copy_(bufs, grads)
    else:
        torch._foreach_mul_(bufs, foreach_scalar(beta, bufs[0]))
        torch._foreach_add_(bufs, grads)
    class_params = [ps for _, ps in by_lr]

    def apply(updates: list[Tensor], scales: list[Scalar], owned: bool) -> None:
        apply_scaled_(class_params, [pick(updates) for pick, _ in by_lr], scales, owned=owned, limit=limit)

    if not nesterov:
        apply(bufs, lrs, False)
    elif owned:
        torch._foreach_add_(grads, bufs, alpha=beta)
        apply(grads, lrs, True)
    else:
        apply(grads, lrs, False)
        apply(bufs, [lr * beta for lr in lrs], False)


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
