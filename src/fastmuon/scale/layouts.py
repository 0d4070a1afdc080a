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
- ``ep:E`` (E dividing the experts; or ``ep``: E = the experts, or the world, whichever is
  smaller): on a (W/E)×E ("dp" × "ep") mesh, expert stacks ``Shard(0)`` of the expert dim over
  ep and FSDP2-sharded over dp, rank ``d·E + e`` holding part d of expert block e; every other
  weight FSDP2-sharded over every rank, on a 1-D mesh of its own.

Expert stacks ``(E, out, in)`` take FSDP2's ``Shard(expert_dim)`` where the layouts above say
``Shard(0)`` over their FSDP dim (every rank; S; D; dp under ``ep``). With ``expert_dim`` 1
(``fully_shard(..., shard_placement_fn=...)`` returning ``Shard(1)``) a rank holds its
``torch.chunk`` block of dim 1 of every expert it holds (under ``ep``, ``(Shard(1), Shard(0))``);
with 0 under ``ep``, FSDP2 cuts the rank's expert block again (``(_StridedShard(0), Shard(0))``):
sub-chunk d of block e. By default ``expert_dim`` is torchtitan's rule
(:func:`torchtitan_expert_dim`): 1 where the ranks it weighs outnumber the experts per layer,
so that no FSDP rank is left without experts. FSDP2 shards a dim other than 0 only evenly
(it raises otherwise), so :func:`check_expert_dim` refuses a dim 1 that does not divide.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..distributed import shard_rows
from ..tools.plan_options import EXPERT_SHARDS, LAYOUT_HELP
from .models import COLWISE, ROWWISE, Tensor, Workload

#: A box of a tensor, ``(start, stop)`` per dim (as :mod:`fastmuon.distributed.parts` writes it).
Region = tuple[tuple[int, int], ...]

KINDS = ("ddp", "fsdp", "hsdp", "fsdp+tp", "ep")


@dataclass(frozen=True)
class Layout:
    """A parsed layout: its kind and mesh (``rows`` × ``cols``: replicas × shards for HSDP, dp ×
    tp for FSDP + TP, dp × ep for expert parallel; 1 × W for FSDP and DDP), the dim FSDP2 shards
    expert stacks on, and the dim torchtitan's rule picks (``str`` names the first where they
    differ)."""

    kind: str
    rows: int
    cols: int
    expert_dim: int = 0
    default_expert_dim: int = 0

    @property
    def world(self) -> int:
        return self.rows * self.cols

    @property
    def sharded(self) -> bool:
        """Whether parameters are DTensors (every layout but DDP)."""
        return self.kind != "ddp"

    @property
    def expert_shards(self) -> int:
        """The ranks FSDP2 shards an expert stack over: every rank (FSDP), S (HSDP), D (FSDP +
        TP), dp (EP); 1 under DDP."""
        return {"ddp": 1, "fsdp": self.world, "hsdp": self.cols}.get(self.kind, self.rows)

    def __str__(self) -> str:
        if self.kind in ("ddp", "fsdp"):
            name = self.kind
        else:
            name = f"{self.kind}:{self.rows}x{self.cols}" if self.kind != "ep" else f"ep:{self.cols}"
        return (
            name if self.expert_dim == self.default_expert_dim else f"{name} (experts dim {self.expert_dim})"
        )


#: ranks per node: the inner dim a mesh given without its size takes
NODE = 8
#: what the inner dim of a two-dim mesh is, by kind
INNER_DIM = {"hsdp": "shard", "fsdp+tp": "tp"}


def torchtitan_expert_dim(kind: str, rows: int, cols: int, num_experts: int) -> int:
    """The dim torchtitan's FSDP shards expert stacks on (its ``apply_fsdp``): 1 where the ranks
    it weighs exceed ``num_experts``, else 0. It weighs the size of the mesh it hands FSDP2
    (FSDP: W; HSDP: R·S, the replicate dim included, as that mesh is 2-D; FSDP + TP: D, the tp
    dim apart) or, under EP, the experts' FSDP dim times the EP dim ((W/E)·E = W). 0 where
    nothing is sharded (DDP) or there are no experts."""
    if kind == "ddp" or not num_experts:
        return 0
    return 1 if _weighed(kind, rows, cols) > num_experts else 0


def _weighed(kind: str, rows: int, cols: int) -> int:
    """The ranks torchtitan's rule weighs against the experts (:func:`torchtitan_expert_dim`)."""
    return rows if kind == "fsdp+tp" else rows * cols


def parse_layout(spec: str, world: int, num_experts: int = 0, expert_shard: str = "auto") -> Layout:
    """``spec`` (:data:`LAYOUT_HELP`) at ``world`` ranks; ``ValueError`` naming the fix otherwise.
    A mesh given without its size (``hsdp``, ``fsdp+tp``) takes one node (:data:`NODE` ranks, or
    the world, where smaller) as the inner dim: one node's shards, one node's tensor-parallel
    group. With ``num_experts`` (the workload's expert count, 0: none), ``ep``'s size must divide
    it, and expert stacks are sharded on ``expert_shard`` (:data:`EXPERT_SHARDS`; ``auto``:
    :func:`torchtitan_expert_dim`)."""
    if expert_shard not in EXPERT_SHARDS:
        raise ValueError(f"--expert-shard {expert_shard!r}: choose one of {', '.join(EXPERT_SHARDS)}")
    layout = _parse_mesh(spec, world, num_experts)
    if expert_shard != "auto" and layout.kind == "ddp":
        raise ValueError(
            f"--expert-shard {expert_shard}: --layout ddp shards nothing; leave out --expert-shard "
            "or choose a sharded layout"
        )
    if expert_shard != "auto" and not num_experts:
        raise ValueError(
            f"--expert-shard {expert_shard}: the model has no expert stacks; leave out --expert-shard"
        )
    rule = torchtitan_expert_dim(layout.kind, layout.rows, layout.cols, num_experts)
    dim = rule if expert_shard == "auto" else int(expert_shard)
    return replace(layout, expert_dim=dim, default_expert_dim=rule)


def _parse_mesh(spec: str, world: int, num_experts: int) -> Layout:
    """``spec``'s kind and mesh at ``world`` ranks (expert stacks on dim 0)."""
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
        return _parse_ep(spec, mesh, world, num_experts)
    if not mesh:
        return _bare_mesh(kind, world)
    rows, cols = _mesh_dims(spec, kind, mesh)
    if rows * cols != world:
        raise ValueError(
            f"--layout {spec!r}: the mesh {rows}x{cols} must multiply to --world {world} "
            "(or leave out --world: a mesh naming both dims sets it)"
        )
    return Layout(kind, rows, cols)


def _mesh_dims(spec: str, kind: str, mesh: str) -> tuple[int, int]:
    """The two dims of ``kind:RxS``, each 1 or more."""
    try:
        rows, cols = (int(x) for x in mesh.lower().split("x"))
    except ValueError:
        raise ValueError(f"--layout {spec!r}: give the mesh as RxS, as {kind}:2x4") from None
    if rows < 1 or cols < 1:
        raise ValueError(f"--layout {spec!r}: the mesh's dims must be 1 or more, as {kind}:2x4")
    return rows, cols


def _bare_mesh(kind: str, world: int) -> Layout:
    """``hsdp`` or ``fsdp+tp`` without a mesh: one node as the inner dim, the nodes as the outer."""
    cols = min(NODE, world)
    if world % cols:
        inner = max(d for d in range(1, NODE + 1) if world % d == 0)
        raise ValueError(
            f"--layout {kind}: a bare {kind} takes one node ({NODE} ranks) as its inner "
            f"({INNER_DIM[kind]}) dim, and --world {world} is not a multiple of {NODE}; give the mesh, "
            f"as {kind}:{world // inner}x{inner}"
        )
    return Layout(kind, world // cols, cols)


def _parse_ep(spec: str, mesh: str, world: int, num_experts: int) -> Layout:
    """``ep`` or ``ep:E``: E ranks shard each expert stack, ``world / E`` replicas of them."""
    ep = _ep_size(spec, mesh) if mesh else min(num_experts or world, world)
    if num_experts and num_experts % ep:
        fits = ", ".join(f"ep:{d}" for d in range(1, num_experts + 1) if num_experts % d == 0)
        why = (
            f"{ep} EP ranks would leave ranks holding no expert"
            if ep > num_experts
            else f"{ep} does not divide them, so EP ranks would hold unequal expert counts"
        )
        given = f"--layout {spec}" + ("" if mesh else f" (at --world {world}: ep:{ep})")
        raise ValueError(
            f"{given}: the model has {num_experts} experts per layer and {why}; "
            f"give --layout ep:E with E dividing {num_experts} ({fits})"
        )
    if world % ep:
        raise ValueError(f"--layout {spec!r}: the ep size {ep} must divide --world {world}")
    return Layout("ep", world // ep, ep)


def _ep_size(spec: str, mesh: str) -> int:
    try:
        ep = int(mesh)
    except ValueError:
        raise ValueError(f"--layout {spec!r}: ep takes one size, as ep:8") from None
    if ep < 1:
        raise ValueError(
            f"--layout {spec!r}: the ep size (ranks per expert stack) must be 1 or more, as ep:8"
        )
    return ep


def given_mesh(spec: str) -> tuple[int, int] | None:
    """The two dims of a mesh ``spec`` names (``hsdp:2x4``: ``(2, 4)``); None for any other spec
    (one :func:`parse_layout` then reports, where malformed)."""
    kind, _, mesh = spec.partition(":")
    if kind not in INNER_DIM or not mesh:
        return None
    try:
        return _mesh_dims(spec, kind, mesh)
    except ValueError:
        return None


def mesh_world(spec: str) -> int | None:
    """The ranks a mesh naming both its dims (``hsdp:RxS``, ``fsdp+tp:DxT``) makes, ``R·S``;
    None for any other spec."""
    dims = given_mesh(spec)
    return None if dims is None else dims[0] * dims[1]


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


def _cut(shape: tuple[int, ...], dim: int, block: tuple[int, int] | None) -> Region | None:
    """The box of ``shape`` holding ``block`` of dim ``dim`` (None where the block is empty)."""
    return _box(shape, **{f"d{dim}": block})


def regions(layout: Layout, tensor: Tensor) -> list[tuple[Region | None, list[int]]]:
    """``tensor``'s distinct boxes under ``layout``, each with the ranks holding it (ascending);
    together they list every rank once."""
    shape, world = tensor.shape, layout.world
    held: dict[Region | None, list[int]] = {}
    dim = layout.expert_dim if tensor.experts else 0  # the dim FSDP2 shards it on

    def put(rank: int, region: Region | None) -> None:
        held.setdefault(region, []).append(rank)

    if layout.kind == "ddp":
        return [(_box(shape), list(range(world)))]
    if layout.kind == "fsdp" or (layout.kind == "ep" and not tensor.experts):
        for r, block in enumerate(_rows_of(shape[dim], world)):
            put(r, _cut(shape, dim, block))
    elif layout.kind == "ep":
        _expert_parallel(layout, shape, put)
    elif layout.kind == "hsdp":
        reps, shards = layout.rows, layout.cols
        blocks = _rows_of(shape[dim], shards)
        for r in range(reps):
            for s in range(shards):
                put(r * shards + s, _cut(shape, dim, blocks[s]))
    else:  # fsdp+tp
        dp, tp = layout.rows, layout.cols
        dp_blocks = _rows_of(shape[dim], dp)
        if tensor.tp == COLWISE and not tensor.experts:
            chunks = _rows_of(shape[0], tp)
            subs = [None if c is None else _rows_of(c[1] - c[0], dp) for c in chunks]
        if tensor.tp == ROWWISE and not tensor.experts:
            col_blocks = _rows_of(shape[1], tp)
        for d in range(dp):
            for t in range(tp):
                rank = d * tp + t
                if tensor.tp == COLWISE and not tensor.experts:
                    put(rank, _box(shape, d0=_sub(chunks[t], subs[t], d)))
                elif tensor.tp == ROWWISE and not tensor.experts:
                    put(rank, _box(shape, d0=dp_blocks[d], d1=col_blocks[t]))
                else:
                    put(rank, _cut(shape, dim, dp_blocks[d]))
    return list(held.items())


def _sub(chunk: tuple[int, int] | None, subs: list | None, d: int) -> tuple[int, int] | None:
    """Sub-chunk ``d`` of ``chunk`` (``subs``: its blocks, relative), in the tensor's rows."""
    sub = None if subs is None else subs[d]
    return None if chunk is None or sub is None else (chunk[0] + sub[0], chunk[0] + sub[1])


def _expert_parallel(layout: Layout, shape: tuple[int, ...], put) -> None:
    """An expert stack under ``ep``: expert block e over ep; over dp, FSDP2's block d of dim 1
    of it, or (dim 0) sub-chunk d of the block (``_StridedShard``)."""
    dp, ep = layout.rows, layout.cols
    blocks = _rows_of(shape[0], ep)
    if layout.expert_dim == 1:
        rows = _rows_of(shape[1], dp)
        for d in range(dp):
            for e in range(ep):
                put(d * ep + e, _box(shape, d0=blocks[e], d1=rows[d]))
        return
    subs = [None if b is None else _rows_of(b[1] - b[0], dp) for b in blocks]
    for d in range(dp):
        for e in range(ep):
            put(d * ep + e, _box(shape, d0=_sub(blocks[e], subs[e], d)))


def rank_regions(layout: Layout, tensor: Tensor) -> list[Region | None]:
    """Each rank's box of ``tensor`` (None: none), rank by rank."""
    out: list[Region | None] = [None] * layout.world
    for region, ranks in regions(layout, tensor):
        for r in ranks:
            out[r] = region
    return out


def check_fits(spec: str, workload: Workload) -> None:
    """Refuse a layout the workload cannot take at any world size, naming the fix."""
    if spec.partition(":")[0] == "ep" and not workload.num_experts:
        raise ValueError(
            f"--layout {spec}: {workload.name} has no expert stacks to shard; ep needs a MoE model "
            "(mixtral-8x7b, deepseek-v3), or choose another layout"
        )


def check_expert_dim(layout: Layout, workload: Workload) -> None:
    """Refuse expert stacks sharded on dim 1 where that dim does not divide over the ranks
    sharding it: FSDP2 shards a dim other than 0 only evenly (``fully_shard`` raises)."""
    if layout.expert_dim != 1:
        return
    k = layout.expert_shards
    uneven = next((t for t in workload.tensors if t.experts and t.shape[1] % k), None)
    if uneven is None:
        return
    why = (
        f"torchtitan's rule: its {_weighed(layout.kind, layout.rows, layout.cols)} ranks outnumber the {workload.num_experts} experts"
        if layout.expert_dim == layout.default_expert_dim
        else "--expert-shard 1"
    )
    raise ValueError(
        f"--layout {layout} at --world {layout.world}: expert stacks are sharded on dim 1 ({why}), "
        f"and FSDP2 shards a dim other than 0 only evenly: {uneven.name}'s dim 1 ({uneven.shape[1]}) "
        f"does not divide over {k} ranks; give --expert-shard 0, or a world whose FSDP dim divides it"
    )


def layout_for(spec: str, world: int, workload: Workload, expert_shard: str = "auto") -> Layout:
    """``spec`` at ``world`` ranks for ``workload`` (:func:`parse_layout`, its experts' count),
    refused (``ValueError`` naming the fix) where the workload cannot take it."""
    check_fits(spec, workload)
    layout = parse_layout(spec, world, workload.num_experts, expert_shard)
    check_expert_dim(layout, workload)
    return layout
