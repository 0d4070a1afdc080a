"""Muon, the optimizer: its constructor and group checks; the update is :mod:`fastmuon.rules.muon`."""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import fields
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import Tensor
from torch.optim.optimizer import ParamsT

from ..ns.matrices import MatrixMapSpec
from ..ns.planner import DEFAULT_MAX_BUCKET_BYTES, CostModel
from ..rules import muon as muon_rule
from ..step.contracts import Rule
from ..step.elementwise import ADJUST_LR, RMS_SCALE
from ..step.nonfinite import DEFAULT_NONFINITE
from ..step.options import ArgumentTypeError, Options, check_foreach
from .base import MatrixOptimizer
from .qk_clip import DEFAULT_ALPHA, refuse_settings_without_parts
from .qk_clip import check_group as check_qk_clip
from .validation import (
    check_fraction,
    check_nonnegative,
    implied_ns_steps,
)

ADAMW_EPS = 1e-8
ADAMW_BETAS = (0.9, 0.95)
ADAMW_LR = 3e-4

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


class Muon(MatrixOptimizer):
    """Muon with batched Newton–Schulz; signature-compatible with ``torch.optim.Muon``.

    Matrices are updated as ``torch.optim.Muon`` does (see "Update rules" in docs/optimizers.md).
    Groups with ``use_muon=False`` (and, where a group does not say, parameters with fewer than 2
    dims) are updated by AdamW; such a parameter in a ``use_muon=True`` group is an error.

    Args:
        params: parameters, ``(name, parameter)`` pairs, or param groups (dicts); a group may set
            ``use_muon`` and any of the per-group hyperparameters below.
        lr: learning rate (a float, or a 1-element tensor) of Muon, and of AdamW in groups
            that hold matrices too.
        weight_decay: decoupled weight decay, ``p ← p·(1 − lr·weight_decay)``, both parts.
        momentum: ``β`` in [0, 1) of Muon's EMA momentum.
        nesterov: Nesterov momentum for Muon (a bool, or an integer read as its truth value).
        ns_coefficients, eps, ns_steps: the Newton–Schulz coefficients (``(a, b, c)``, one per step, or
            a preset name), eps and iteration count; ``ns_steps=None`` (default, also where a group sets
            only ``ns_coefficients``): the preset's count (4 for ``"aol"``), else 5.
        adjust_lr_fn: the per-matrix factor ``s``: ``None``/"original", "match_rms_adamw",
            "spectral_unclamped" (torch's modes), or "ultralytics", "none".
        rms_scale: the update RMS ``adjust_lr_fn="match_rms_adamw"`` aims at: ``s =
            rms_scale·sqrt(max(rows, cols))`` (0.2 as Moonlight and torch; DeepSeek-V4 uses 0.18).
        ns_dtype: the dtype the iteration runs in (bf16 by default, as torch).
        ns_method: "auto", "standard", "gram" or "eigh" (as in :class:`~fastmuon.MuSGD`).
        matrices: how each tensor maps to matrices: "flatten", "experts", "transposed" or a dict
            (see :mod:`fastmuon.ns.matrices`); per group, or a list with one per parameter.
        policy: how matrices are batched ("auto", "exact", "min_launches"); optimizer-wide.
        betas: AdamW's ``(β1, β2)``, default (0.9, 0.95).
        adamw_lr: AdamW's ``lr`` in ``use_muon=False`` groups that set none (default 3e-4: Muon's
            learning rates are far too large for AdamW); groups also holding matrices share ``lr``.
        adamw_eps: AdamW's eps in groups that also hold matrices, default 1e-8; in a
            ``use_muon=False`` group AdamW uses the group's ``eps`` (default 1e-8 there).
        foreach: ``None`` or ``True``: the batched path; ``False``: the per-parameter loop.
        compile, max_bucket_bytes, cost_model: as in :class:`~fastmuon.MuSGD`.
        process_group: DDP's ranks split the NS work (FSDP2 DTensors need none; :mod:`fastmuon.distributed`).
        nonfinite: what a NaN/Inf gradient does, as in :class:`~fastmuon.MuSGD` ("raise" by default).
        cautious_weight_decay: decay a matrix only where its update and the parameter agree in
            sign, ``p ← p − lr·wd·𝟙[u⊙p ≥ 0]⊙p`` (Chen et al., arXiv 2510.12402); per group.
        capturable: as in :class:`~fastmuon.MuSGD`, AdamW's step counts kept on the parameters' devices.
        owner_group_size, max_exchange_bytes: the distributed step's owner groups and exchange
            buffer cap, as in :class:`~fastmuon.MuSGD`.
        qk_clip_tau: QK-clip (MuonClip's, Kimi K2): after each step, every attention head whose
            largest pre-softmax logit ``S`` exceeded ``τ`` has its query and key rows scaled by
            ``(τ/S)^α`` and ``(τ/S)^(1−α)``; None (the default) is off. Per group, on the parts
            its ``attention`` entries name (:func:`fastmuon.param_groups`'s ``attention=``), by the
            maxima given to ``step(logit_maxima=...)``; see "QK-clip (MuonClip)" in docs/optimizers.md.
        qk_clip_alpha: ``α`` in [0, 1], the queries' share of the clip (default 0.5).
        state_dtype: a group's state buffers' dtype (not AdamW's step count), as in :class:`~fastmuon.MuSGD`.

    ``load_state_dict`` also loads state dicts of ``torch.optim`` Muon, AdamW, SGD and Ultralytics' MuSGD.

    Examples:
        Matrices to Muon, the rest (biases, norms, embeddings, the head) to AdamW, split by
        :func:`fastmuon.param_groups`:

        >>> import torch, fastmuon
        >>> model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
        >>> opt = fastmuon.Muon(fastmuon.param_groups(model), lr=0.02, adamw_lr=3e-4)
        >>> [g["use_muon"] for g in opt.param_groups]
        [True, False, False]
        >>> model(torch.randn(32, 8)).square().mean().backward()
        >>> opt.step()
    """

    _rule: ClassVar[Rule] = muon_rule

    def __init__(
        self,
        params: ParamsT,
        lr: float | Tensor = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: Any = (3.4445, -4.775, 2.0315),
        eps: float = 1e-7,
        ns_steps: int | None = None,
        adjust_lr_fn: str | None = None,
        *,
        ns_dtype: torch.dtype = torch.bfloat16,
        ns_method: str = "auto",
        matrices: MatrixMapSpec | list = "flatten",  # type: ignore[type-arg]  # the annotation inspect shows
        policy: str = "auto",
        rms_scale: float = RMS_SCALE,
        betas: tuple[float, float] = ADAMW_BETAS,
        adamw_eps: float = ADAMW_EPS,
        adamw_lr: float = ADAMW_LR,
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
        qk_clip_tau: float | None = None,
        qk_clip_alpha: float = DEFAULT_ALPHA,
        state_dtype: torch.dtype | None = None,
    ):
        defaults, options = muon_settings(locals())
        super().__init__(params, defaults, options, process_group)

    @property
    def adamw_lr(self) -> float:
        """AdamW's learning rate in ``use_muon=False`` groups that set none (fixed at construction)."""
        return self.options.adamw_lr  # type: ignore[return-value]

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if isinstance(param_group, dict):
            refuse_settings_without_parts(param_group, self.defaults, f"param group {len(self.param_groups)}")
        if isinstance(param_group, dict) and param_group.get("use_muon") is False:
            adamw_defaults = {"eps": ADAMW_EPS, "lr": self.adamw_lr}
            missing = {k: v for k, v in adamw_defaults.items() if k not in param_group}
            if missing:
                param_group = {**param_group, **missing}
        super().add_param_group(param_group)

    def _validate_group(self, group: dict[str, Any], where: str) -> None:
        super()._validate_group(group, where)
        mode = group["adjust_lr_fn"]
        if mode is not None and mode not in ADJUST_LR:
            raise ValueError(f"unknown adjust_lr_fn {mode!r} in {where}; choose None or one of {ADJUST_LR}")
        betas = group["betas"]
        if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
            raise ValueError(f"betas in {where} must be a pair (beta1, beta2), got {betas!r}")
        check_fraction("betas[0]", betas[0], where)
        check_fraction("betas[1]", betas[1], where)
        check_nonnegative("adamw_eps", group["adamw_eps"], where)
        if not isinstance(group.get("cautious_weight_decay", False), bool):
            raise ArgumentTypeError(
                f"cautious_weight_decay in {where} must be True or False, "
                f"got {group['cautious_weight_decay']!r}"
            )
        if group.get("use_muon") is True:
            for j, p in enumerate(group["params"]):
                if p.ndim < 2:
                    raise ValueError(
                        f"{self._param_name(group, j)} is in a use_muon=True group of {where} but has "
                        f"{p.ndim} dim(s); Muon orthogonalises matrices only: move it to a group "
                        "with use_muon=False (AdamW)"
                    )
        self._check_matrix_maps(group, where)
        check_qk_clip(group, where, lambda j: self._param_name(group, j))


def muon_options() -> tuple[str, ...]:
    """Muon's constructor arguments but ``params`` and ``process_group`` (held apart)."""
    names = tuple(inspect.signature(Muon.__init__).parameters)
    return tuple(n for n in names[2:] if n != "process_group")


def muon_settings(arguments: Mapping[str, Any]) -> tuple[dict[str, Any], Options]:
    """The group defaults and options of :class:`Muon`'s arguments among ``arguments`` (a
    constructor call's ``locals()``, Muon's or a variant's); a variant adds its own group options."""
    defaults = {name: arguments[name] for name in muon_options()}
    defaults["ns_steps"] = implied_ns_steps(defaults["ns_steps"], defaults["ns_coefficients"])
    check_foreach(defaults["foreach"])
    check_nonnegative("adamw_lr", defaults["adamw_lr"], "Muon")
    options = Options(**{f.name: defaults.pop(f.name) for f in fields(Options)})
    return defaults, options
