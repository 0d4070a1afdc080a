"""The pure arithmetic of parameters held in parts, without a process group: which part of each
matrix a rank holds and views, how a matrix is put back together from its parts, and who sends
what to whom. Layouts are random grids of blocks with replicas, as any mix of ``Shard`` and
``Replicate`` placements makes them; every answer is checked against slicing the whole tensor."""

from __future__ import annotations

import itertools
import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fastmuon.distributed.exchange import Routes, _whole, contiguous_layout, exchange_bytes
from fastmuon.distributed.parts import Parts, region_numel, whole_region
from fastmuon.distributed.placement import Links, holding_of, place
from fastmuon.distributed.sharded import ShardedMatrix, held_pieces
from fastmuon.ns.build import plan_for
from fastmuon.ns.engine import NSConfig, spec_of
from fastmuon.ns.matrices import parse
from fastmuon.ns.planner import default_cost_model


def cuts(draw, size: int, most: int) -> list[tuple[int, int]]:
    """``size`` cut into at most ``most`` ranges (some maybe empty, as uneven shards leave them)."""
    k = draw(st.integers(1, most))
    points = sorted(draw(st.lists(st.integers(0, size), min_size=k - 1, max_size=k - 1)))
    bounds = [0, *points, size]
    return list(zip(bounds, bounds[1:]))


@st.composite
def layouts(draw):
    """A 3-D tensor's shape and each rank's box: a grid over dims 0 and 1, each cell on
    ``replicas`` ranks (empty cells hold nothing)."""
    shape = (draw(st.integers(1, 6)), draw(st.integers(1, 7)), draw(st.integers(1, 3)))
    rows, cols = cuts(draw, shape[0], 3), cuts(draw, shape[1], 2)
    replicas = draw(st.integers(1, 2))
    regions = []
    for _ in range(replicas):
        for (a, b), (c, d) in itertools.product(rows, cols):
            regions.append(((a, b), (c, d), (0, shape[2])) if a < b and c < d else None)
    return shape, tuple(regions)


def local_part(whole: torch.Tensor, region) -> torch.Tensor:
    """A rank's local tensor: its box of ``whole`` (an empty tensor where it holds none)."""
    index = tuple(slice(a, b) for a, b in region) if region else tuple(slice(0, 0) for _ in whole.shape)
    return whole[index]


MAPS = ["flatten", "experts", {"batch_dims": 1, "heads": 2}, {"split": [1, 2]}]


def part_of(box, shape, region):
    """The part of ``t[box]`` inside ``region`` (a rank's box), in the matrix's coordinates,
    or None: worked out dim by dim from the definitions."""
    if region is None:
        return None
    out = []
    for d, (size, (s, e)) in enumerate(zip(shape, region)):
        index = box[d] if d < len(box) else slice(None)
        a, b = (index, index + 1) if isinstance(index, int) else index.indices(size)[:2]
        lo, hi = max(a, s), min(b, e)
        if lo >= hi:
            return None
        if not isinstance(index, int):
            out.append((lo - a, hi - a))
    return tuple(out)


@settings(max_examples=80, deadline=None)
@given(layouts(), st.sampled_from(MAPS))
def test_each_rank_views_its_part_of_every_matrix(layout, spec):
    shape, regions = layout
    m = parse(spec)
    try:
        m.check(shape)
    except ValueError:
        return  # a map this shape cannot take (heads that do not divide, a split that does not fit)
    whole = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape)
    for rank, region in enumerate(regions):
        t = local_part(whole, region)
        pieces = iter(held_pieces(m, t, t, t, Parts(shape, regions, rank)))
        for box in m.boxes(shape):
            matrix = whole[box]
            held = tuple(part_of(box, shape, r) for r in regions)
            holders = [h for h in held if h is not None]
            alone = len(holders) == 1 and holders[0] == whole_region(matrix.shape)
            if held[rank] is None and alone:
                continue  # another rank's alone: not in this rank's list
            piece = next(pieces)
            view, described = piece.param, piece.whole
            assert described is not None
            assert described.shape == tuple(matrix.shape) and described.held == held
            assert described.exchanged == (not alone)
            if held[rank] is None:
                assert view.numel() == 0
            else:
                assert torch.equal(view, matrix[tuple(slice(a, b) for a, b in held[rank])])
        assert next(pieces, None) is None, "a matrix the rank should not hold"


@settings(max_examples=60, deadline=None)
@given(layouts(), st.integers(1, 3))
def test_a_matrix_is_put_back_together_from_its_parts(layout, count):
    shape, regions = layout
    whole = torch.randn(count, *shape)
    distinct = sorted({r for r in regions if r is not None})
    blocks = [(r, whole[(slice(None), *(slice(a, b) for a, b in r))]) for r in distinct]
    assert torch.equal(_whole(blocks, shape, count), whole)


@settings(max_examples=40, deadline=None)
@given(
    st.lists(layouts(), min_size=1, max_size=5),
    st.sampled_from([None, 1, 2]),
    st.sampled_from([None, 64, 4096]),
)
def test_routes_send_what_is_received_and_cover_each_matrix_once(matrices, group_size, cap):
    """Whatever the placement (owner groups of 2 or none, rounds under a cap or one round):
    every matrix's targets' sources cover it exactly once, every holder gets back exactly its
    part, and what each rank sends each other rank in a round is what that rank receives."""
    world = max(len(regions) for _, regions in matrices)
    shapes = [s for s, _ in matrices]
    held = [tuple(regions) + (None,) * (world - len(regions)) for _, regions in matrices]
    cfg = NSConfig.make(5, "jordan", 1e-7, torch.float32, "auto")
    specs = [spec_of(torch.empty(0), cfg, contiguous_layout(s)) for s in shapes]
    plan = plan_for(specs, [cfg] * len(specs), "auto", "cpu", 1 << 30, 1)
    holdings = [
        holding_of(ShardedMatrix(s, h, torch.float32, torch.device("cpu")), 4) for s, h in zip(shapes, held)
    ]
    size = group_size if group_size is None or world % group_size == 0 else 1
    splittable = [len(s) == 2 and (size is None or max(s[0], math.prod(s[1:])) % size == 0) for s in shapes]
    units = place(
        plan, world, holdings, default_cost_model("cpu"), Links(1e9, 1e9, world), size, 1, splittable
    )
    caps = None if cap is None else [cap] * world
    routes = Routes(plan, shapes, held, world, units, caps)
    for i, shape in enumerate(shapes):
        targets = [t for t, target in enumerate(routes.targets) if target.matrix == i]
        covered = sum(region_numel(reg) for t in targets for _, reg in routes.sources[t])
        assert covered == math.prod(shape), "a matrix's sources must cover it exactly once"
        for r in range(world):
            back = sum(region_numel(reg) for t in targets for h, reg in routes.pieces[t] if h == r)
            assert back == region_numel(held[i][r]), "every holder gets back exactly its part"
    for rounds in routes.rounds.values():
        for units_of_round in rounds:
            sizes = [routes.round_sizes(units_of_round, r) for r in range(world)]
            for phase in (0, 1):
                sends = [sizes[r][phase][0] for r in range(world)]
                recvs = [sizes[r][phase][1] for r in range(world)]
                assert all(sends[r][o] == recvs[o][r] for r in range(world) for o in range(world))
    sent = sum(exchange_bytes(routes, r)[0] for r in range(world))
    received = sum(exchange_bytes(routes, r)[1] for r in range(world))
    assert sent == received
