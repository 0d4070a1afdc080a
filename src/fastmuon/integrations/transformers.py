"""Optimizer factories for 🤗 Transformers' ``Trainer``: fastmuon's groups built from the model.

``Trainer(optimizer_cls_and_kwargs=(factory, kwargs))`` treats anything that is not a
``torch.optim.Optimizer`` subclass as a factory: it calls ``factory()`` with no arguments and
then ``(model, **kwargs)`` on the result, with the model it is about to train (wrapped by
accelerate where it prepares the model first, as FSDP2 runs do; its parameters are then the
sharded ones). A factory here builds :func:`fastmuon.param_groups` from that model, so Muon
gets the model's matrices and AdamW (or SGD) the embeddings, head, norms and biases::

    from fastmuon.transformers import MuonFactory

    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=data,
        optimizer_cls_and_kwargs=(MuonFactory, {"lr": 0.02, "weight_decay": 0.01}),
    )

The keywords ``head``, ``exclude``, ``decay_vectors`` and ``matrices`` go to
:func:`fastmuon.param_groups`; every other keyword goes to the optimizer's constructor. The
Trainer still makes the learning-rate schedule (from ``TrainingArguments``) over the groups'
own ``lr``, and saves and resumes the optimizer's state dict with its checkpoints.

:class:`MuonFactory` and :class:`MuSGDFactory` are ready-made; :func:`factory_for` makes one for
any optimizer class that takes ``param_groups``' groups (a Muon variant, a subclass).
This module imports nothing of Transformers: the protocol is a plain call.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from fastmuon import Muon, MuSGD, param_groups

#: the factory keywords that shape the groups (:func:`fastmuon.param_groups`'s), not the optimizer
GROUP_KEYWORDS = ("head", "exclude", "decay_vectors", "matrices")


class OptimizerFactory:
    """Builds ``optimizer(fastmuon.param_groups(model, ...), ...)`` when the Trainer calls it.

    A subclass names the class in ``optimizer``; :func:`factory_for` makes such subclasses.
    """

    optimizer: ClassVar[type[torch.optim.Optimizer]]

    def __call__(self, model: nn.Module, **kwargs: Any) -> torch.optim.Optimizer:
        """The optimizer for ``model``: ``kwargs`` named in :data:`GROUP_KEYWORDS` shape the
        groups, the rest are the optimizer's constructor arguments."""
        cls = getattr(type(self), "optimizer", None)
        if cls is None:
            raise TypeError(
                f"{type(self).__name__} names no optimizer class; use MuonFactory, MuSGDFactory or "
                "factory_for(YourOptimizer)"
            )
        if not isinstance(model, nn.Module):
            raise TypeError(
                f"{type(self).__name__} builds its groups from the model (an nn.Module), got "
                f"{type(model).__name__}; pass it as Trainer(optimizer_cls_and_kwargs=({type(self).__name__}, "
                "kwargs)), which calls it with the model"
            )
        if "params" in kwargs:
            raise TypeError(
                f"{type(self).__name__} builds the param groups from the model itself; drop params= "
                "(shape the groups with head=, exclude=, decay_vectors=, matrices=)"
            )
        group_options = {k: kwargs.pop(k) for k in GROUP_KEYWORDS if k in kwargs}
        return cls(param_groups(_unwrapped(model), **group_options), **kwargs)

    def __repr__(self) -> str:
        cls = getattr(type(self), "optimizer", None)
        return f"{type(self).__name__}({cls.__name__ if cls is not None else None})"


def factory_for(optimizer: type[torch.optim.Optimizer]) -> type[OptimizerFactory]:
    """A factory class for ``optimizer`` (any class that takes :func:`fastmuon.param_groups`'
    groups as its first argument), to pass to the Trainer as ``(factory, kwargs)``."""
    if not (isinstance(optimizer, type) and issubclass(optimizer, torch.optim.Optimizer)):
        raise TypeError(f"factory_for takes an optimizer class, got {optimizer!r}")
    name = f"{optimizer.__name__}Factory"
    doc = f"Builds ``{optimizer.__name__}(fastmuon.param_groups(model, ...), ...)`` for the Trainer."
    return type(name, (OptimizerFactory,), {"optimizer": optimizer, "__doc__": doc, "__module__": __name__})


def _unwrapped(model: nn.Module) -> nn.Module:
    """The module DDP wraps (its parameters are the same; their names lose ``module.``)."""
    if isinstance(model, nn.parallel.DistributedDataParallel):
        return model.module
    return model


MuonFactory = factory_for(Muon)
MuSGDFactory = factory_for(MuSGD)

__all__ = ["GROUP_KEYWORDS", "MuSGDFactory", "MuonFactory", "OptimizerFactory", "factory_for"]
