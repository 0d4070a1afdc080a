"""Per-parameter reference optimizers: the same updates as a plain Python loop.

One Newton–Schulz call and a handful of small kernels per parameter, exactly how Muon is
usually written. The benchmark uses them as the "per-parameter" contender; they are the
``foreach=False`` paths of the fast optimizers.
"""

from __future__ import annotations

from typing import Any

from .muon import Muon
from .musgd import MuSGD


class ReferenceMuSGD(MuSGD):
    """:class:`~fastmuon.MuSGD` stepping one parameter at a time."""

    def __init__(self, params, *args: Any, **kwargs: Any):
        kwargs["foreach"] = False
        super().__init__(params, *args, **kwargs)


class ReferenceMuon(Muon):
    """:class:`~fastmuon.Muon` stepping one parameter at a time."""

    def __init__(self, params, *args: Any, **kwargs: Any):
        kwargs["foreach"] = False
        super().__init__(params, *args, **kwargs)
