"""MuSGD, the optimizer: its constructor and group checks; the update is :mod:`fastmuon.rules.musgd`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import Tensor
from torch.optim.optimizer import ParamsT

from ..ns.matrices import MatrixMapSpec
from ..ns.planner import DEFAULT_MAX_BUCKET_BYTES, CostModel
from ..rules import musgd as musgd_rule
from ..step.contracts import Rule
from ..step.elementwise import ADJUST_LR, ADJUST_LR_ALIAS, RMS_SCALE
from ..step.nonfinite import DEFAULT_NONFINITE
from ..step.options import ArgumentTypeError, Options, check_foreach
from .base import MatrixOptimizer
from .validation import (
    UnsupportedOptionError,
    check_nonnegative,
    implied_ns_steps,
    resolve_alias,
)

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


class MuSGD(MatrixOptimizer):
    """Muon + SGD hybrid (a drop-in for Ultralytics' MuSGD), batched across all matrices.

    A matrix (>=2D parameter) in a ``use_muon=True`` group takes, each step, ``lr·muon`` times its
    orthogonalised EMA momentum, then ``lr·sgd`` times an SGD step with coupled weight decay; a
    vector there takes the SGD step alone at ``lr·sgd``; a ``use_muon=False`` group takes plain SGD
    at ``lr`` (see "Update rules" in docs/optimizers.md). As in Ultralytics, a group not setting
    ``use_muon`` takes the constructor's (default False): ``MuSGD(model.parameters())`` is plain
    SGD, and :func:`fastmuon.param_groups` builds the usual split.

    The positional arguments are Ultralytics' MuSGD's (order, defaults), the rest keyword-only;
    ``opt.muon`` and ``opt.sgd`` set every group's mixing factors, as Ultralytics' attributes do.

    Args:
        params: parameters, ``(name, parameter)`` pairs, or param groups (dicts); a group may set
            any of the per-group hyperparameters below.
        lr: learning rate (a float, or a 1-element tensor).
        momentum: ``β`` in [0, 1): of the Muon EMA and of the SGD heavy-ball momentum alike.
        weight_decay: coupled (L2) weight decay of the SGD step, ``g' = g + weight_decay·p``.
        nesterov: Nesterov momentum in both halves (a bool, or an integer read as its truth value).
        use_muon: the ``use_muon`` of groups that do not set it.
        muon: the factor on ``lr`` for the Muon half.
        sgd: the factor on ``lr`` for the SGD half of parameters in ``use_muon`` groups.
        ns_steps, ns_coefficients, eps: Newton–Schulz's iteration count (None: the preset's),
            coefficients (a preset name such as "jordan") and eps, as in :class:`~fastmuon.Muon`.
        ns_dtype: the dtype the iteration runs in (bf16 by default, as Ultralytics).
        ns_method: "auto" (the cheapest accurate formulation per bucket: Gram-space NS for wide
            fp32 buckets; on CPUs, where bf16 NS runs in fp32, the eigendecomposition route where
            it costs less; see planner.choose_method), "standard", "gram", "eigh".
        matrices: how each tensor maps to matrices ("flatten": conv kernels, linear weights), as
            in :class:`~fastmuon.Muon`.
        policy: how matrices are batched ("auto", "exact", "min_launches"); optimizer-wide.
        adjust_lr_fn: the per-matrix factor ``s``: "ultralytics", "original", "match_rms_adamw",
            "spectral_unclamped", "none" (Muon's name; ``adjust_lr``, keyword or group key, is its alias).
        rms_scale: the RMS ``adjust_lr_fn="match_rms_adamw"`` aims at, as in :class:`~fastmuon.Muon`.
        foreach: ``None`` or ``True``: the batched path; ``False``: the per-parameter reference loop.
        compile: run each bucket's NS through ``torch.compile`` (worth it on GPUs; once per shape).
        max_bucket_bytes, cost_model: planner memory cap and cost constants (``None``: the
            built-in constants per device type; ``"calibrate"``: measured once on this machine).
        process_group: with DDP (replicated parameters), each rank orthogonalises only its share
            of the matrices and the results are exchanged; FSDP2 DTensor parameters need nothing.
        nonfinite: what a NaN/Inf gradient does: "raise" (default, naming the parameter; on an
            accelerator it is skipped and the next ``step()`` or ``state_dict()`` raises, so no step
            waits for the device), "skip" that parameter for the step, or "ignore".
        capturable: read nothing on the host during a step (a tensor ``lr`` stays a tensor, no fused
            CPU kernel, no host-side NS range check), so that a CUDA graph can capture it (see
            "Host time" in docs/performance.md); it needs ``nonfinite`` "skip" or "ignore".
        owner_group_size, max_exchange_bytes: the distributed step over DTensors (FSDP2, HSDP,
            tensor and expert parallel; see docs/distributed.md). A matrix costing more than a
            rank's fair share of NS is orthogonalised by an owner group: ``None`` (default) sizes
            it per matrix (2, 4, ... up to a node), ``1`` keeps whole-matrix owners, ``g`` splits
            over ``g`` ranks (dividing them). Exchange rounds stay within ``max_exchange_bytes``
            per rank (``None``: its shard in the NS dtype or, if larger, all its buffers in 2 GiB).
        cautious_weight_decay: False only (named so that it is refused with the reason): cautious
            decay is defined for decoupled decay, and MuSGD's is coupled (use :class:`~fastmuon.Muon`).
        state_dtype: a group's momentum buffers' dtype: ``None`` (default) each parameter's own, or
            e.g. ``torch.bfloat16`` to halve fp32 state, computed in float32 and rounded once when
            stored ("Low-memory state" in docs/optimizers.md); loaded state is cast to it.

    The batched step runs a program built on the first step and reused while the parameters
    with gradients, their layouts and the equality classes of the groups' hyperparameters stay
    the same (values are read each step). ``load_state_dict`` also takes Ultralytics' MuSGD's,
    ``torch.optim`` SGD's, Muon's and AdamW's state dicts; Ultralytics' MuSGD loads what it saves.

    Examples:
        Matrices take Muon and SGD, the rest plain SGD, split by :func:`fastmuon.param_groups`:

        >>> import torch, fastmuon
        >>> model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
        >>> opt = fastmuon.MuSGD(fastmuon.param_groups(model), lr=0.02, momentum=0.9, nesterov=True)
        >>> [g["use_muon"] for g in opt.param_groups]
        [True, False, False]
        >>> model(torch.randn(32, 8)).square().mean().backward()
        >>> opt.step()
    """

    _rule: ClassVar[Rule] = musgd_rule
    _lr_factor_alias = ADJUST_LR_ALIAS  # ``adjust_lr``: MuSGD's second name for ``adjust_lr_fn``

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
        ns_steps: int | None = None,
        ns_coefficients: Any = "jordan",
        ns_dtype: torch.dtype = torch.bfloat16,
        eps: float = 1e-7,
        ns_method: str = "auto",
        matrices: MatrixMapSpec | list = "flatten",  # type: ignore[type-arg]  # the annotation inspect shows
        policy: str = "auto",
        adjust_lr_fn: str = "ultralytics",
        rms_scale: float = RMS_SCALE,
        adjust_lr: str | None = None,
        foreach: bool | None = None,
        max_bucket_bytes: int = DEFAULT_MAX_BUCKET_BYTES,
        cost_model: CostModel | str | None = None,
        compile: bool = False,
        process_group: ProcessGroup | None = None,
        nonfinite: str = DEFAULT_NONFINITE,
        capturable: bool = False,
        owner_group_size: int | None = None,
        max_exchange_bytes: int | None = None,
        cautious_weight_decay: bool = False,
        state_dtype: torch.dtype | None = None,
    ):
        if cautious_weight_decay is not False:
            raise cautious_decay_refusal("the constructor's arguments")
        defaults = dict(
            lr=lr,
            momentum=momentum,
            weight_decay=weight_decay,
            nesterov=nesterov,
            use_muon=use_muon,
            muon=muon,
            sgd=sgd,
            ns_steps=implied_ns_steps(ns_steps, ns_coefficients),
            ns_coefficients=ns_coefficients,
            ns_dtype=ns_dtype,
            ns_method=ns_method,
            matrices=matrices,
            eps=eps,
            adjust_lr_fn=resolve_alias(adjust_lr_fn, adjust_lr, "adjust_lr_fn", "adjust_lr", "ultralytics"),
            rms_scale=rms_scale,
            state_dtype=state_dtype,
        )
        options = Options(
            foreach=check_foreach(foreach),
            policy=policy,
            compile=compile,
            max_bucket_bytes=max_bucket_bytes,
            cost_model=cost_model,
            nonfinite=nonfinite,
            capturable=capturable,
            owner_group_size=owner_group_size,
            max_exchange_bytes=max_exchange_bytes,
        )
        super().__init__(params, defaults, options, process_group)

    # Ultralytics' attributes; here group values (one may differ): read the default, set every group
    @property
    def muon(self) -> float:
        value: float = self.defaults["muon"]
        return value

    @muon.setter
    def muon(self, value: float) -> None:
        self._set_everywhere("muon", value)

    @property
    def sgd(self) -> float:
        value: float = self.defaults["sgd"]
        return value

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
        if group["adjust_lr_fn"] not in ADJUST_LR:
            raise ValueError(
                f"unknown adjust_lr_fn {group['adjust_lr_fn']!r} in {where}; choose one of {ADJUST_LR}"
            )
        if group.get("cautious_weight_decay", False) is not False:
            raise cautious_decay_refusal(where)
        if group.get("qk_clip_tau") is not None:
            raise UnsupportedOptionError(
                f"qk_clip_tau in {where}: MuSGD does not take QK-clip; use Muon, NorMuon or AdaMuon "
                "for it, or leave qk_clip_tau unset"
            )
        self._check_matrix_maps(group, where)


def cautious_decay_refusal(where: str) -> UnsupportedOptionError:
    """Why MuSGD refuses ``cautious_weight_decay``, the same as a keyword and as a group key."""
    return UnsupportedOptionError(
        f"cautious_weight_decay in {where}: MuSGD does not take it, as its weight decay is coupled "
        "(L2 inside the SGD momentum) and cautious decay is defined for decoupled decay; use Muon, "
        "NorMuon or AdaMuon for it, or leave cautious_weight_decay unset (False)"
    )
