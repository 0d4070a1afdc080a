"""Third-party Muon implementations a user might pick instead, set up as their own docs show.

Both are optional (``pip install 'fastmuon[peers]'``); a missing one makes its row a skip with
the reason. Each steps a private copy of the tensors: both write into the gradients they are
given (Nesterov blends the momentum into them), which must not change what the others step on.
Non-matrix parameters get each library's own AdamW, as their docs pair them.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import torch

from .contenders import Contender, Unavailable, Unmapped, Workbench, as_2d_matrices

#: the AdamW settings every Muon row uses for the parameters Muon does not take
OTHER_BETAS = (0.9, 0.95)


def import_peer(module: str, distribution: str) -> tuple[ModuleType, str]:
    """The peer's module and installed version, or :class:`Unavailable` naming the extra to install."""
    try:
        version = importlib.metadata.version(distribution)
        return importlib.import_module(module), version
    except importlib.metadata.PackageNotFoundError:
        raise Unavailable(f"{distribution} is not installed (pip install 'fastmuon[peers]')") from None
    except Exception as e:  # installed but does not load beside this torch
        raise Unavailable(f"{distribution} failed to import: {type(e).__name__}: {e}") from None


def _needs_muon(wb: Workbench, library: str) -> None:
    if wb.optimizer != "muon":
        raise Unavailable(f"{library} is compared as a Muon optimizer: run with --optimizer muon")


def _split(wb: Workbench) -> tuple[Unmapped, list[dict[str, Any]]]:
    """The workbench's groups split into Muon's matrices and the rest, on a private copy; mapped
    matrix parameters as 2-D views of their matrices (see :func:`.contenders.as_2d_matrices`)."""
    own = wb.private_copy()
    matrices = as_2d_matrices(own.groups(own.is_matrix), own.is_matrix)
    return matrices, own.groups(lambda p, g: not own.is_matrix(p, g))


# ----- heavyball ---------------------------------------------------------------------------------
@contextlib.contextmanager
def heavyball_eager(heavyball: ModuleType) -> Iterator[None]:
    """Run heavyball's building blocks without ``torch.compile`` for the duration of a step.

    heavyball compiles each building block on first use (its documented default); on a CPU that
    takes minutes per new shape, longer than a whole benchmark run. ``heavyball.utils.compile_mode
    = None`` is its own switch for eager execution.
    """
    previous = heavyball.utils.compile_mode
    heavyball.utils.compile_mode = None
    try:
        yield
    finally:
        heavyball.utils.compile_mode = previous


def heavyball_specs(heavyball: ModuleType, matrices: list[dict], others: list[dict]) -> list[dict]:
    """``heavyball.SplitOpt`` specs as its README pairs them: Muon for matrices, AdamW for the rest.

    The manifest's ``momentum`` is heavyball's ``betas[0]``; ``heavyball_momentum=True`` picks
    its SGD-style buffer (``m = β·m + g``), the convention torch.optim.Muon and fastmuon use.
    ``consume_grad=False`` keeps ``p.grad`` attached after the step, as a training loop expects.
    """
    specs = [
        {
            "params": g["params"],
            "optimizer": heavyball.Muon,
            "lr": g["lr"],
            "betas": (g.get("momentum", 0.95), 0.99),
            "weight_decay": g.get("weight_decay", 0.0),
            "nesterov": g.get("nesterov", True),
            "heavyball_momentum": True,
            "consume_grad": False,
        }
        for g in matrices
    ]
    specs += [
        {
            "params": g["params"],
            "optimizer": heavyball.AdamW,
            "lr": g["lr"],
            "betas": OTHER_BETAS,
            "weight_decay": g.get("weight_decay", 0.0),
            "consume_grad": False,
        }
        for g in others
    ]
    return specs


def heavyball_contender(wb: Workbench) -> Contender:
    """heavyball's ``Muon`` (SplitOpt with its AdamW), run eagerly (see :func:`heavyball_eager`)."""
    _needs_muon(wb, "heavyball")
    heavyball, version = import_peer("heavyball", "heavyball")
    matrices, others = _split(wb)
    opt = heavyball.SplitOpt(heavyball_specs(heavyball, matrices.groups, others))
    note = (
        "SplitOpt(Muon for matrices, AdamW for the rest), NS in bfloat16 (its own); eager: "
        "heavyball.utils.compile_mode=None (its default compiles every block, minutes per shape on a CPU)"
    ) + matrices.note
    return Contender(
        f"heavyball Muon {version}",
        [opt],
        torch.bfloat16,
        note,
        ns_useful_flops=wb.matrix_flops(),
        ns_flops=wb.matrix_flops(),
        step_context=lambda: heavyball_eager(heavyball),
    )


# ----- pytorch-optimizer -------------------------------------------------------------------------
def pytorch_optimizer_groups(matrices: list[dict], others: list[dict]) -> list[dict]:
    """Groups flagged ``use_muon`` as its docstring shows (it steps the rest with its AdamW)."""
    muon_keys = ("lr", "momentum", "nesterov", "weight_decay", "ns_steps")
    groups = [
        {k: g[k] for k in muon_keys if k in g} | {"params": g["params"], "use_muon": True} for g in matrices
    ]
    groups += [
        {"params": g["params"], "use_muon": False, "lr": g["lr"], "betas": OTHER_BETAS}
        | {"weight_decay": g.get("weight_decay", 0.0)}
        for g in others
    ]
    return groups


def pytorch_optimizer_contender(wb: Workbench) -> Contender:
    """pytorch-optimizer's ``Muon`` (foreach: same-shape stacks, NS in bfloat16)."""
    _needs_muon(wb, "pytorch-optimizer")
    module, version = import_peer("pytorch_optimizer", "pytorch_optimizer")
    matrices, others = _split(wb)
    opt = module.Muon(pytorch_optimizer_groups(matrices.groups, others))
    return Contender(
        f"pytorch-optimizer Muon {version}",
        [opt],
        torch.bfloat16,
        "use_muon groups (its AdamW for the rest), foreach default, NS in bfloat16 (its own)" + matrices.note,
        ns_useful_flops=wb.matrix_flops(),
        ns_flops=wb.matrix_flops(),
    )


def pytorch_optimizer_variant_contender(wb: Workbench) -> Contender:
    """pytorch-optimizer's ``NorMuon`` or ``AdaMuon`` (its defaults: foreach as it chooses, NS in
    bfloat16), beside fastmuon's class of the same name (``--optimizer normuon``/``adamuon``)."""
    names = {"normuon": "NorMuon", "adamuon": "AdaMuon"}
    if wb.optimizer not in names:
        raise Unavailable("pytorch-optimizer's variants are compared with --optimizer normuon or adamuon")
    module, version = import_peer("pytorch_optimizer", "pytorch_optimizer")
    matrices, others = _split(wb)
    name = names[wb.optimizer]
    opt = getattr(module, name)(pytorch_optimizer_groups(matrices.groups, others))
    return Contender(
        f"pytorch-optimizer {name} {version}",
        [opt],
        torch.bfloat16,
        "use_muon groups (its AdamW for the rest), NS in bfloat16 (its own)" + matrices.note,
        ns_useful_flops=wb.matrix_flops(),
        ns_flops=wb.matrix_flops(),
    )
