"""Where each rank's part of every parameter lies under a parallel layout, as a pure function of
the world size: what torch's own APIs (FSDP2's ``fully_shard``, ``parallelize_module``,
``distribute_tensor``) leave on each rank, computed without a process group.

- ``ddp``: every rank holds every parameter whole (plain tensors, gradients averaged);
- ``fsdp``: ``Shard(0)`` over every rank (``torch.chunk`` row blocks, trailing ranks maybe empty);
- ``hsdp:RxS``: ``(Replicate(), Shard(0))`` on an R×S mesh: rank ``r·S + s`` holds row block s;
- ``fsdp+tp:DxT``: tensor parallelism on the T ("tp") dim, FSDP2 on the D ("dp") dim, rank
  ``d·T + t``: a column-wise weight is cut in T row chunks, chunk t in D sub-chunks, and rank
  (d, t) holds sub-chunk d of chunk t (``(_StridedShard(0), Shard(0))``); a row-wise weight holds
  row block d of column block t (``(Shard(0), Shard(1))``); a weight tensor parallelism leaves
  alone holds row block d on every t (``Shard(0)`` over dp, replicated over tp);
- ``ep:E`` (or ``ep``: E = the experts, or the world, whichever is smaller): expert stacks
  ``(Replicate(), Shard(0))`` on a (W/E)×E mesh, ``Shard(0)`` of the expert dim over E; every
  other weight FSDP2-sharded over every rank, on a 1-D mesh of its own.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...distributed import shard_rows
from .models import COLWISE, ROWWISE, Tensor, Workload

#: A box of a tensor, ``(start, stop)`` per dim (as :mod:`fastmuon.distributed.parts` writes it).
Region = tuple[tuple[int, int], ...]

KINDS = ("ddp", "fsdp", "hsdp", "fsdp+tp", "ep")
LAYOUT_HELP = "ddp | fsdp | hsdp:RxS | fsdp+tp:DxT | ep[:E]"


@dataclass(frozen=True)
class Layout:
    """A parsed layout: its kind and mesh (``rows`` × ``cols``: replicas × shards for HSDP, dp ×
    tp for FSDP + TP, dp × ep for expert parallel; 1 × W for FSDP and DDP)."""

    kind: str
    rows: int
    cols: int

    @property
    def world(self) -> int:
        return self.rows * self.cols

    @property
    def sharded(self) -> bool:
        """Whether parameters are DTensors (every layout but DDP)."""
        return self.kind != "ddp"

    def __str__(self) -> str:
        if self.kind in ("ddp", "fsdp"):
            return self.kind
        return f"{self.kind}:{self.rows}x{self.cols}" if self.kind != "ep" else f"ep:{self.cols}"


def parse_layout(spec: str, world: int, num_experts: int = 0) -> Layout:
    """``spec`` (:data:`LAYOUT_HELP`) at ``world`` ranks; ``ValueError`` naming the fix otherwise.
    A mesh given without its size (``hsdp``, ``fsdp+tp``) takes 8 ranks per node as the inner
    dim (or the world, where smaller): one node's shards, one node's tensor-parallel group."""
    kind, _, mesh = spec.partition(":")
    if kind not in KINDS:
        raise ValueError(f"unknown layout {spec!r} for --layout; choose one of {LAYOUT_HELP}")
    if world < 1:
        raise ValueError(f"--world must be a positive rank count, got {world}")
    if kind in ("ddp", "fsdp"):
        if mesh:
            raise ValueError(f"--layout {kind} takes no mesh ({spec!r}); give {kind!r}")
        return Layout(kind, 1, world)
    if kind == "ep":
        if mesh:
            try:
                ep = int(mesh)
            except ValueError:
                raise ValueError(f"--layout {spec!r}: ep takes one size, as ep:8") from None
        else:
            ep = min(num_experts or world, world)
        if ep < 1 or world % ep:
            raise ValueError(f"--layout {spec!r}: the ep size {ep} must divide --world {world}")
        return Layout(kind, world // ep, ep)
    if mesh:
        try:
            rows, cols = (int(x) for x in mesh.lower().split("x"))
        except ValueError:
            raise ValueError(f"--layout {spec!r}: give the mesh as RxS, as {kind}:2x4") from None
    else:
        cols = min(8, world)
        rows = world // cols
    if rows * cols != world or rows < 1 or cols < 1:
        raise ValueError(f"--layout {spec!r}: the mesh {rows}x{cols} must multiply to --world {world}")
    return Layout(kind, rows, cols)


def _rows_of(rows: int, parts: int) -> list[tuple[int, int] | None]:
    """``torch.chunk``'s row blocks of ``rows`` in ``parts`` (None: empty)."""
    sizes = shard_rows(rows, parts)
    out, start = [], 0
    for n in sizes:
        out.append((start, start + n) if n else None)
        start += n
    return out


def _box(shape: tuple[int, ...], **dims: tuple[int, int] | None) -> Region | None:
    """The box of ``shape`` with the given dims cut (``d0``, ``d1``); None if any cut is empty."""
    out = []
    for d, n in enumerate(shape):
        cut = dims.get(f"d{d}", (0, n))
        if cut is None:
            return None
        out.append(cut)
    return tuple(out)


def regions(layout: Layout, tensor: Tensor) -> list[tuple[Region | None, list[int]]]:
    """``tensor``'s distinct boxes under ``layout``, each with the ranks holding it (ascending);
    together they list every rank once."""
    shape, world = tensor.shape, layout.world
    held: dict[Region | None, list[int]] = {}

    def put(rank: int, region: Region | None) -> None:
        held.setdefault(region, []).append(rank)

    if layout.kind == "ddp":
        return [(_box(shape), list(range(world)))]
    if layout.kind == "fsdp" or (layout.kind == "ep" and not tensor.experts):
        for r, rows in enumerate(_rows_of(shape[0], world)):
            put(r, _box(shape, d0=rows))
    elif layout.kind == "ep":
        dp, ep = layout.rows, layout.cols
        blocks = _rows_of(shape[0], ep)
        for d in range(dp):
            for e in range(ep):
                put(d * ep + e, _box(shape, d0=blocks[e]))
    elif layout.kind == "hsdp":
        reps, shards = layout.rows, layout.cols
        blocks = _rows_of(shape[0], shards)
        for r in range(reps):
            for s in range(shards):
                put(r * shards + s, _box(shape, d0=blocks[s]))
    else:  # fsdp+tp
        dp, tp = layout.rows, layout.cols
        row_blocks = _rows_of(shape[0], dp)
        if tensor.tp == COLWISE and not tensor.experts:
            chunks = _rows_of(shape[0], tp)
            subs = [None if c is None else _rows_of(c[1] - c[0], dp) for c in chunks]
        if tensor.tp == ROWWISE and not tensor.experts:
            col_blocks = _rows_of(shape[1], tp)
        for d in range(dp):
            for t in range(tp):
                rank = d * tp + t
                if tensor.tp == COLWISE and not tensor.experts:
                    chunk, sub = chunks[t], None if subs[t] is None else subs[t][d]
                    rows = None if sub is None else (chunk[0] + sub[0], chunk[0] + sub[1])
                    put(rank, _box(shape, d0=rows))
                elif tensor.tp == ROWWISE and not tensor.experts:
                    put(rank, _box(shape, d0=row_blocks[d], d1=col_blocks[t]))
                else:
                    put(rank, _box(shape, d0=row_blocks[d]))
    return list(held.items())


def rank_regions(layout: Layout, tensor: Tensor) -> list[Region | None]:
    """Each rank's box of ``tensor`` (None: none), rank by rank."""
    out: list[Region | None] = [None] * layout.world
    for region, ranks in regions(layout, tensor):
        for r in ranks:
            out[r] = region
    return out


def check_fits(layout: Layout, workload: Workload) -> None:
    """Refuse a layout the workload cannot take, naming the fix."""
    if layout.kind == "ep" and not workload.num_experts:
        raise ValueError(
            f"--layout {layout}: {workload.name} has no expert stacks to shard; choose a MoE model "
            "(mixtral-8x7b, deepseek-v3) or another layout"
        )
