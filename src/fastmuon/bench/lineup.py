"""The one register of the bench's contenders: per update rule, fastmuon's class for it and the
contenders a run puts side by side, in report order, each with its label.

Adding a contender is one factory (in :mod:`.contenders`, :mod:`.peers` or :mod:`.qk_clip`) and
its entries here; the factories take fastmuon's class from the :class:`.contenders.Workbench`
(``fastmuon``, set from :data:`CLASSES` by whoever builds it), so none of them imports this module.
"""

from __future__ import annotations

from collections.abc import Callable

from .. import AdaMuon, Muon, MuSGD, NorMuon
from .contenders import (
    Contender,
    Workbench,
    bf16_state_contender,
    fastmuon_contender,
    reference_contender,
    sgd_contender,
    torch_muon_contender,
    torch_muon_fp32_contender,
    ultralytics_contender,
    ultralytics_fp32_contender,
)
from .peers import heavyball_contender, pytorch_optimizer_contender, pytorch_optimizer_variant_contender
from .qk_clip import qk_clip_contender

#: update rule (``--optimizer``) -> fastmuon's class for it; the class's name is the rule's in the report
CLASSES: dict[str, type[MuSGD | Muon | NorMuon | AdaMuon]] = {
    "musgd": MuSGD,
    "muon": Muon,
    "normuon": NorMuon,
    "adamuon": AdaMuon,
}
OPTIMIZERS = tuple(CLASSES)

#: update rule -> contender factories, in report order (the first is the one the others are compared to)
CONTENDERS: dict[str, list[Callable[[Workbench], Contender]]] = {
    "musgd": [
        fastmuon_contender,
        reference_contender,
        bf16_state_contender,
        ultralytics_contender,
        ultralytics_fp32_contender,
        sgd_contender,
    ],
    "muon": [
        fastmuon_contender,
        reference_contender,
        bf16_state_contender,
        qk_clip_contender,
        torch_muon_contender,
        torch_muon_fp32_contender,
        heavyball_contender,
        pytorch_optimizer_contender,
        sgd_contender,
    ],
    "normuon": [
        fastmuon_contender,
        reference_contender,
        bf16_state_contender,
        qk_clip_contender,
        pytorch_optimizer_variant_contender,
    ],
    "adamuon": [
        fastmuon_contender,
        reference_contender,
        bf16_state_contender,
        qk_clip_contender,
        pytorch_optimizer_variant_contender,
    ],
}

#: what each factory is called (``--contenders`` selects by it, and it names the row of one unavailable)
CONTENDER_LABELS: dict[Callable[[Workbench], Contender], str] = {
    fastmuon_contender: "fastmuon",
    reference_contender: "per-parameter",
    bf16_state_contender: "bf16-state",
    qk_clip_contender: "qk-clip",
    torch_muon_contender: "torch.optim.Muon",
    torch_muon_fp32_contender: "torch.optim.Muon (NS in float32)",
    heavyball_contender: "heavyball Muon",
    pytorch_optimizer_contender: "pytorch-optimizer Muon",
    sgd_contender: "torch.optim.SGD foreach",
    ultralytics_contender: "Ultralytics MuSGD",
    ultralytics_fp32_contender: "Ultralytics MuSGD (NS in float32)",
    pytorch_optimizer_variant_contender: "pytorch-optimizer NorMuon/AdaMuon",
}
