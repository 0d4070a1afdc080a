"""Newton–Schulz across ranks: DDP-replicated parameters share the work (:mod:`.replicated`, by
:mod:`.owners`' FLOP-balanced units); DTensor parameters on any mesh (FSDP2, HSDP, tensor and
expert parallel) are gathered to an owner or owner group (:mod:`.placement`, :mod:`.group_ns`)
and sent back in rounds within a buffer cap (:mod:`.parts`, :mod:`.sharded`, :mod:`.exchange`).
The optimizer hands the layer a context (:mod:`.context`), never itself; :mod:`.inflight` keeps every
collective's tensors alive until it is done."""

from .dtensor import is_dtensor, local_shard
from .owners import WorkUnit, assign_work, sub_plan
from .sharded import shard_rows
from .stats import CommStats

__all__ = ["CommStats", "WorkUnit", "assign_work", "is_dtensor", "local_shard", "shard_rows", "sub_plan"]
