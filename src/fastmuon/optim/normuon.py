"""NorMuon and AdaMuon, the optimizers: Muon's arguments plus each variant's second-moment
options; the update itself is :mod:`fastmuon.rules.second_moment`'s, one rule for both."""

from __future__ import annotations

from typing import Any, ClassVar

from torch.optim.optimizer import ParamsT

from ..distributed.dtensor import is_dtensor
from ..rules.second_moment import ADAMUON, NORMUON
from ..step.contracts import Rule
from ..step.moments import RESCALES
from .base import MatrixOptimizer
from .muon import Muon, bind_muon_options, with_muon_options
from .validation import ArgumentTypeError, check_fraction, check_nonnegative


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

    Every argument of :class:`~fastmuon.Muon` is taken, with its meaning and default (AdamW for
    the parameters Muon does not take, matrix maps, DDP, ``foreach=False``, ...), plus, per group:

    Args:
        beta2: ``β₂`` in [0, 1) of the per-row second moment (default 0.95, the paper's).
        moment_eps: ``ε`` in ``O/(√v + ε)`` (default 1e-8, dion's).
        rescale: ``"norm"`` (default): keep the Frobenius norm NS gave and apply Muon's lr
            factor ``adjust_lr_fn`` (the authors' code, dion, modded-nanogpt: Muon's learning
            rates carry over); ``"rms"``: the paper's Algorithm 1, an update of RMS 0.2 (AdamW's),
            with no lr factor (``adjust_lr_fn`` must be None or ``"none"``).

    The state of a matrix parameter adds ``second_moment``: a 1-D tensor with one entry per row
    of each of its matrices (of each expert, fused part or head of a matrix map, in the map's
    order), in the group's ``state_dtype`` as Muon's buffers are. FSDP2-sharded matrices are
    refused (use :class:`~fastmuon.Muon` there).

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

    @with_muon_options()
    def __init__(
        self,
        params: ParamsT,
        *args: Any,
        beta2: float = 0.95,
        moment_eps: float = 1e-8,
        rescale: str = "norm",
        **options: Any,
    ):
        # Muon's settings joined by the variant's group options reach the base class at once (Muon's
        # constructor does no more than build them)
        defaults, settings, process_group = bind_muon_options(NorMuon.__init__, self, params, args, options)
        defaults.update(beta2=beta2, moment_eps=moment_eps, rescale=rescale)
        MatrixOptimizer.__init__(self, params, defaults, settings, process_group)


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

    The state of a matrix parameter adds ``second_moment``, of the parameter's shape, in the
    group's ``state_dtype`` as Muon's buffers are.

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

    @with_muon_options(defaults={"nesterov": False})
    def __init__(
        self,
        params: ParamsT,
        *args: Any,
        beta2: float = 0.95,
        moment_eps: float = 1e-8,
        sign_momentum: bool = True,
        rescale: str = "rms",
        **options: Any,
    ):
        defaults, settings, process_group = bind_muon_options(AdaMuon.__init__, self, params, args, options)
        defaults.update(beta2=beta2, moment_eps=moment_eps, rescale=rescale, sign_momentum=sign_momentum)
        MatrixOptimizer.__init__(self, params, defaults, settings, process_group)

    def _validate_group(self, group: dict[str, Any], where: str) -> None:
        super()._validate_group(group, where)
        if not isinstance(group["sign_momentum"], bool):
            raise ArgumentTypeError(
                f"sign_momentum in {where} must be True or False, got {group['sign_momentum']!r}"
            )
