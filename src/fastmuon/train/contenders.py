"""The optimizers compared, each with its stated, lightly tuned hyperparameters.

Learning rates were picked per task from a small sweep at the default budget, seed 0 (about
four values per contender and task, roughly x2 apart; the best validation loss won; see
docs/training.md). Everything else is the usual default for that optimizer: Nesterov
momentum 0.9 and weight decay 5e-4 for the SGD family, betas (0.9, 0.95) for AdamW, momentum
0.95 for Muon; NorMuon and AdaMuon keep Muon's settings and AdamW part (their own options at
their defaults: NorMuon's Nesterov momentum and Muon's lr factor, AdaMuon's plain momentum of
the sign and update RMS 0.2) and had only their learning rate swept. The bf16-state contenders
are MuSGD and Muon with the same settings and ``state_dtype=torch.bfloat16`` (not swept: the
comparison is of the same run with its state stored in bf16). All contenders share the
learning-rate schedule in :func:`lr_multiplier`, the seed and the step budget.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from .. import AdaMuon, Muon, MuSGD, NorMuon, param_groups

WARMUP_FRACTION = 0.05


def lr_multiplier(step: int, total: int) -> float:
    """Linear warm-up over the first 5% of steps, then cosine decay to zero at ``total``.

    ``step`` counts optimizer steps already taken (0 for the first one).
    """
    warmup = max(1, int(WARMUP_FRACTION * total))
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def _musgd(model: nn.Module, hp: dict[str, Any], ns_dtype: torch.dtype) -> Optimizer:
    # MuSGD's own split: matrices get lr·muon·NS(momentum) + lr·sgd·SGD, the rest plain SGD at lr.
    return MuSGD(param_groups(model), nesterov=True, ns_dtype=ns_dtype, **hp)


def _muon(model: nn.Module, hp: dict[str, Any], ns_dtype: torch.dtype) -> Optimizer:
    # Matrices: Muon at ``lr``; embeddings, head, norms, biases: AdamW at ``adamw_lr``.
    return Muon(param_groups(model), nesterov=True, ns_dtype=ns_dtype, **hp)


def _normuon(model: nn.Module, hp: dict[str, Any], ns_dtype: torch.dtype) -> Optimizer:
    # Muon's split and lr factor; NS's update divided by its per-row second moment's root.
    return NorMuon(param_groups(model), nesterov=True, ns_dtype=ns_dtype, **hp)


def _adamuon(model: nn.Module, hp: dict[str, Any], ns_dtype: torch.dtype) -> Optimizer:
    # Muon's split; NS of the momentum's sign, elementwise second moment, update RMS 0.2.
    return AdaMuon(param_groups(model), ns_dtype=ns_dtype, **hp)


def _sgd(model: nn.Module, hp: dict[str, Any], ns_dtype: torch.dtype) -> Optimizer:
    return torch.optim.SGD(model.parameters(), nesterov=True, **hp)


def _adamw(model: nn.Module, hp: dict[str, Any], ns_dtype: torch.dtype) -> Optimizer:
    return torch.optim.AdamW(model.parameters(), **hp)


@dataclass(frozen=True)
class Contender:
    """An optimizer recipe: ``hparams[task]`` are the keyword arguments used on that task."""

    name: str
    label: str
    factory: Callable[[nn.Module, dict[str, Any], torch.dtype], Optimizer]
    hparams: dict[str, dict[str, Any]]

    def build(self, model: nn.Module, task: str, ns_dtype: torch.dtype) -> Optimizer:
        if task not in self.hparams:
            raise ValueError(f"{self.label} has no hyperparameters for task {task!r}")
        return self.factory(model, self.hparams[task], ns_dtype)

    def describe(self, task: str) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.hparams[task].items())


MUSGD_HPARAMS = {
    "digits": dict(lr=0.05, momentum=0.9, weight_decay=5e-4, muon=0.5, sgd=0.5),
    "chars": dict(lr=0.15, momentum=0.9, weight_decay=5e-4, muon=0.5, sgd=0.5),
}
MUON_HPARAMS = {
    "digits": dict(lr=0.02, momentum=0.95, weight_decay=0.01, adamw_lr=0.01),
    "chars": dict(lr=0.05, momentum=0.95, weight_decay=0.01, adamw_lr=0.02),
}


def bf16_state(hparams: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The same settings per task, every state buffer stored in bf16."""
    return {task: {**hp, "state_dtype": torch.bfloat16} for task, hp in hparams.items()}


CONTENDERS: dict[str, Contender] = {
    c.name: c
    for c in (
        Contender("musgd", "fastmuon MuSGD", _musgd, MUSGD_HPARAMS),
        Contender("muon", "fastmuon Muon", _muon, MUON_HPARAMS),
        Contender(
            "normuon",
            "fastmuon NorMuon",
            _normuon,
            {
                "digits": dict(lr=0.32, momentum=0.95, weight_decay=0.01, adamw_lr=0.01),
                "chars": dict(lr=0.05, momentum=0.95, weight_decay=0.01, adamw_lr=0.02),
            },
        ),
        Contender(
            "adamuon",
            "fastmuon AdaMuon",
            _adamuon,
            {
                "digits": dict(lr=0.08, momentum=0.95, weight_decay=0.01, adamw_lr=0.01),
                "chars": dict(lr=0.04, momentum=0.95, weight_decay=0.01, adamw_lr=0.02),
            },
        ),
        Contender("musgd-bf16", "fastmuon MuSGD (bf16 state)", _musgd, bf16_state(MUSGD_HPARAMS)),
        Contender("muon-bf16", "fastmuon Muon (bf16 state)", _muon, bf16_state(MUON_HPARAMS)),
        Contender(
            "sgd",
            "torch SGD (Nesterov)",
            _sgd,
            {
                "digits": dict(lr=0.05, momentum=0.9, weight_decay=5e-4),
                "chars": dict(lr=0.3, momentum=0.9, weight_decay=5e-4),
            },
        ),
        Contender(
            "adamw",
            "torch AdamW",
            _adamw,
            {
                "digits": dict(lr=0.01, betas=(0.9, 0.95), weight_decay=0.01),
                "chars": dict(lr=0.015, betas=(0.9, 0.95), weight_decay=0.01),
            },
        ),
    )
}


def parse_optimizers(values: list[str] | None) -> list[Contender]:
    """``--optimizer`` values (repeatable, comma lists, or 'all') to contenders, in given order."""
    names: list[str] = []
    for v in values or ["all"]:
        for name in (s.strip().lower() for s in v.split(",")):
            if not name:
                continue
            chosen = list(CONTENDERS) if name == "all" else [name]
            for n in chosen:
                if n not in CONTENDERS:
                    raise ValueError(
                        f"unknown optimizer {n!r} in --optimizer; choose from {list(CONTENDERS)} or 'all'"
                    )
                if n not in names:
                    names.append(n)
    if not names:
        raise ValueError(f"--optimizer selected nothing; choose from {list(CONTENDERS)} or 'all'")
    return [CONTENDERS[n] for n in names]
