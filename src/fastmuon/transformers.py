"""The public path of the 🤗 Transformers factories (:mod:`fastmuon.integrations.transformers`):
``Trainer(optimizer_cls_and_kwargs=(fastmuon.transformers.MuonFactory, kwargs))``."""

from .integrations.transformers import (
    GROUP_KEYWORDS,
    MuonFactory,
    MuSGDFactory,
    OptimizerFactory,
    factory_for,
)

__all__ = ["GROUP_KEYWORDS", "MuSGDFactory", "MuonFactory", "OptimizerFactory", "factory_for"]
