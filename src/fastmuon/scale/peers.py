"""The peers' designs, each modelled from its code: what one optimizer step's Newton–Schulz
costs every rank (FLOPs, bytes sent and received, collectives, buffers) at any world size.

One function per design, each a pure function of the workload, the layout and the settings,
its docstring naming the file and function it follows. Every design orthogonalises the
workload's matrices as fastmuon maps them (q, k and v apart where a tensor fuses them, a
stack's experts one by one, five standard NS steps), so the FLOPs compare the same update;
what differs is how each design places, batches and moves them. NS FLOPs are priced at the
plan's NS dtype for every design. Bytes are payload (what leaves and enters the rank if every
message went straight to its destination), in the dtype the design's code moves.
"""

from __future__ import annotations

import functools
import heapq
import math
import re
from collections.abc import Callable

import numpy as np
import torch

from ..distributed import shard_rows
from ..ns.matrices import parse
from ..ns.planner import CostModel, kernels_per_bucket, ns_flops
from .figures import NS_STEPS, Figures, Settings, matrices
from .layouts import Layout, regions
from .models import COLWISE, Tensor, Workload

Peer = Callable[[Workload, Layout, Settings, CostModel, float], "Figures | str"]
BF16 = 2  # bytes: dion's and Emerging-Optimizers' wire dtype
FP32 = 4


# ----- what every design shares --------------------------------------------------------------------
_COSTS: dict[tuple, tuple[int, int]] = {}


def slice_cost(shape: tuple[int, ...], spec) -> tuple[int, int]:
    """``(slices, flops)`` of a tensor of ``shape`` under the matrix map ``spec``: its batch (a
    stack's experts; 1 for a plain matrix), and the NS FLOPs of one slice's matrices (those
    fastmuon orthogonalises)."""
    key = (tuple(shape), repr(spec))
    if key not in _COSTS:
        alone = Workload("", "", (Tensor("", tuple(shape), spec),))
        mats = matrices(alone, Layout("ddp", 1, 1))
        slices = math.prod(shape[: parse(spec).batch_dims])
        flops = sum(ns_flops(*m.rows_cols, NS_STEPS) for m in mats)
        _COSTS[key] = (slices, flops // slices)
    return _COSTS[key]


def tensor_flops(t: Tensor) -> int:
    slices, flops = slice_cost(t.shape, t.map)
    return slices * flops


def _ns_dtype(settings: Settings) -> torch.dtype:
    return settings.ns_dtype if settings.plan_device == "cuda" else torch.float32


def ns_seconds(flops: np.ndarray, calls: np.ndarray, settings: Settings, model: CostModel) -> np.ndarray:
    """NS time: the FLOPs at the NS dtype's rate, and a standard NS call's launches per call."""
    dtype = _ns_dtype(settings)
    launch = kernels_per_bucket(NS_STEPS) * model.launch_cost(dtype)
    return flops * model.flop_seconds(dtype) + calls * launch


@functools.lru_cache(maxsize=4096)
def _boxes(
    layout: Layout, shape: tuple[int, ...], tp: str | None, experts: bool
) -> tuple[np.ndarray, np.ndarray]:
    """Each rank's box of a tensor as its elements and its dim-0 length (tensors alike share one:
    a model repeats its layers' shapes)."""
    numel = np.zeros(layout.world, dtype=np.int64)
    first = np.zeros(layout.world, dtype=np.int64)
    for box, ranks in regions(layout, Tensor("", shape, None, tp, experts)):
        if box is not None:
            numel[ranks] = math.prod(b - a for a, b in box)
            first[ranks] = box[0][1] - box[0][0]
    numel.setflags(write=False)  # shared by every caller
    first.setflags(write=False)
    return numel, first


def rank_numel(layout: Layout, t: Tensor) -> np.ndarray:
    """Elements of ``t`` each rank holds."""
    return _boxes(layout, t.shape, t.tp, t.experts)[0]


def local_slices(layout: Layout, t: Tensor) -> np.ndarray:
    """Slices (experts) of a stack each rank holds: the length of its box's dim 0."""
    return _boxes(layout, t.shape, t.tp, t.experts)[1]


def held(workload: Workload, layout: Layout) -> np.ndarray:
    """Elements of the orthogonalised tensors each rank holds (its shard)."""
    out = np.zeros(layout.world, dtype=np.int64)
    for t in workload.tensors:
        out += rank_numel(layout, t)
    return out


def tp_split(t: Tensor) -> bool:
    """Whether tensor parallelism cuts ``t`` (a column- or row-wise weight, not an expert stack)."""
    return t.tp is not None and not t.experts


def _zeros(world: int, n: int) -> list[np.ndarray]:
    return [np.zeros(world, dtype=np.int64) for _ in range(n)]


def _figures(
    design: str, layout: Layout, w: Workload, settings: Settings, model: CostModel, link: float,
    arrays: tuple[np.ndarray, ...], received_bound: bool, collectives: dict[str, int], item: int, note: str,
) -> Figures:  # fmt: skip
    """The Figures of one design: time from its FLOPs and calls, and its bytes over ``link``:
    the bytes received where every exchange is a ring collective (``received_bound``), else
    the larger direction."""
    flops, calls, sent, received, buffers = arrays
    comm = (received if received_bound else np.maximum(sent, received)) / link
    return Figures(
        design, str(layout), layout.world, flops, sent, received, buffers, held(w, layout),
        ns_seconds(flops, calls, settings, model), comm, {k: n for k, n in collectives.items() if n},
        item, note,
    )  # fmt: skip


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


# ----- plain -----------------------------------------------------------------------------------------
def plain(w: Workload, layout: Layout, settings: Settings, model: CostModel, link: float) -> Figures:
    """Every rank orthogonalises every matrix alone, one NS call each (plain DDP Muon; under a
    sharded layout after an ``all_gather`` of each matrix's parts, moved in the NS dtype).
    Each rank receives what it lacks of every matrix and sends its parts to the ranks lacking
    them (shared among a part's holders); buffers: the largest gathered matrix."""
    world = layout.world
    mats = matrices(w, layout)
    flops, calls, sent, received, buffers = _zeros(world, 5)
    item = _itemsize(settings.ns_dtype)
    flops[:] = sum(ns_flops(*m.rows_cols, NS_STEPS) for m in mats)
    calls[:] = len(mats)
    gathers = 0
    alike: dict[int, list] = {}  # matrices alike (one per layer) share a description: summed once
    for m in mats:
        if m.candidates is not None and len(m.candidates) == world:
            continue  # whole everywhere already
        gathers += 1
        if id(m) in alike:
            alike[id(m)][0] += 1
            continue
        counts = np.array([len(r) for r in m.part_ranks], dtype=np.int64)
        ranks = np.concatenate(m.part_ranks)
        parts = np.repeat(m.part_numel, counts)
        per = np.repeat(counts, counts)
        got = np.bincount(ranks, weights=(m.numel - parts) * item, minlength=world)
        out = np.bincount(ranks, weights=(parts * item * (world - per)) // per, minlength=world)
        alike[id(m)] = [1, got.astype(np.int64), out.astype(np.int64)]
        buffers[:] = np.maximum(buffers, m.numel * item)
    for count, got, out in alike.values():
        received += got * count
        sent += out * count
    arrays = (flops, calls, sent, received, buffers)
    return _figures(
        "plain", layout, w, settings, model, link, arrays, True, {"all_gather": gathers}, item, ""
    )


# ----- keller -----------------------------------------------------------------------------------------
def keller(w: Workload, layout: Layout, settings: Settings, model: CostModel, link: float) -> Figures | str:
    """KellerJordan/Muon ``muon.py``, ``Muon.__init__`` and ``Muon.step``: the parameters sorted
    by ``size()`` (dims compared in turn), largest first, taken W at a time; rank r updates the
    r-th of each round (one NS call, a stack batched) and one ``all_gather`` per round hands every
    rank the updated parameters, in their dtype. The list is padded with ``empty_like`` copies of
    the last (smallest) parameter, W − len mod W of them: the last round's empty slots gather
    those, and they are the step's only buffers. Every gradient must be whole on every rank."""
    if layout.sharded:
        return "needs every gradient whole on every rank (DDP only)"
    world = layout.world
    flops, calls, sent, received, buffers = _zeros(world, 5)
    item = _itemsize(settings.param_dtype)
    order = sorted(w.tensors, key=lambda t: t.shape, reverse=True)
    last = order[-1].numel
    rounds = math.ceil(len(order) / world)
    for k in range(rounds):
        batch = order[k * world : (k + 1) * world]
        sizes = np.array([t.numel for t in batch] + [last] * (world - len(batch)), dtype=np.int64)
        for j, t in enumerate(batch):
            flops[j] += tensor_flops(t)
            calls[j] += 1
        sent += sizes * item * (world - 1)
        received += (int(sizes.sum()) - sizes) * item
    buffers[:] = (world - len(order) % world) * last * item
    arrays = (flops, calls, sent, received, buffers)
    note = "one all_gather per round of W parameters, in the parameters' dtype"
    return _figures(
        "keller", layout, w, settings, model, link, arrays, True, {"all_gather": rounds}, item, note
    )


# ----- dion -------------------------------------------------------------------------------------------
def dion_mode(layout: Layout, t: Tensor) -> str:
    """How dion's Muon takes ``t`` (``megabatch_base.py``, ``_get_shard_info``): ``"whole"`` (not
    sharded over a mesh dim of size > 1), ``"rows"`` / ``"cols"`` (sharded on its dim 0 / 1),
    ``"batch"`` (a stack sharded on its expert dim: orthogonalised where it lies) or ``"two"``
    (sharded on two mesh dims, which it refuses)."""
    kind, rows, cols = layout.kind, layout.rows, layout.cols
    stack = len(t.shape) > 2
    if kind == "ddp":
        return "whole"
    if kind == "fsdp+tp" and tp_split(t):
        if rows > 1 and cols > 1:
            return "two"
        if cols > 1:
            return "rows" if t.tp == COLWISE else "cols"
    over = {"fsdp": layout.world, "hsdp": cols, "fsdp+tp": rows}.get(kind)
    if kind == "ep":
        over = cols if t.experts else layout.world
    if over == 1:
        return "whole"
    return "batch" if stack else "rows"


def dion_groups(layout: Layout) -> np.ndarray:
    """dion's process group, one row per replica: the 1-D mesh its Muon is given (HSDP: the
    shard sub-mesh; FSDP + TP: the mesh dim of size > 1, the dp dim when both are)."""
    ranks = np.arange(layout.world)
    if layout.kind == "hsdp":
        return ranks.reshape(layout.rows, layout.cols)
    if layout.kind == "fsdp+tp" and layout.rows > 1 and layout.cols > 1:
        return ranks.reshape(layout.rows, layout.cols).T  # the dp groups
    return ranks[None]


def _dion_refusal(layout: Layout, tasks: dict[tuple, list[Tensor]], n: int) -> str | None:
    for (_, mode, _), ts in tasks.items():
        t = ts[0]
        if mode == "two":
            return (
                "refuses parameters sharded on two mesh dims (FSDP's and TP's): _get_shard_info raises "
                "NotImplementedError; give fsdp+tp:1xT or another layout"
            )
        spec = parse(t.map)
        if mode == "rows" and spec.split is not None and spec.stored_dim() == 0 and t.shape[0] % n:
            return (
                f"split_sizes needs dim 0 of {t.name} ({t.shape[0]}) divisible by the shard group ({n}): "
                "megabatch_orthogonalize_async raises NotImplementedError"
            )
    return None


def dion(w: Workload, layout: Layout, settings: Settings, model: CostModel, link: float) -> Figures | str:
    """microsoft/dion ``dion/muon.py``, ``Muon._create_ortho_tasks``, and ``dion/megabatch_base.py``,
    ``megabatch_orthogonalize_async``: one task per (shape, placement, dtype) group of parameters,
    the whole group at once; its N tensors padded with zero matrices to a multiple of the
    process group's size n, each rank orthogonalising ``ceil(N / n)`` of them in one stacked NS
    call (pads included). Sharded tensors: each rank's shard padded to ``ceil(size / n)``
    along the sharded dim, assembled by one ``all_to_all`` and returned by another; tensors
    whole on every rank: an ``all_gather`` of the results (one tensor alone: every rank
    orthogonalises it, nothing moves); stacks sharded on the expert dim: orthogonalised where
    they lie. Moves bf16 (``muon_update_pre_orthogonalize``). Buffers: the send and receive
    buffers of a task's exchanges, summed over the 3 tasks ``AsyncRuntime`` keeps in flight
    (``DistributedOrthoBase.step``). HSDP: every replica group does the same on its shards."""
    world = layout.world
    groups = dion_groups(layout)
    n = groups.shape[1]
    tasks: dict[tuple, list[Tensor]] = {}
    for t in w.tensors:
        tasks.setdefault((t.shape, dion_mode(layout, t), repr(t.map)), []).append(t)
    problem = _dion_refusal(layout, tasks, n)
    if problem:
        return problem
    flops, calls, sent, received, buffers = _zeros(world, 5)
    per_task: list[np.ndarray] = []
    kinds = {"all_to_all": 0, "all_gather": 0}
    for (shape, mode, _), ts in tasks.items():
        t, count = ts[0], len(ts)
        task_buffer = np.zeros(world, dtype=np.int64)
        if mode == "batch":
            local = local_slices(layout, t)
            flops += count * local * slice_cost(t.shape, t.map)[1]
            calls += local > 0
        elif mode == "whole" and count == 1:
            flops += tensor_flops(t)
            calls += 1
        else:
            per = math.ceil(count / n)
            if mode == "whole":
                numel = t.numel
                flops += per * tensor_flops(t)
                moved = per * numel * BF16 * (n - 1)
                task_buffer[:] = (1 + n) * per * numel * BF16
                kinds["all_gather"] += 1
            else:
                dim = 0 if mode == "rows" else 1
                padded = list(shape)
                padded[dim] = math.ceil(shape[dim] / n) * n
                local = math.prod(padded) // n
                flops += per * tensor_flops(Tensor(t.name, tuple(padded), t.map))
                moved = 2 * per * local * BF16 * (n - 1)  # there and back
                task_buffer[:] = 4 * per * n * local * BF16
                kinds["all_to_all"] += 2
            sent += moved
            received += moved
            calls += 1
        per_task.append(task_buffer)
    for k in range(len(per_task)):
        buffers = np.maximum(buffers, sum(per_task[k : k + 3]))
    arrays = (flops, calls, sent, received, buffers)
    note = f"{len(tasks)} tasks, one per shape; each padded to a multiple of the group ({n})"
    return _figures("dion", layout, w, settings, model, link, arrays, False, kinds, BF16, note)


# ----- torchtitan -----------------------------------------------------------------------------------
_LAYER = re.compile(r"(?:^|\.)(\d+)\.")


def titan_buckets(w: Workload) -> list[list[Tensor]]:
    """The buckets of torchtitan's one DistMuon configuration (``models/kimi_k2_7/config_registry.py``,
    ``_dist_muon_optimizer``): layer 0 alone, then layers in pairs, each pair's expert stacks in
    a bucket after the rest's; tensors without a layer index in one last bucket. Items sorted
    by name, as ``_build_bucket_plans`` sorts them."""
    buckets: dict[tuple[float, bool], list[Tensor]] = {}  # a pair index, inf for no layer
    for t in w.tensors:
        m = _LAYER.search(t.name)
        layer = int(m.group(1)) if m else None
        pair = (layer + 1) // 2 if layer is not None else math.inf
        buckets.setdefault((pair, len(t.shape) > 2), []).append(t)
    return [sorted(b, key=lambda t: t.name) for _, b in sorted(buckets.items())]


def titan_cost(shape: tuple[int, ...], steps: int = NS_STEPS) -> int:
    """The owners' balancing load (``dist_muon.py``, ``_estimate_muon_compute_cost``): two
    ``s²·l`` and one ``s³`` product per step, s and l the short and long dims."""
    s, l = sorted(shape)
    return steps * s * s * (2 * l + s)


def titan_owners(items: list[Tensor], cumulative: list[int], item: int) -> list[int]:
    """Owners (positions in the group) of a bucket's tensors (``_balance_loads_across_partitions``):
    largest balancing load first (then bytes, then name), each to the position whose load in
    this bucket is least, then whose bytes, then whose load over the earlier buckets; updates
    ``cumulative`` in place."""
    heap = [(0, 0, c, p) for p, c in enumerate(cumulative)]
    heapq.heapify(heap)
    order = sorted(
        range(len(items)), key=lambda i: (-titan_cost(items[i].shape), -items[i].numel, items[i].name)
    )
    owners = [0] * len(items)
    for i in order:
        primary, secondary, total, p = heapq.heappop(heap)
        load = titan_cost(items[i].shape)
        owners[i] = p
        heapq.heappush(heap, (primary + load, secondary + items[i].numel * item, total + load, p))
    for _, _, total, p in heap:
        cumulative[p] = total
    return owners


def titan_groups(layout: Layout, t: Tensor) -> np.ndarray:
    """The groups (one row per replica) sharing ``t``'s FSDP dim, the bucket's mesh; a group of
    one orthogonalises ``t`` where it lies."""
    ranks = np.arange(layout.world)
    if layout.kind == "hsdp":
        return ranks.reshape(layout.rows, layout.cols)
    if layout.kind == "ep" and t.experts:
        return ranks[:, None]
    if layout.kind == "fsdp+tp":
        return ranks.reshape(layout.rows, layout.cols).T  # the dp groups
    return ranks[None]


def _titan_local(layout: Layout, t: Tensor) -> tuple[np.ndarray, np.ndarray]:
    """Slices of a tensor orthogonalised where it lies, and their elements, by rank."""
    if len(t.shape) > 2:
        local = local_slices(layout, t)
        return local, local * (t.numel // t.shape[0])
    ones = np.ones(layout.world, dtype=np.int64)
    return ones, ones * t.numel


def torchtitan(
    w: Workload, layout: Layout, settings: Settings, model: CostModel, link: float
) -> Figures | str:
    """pytorch/torchtitan ``torchtitan/distributed/flex_shard/dist_muon.py``, ``DistMuon``, with the
    compute layouts of its one configuration (``_dist_muon_optimizer``): a matrix is ``Owned``
    (sent whole to one rank of its FSDP group, returned after NS), an expert stack ``Shard(0)``
    over its experts, which is how FSDP2 stores it, so it is orthogonalised where it lies.
    Owners come from ``_assign_balanced_owner_ranks``: LPT per bucket on ``steps·s²·(2l+s)``,
    ties by bytes and by the load of earlier buckets. Each bucket with owned tensors is one
    packed ``all_to_all_single`` there and one back (``_optimizer_reshard_runtime.py``), in the
    parameters' dtype. Buffers: the two pipeline slots (``_NUM_PIPELINE_SLOTS``) kept between
    steps, each as large as the largest of its (alternate) buckets' packed exchange buffers and
    scratch, and the local buckets' scratch. HSDP: every replica group does the same."""
    if not layout.sharded:
        return "needs DTensor parameters (_validate_parameter_storage): FSDP2, HSDP or EP, not plain DDP"
    if layout.kind == "fsdp+tp" and layout.cols > 1 and any(tp_split(t) for t in w.tensors):
        return (
            "refuses a tensor-parallel shard beside the FSDP one: every storage mesh dim but the "
            "redistributed one must be replicated (_resolve_storage_to_compute_transition)"
        )
    world = layout.world
    item = _itemsize(settings.param_dtype)
    flops, calls, sent, received, _ = _zeros(world, 5)
    local_scratch = np.zeros(world, dtype=np.int64)
    slots = [np.zeros((4, world), dtype=np.int64) for _ in range(2)]
    cumulative: dict[int, list[int]] = {}
    redistributed, owned_total = 0, 0
    for bucket in titan_buckets(w):
        owned = [t for t in bucket if len(t.shape) == 2 and titan_groups(layout, t).shape[1] > 1]
        mine = {id(t) for t in owned}
        for t in bucket:
            if id(t) not in mine:
                local, numel = _titan_local(layout, t)
                flops += local * slice_cost(t.shape, t.map)[1]
                calls += local > 0
                local_scratch = np.maximum(local_scratch, numel)
        if not owned:
            continue
        group = titan_groups(layout, owned[0])
        n = group.shape[1]
        owners = titan_owners(owned, cumulative.setdefault(n, [0] * n), item)
        # by position in the group: bytes, NS work, and the packed exchange buffers (storage
        # side, compute side) and scratch (storage, compute) the bucket needs
        b_flops, b_calls, b_sent, b_received = (np.zeros(n, dtype=np.int64) for _ in range(4))
        need = np.zeros((4, n), dtype=np.int64)
        for t, o in zip(owned, owners):
            parts = np.array(shard_rows(t.shape[0], n), dtype=np.int64) * t.shape[1]
            away = parts.copy()
            away[o] = 0
            b_sent += away  # each holder's part to the owner, and back
            b_received += away
            b_sent[o] += away.sum()
            b_received[o] += away.sum()
            b_flops[o] += tensor_flops(t)
            b_calls[o] += 1
            need[0] += parts
            need[1, o] += t.numel
            need[2] = np.maximum(need[2], parts)
            need[3, o] = max(need[3, o], t.numel)
        for arr, b in (
            (flops, b_flops),
            (calls, b_calls),
            (sent, b_sent * item),
            (received, b_received * item),
        ):
            arr[group] += b
        slot = slots[redistributed % 2]
        slot[:, group] = np.maximum(slot[:, group], need[:, None, :])
        redistributed += 1
        owned_total += len(owned)
    buffers = (slots[0].sum(axis=0) + slots[1].sum(axis=0) + local_scratch) * item
    arrays = (flops, calls, sent, received, buffers)
    note = f"{owned_total} matrices sent to owners in {redistributed} buckets; stacks orthogonalised where they lie"
    kinds = {"all_to_all": 2 * redistributed}
    return _figures("torchtitan", layout, w, settings, model, link, arrays, False, kinds, item, note)


# ----- megatron -----------------------------------------------------------------------------------
def megatron_params(w: Workload, experts: bool) -> list[tuple[Tensor, tuple[int, int]]]:
    """The 2-D parameters of one of Megatron's buffers (dense or expert), each with its shape: a
    stack's experts are parameters of their own (Megatron keeps one weight per local expert)."""
    out: list[tuple[Tensor, tuple[int, int]]] = []
    for t in w.tensors:
        if t.experts != experts:
            continue
        matrix = (t.shape[-2], t.shape[-1])
        out += [(t, matrix)] * math.prod(t.shape[:-2])  # one for a 2-D tensor
    return out


def _pad(n: int, divisor: int) -> int:
    return -(-n // divisor) * divisor


def megatron_layout(shapes: list[tuple[int, int]], dp: int) -> tuple[list[int], int]:
    """The shard (data-parallel rank) of each parameter and the padded shard size, as
    ``LayerWiseDistributedOptimizer._compute_per_buffer_param_layout`` lays out one bucket (the
    default DDP config's: ``overlap_grad_reduce`` off, so one bucket a buffer). The parameters
    in backprop (reverse) order, sorted stably by ``max·min²``, largest first; each goes to the
    shard of least NS load among those it fits in under 1.3× the mean shard (its start aligned
    to 64 elements), else to the least filled; shards padded to the largest, to a multiple of
    ``lcm(64, lcm(dp, 128) / dp)``."""
    order = list(reversed(range(len(shapes))))
    cost = [max(s) * min(s) ** 2 for s in shapes]
    numel = [s[0] * s[1] for s in shapes]
    cap = sum(numel) / dp * 1.3
    cursor, load = np.zeros(dp, dtype=np.int64), np.zeros(dp, dtype=np.int64)
    shard = [0] * len(shapes)
    for i in sorted(order, key=lambda i: -cost[i]):
        start = -(-cursor // 64) * 64
        fits = start + numel[i] <= cap
        s = (
            int(np.argmin(np.where(fits, load, np.iinfo(np.int64).max)))
            if fits.any()
            else int(np.argmin(cursor))
        )
        shard[i] = s
        cursor[s] = start[s] + numel[i]
        load[s] += cost[i]
    divisor = math.lcm(64, math.lcm(dp, 128) // dp)
    return shard, _pad(int(cursor.max()), divisor)


def megatron_tp(layout: Layout) -> bool:
    """Whether ``layout`` is Megatron's: every parameter whole on every data-parallel rank,
    tensor-parallel shards aside (DDP, or tensor parallelism alone)."""
    return layout.kind == "ddp" or (layout.kind == "fsdp+tp" and layout.rows == 1 and layout.cols > 1)


def _megatron_refusal(layout: Layout, ddp: bool = True) -> str:
    if layout.kind == "fsdp+tp":
        return (
            f"needs every TP shard whole on each data-parallel rank (Megatron's DDP): {layout} shards it over "
            f"{layout.rows} ranks; give fsdp+tp:1x{layout.cols}" + (" or ddp" if ddp else "")
        )
    return "needs every parameter whole on every data-parallel rank (Megatron's DDP): give ddp or fsdp+tp:1xT"


def megatron(w: Workload, layout: Layout, settings: Settings, model: CostModel, link: float) -> Figures | str:
    """NVIDIA/Megatron-LM ``megatron/core/optimizer/layer_wise_optimizer.py``,
    ``LayerWiseDistributedOptimizer``: every data-parallel rank holds the model whole; each
    parameter is owned by the rank :func:`megatron_layout` puts it on (dense and expert
    parameters laid out apart, each buffer its own loads), the owner updates it (one NS call)
    and one ``all_gather`` per buffer (``start_param_sync``) hands every rank the padded
    shards, in the parameters' dtype. Buffers: the padding of the parameter buffer. Under
    tensor parallelism alone (``fsdp+tp:1xT``, a data-parallel group of one), its Muon
    (``emerging_optimizers.py``, ``TensorParallelMuon.orthogonalize``) takes the default
    ``muon_tp_mode="duplicated"``: an fp32 ``all_gather`` of each TP shard over the TP group,
    and every TP rank orthogonalises the whole matrix; weights TP leaves whole are
    orthogonalised on every rank."""
    if not megatron_tp(layout):
        return _megatron_refusal(layout)
    if layout.kind == "fsdp+tp":
        return _megatron_duplicated(w, layout, settings, model, link)
    world = layout.world
    flops, calls, sent, received, buffers = _zeros(world, 5)
    item = _itemsize(settings.param_dtype)
    gathers, padding = 0, 0
    for experts in (False, True):
        params = megatron_params(w, experts)
        if not params:
            continue
        if world == 1:
            flops[0] += sum(tensor_flops(t) for t in w.tensors if t.experts == experts)
            calls[0] += len(params)
            continue
        shard, size = megatron_layout([s for _, s in params], world)
        for (t, _), s in zip(params, shard):
            flops[s] += slice_cost(t.shape, t.map)[1]
            calls[s] += 1
        sent += size * (world - 1) * item
        received += size * (world - 1) * item
        padding += size * world - sum(a * b for _, (a, b) in params)
        gathers += 1
    buffers[:] = padding * item
    arrays = (flops, calls, sent, received, buffers)
    note = "owners by NS load under a 1.3x shard cap, one padded all_gather per buffer"
    return _figures(
        "megatron", layout, w, settings, model, link, arrays, True, {"all_gather": gathers}, item, note
    )


def _megatron_duplicated(
    w: Workload, layout: Layout, settings: Settings, model: CostModel, link: float
) -> Figures:
    world = layout.world
    flops, calls, sent, received, buffers = _zeros(world, 5)
    gathers = 0
    for t in w.tensors:
        flops += tensor_flops(t)
        calls += 1
        if tp_split(t):
            own = rank_numel(layout, t)
            sent += own * (world - 1) * FP32
            received += (t.numel - own) * FP32
            buffers[:] = np.maximum(buffers, 2 * t.numel * FP32)
            gathers += 1
    arrays = (flops, calls, sent, received, buffers)
    note = "TP shards all-gathered in fp32 and orthogonalised whole on every TP rank (tp_mode duplicated)"
    return _figures(
        "megatron", layout, w, settings, model, link, arrays, True, {"all_gather": gathers}, FP32, note
    )


# ----- emerging ---------------------------------------------------------------------------------
def emerging(w: Workload, layout: Layout, settings: Settings, model: CostModel, link: float) -> Figures | str:
    """NVIDIA-NeMo/Emerging-Optimizers ``emerging_optimizers/orthogonalized_optimizers/muon_utils.py``,
    ``newton_schulz_tp`` with ``tp_mode="distributed"`` (as Megatron's ``TensorParallelMuon``
    runs it): a TP shard is never gathered. Each NS step forms the Gram matrix ``X·Xᵀ`` of the
    local shard over the dim TP leaves whole (``partition_dim`` 0, a column-wise weight, is
    transposed first, so its Gram matrix spans the input dim, the long one where the weight is
    narrow), ``all_reduce``-s it over the TP group (bf16: the default ``fp32_matmul_prec``
    "medium" runs NS in bf16), and every TP rank squares it and applies it to its shard: per
    step ``4·g²·l + 2·g³`` FLOPs for a Gram dim g and a local length l. One more ``all_reduce``
    per matrix gives the Frobenius norm (one fp32 scalar: counted, its bytes left out). Weights
    TP leaves whole (``partition_dim`` None) fall back to ``newton_schulz`` of the whole on every
    rank. Applies where tensor-parallel shards exist and each is whole on its rank
    (``fsdp+tp:1xT``); without them every rank orthogonalises its whole matrices, which is
    Megatron's step (``megatron`` under ``ddp``)."""
    tp = layout.cols if layout.kind == "fsdp+tp" else 1
    if tp == 1 or not any(tp_split(t) for t in w.tensors):
        return (
            f"no tensor-parallel shards under {layout}: its distributed NS takes TP shards only, elsewhere "
            "every rank orthogonalises its whole matrices (the megatron design); give fsdp+tp:1xT"
        )
    if layout.rows > 1:
        return _megatron_refusal(layout, ddp=False)
    world = layout.world
    flops, calls, sent, received, buffers = _zeros(world, 5)
    reductions = 0
    for t in w.tensors:
        if not tp_split(t):
            flops += tensor_flops(t)
            calls += 1
            continue
        alone = Workload("", "", (Tensor(t.name, t.shape, t.map),))
        dim = 0 if t.tp == COLWISE else 1
        for m in matrices(alone, Layout("ddp", 1, 1)):
            g = m.rows_cols[1 - dim]
            local = np.array(shard_rows(m.rows_cols[dim], world), dtype=np.int64)
            flops += NS_STEPS * (4 * g * g * local + 2 * g**3)
            calls += 1
            moved = NS_STEPS * 2 * (world - 1) * g * g * BF16 // world
            sent += moved
            received += moved
            buffers[:] = np.maximum(buffers, g * g * BF16)
            reductions += NS_STEPS + 1
    arrays = (flops, calls, sent, received, buffers)
    note = "a Gram all_reduce over the TP group per NS step of every TP-split matrix"
    return _figures(
        "emerging", layout, w, settings, model, link, arrays, False, {"all_reduce": reductions}, BF16, note
    )


#: the peers' designs, by name, in the order the plan lists them
PEERS: dict[str, Peer] = {
    "keller": keller,
    "dion": dion,
    "torchtitan": torchtitan,
    "megatron": megatron,
    "emerging": emerging,
    "plain": plain,
}
