"""Newton–Schulz across ranks: DDP-replicated parameters share the work; DTensor parameters on
any mesh (FSDP2, HSDP, tensor and expert parallel) are gathered to an owner (or owner group) and
sent back, in rounds within a buffer cap. The optimizer hands the layer a context, never itself.

- :mod:`.context`: the :class:`DistContext`, agreeing on a step, building its executor;
- :mod:`.owners`: FLOP-balanced work units and each owner's plan;
- :mod:`.replicated`: NS over DDP-replicated parameters, one broadcast per unit;
- :mod:`.placement`: where each matrix's NS runs over DTensors, by predicted time;
- :mod:`.parts`: every rank's box of every parameter, gathered once;
- :mod:`.sharded`: the matrices a rank takes part in, and which move;
- :mod:`.exchange`: gather-to-owner and scatter-back over those boxes, in rounds;
- :mod:`.dtensor`: DTensor facts and local shards;
- :mod:`.group_ns`: NS of one matrix split by columns over an owner group;
- :mod:`.inflight`: keeping every collective's tensors alive until it is done;
- :mod:`.stats`: what a step cost one rank (:class:`CommStats`).
"""

from .dtensor import is_dtensor, local_shard
from .owners import WorkUnit, assign_work, sub_plan
from .sharded import shard_rows
from .stats import CommStats

__all__ = ["CommStats", "WorkUnit", "assign_work", "is_dtensor", "local_shard", "shard_rows", "sub_plan"]
