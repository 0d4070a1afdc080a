"""Run a plan: pack tensors into bucket buffers, Newton–Schulz once per bucket, unpack.

Tensors that share their shape, strides and orientation form a *run* of consecutive slots in
a bucket, and each run is packed with one strided copy (with the dtype cast folded in) and
unpacked with another, whatever the memory format: a channels_last conv weight is read and
written in its own memory order, never made contiguous first. Bucket buffers persist between
steps, so the zero padding is written once.
"""

from __future__ import annotations

import functools
import itertools
import operator
import weakref
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ..matrices import MatrixMapSpec, maps_of
from ..step.nonfinite import zero_rejected_
from ..step.program import Gather
from . import device as compute
from .device import compute_dtype, wider_dtype
from .layout import memory_order
from .newton_schulz import METHODS, CoefficientSpec, resolve_coefficients
from .planner import (
    DEFAULT_MAX_BUCKET_BYTES,
    Bucket,
    CostModel,
    MatrixSpec,
    Plan,
    plan_buckets,
)


@dataclass(frozen=True)
class NSConfig:
    """The Newton–Schulz settings a bucket runs with; matrices with different ones never share."""

    steps: int
    coefficients: tuple[tuple[float, float, float], ...]
    eps: float
    dtype: torch.dtype
    method: str = "auto"

    @classmethod
    def make(
        cls, steps: int, coefficients: CoefficientSpec, eps: float, dtype: torch.dtype, method: str = "auto"
    ):
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ValueError(f"ns_dtype must be a floating torch.dtype, got {dtype!r}")
        if not eps >= 0:
            raise ValueError(f"eps must be >= 0, got {eps!r}")
        if method not in ("auto", *METHODS):
            raise ValueError(f"unknown ns_method {method!r}; choose 'auto' or one of {sorted(METHODS)}")
        return cls(steps, tuple(resolve_coefficients(coefficients, steps)), float(eps), dtype, method)


@dataclass(frozen=True)
class TensorLayout:
    """Shape and strides of a tensor, and the dim order that walks its memory contiguously."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    perm: tuple[int, ...]

    @classmethod
    def of(cls, t: Tensor) -> TensorLayout:
        perm = memory_order(t)
        if perm is None:  # overlapping or gappy strides: use a copy
            return cls(tuple(t.shape), _contiguous_strides(t.shape), tuple(range(t.ndim)))
        return cls(tuple(t.shape), tuple(t.stride()), perm)

    @property
    def matrix(self) -> tuple[int, int]:
        rows = self.shape[0]
        return rows, (_numel(self.shape) // rows if rows else 0)

    def memory_shape(self) -> list[int]:
        return [self.shape[d] for d in self.perm]

    def logical_view(self, flat: Tensor, count: int) -> Tensor:
        """View ``count`` tensors stored back to back in memory order as ``(count, *shape)``."""
        inverse = sorted(range(len(self.perm)), key=lambda d: self.perm[d])
        return flat.view(count, *self.memory_shape()).permute(0, *(1 + d for d in inverse))


@dataclass(frozen=True)
class _Run:
    """Slots ``start:stop`` of a bucket, all holding tensors of one layout and orientation."""

    start: int
    stop: int
    layout: TensorLayout
    transposed: bool
    tensors: tuple[int, ...]

    def slots(self, batch: Tensor) -> Tensor:
        """The run's region of a ``(B, R, C)`` batch, as ``(k, *shape)`` in the tensors' own shape."""
        return _region(batch[self.start : self.stop], self.layout, self.transposed)


def _region(slots: Tensor, layout: TensorLayout, transposed: bool) -> Tensor:
    """``(k, R, C)`` bucket slots holding tensors of ``layout`` as a ``(k, *shape)`` view."""
    rows, cols = layout.matrix
    region = slots[:, :cols, :rows].mT if transposed else slots[:, :rows, :cols]
    return region.view(len(slots), *layout.shape)


def _slot_view(batch: Tensor, slot: int, layout: TensorLayout, transposed: bool) -> Tensor:
    """The tensor in ``slot`` of a ``(B, R, C)`` batch, as a view with its own shape."""
    return _region(batch[slot : slot + 1], layout, transposed)[0]


class ScratchArena:
    """Temporaries of the NS kernels, kept between steps and shared by the buckets in turn.

    A CPU allocator returns large blocks to the OS when they are freed, so every fresh
    temporary is page-faulted in again, zero-filled, on every step; kept buffers skip that.
    One flat arena per (role, dtype), sized to the largest request,
    serves every bucket, since buckets run one after another. (On CUDA the caching allocator
    already reuses memory, so the engine does not use this there.)
    """

    def __init__(self, device: torch.device):
        self.device = device
        self._arenas: dict[tuple[str, torch.dtype], Tensor] = {}
        self._views: dict[tuple[str, torch.dtype, tuple[int, ...]], Tensor] = {}
        self._takers: dict[torch.dtype, Callable[[str, tuple[int, ...]], Tensor]] = {}

    def for_dtype(self, dtype: torch.dtype):
        """The ``scratch(tag, shape)`` callable the kernels take (newton_schulz.Scratch), made
        once per dtype."""
        taker = self._takers.get(dtype)
        if taker is None:
            taker = self._takers[dtype] = self._taker(dtype)
        return taker

    def _taker(self, dtype: torch.dtype):
        def take(tag: str, shape: tuple[int, ...]) -> Tensor:
            view = self._views.get((tag, dtype, shape))  # made once: a view costs Python time
            if view is None:
                view = self._view(tag, dtype, tuple(shape))
            return view

        return take

    def _view(self, tag: str, dtype: torch.dtype, shape: tuple[int, ...]) -> Tensor:
        numel = _numel(shape)
        arena = self._arenas.get((tag, dtype))
        if arena is None or arena.numel() < numel:
            arena = self._arenas[(tag, dtype)] = torch.empty(numel, dtype=dtype, device=self.device)
            for key in [k for k in self._views if k[:2] == (tag, dtype)]:
                del self._views[key]  # views of the old, smaller arena
        view = self._views[(tag, dtype, shape)] = arena[:numel].view(shape)
        return view

    def tensors(self) -> list[Tensor]:
        return list(self._arenas.values())


#: On a CPU, buckets of matrices with at most this many rows (after orienting them wide) keep
#: their NS output and temporaries between steps; None: every bucket. Kept buffers save the
#: page faults of fresh ones at every bucket size, for workspace memory (about 3x for GPT-2's
#: 768-wide matrices); a number here trades that speed back for memory on the larger matrices.
REUSE_MAX_ROWS: int | None = None

#: Buckets holding more than this many runs are packed with one index copy instead of a copy
#: per run (fewer launches), as long as the int64 index stays small.
GATHER_MIN_RUNS = 3
GATHER_MAX_ELEMENTS = 8 * 2**20


class Orthogonalizer:
    """Executes a :class:`Plan` for tensors of fixed layouts; reusable step after step.

    Per bucket: :meth:`pack` the sources into the persistent ``(B, R, C)`` buffer,
    :meth:`run_bucket` (one batched NS), :meth:`unpack` into results with each source's shape
    and strides. With ``result_views`` (for a caller that consumes the results at once, as the
    optimizers do) a CPU run's results are instead views into its output buffers, valid until
    the next call: no unpacking copy.
    """

    def __init__(
        self,
        plan: Plan,
        layouts: Sequence[TensorLayout],
        configs: dict[Hashable, NSConfig],
        compile: bool = False,
        result_views: bool = False,
    ):
        self.plan = plan
        self.compile = compile
        self.result_views = result_views
        self.layouts = list(layouts)
        self.configs = configs
        self._bucket_configs = [configs[bucket.key] for bucket in plan.buckets]
        self._runs = [self._split_runs(b) for b in plan.buckets]
        # each bucket's members picked out of a per-call list (sources, dtypes), in slot order
        self._members = [Gather([m.index for m in b.members]) for b in plan.buckets]
        self._gathers = [self._gather_index(b, runs) for b, runs in zip(plan.buckets, self._runs)]
        self._buffers: list[Tensor | None] = [None] * len(plan.buckets)
        self._staging: list[Tensor | None] = [None] * len(plan.buckets)
        # per gather bucket: its members' places in the staging buffer, in their planned layouts
        self._staging_views: list[tuple[Tensor, list[Tensor], Tensor] | None] = [None] * len(plan.buckets)
        self._outputs: list[Tensor | None] = [None] * len(plan.buckets)
        self._result_views: list[list[Tensor] | None] = [None] * len(plan.buckets)
        self._member_indices: dict[tuple, Tensor] = {}
        self._slot_regions: list[tuple[Tensor, list[Tensor]] | None] = [None] * len(plan.buckets)
        # unpacking a cast into kept buffers (result views): the copies and the views made once
        self._unpack_ops: list[tuple[torch.dtype, Callable[[Tensor], None], list[Tensor]] | None] = [
            None
        ] * len(plan.buckets)
        self._unpack_buffers: list[list[Tensor]] = [[] for _ in plan.buckets]
        self._input_views: list[Tensor] | None = None
        self._scratch: ScratchArena | None = None

    def _split_runs(self, bucket: Bucket) -> list[_Run]:
        runs: list[_Run] = []
        for m in bucket.members:
            layout = self.layouts[m.index]
            last = runs[-1] if runs else None
            if last and last.layout == layout and last.transposed == m.transposed:
                runs[-1] = _Run(last.start, m.slot + 1, layout, m.transposed, (*last.tensors, m.index))
            else:
                runs.append(_Run(m.slot, m.slot + 1, layout, m.transposed, (m.index,)))
        return runs

    def _gather_index(self, bucket: Bucket, runs: list[_Run]) -> Tensor | None:
        """For buckets of many runs: where each element of the members, concatenated in their
        memory order, lives in the flat ``(B, R, C)`` buffer (built once, on the CPU)."""
        total = sum(_numel(self.layouts[m.index].shape) for m in bucket.members)
        if len(runs) < GATHER_MIN_RUNS or total > GATHER_MAX_ELEMENTS:
            return None
        _, R, C = bucket.shape
        parts = []
        for m in bucket.members:
            layout = self.layouts[m.index]
            cols = layout.matrix[1]
            logical = torch.arange(_numel(layout.shape)).view(layout.shape).permute(layout.perm).reshape(-1)
            row, col = logical // cols, logical % cols
            if m.transposed:
                row, col = col, row
            parts.append(m.slot * R * C + row * C + col)
        return torch.cat(parts)

    def __call__(
        self,
        sources: Sequence[Tensor],
        out_dtypes: Sequence[torch.dtype],
        keep: Tensor | Sequence[Tensor] | None = None,
        keep_positions: tuple[int, ...] | None = None,
    ) -> list[Tensor]:
        """Orthogonalise ``sources``; each result has its source's shape and strides, in ``out_dtypes``.

        ``keep`` (one bool per source: a vector, or 0-d tensors) zeroes the rejected sources
        inside their bucket; with ``keep_positions`` source ``i``'s flag is ``keep[keep_positions[i]]``
        (a step's flags for all its parameters, picked per bucket with one index each).
        """
        results: list[Tensor | None] = [None] * len(sources)
        if keep is not None and not isinstance(keep, Tensor):
            keep = torch.stack(list(keep))
        for b in range(len(self.plan.buckets)):
            batch = self.pack(b, sources)
            if keep is not None:
                index = self._member_index(b, keep.device, keep_positions)
                zero_rejected_(batch, keep.index_select(0, index))
            self.unpack(b, self.run_bucket(b, batch), out_dtypes, results)
        return results  # type: ignore[return-value]

    def _member_index(self, b: int, device: torch.device, positions: tuple[int, ...] | None) -> Tensor:
        """Where bucket ``b``'s members' flags sit in a keep vector, in slot order (made once per
        device and positions)."""
        key = (b, device, positions)
        index = self._member_indices.get(key)
        if index is None:
            members = self.plan.buckets[b].members
            at = [m.index if positions is None else positions[m.index] for m in members]
            index = self._member_indices[key] = torch.tensor(at, device=device)
        return index

    def run_bucket(self, b: int, batch: Tensor) -> Tensor:
        """One batched Newton–Schulz call on bucket ``b``'s packed batch.

        On a CPU the result lands in the bucket's persistent output buffer (valid until the next
        call) and the kernel's temporaries in the shared scratch arena: no fresh memory per step.
        """
        bucket = self.plan.buckets[b]
        config = self._bucket_configs[b]
        coefficients = list(config.coefficients)
        if self.compile and bucket.method != "eigh":  # eigh: one LAPACK call, nothing to fuse
            return compiled_kernel(bucket.method)(batch, coefficients, config.eps)
        if not self._reuses_memory(batch):
            return METHODS[bucket.method](batch, coefficients, config.eps)
        out = self._outputs[b]
        if out is None:
            out = self._outputs[b] = torch.empty_like(batch)
        if self._scratch is None:
            self._scratch = ScratchArena(batch.device)
        scratch = self._scratch.for_dtype(batch.dtype)
        return METHODS[bucket.method](batch, coefficients, config.eps, scratch, out)

    @staticmethod
    def _reuses_memory(batch: Tensor) -> bool:
        """Keep NS results and temporaries between steps: on CPUs (see :class:`ScratchArena`),
        up to :data:`REUSE_MAX_ROWS`, and not while ``torch.compile`` traces the step (see
        :func:`_compiling`)."""
        return (
            compute.is_host(batch.device)
            and (REUSE_MAX_ROWS is None or batch.size(-2) <= REUSE_MAX_ROWS)
            and not _compiling()
        )

    def workspaces(self) -> list[Tensor]:
        """Every tensor this engine keeps between steps (buffers, outputs, scratch, indices)."""
        kept = [*self._buffers, *self._staging, *self._outputs, *self._gathers]
        kept += [t for ts in self._unpack_buffers for t in ts]
        kept += self._scratch.tensors() if self._scratch is not None else []
        return [t for t in kept if t is not None]

    def buffer(self, b: int, device: torch.device) -> Tensor:
        """Bucket ``b``'s persistent input buffer: zeros once, so padding stays zero."""
        buf = self._buffers[b]
        if buf is None:
            bucket = self.plan.buckets[b]
            buf = self._buffers[b] = torch.zeros(bucket.shape, dtype=bucket.dtype, device=device)
        return buf

    def input_views(self) -> list[Tensor] | None:
        """Where NS reads each tensor from: a view of its slot in its bucket's buffer, in the
        tensor's own shape and in the bucket's NS dtype. A caller that writes its sources there itself (e.g. the momentum step,
        with ``out=``, rounding each value once to the slot's dtype where it differs) and passes
        these views back as the sources skips packing: on yolo26n that saves a fresh tensor per
        matrix and two copies of the whole set.

        CPU only (else ``None``, and the sources are packed, cast included): on a GPU the strided
        per-tensor writes would cost a launch per matrix, where a pack costs two. Never while
        ``torch.compile`` traces the step (see :func:`_compiling`).
        """
        if _compiling():
            return None
        if self._input_views is None:
            views: list[Tensor] = [None] * len(self.layouts)  # type: ignore[list-item]
            for b, bucket in enumerate(self.plan.buckets):
                if not compute.is_host(bucket.device):
                    views = []
                    break
                buf = self.buffer(b, bucket.device)
                for m in bucket.members:
                    views[m.index] = _slot_view(buf, m.slot, self.layouts[m.index], m.transposed)
            self._input_views = views
        return self._input_views or None

    def _packed_already(self, b: int, sources: Sequence[Tensor]) -> bool:
        """Whether bucket ``b``'s sources are its :meth:`input_views` (written in place by the caller)."""
        views = self._input_views
        pick = self._members[b]
        return bool(views) and all(map(operator.is_, pick(sources), pick(views)))

    def pack(self, b: int, sources: Sequence[Tensor]) -> Tensor:
        """Copy bucket ``b``'s sources (cast to the NS dtype) into its persistent buffer.

        A bucket of few runs takes one ``stack`` per run straight into the run's slots (a view
        made once), whatever the sources' strides; one of many runs takes one foreach copy into
        its members' places in a staging buffer (views made once) and one index copy.
        """
        bucket = self.plan.buckets[b]
        if self._packed_already(b, sources):
            return self._buffers[b]  # type: ignore[return-value]
        buf = self.buffer(b, sources[bucket.members[0].index].device)
        index = self._gathers[b]
        compiling = _compiling()
        if index is None:
            regions = [run.slots(buf) for run in self._runs[b]] if compiling else self._run_slots(b, buf)
            for run, slots in zip(self._runs[b], regions):
                torch.stack([sources[i] for i in run.tensors], out=slots)
            return buf
        if index.device != buf.device:
            index = self._gathers[b] = index.to(buf.device)
        if not compiling:
            # one copy (with the cast) of every source into its place in the staging buffer:
            # the same values as concatenating their flat views, without a view per source per
            # call (the sources are new tensors each step) and, on a CPU, faster than that cat
            staging, places, target = self._staging_places(b, buf)
            torch._foreach_copy_(places, self._members[b](sources))
            target.index_copy_(0, index, staging)
            return buf
        flat = [_memory_flat(sources[m.index], self.layouts[m.index]) for m in bucket.members]
        staging = self._staging_for(b, buf)
        torch.cat(flat, out=staging)  # one copy, with the cast to the NS dtype
        buf.view(-1).index_copy_(0, index, staging)
        return buf

    def _staging_for(self, b: int, buf: Tensor) -> Tensor:
        """Gather bucket ``b``'s flat staging buffer: its members back to back in memory order."""
        staging = self._staging[b]
        if staging is None:
            numel = self._gathers[b].numel()  # type: ignore[union-attr]
            staging = self._staging[b] = torch.empty(numel, dtype=buf.dtype, device=buf.device)
        return staging

    def _staging_places(self, b: int, buf: Tensor) -> tuple[Tensor, list[Tensor], Tensor]:
        """The staging buffer of gather bucket ``b``, each member's place there as a view in its
        planned layout (dense, so its elements lie in memory order, as a flat view's would), and
        the bucket buffer viewed flat: made once per buffer."""
        made = self._staging_views[b]
        if made is None or made[2]._base is not buf:
            staging = self._staging_for(b, buf)
            places, offset = [], 0
            for layout in self._members[b](self.layouts):
                places.append(torch.as_strided(staging, layout.shape, layout.stride, offset))
                offset += _numel(layout.shape)
            made = self._staging_views[b] = (staging, places, buf.view(-1))
        return made

    def _run_slots(self, b: int, buf: Tensor) -> list[Tensor]:
        """Each run's region of bucket ``b``'s buffer as ``(k, *shape)`` (views made once)."""
        views = self._slot_regions[b]
        if views is None or views[0] is not buf:
            views = self._slot_regions[b] = (buf, [run.slots(buf) for run in self._runs[b]])
        return views[1]

    def unpack(self, b: int, out: Tensor, out_dtypes: Sequence[torch.dtype], results: list) -> None:
        """Write bucket ``b``'s results into ``results`` (views with each source's strides)."""
        bucket, index = self.plan.buckets[b], self._gathers[b]
        dtypes = self._members[b](out_dtypes)
        dtype = dtypes[0]
        if dtypes.count(dtype) != len(dtypes):
            raise ValueError("tensors packed together must share one output dtype")
        if self.result_views and out.dtype == dtype and compute.is_host(out.device):
            # the step consumes the results at once: hand out views of the output, no unpacking
            # copy (views of a persistent buffer are made once: a view costs Python time per matrix)
            views = self._result_views[b] if out is self._outputs[b] else None
            if views is None:
                views = [_slot_view(out, m.slot, self.layouts[m.index], m.transposed) for m in bucket.members]
                if out is self._outputs[b]:
                    self._result_views[b] = views
            for m, view in zip(bucket.members, views):
                results[m.index] = view
            return
        if self.result_views and out.dtype != dtype and not _compiling():
            # cast into kept buffers whose result views are made once; the output's own views
            # are made once per output tensor (once in all where the output is kept)
            prepared = self._unpack_ops[b]
            if prepared is None or prepared[0] != dtype:
                prepared = self._unpack_ops[b] = (
                    dtype,
                    *self._prepare_unpack(b, out.dtype, dtype, out.device),
                )
            _, fill, views = prepared
            fill(out)
            for m, view in zip(bucket.members, views):
                results[m.index] = view
            return
        if index is not None:
            flat = out.reshape(-1).index_select(0, index)
            flat = flat if flat.dtype == dtype else flat.to(dtype)
            offset = 0
            for m in bucket.members:
                layout = self.layouts[m.index]
                results[m.index] = torch.as_strided(flat, layout.shape, layout.stride, offset)
                offset += _numel(layout.shape)
            return
        for run in self._runs[b]:
            self._unpack_run(run, out, dtype, results)

    def _prepare_unpack(
        self, b: int, from_dtype: torch.dtype, dtype: torch.dtype, device: torch.device
    ) -> tuple[Callable[[Tensor], None], list[Tensor]]:
        """The copy that casts bucket ``b``'s NS output into kept buffers of ``dtype``, and the
        results' views there (member order): the operations of the unkept path, so the same
        values, with every view made once."""
        bucket, index = self.plan.buckets[b], self._gathers[b]
        kept = self._unpack_buffers[b]
        views: dict[int, Tensor] = {}
        if index is not None:
            if index.device != device:
                index = self._gathers[b] = index.to(device)
            picked = torch.empty(index.numel(), dtype=from_dtype, device=device)
            cast = torch.empty(index.numel(), dtype=dtype, device=device)
            kept += [picked, cast]
            flat_of = _ViewsOf(lambda out: out.reshape(-1))

            def fill(out: Tensor) -> None:
                torch.index_select(flat_of(out), 0, index, out=picked)
                cast.copy_(picked)

            offset = 0
            for m in bucket.members:
                layout = self.layouts[m.index]
                views[m.index] = torch.as_strided(cast, layout.shape, layout.stride, offset)
                offset += _numel(layout.shape)
            return fill, [views[m.index] for m in bucket.members]
        runs = self._runs[b]
        targets = []
        for run in runs:
            layout, count = run.layout, run.stop - run.start
            numel = _numel(layout.shape)
            flat = torch.empty(count * numel, dtype=dtype, device=device)
            kept.append(flat)
            targets.append(layout.logical_view(flat, count))
            for j, i in enumerate(run.tensors):
                views[i] = torch.as_strided(flat, layout.shape, layout.stride, j * numel)
        slots_of = _ViewsOf(lambda out: [run.slots(out) for run in runs])

        def fill_runs(out: Tensor) -> None:
            for target, region in zip(targets, slots_of(out)):
                target.copy_(region)

        return fill_runs, [views[m.index] for m in bucket.members]

    def _unpack_run(self, run: _Run, out: Tensor, dtype: torch.dtype, results: list) -> None:
        layout, count = run.layout, run.stop - run.start
        numel = _numel(layout.shape)
        region = out[run.start : run.stop]
        if (
            region.dtype == dtype
            and not run.transposed
            and layout.matrix == tuple(out.shape[1:])
            and layout.perm == tuple(range(len(layout.shape)))
        ):  # unpadded, upright, contiguous: the results are views of the NS output itself
            for j, i in enumerate(run.tensors):
                results[i] = region[j].view(layout.shape)
            return
        flat = torch.empty(count * numel, dtype=dtype, device=out.device)
        layout.logical_view(flat, count).copy_(run.slots(out))
        for j, i in enumerate(run.tensors):
            results[i] = torch.as_strided(flat, layout.shape, layout.stride, j * numel)


class _ViewsOf:
    """Views of the latest tensor passed in, made once per tensor (held weakly: a fresh output
    per step is not kept alive, a kept one gets its views made once)."""

    def __init__(self, make: Callable[[Tensor], object]):
        self.make = make
        self.ref: weakref.ref | None = None
        self.views: object = None

    def __call__(self, t: Tensor):
        if self.ref is None or self.ref() is not t:
            self.ref, self.views = weakref.ref(t), self.make(t)
        return self.views


def _compiling() -> bool:
    """Whether ``torch.compile`` is tracing the caller (e.g. a user's ``torch.compile(opt.step)``).

    Then the compiler plans memory itself, and the engine hands it no kept buffers to write into:
    views of one kept buffer written in place are aliased, mutated graph inputs, which the
    compiler handles poorly (copies, recompiles) and, once it has made their sizes dynamic (a
    changed plan), not at all.
    """
    return torch.compiler.is_compiling()


@functools.cache
def compiled_kernel(method: str):
    """The NS loop through ``torch.compile`` (whole graph, static shapes: one compile per bucket
    shape, then the elementwise scaling fuses into the matmul epilogues where the backend can)."""
    return torch.compile(METHODS[method], fullgraph=True, dynamic=False)


def _memory_flat(t: Tensor, layout: TensorLayout) -> Tensor:
    """``t``'s elements in the planned layout's memory order, as a 1-D tensor (a view when ``t``
    has the planned strides; a contiguous one takes one view op, not two)."""
    t = _in_layout(t, layout)
    if layout.perm == tuple(range(t.ndim)):
        return t.view(-1)
    return t.permute(layout.perm).reshape(-1)


def _in_layout(t: Tensor, layout: TensorLayout) -> Tensor:
    """``t`` itself when it already has the planned strides, else a copy that has them."""
    if t.stride() == layout.stride:
        return t
    return torch.empty_strided(layout.shape, layout.stride, dtype=t.dtype, device=t.device).copy_(t)


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides, acc = [], 1
    for s in reversed(shape):
        strides.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(strides))


def matrix_spec(t: Tensor, config: NSConfig, layout: TensorLayout) -> MatrixSpec:
    """The planner's view of a >=2D tensor: flattened to (out, everything else), in the dtype
    NS will really run in there; tensors of different dtypes or NS settings never share.
    With ``method="auto"`` a native low-precision request may run in fp32 where the planner finds
    that faster (``compute.wider_dtype``)."""
    rows, cols = layout.matrix
    dtype = compute_dtype(config.dtype, t.device)
    requested = config.dtype if config.dtype != dtype else None
    fallback = wider_dtype(dtype, t.device) if config.method == "auto" else None
    return MatrixSpec(
        rows,
        cols,
        dtype,
        t.device,
        (t.dtype, config),
        (layout.shape, layout.stride),
        config.method,
        requested,
        fallback,
    )


def orthogonalize(
    tensors: Sequence[Tensor],
    steps: int = 5,
    coefficients: CoefficientSpec = "jordan",
    eps: float = 1e-7,
    dtype: torch.dtype = torch.bfloat16,
    policy: str = "auto",
    max_bucket_bytes: int = DEFAULT_MAX_BUCKET_BYTES,
    cost_model: CostModel | None = None,
    method: str = "auto",
    matrices: MatrixMapSpec | list = None,
) -> list[Tensor]:
    """Orthogonalise a list of >=2D tensors through the planner; results keep shapes, in ``dtype``.

    Each tensor is treated as the matrix ``t.flatten(1)``, or as the matrices its ``matrices``
    map says (one map for all tensors or a list with one each; see :mod:`fastmuon.matrices`):
    an expert stack ``(E, out, in)`` with ``"experts"`` is E matrices, each orthogonalised alone,
    all of them batched by the planner like any others. ``method`` picks the NS formulation
    ("auto": the cheapest accurate one per bucket, see ``planner.choose_method``: Gram-space where
    cheaper and the compute dtype is fp32+, on CPUs the eigendecomposition route where it costs
    less and a bf16/fp16 ``dtype`` runs in fp32; on CPUs with bf16 matmul units each bucket also
    in whichever of bf16 and fp32 the cost model prices faster; "standard", "gram", "eigh"). For repeated calls on the same shapes, an optimizer caches the plan and
    buffers; this function plans afresh each call.
    """
    tensors = list(tensors)
    maps = maps_of(matrices, len(tensors))
    for i, (t, m) in enumerate(zip(tensors, maps)):
        if t.ndim < 2:
            raise ValueError(f"tensor {i} has shape {tuple(t.shape)}; orthogonalize needs >=2D tensors")
        if t.is_complex():
            raise ValueError(f"tensor {i} is complex; only real tensors can be orthogonalised")
        try:
            m.check(t.shape)
        except ValueError as e:
            raise ValueError(f"tensor {i} (shape {tuple(t.shape)}): {e}") from None
    if any(not m.is_flatten for m in maps):
        pieces = [m.views(t) for t, m in zip(tensors, maps)]
        flat = orthogonalize(
            [v for vs in pieces for v in vs],
            steps,
            coefficients,
            eps,
            dtype,
            policy,
            max_bucket_bytes,
            cost_model,
            method,
        )
        starts = [0, *itertools.accumulate(map(len, pieces))]
        return [
            flat[a] if m.is_flatten else m.assemble(t.shape, flat[a:b], dtype, t.device)
            for t, m, a, b in zip(tensors, maps, starts, starts[1:])
        ]
    config = NSConfig.make(steps, coefficients, eps, dtype, method)
    live = [i for i, t in enumerate(tensors) if t.numel() > 0]
    layouts = [TensorLayout.of(tensors[i]) for i in live]
    specs = [matrix_spec(tensors[i], config, lay) for i, lay in zip(live, layouts)]
    plan = plan_buckets(
        specs, policy=policy, steps=steps, max_bucket_bytes=max_bucket_bytes, cost_model=cost_model
    )
    configs = {b.key: config for b in plan.buckets}
    outputs = Orthogonalizer(plan, layouts, configs)([tensors[i] for i in live], [dtype] * len(live))
    results = [torch.empty_like(t, dtype=dtype) for t in tensors]
    for i, out in zip(live, outputs):
        results[i] = out
    return results
