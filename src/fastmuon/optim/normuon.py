"""NorMuon and AdaMuon, the optimizers; the update is :mod:`fastmuon.rules.second_moment`'s."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import Tensor
from torch.optim.optimizer import ParamsT

from ..distributed.dtensor import is_dtensor
from ..ns.matrices import MatrixMapSpec
from ..ns.planner import DEFAULT_MAX_BUCKET_BYTES, CostModel
from ..rules.second_moment import ADAMUON, NORMUON
from ..step.contracts import Rule
from ..step.elementwise import RMS_SCALE
from ..step.moments import RESCALES
from ..step.nonfinite import DEFAULT_NONFINITE
from ..step.options import ArgumentTypeError
from .base import MatrixOptimizer
from .muon import ADAMW_BETAS, ADAMW_EPS, ADAMW_LR, Muon, muon_settings
from .qk_clip import DEFAULT_ALPHA
from .validation import check_fraction, check_nonnegative

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


class _SecondMomentMuon(Muon):
    """Muon with a second moment of the orthogonalised update (see the subclasses)."""

    def _validate_group(self, group: dict[str, Any], where: str) -> None:
        super()._validate_group(group, where)
        check_fraction("beta2", group["beta2"], where)
        check_nonnegative("moment_eps", group["moment_eps"], where)
        rescale = group["rescale"]
        if rescale not in RESCALES:
            raise ValueError(f"unknown rescale {rescale!r} in {where}; choose one of {RESCALES}")
        if rescale == "rms" and group["adjust_lr_fn"] not in (None, "none"):
            raise ValueError(
                f"adjust_lr_fn={group['adjust_lr_fn']!r} in {where} has no effect with rescale='rms' "
                "(the rescale sets every matrix's update RMS); set adjust_lr_fn=None (or 'none'), or "
                "rescale='norm' to keep NS's norm and apply Muon's lr factor"
            )
        for j, p in enumerate(group["params"]):
            if is_dtensor(p) and self.rule.is_matrix(group, p):
                raise ValueError(
                    f"{self._param_name(group, j)} in {where} is an FSDP2-sharded (DTensor) matrix; "
                    f"{type(self).__name__}'s statistics of the whole update are not computed across "
                    "shards yet: use Muon for sharded matrices, or replicate them (DDP)"
                )


class NorMuon(_SecondMomentMuon):
    """NorMuon (Li et al., arXiv 2510.05491): Muon whose orthogonalised update is divided, row by
    row, by the root of an EMA of its mean square per row (per neuron), then rescaled.

    Every argument of :class:`~fastmuon.Muon` is taken with its meaning and default, plus, per group:

    Args:
        beta2: ``β₂`` in [0, 1) of the per-row second moment (default 0.95, the paper's).
        moment_eps: ``ε`` in ``O/(√v + ε)`` (default 1e-8, dion's).
        rescale: ``"norm"`` (default): keep the Frobenius norm NS gave and apply Muon's lr
            factor ``adjust_lr_fn`` (the authors' code, dion, modded-nanogpt: Muon's learning
            rates carry over); ``"rms"``: the paper's Algorithm 1, an update of RMS 0.2 (AdamW's),
            with no lr factor (``adjust_lr_fn`` must be None or ``"none"``).

    A matrix's state adds ``second_moment``, one entry per row of each of its matrices (in map
    order), in the group's ``state_dtype``; FSDP2-sharded matrices are refused (use Muon there).

    Examples:
        Muon's param groups and learning rates carry over (``rescale="norm"``, the default):

        >>> import torch, fastmuon
        >>> model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
        >>> opt = fastmuon.NorMuon(fastmuon.param_groups(model), lr=0.02, beta2=0.95)
        >>> model(torch.randn(32, 8)).square().mean().backward()
        >>> opt.step()
        >>> opt.state[model[0].weight]["second_moment"].shape  # one entry per row (neuron)
        torch.Size([16])

        The paper's update of RMS 0.2, which takes no lr factor (``adjust_lr_fn`` left None):

        >>> opt = fastmuon.NorMuon(fastmuon.param_groups(model), lr=0.02, rescale="rms")
    """

    _rule: ClassVar[Rule] = NORMUON

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
        beta2: float = 0.95,
        moment_eps: float = 1e-8,
        rescale: str = "norm",
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
        # Muon's options, then the variant's group options: Muon's constructor does no more
        defaults, options = muon_settings(locals())
        defaults.update(beta2=beta2, moment_eps=moment_eps, rescale=rescale)
        MatrixOptimizer.__init__(self, params, defaults, options, process_group)


class AdaMuon(_SecondMomentMuon):
    """AdaMuon (Si et al., arXiv 2507.11005): Muon of the momentum's sign whose orthogonalised
    update is divided elementwise by the root of an EMA of its square, then rescaled to RMS 0.2.

    Every argument of :class:`~fastmuon.Muon` is taken, with its meaning and default except
    ``nesterov`` (False here: the paper's momentum is plain), plus, per group:

    Args:
        beta2: ``β₂`` in [0, 1) of the elementwise second moment (default 0.95).
        moment_eps: ``ε`` in ``O/(√v + ε)`` (default 1e-8).
        sign_momentum: orthogonalise ``sign(M)`` (default True, the paper's sign-stabilised
            update); False orthogonalises ``M`` (the paper's first version, pytorch-optimizer's).
        rescale: ``"rms"`` (default): the paper's RMS-aligned rescale, ``0.2·√(mn)/‖Ô‖_F``, with
            no lr factor (``adjust_lr_fn`` must be None or ``"none"``); ``"norm"``: keep NS's
            Frobenius norm and apply ``adjust_lr_fn``.

    A matrix's state adds ``second_moment``, of the parameter's shape, in the group's ``state_dtype``.

    Examples:
        Muon's param groups, with a learning rate near AdamW's (the update has AdamW's RMS):

        >>> import torch, fastmuon
        >>> model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
        >>> opt = fastmuon.AdaMuon(fastmuon.param_groups(model), lr=0.04, adamw_lr=3e-4)
        >>> model(torch.randn(32, 8)).square().mean().backward()
        >>> opt.step()
        >>> opt.state[model[0].weight]["second_moment"].shape  # the parameter's shape
        torch.Size([16, 8])
    """

    _rule: ClassVar[Rule] = ADAMUON

    def __init__(
        self,
        params: ParamsT,
        lr: float | Tensor = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = False,
        ns_coefficients: Any = (3.4445, -4.775, 2.0315),
        eps: float = 1e-7,
        ns_steps: int | None = None,
        adjust_lr_fn: str | None = None,
        *,
        beta2: float = 0.95,
        moment_eps: float = 1e-8,
        sign_momentum: bool = True,
        rescale: str = "rms",
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
        defaults.update(beta2=beta2, moment_eps=moment_eps, rescale=rescale, sign_momentum=sign_momentum)
        MatrixOptimizer.__init__(self, params, defaults, options, process_group)

    def _validate_group(self, group: dict[str, Any], where: str) -> None:
        super()._validate_group(group, where)
        if not isinstance(group["sign_momentum"], bool):
            raise ArgumentTypeError(
                f"sign_momentum in {where} must be True or False, got {group['sign_momentum']!r}"
            )
