"""What one optimizer step's Newton–Schulz costs each rank, computed for any world size: NS
FLOPs, bytes sent and received, collectives, exchange buffers, predicted seconds.

fastmuon's own figures come from the functions its distributed step runs: the planner
(:func:`fastmuon.ns.build.plan_for`), the FLOP-balanced owners
(:func:`fastmuon.distributed.assign_work`, restricted to the ranks holding a matrix whole), and
the exchange's routing rule (every part from its nearest holder to the owner, every holder's part
of the result back; see :mod:`fastmuon.distributed.exchange`). They are recomputed here over
arrays rather than through ``exchange.Routes``, which lists every rank's box of every matrix and
would take minutes at 1,024 ranks on a model with tens of thousands of expert matrices; the tests
hold the two equal on small worlds, and equal to what gloo runs count.

Beside them, the peers' designs, modelled from their code in :mod:`.peers`.

Bytes are payload: what a rank puts on or takes off the wire if every message went straight to
its destination (as ``all_to_all`` sends; ring broadcasts and all-gathers forward as much as they
receive). An exchange's time is its larger direction over the link (all_to_all), or the bytes
received (broadcast, all_gather: every rank forwards while it receives).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..distributed import assign_work
from ..distributed.exchange import DEFAULT_MIN_EXCHANGE_BYTES, block_region, contiguous_layout, pack_rounds
from ..distributed.group_ns import group_reduce_calls, group_reduce_elements
from ..distributed.owners import owner_plan
from ..distributed.placement import Holding, Links, place
from ..distributed.placement import group_link as gram_link
from ..ns.build import plan_for
from ..ns.engine import NSConfig, spec_of
from ..ns.matrices import parse
from ..ns.planner import CostModel, Plan, kernels_per_bucket, ns_cost
from .layouts import NODE, Layout, regions
from .models import Tensor, Workload

#: Muon's defaults (fastmuon.Muon): five steps of its quintic, eps 1e-7
NS_STEPS, NS_COEFFICIENTS, NS_EPS = 5, (3.4445, -4.775, 2.0315), 1e-7


@dataclass
class Matrix:
    """One matrix NS orthogonalises: its shape (as stored), and its distinct parts across the
    ranks: each part's elements and the ranks holding it (ascending)."""

    shape: tuple[int, ...]
    numel: int
    part_numel: np.ndarray
    part_ranks: list[np.ndarray]
    part_regions: np.ndarray  # (parts, kept dims, 2): each part's box in the matrix's coordinates

    @property
    def rows_cols(self) -> tuple[int, int]:
        return self.shape[0], self.numel // self.shape[0]

    @property
    def candidates(self) -> list[int] | None:
        """The ranks holding it whole (it has one part then), else None."""
        if len(self.part_numel) == 1 and self.part_numel[0] == self.numel:
            return self.part_ranks[0].tolist()
        return None

    @property
    def exchanged(self) -> bool:
        """Whether it moves: unless one rank alone holds it whole."""
        return not (
            len(self.part_numel) == 1 and self.part_numel[0] == self.numel and len(self.part_ranks[0]) == 1
        )


def matrices(workload: Workload, layout: Layout) -> list[Matrix]:
    """Every matrix of the workload's tensors (their maps' boxes, in order) with its parts.
    Tensors alike (one per layer) share their matrices' descriptions (read-only)."""
    out: list[Matrix] = []
    seen: dict[tuple, list[Matrix]] = {}
    for tensor in workload.tensors:
        key = (tensor.shape, tensor.tp, tensor.experts, repr(parse(tensor.map)))
        if key not in seen:
            seen[key] = _tensor_matrices(tensor, layout)
        out += seen[key]
    return out


def _tensor_matrices(tensor: Tensor, layout: Layout) -> list[Matrix]:
    shape = tensor.shape
    boxes = parse(tensor.map).boxes(shape)
    lo, hi, step, kept = _box_arrays(boxes, shape)
    held = [(r, np.asarray(ranks)) for r, ranks in regions(layout, tensor) if r is not None]
    rlo = np.array([[a for a, _ in r] for r, _ in held], dtype=np.int64)
    rhi = np.array([[b for _, b in r] for r, _ in held], dtype=np.int64)
    # a box's entries in a dim are lo, lo + step, ... below hi: those in [s, e) number
    # ceil((e - lo) / step) - ceil((s - lo) / step) (an interleaved part has step > 1)
    first, stop = np.maximum(lo[:, None], rlo[None]), np.minimum(hi[:, None], rhi[None])
    base, every = lo[:, None], step[:, None]
    lengths = np.clip(-((base - stop) // every) - -((base - first) // every), 0, None)
    numel = lengths.prod(axis=2)  # (matrices, regions); dropped dims count 1 where they overlap
    start = np.clip(-((base - first) // every), 0, None)  # the part's first entry, counted in the box
    boxes_in = np.stack([start, start + lengths], axis=-1)[:, :, kept, :]
    mshape = tuple(int(n) for n, k in zip(-((lo[0] - hi[0]) // step[0]), kept) if k)
    whole = math.prod(mshape)
    ranks_of = [r for _, r in held]
    out = []
    for i in range(len(boxes)):
        (js,) = np.nonzero(numel[i])
        out.append(Matrix(mshape, whole, numel[i, js], [ranks_of[j] for j in js], boxes_in[i, js]))
    return out


def _held(mats: Sequence[Matrix], world: int) -> np.ndarray:
    """Elements of the matrices each rank holds (matrices alike share one description: each
    description's sums are taken once)."""
    held = np.zeros(world, dtype=np.int64)
    alike: dict[int, tuple[np.ndarray, int]] = {}
    for m in mats:
        if id(m) not in alike:
            alike[id(m)] = (per_rank_elements(m, world), 0)
        sums, count = alike[id(m)]
        alike[id(m)] = (sums, count + 1)
    for sums, count in alike.values():
        held += sums * count
    return held


def per_rank_elements(m: Matrix, world: int) -> np.ndarray:
    """Elements of matrix ``m`` each rank holds."""
    ranks = np.concatenate(m.part_ranks) if m.part_ranks else np.zeros(0, dtype=np.int64)
    numel = np.repeat(m.part_numel, [len(r) for r in m.part_ranks])
    return np.bincount(ranks, weights=numel, minlength=world).astype(np.int64)


def _box_arrays(boxes, shape) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[bool]]:
    """The boxes as ``(start, stop, step)`` arrays per dim, and the dims a matrix keeps (an
    integer index drops its dim), as :func:`fastmuon.distributed.sharded.held_pieces` reads a box."""
    lo = np.zeros((len(boxes), len(shape)), dtype=np.int64)
    hi = np.tile(np.asarray(shape, dtype=np.int64), (len(boxes), 1))
    step = np.ones((len(boxes), len(shape)), dtype=np.int64)
    kept = [True] * len(shape)
    for i, box in enumerate(boxes):
        for d, index in enumerate(box):
            if isinstance(index, slice):
                a, b, every = index.indices(shape[d])
                lo[i, d], hi[i, d], step[i, d] = a, max(a, b), every
            else:
                lo[i, d], hi[i, d] = int(index), int(index) + 1
                kept[d] = False
    return lo, hi, step, kept


# ----- figures ------------------------------------------------------------------------------------
@dataclass
class Settings:
    """What the plan depends on beside shapes: dtypes, the device the plan is for, its cost
    constants (None: the device type's built-in ones), the planner's settings."""

    ns_dtype: torch.dtype = torch.bfloat16
    param_dtype: torch.dtype = torch.float32
    plan_device: str = "cuda"
    cost_model: CostModel | None = None
    policy: str = "auto"
    max_bucket_bytes: int = 512 * 2**20
    threads: int | None = None
    owner_group_size: int | None = None
    max_exchange_bytes: int | None = None

    def config(self) -> NSConfig:
        return NSConfig.make(NS_STEPS, NS_COEFFICIENTS, NS_EPS, self.ns_dtype)

    def plan(self, shapes: Sequence[tuple[int, ...]]) -> Plan:
        """The plan fastmuon builds for matrices of these shapes (whole, contiguous)."""
        config = self.config()
        device = "meta" if self.plan_device == "cuda" else self.plan_device  # meta: no memory
        probe = torch.empty(0, dtype=self.param_dtype, device=device)
        specs = [spec_of(probe, config, contiguous_layout(s)) for s in shapes]
        return plan_for(
            specs, [config] * len(specs), self.policy, self.cost_model, self.max_bucket_bytes, self.threads
        )


@dataclass
class Figures:
    """One design's figures for every rank (arrays of length W), and what is the same for all."""

    design: str
    layout: str
    world: int
    flops: np.ndarray
    sent: np.ndarray  # bytes
    received: np.ndarray
    buffers: np.ndarray  # bytes of exchange buffers kept between steps (peers: the largest transient)
    held: np.ndarray  # elements of orthogonalised matrices the rank holds (its shard)
    ns_seconds: np.ndarray
    comm_seconds: np.ndarray
    collectives: dict[str, int] = field(default_factory=dict)  # kind -> count per step
    itemsize: int = 2  # bytes per element moved
    note: str = ""
    work: Any = None  # fastmuon's: (plan, units, local plans by rank) of the exchange, for measuring
    link_bytes_per_s: float = 0.0  # each way, the link the exchange crosses (0: unpriced; balance.priced)

    @property
    def imbalance(self) -> float:
        mean = float(self.flops.mean())
        return float(self.flops.max()) / mean if mean else 1.0

    def bytes_per_shard(self) -> tuple[float, float]:
        """Largest sent and received bytes over the rank's shard in the same dtype."""
        shard = np.maximum(self.held * self.itemsize, 1)
        return float((self.sent / shard).max()), float((self.received / shard).max())

    def classes(self) -> list[dict[str, Any]]:
        """Ranks with identical figures, busiest first: each class's ranks and figures."""
        keys: dict[tuple, list[int]] = {}
        for r in range(self.world):
            key = (
                int(self.flops[r]),
                int(self.sent[r]),
                int(self.received[r]),
                int(self.buffers[r]),
                int(self.held[r]),
            )
            keys.setdefault(key, []).append(r)
        out = []
        for (flops, sent, received, buffers, held), ranks in keys.items():
            r = ranks[0]
            out.append(
                {
                    "ranks": _ranges(ranks),
                    "count": len(ranks),
                    "ns_flops": flops,
                    "bytes_sent": sent,
                    "bytes_received": received,
                    "buffer_bytes": buffers,
                    "shard_bytes": held * self.itemsize,
                    "ns_seconds": float(self.ns_seconds[r]),
                    "comm_seconds": float(self.comm_seconds[r]),
                }
            )
        return sorted(out, key=lambda c: (-c["ns_flops"], -c["bytes_received"], c["ranks"]))

    def summary(self) -> dict[str, Any]:
        sent, received = self.bytes_per_shard()
        return {
            "design": self.design,
            "layout": self.layout,
            "world": self.world,
            "ns_flops_max": int(self.flops.max()),
            "ns_flops_mean": float(self.flops.mean()),
            "imbalance": self.imbalance,
            "bytes_sent_max": int(self.sent.max()),
            "bytes_received_max": int(self.received.max()),
            "sent_per_shard_max": sent,
            "received_per_shard_max": received,
            "buffer_bytes_max": int(self.buffers.max()),
            "ns_seconds_max": float(self.ns_seconds.max()),
            "comm_seconds_max": float(self.comm_seconds.max()),
            "collectives": dict(self.collectives),
            "rank_classes": len(self.classes()),
            "note": self.note,
        }


def _ranges(ranks: list[int]) -> str:
    """``0-3,8,10-11``: a sorted rank list written short."""
    ends = [i for i, r in enumerate(ranks) if i + 1 == len(ranks) or ranks[i + 1] != r + 1]
    starts = [0] + [e + 1 for e in ends[:-1]]
    return ",".join(f"{ranks[s]}" if s == e else f"{ranks[s]}-{ranks[e]}" for s, e in zip(starts, ends))


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _bucket_seconds(plan: Plan, b: int, slots: int, model: CostModel, threads: int) -> float:
    """What ``slots`` slots of bucket ``b`` cost as one NS call under ``model``."""
    bucket = plan.buckets[b]
    _, r, c = bucket.shape
    per = ns_cost(r, c, plan.steps, bucket.method, bucket.dtype, model.eigh, threads, bucket.preconditioning)
    launches = kernels_per_bucket(plan.steps, bucket.method, bucket.preconditioning)
    return slots * per * model.flop_seconds(bucket.dtype) + launches * model.launch_cost(bucket.dtype)


def _plan_seconds(plan: Plan, model: CostModel, threads: int) -> float:
    return sum(_bucket_seconds(plan, b, bk.shape[0], model, threads) for b, bk in enumerate(plan.buckets))


def _nearest(ranks: np.ndarray, owner: int) -> int:
    """The holder an owner takes a part from (``exchange.source_of``): itself, else the
    nearest by rank number, the lower on a tie (``ranks`` ascending)."""
    k = int(np.argmin(np.abs(ranks - owner)))
    return int(ranks[k])


def fastmuon_figures(
    workload: Workload,
    layout: Layout,
    settings: Settings,
    model: CostModel,
    link: float,
    group_link: float | None = None,
) -> Figures:
    """fastmuon's step: the exchange (two all_to_all per NS dtype) for sharded layouts, one
    broadcast per work unit under DDP; ``model`` prices NS, ``link`` (bytes/s each way) the bytes."""
    world = layout.world
    threads = settings.threads or torch.get_num_threads()
    mats = matrices(workload, layout)
    flops = np.zeros(world, dtype=np.int64)
    sent, received, buffers = (np.zeros(world, dtype=np.int64) for _ in range(3))
    held = _held(mats, world)
    seconds = np.zeros(world)
    if not layout.sharded:  # DDP: ReplicatedOrthogonalizer
        plan = settings.plan([m.shape for m in mats])
        units = assign_work(plan, world)  # whole-matrix owners, one broadcast each
        flat_bytes = 0
        for u in units:
            bucket = plan.buckets[u.bucket]
            size = sum(m.rows * m.cols for m in bucket.members[u.start : u.stop]) * _itemsize(bucket.dtype)
            flat_bytes += size
            flops[u.owner] += u.flops
            seconds[u.owner] += _bucket_seconds(plan, u.bucket, u.stop - u.start, model, threads)
            sent[u.owner] += size * (world - 1)
            received += size
            received[u.owner] -= size
        buffers[:] = flat_bytes  # one flat buffer per unit, on every rank
        comm = received / link
        return Figures(
            "fastmuon", str(layout), world, flops, sent, received, buffers, held, seconds, comm,
            {"broadcast": len(units)}, _itemsize(settings.ns_dtype), "", (plan, units, {}),
        )  # fmt: skip
    spread = [i for i, m in enumerate(mats) if m.exchanged]
    plan = settings.plan([mats[i].shape for i in spread])
    item = _itemsize(settings.ns_dtype)
    node = min(NODE, world) if settings.plan_device == "cuda" else world
    links = Links(link, group_link or link, node)
    # matrices alike (one per layer) share one description, and so one holding and its sums
    alike: dict[int, tuple[Holding, np.ndarray]] = {}
    held_ex = np.zeros(world, dtype=np.int64)
    holdings = []
    for i in spread:
        m = mats[i]
        if id(m) not in alike:
            h = Holding(m.numel, m.part_numel, m.part_ranks, item)
            alike[id(m)] = (h, np.bincount(h.ranks, weights=h.numels, minlength=world).astype(np.int64))
        h, per_rank = alike[id(m)]
        holdings.append(h)
        held_ex += per_rank * item
    caps = (
        [settings.max_exchange_bytes] * world
        if settings.max_exchange_bytes is not None
        else np.maximum(held_ex, 2 * DEFAULT_MIN_EXCHANGE_BYTES - held_ex).tolist()
    )
    units = place(
        plan, world, holdings, model, links, settings.owner_group_size, threads,
        splittable=[len(mats[i].shape) == 2 for i in spread], max_piece_bytes=int(min(caps)) if spread else None,
    )  # fmt: skip
    reduce_bytes = np.zeros(world, dtype=np.int64)
    reduce_seconds = np.zeros(world)
    needs, phases = [], []
    reduces = 0
    for u in units:
        bucket = plan.buckets[u.bucket]
        per = [np.zeros(world, dtype=np.int64) for _ in range(4)]  # gather send/recv, scatter send/recv
        for mem in bucket.members[u.start : u.stop]:
            m = mats[spread[mem.index]]
            if u.group:
                for j, o in enumerate(u.group):
                    block = block_region(m.shape, j, len(u.group))
                    _target_bytes(m, holdings[mem.index], o, np.asarray(block), per, sent, received, item)
            else:
                _target_bytes(m, holdings[mem.index], u.owner, None, per, sent, received, item)
        for r in u.owners:
            flops[r] += u.flops
        if u.group:
            g = len(u.group)
            mem = bucket.members[u.start]
            n = group_reduce_elements(1, min(mem.rows, mem.cols), plan.steps, bucket.preconditioning)
            moved = 2 * (g - 1) * n * _itemsize(bucket.dtype) // g
            idx = list(u.group)
            reduce_bytes[idx] += moved
            reduce_seconds[idx] += moved / gram_link(g, links)
            launch = kernels_per_bucket(plan.steps) * model.launch_cost(bucket.dtype)
            seconds[idx] += u.flops * model.flop_seconds(bucket.dtype) + launch
            reduces += group_reduce_calls(plan.steps, bucket.preconditioning)
        itemsize = _itemsize(bucket.dtype)
        per = [p * itemsize for p in per]
        phases.append(per)
        need = per[0] + per[1] + per[2]
        (touched,) = np.nonzero(need)
        needs.append((touched, need[touched]))
    rounds = pack_rounds(needs, [plan.buckets[u.bucket].dtype for u in units], caps, world)
    count = 0
    for rs in rounds.values():
        biggest = np.zeros(world, dtype=np.int64)
        for ks in rs:
            count += 1
            # each owner's single-owner units of a round run as one engine (exchange.owner_plan)
            by_owner: dict[int, list] = {}
            for k in ks:
                if not units[k].group:
                    by_owner.setdefault(units[k].owner, []).append(units[k])
            for r, mine in by_owner.items():
                seconds[r] += _plan_seconds(owner_plan(plan, mine)[0], model, threads)
            total = sum(
                (phases[k][0] + phases[k][1] + phases[k][2] for k in ks), np.zeros(world, dtype=np.int64)
            )
            biggest = np.maximum(biggest, total)
        buffers += biggest
        buffers += sum((phases[k][3] for ks in rs for k in ks), np.zeros(world, dtype=np.int64))
    sent += reduce_bytes
    received += reduce_bytes
    # what each rank holds whole alone runs in a local engine, its own plan
    local: dict[int, list[tuple[int, ...]]] = {}
    for m in mats:
        if not m.exchanged:
            local.setdefault(int(m.part_ranks[0][0]), []).append(m.shape)
    by_shapes: dict[tuple, tuple[Plan, int, float]] = {}
    local_plans: dict[int, Plan] = {}
    for r, shapes in local.items():
        key = tuple(shapes)
        if key not in by_shapes:
            p = settings.plan(shapes)
            by_shapes[key] = (p, p.flops(), _plan_seconds(p, model, threads))
        local_plans[r], f, s = by_shapes[key]
        flops[r] += f
        seconds[r] += s
    comm = np.maximum(sent - reduce_bytes, received - reduce_bytes) / link + reduce_seconds
    groups = sum(1 for u in units if u.group)
    note = (
        f"{len(spread)} of {len(mats)} matrices exchanged ({groups} by owner groups) in {count} "
        f"round{'s' if count != 1 else ''}, {len(mats) - len(spread)} orthogonalised where they lie"
    )
    kinds = {"all_to_all": 2 * count} if spread else {}
    if reduces:
        kinds["all_reduce"] = reduces
    return Figures(
        "fastmuon", str(layout), world, flops, sent, received, buffers, held, seconds, comm,
        kinds, item, note, (plan, units, local_plans),
    )  # fmt: skip


def _target_bytes(m: Matrix, h: Holding, owner: int, block, per, sent, received, item: int) -> None:
    """Add one target's exchange to the per-rank arrays (``per``: elements in each buffer;
    ``sent``, ``received``: bytes of ``item`` each): each part's nearest holder sends the part
    (its overlap with ``block``, a ``(dims, 2)`` box; None: the whole matrix) to ``owner``, and
    every holder of it gets that piece of the result back (``exchange.Routes``' rule)."""
    gsend, grecv, ssend, srecv = per
    if block is None:
        n_parts = m.part_numel
    else:
        lo = np.maximum(m.part_regions[:, :, 0], block[None, :, 0])
        hi = np.minimum(m.part_regions[:, :, 1], block[None, :, 1])
        n_parts = np.clip(hi - lo, 0, None).prod(axis=1)
    single = len(h.ranks) == len(m.part_ranks)
    if single and block is None:  # every part one holder's (FSDP row blocks): all at once
        src = h.ranks
        np.add.at(gsend, src, n_parts)
        grecv[owner] += int(n_parts.sum())
        ssend[owner] += int(n_parts.sum())
        np.add.at(srecv, src, n_parts)
        away = src != owner
        np.add.at(sent, src[away], n_parts[away] * item)
        np.add.at(received, src[away], n_parts[away] * item)
        moved = int(n_parts[away].sum()) * item
        sent[owner] += moved
        received[owner] += moved
        return
    for n, ranks in zip(n_parts.tolist(), m.part_ranks):
        if n <= 0:
            continue
        holder = _nearest(ranks, owner)
        gsend[holder] += n
        grecv[owner] += n
        ssend[owner] += n * len(ranks)
        srecv[ranks] += n
        if holder != owner:
            sent[holder] += n * item
            received[owner] += n * item
        has_owner = bool(np.any(ranks == owner))
        sent[owner] += n * item * (len(ranks) - has_owner)
        received[ranks] += n * item
        if has_owner:
            received[owner] -= n * item
