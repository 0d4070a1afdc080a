"""Run a plan: pack tensors into bucket buffers, Newton–Schulz once per bucket, unpack.

Tensors that share their shape, strides and orientation form a *run* of consecutive slots, packed
with one strided copy (the dtype cast folded in) and unpacked with another, in their own memory
order: a channels_last conv weight is never made contiguous first. Bucket buffers persist between
steps, so the zero padding is written once. An optimizer step may instead run the plan one bucket
at a time (:meth:`Orthogonalizer.open_bucket`), writing each bucket's inputs in place and applying
its results before the next bucket starts.
"""

from __future__ import annotations

import functools
import itertools
import operator
import weakref
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Literal, NamedTuple, TypeVar

import torch
from torch import Tensor

from . import device
from .device import compute_dtype, wider_dtype
from .layout import memory_order
from .newton_schulz import (
    METHODS,
    Coefficients,
    CoefficientSpec,
    check_method_preconditioning,
    default_steps,
    gram_first_run,
    normalize_in_fp64_,
    ns_kernel,
    pinned_kernel,
    resolve_coefficients,
    resolve_preconditioning,
    takes_fp64_route,
)
from .planner import Bucket, MatrixSpec, Plan


@dataclass(frozen=True)
class NSConfig:
    """The Newton–Schulz settings a bucket runs with (matrices with others never share one);
    ``preconditioning`` sits beside the schedule fitted to it: by default the one its preset names."""

    steps: int
    coefficients: tuple[tuple[float, float, float], ...]
    eps: float
    dtype: torch.dtype
    method: str = "auto"
    preconditioning: str = "frobenius"

    @classmethod
    def make(
        cls,
        steps: int | None,
        coefficients: CoefficientSpec,
        eps: float,
        dtype: torch.dtype,
        method: str = "auto",
        preconditioning: str | None = None,
    ) -> NSConfig:
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ValueError(f"ns_dtype must be a floating torch.dtype, got {dtype!r}")
        if not eps >= 0:
            raise ValueError(f"eps must be >= 0, got {eps!r}")
        if method not in ("auto", *METHODS):
            raise ValueError(f"unknown ns_method {method!r}; choose 'auto' or one of {sorted(METHODS)}")
        if steps is None:  # the count the coefficients were published for
            steps = default_steps(coefficients, preconditioning)
        preconditioning = resolve_preconditioning(coefficients, preconditioning)
        check_method_preconditioning(method, preconditioning)
        schedule = tuple(resolve_coefficients(coefficients, steps))
        return cls(steps, schedule, float(eps), dtype, method, preconditioning)


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
    return _region(batch[slot : slot + 1], layout, transposed)[0]


@dataclass(frozen=True, eq=False)
class BucketFrame:
    """Where a bucket's members sit in a ``(B, R, C)`` tensor laid out as its NS input, for a
    caller that keeps such tensors itself (see :mod:`fastmuon.step.bucket_momentum`)."""

    record: BucketRecord

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.record.bucket.shape)

    def members(self, batch: Tensor) -> list[Tensor]:
        """Each member's place in ``batch``, in slot order, a view in the member's own shape."""
        return _slot_views(batch, self.record)


def _cast_places(rec: BucketRecord, layout: BucketLayout, out: Tensor, dtype: torch.dtype) -> list[Tensor]:
    """The members' places for results cast to ``dtype``, in the workspace clear of ``out``."""
    total = rec.offsets[-1] + _numel(rec.layouts[-1].shape)
    offset, fits = layout.free_after(out, total * dtype.itemsize)
    if not fits:  # fits from the next call on
        return _strided_views(torch.empty(total, dtype=dtype, device=out.device), rec)
    flat = layout.place("cast", dtype, total, offset)
    cached = layout.cache.get("cast")
    if cached is None or cached[0] is not flat:  # type: ignore[index]
        cached = layout.cache["cast"] = (flat, _strided_views(flat, rec, flat.storage_offset()))
    views: list[Tensor] = cached[1]  # type: ignore[index]
    return views


def _slot_views(batch: Tensor, rec: BucketRecord) -> list[Tensor]:
    return [
        _slot_view(batch, m.slot, layout, m.transposed) for m, layout in zip(rec.bucket.members, rec.layouts)
    ]


class ScratchArena:
    """Temporaries of the NS kernels, kept between steps and shared by the buckets in turn: a CPU
    allocator returns large freed blocks to the OS, so fresh ones page-fault in again every step."""

    def __init__(self, device: torch.device):
        self.device = device
        self._arenas: dict[tuple[str, torch.dtype], Tensor] = {}
        self._views: dict[tuple[str, torch.dtype, tuple[int, ...]], Tensor] = {}
        self._takers: dict[torch.dtype, Callable[[str, tuple[int, ...]], Tensor]] = {}

    def for_dtype(self, dtype: torch.dtype) -> Callable[[str, tuple[int, ...]], Tensor]:
        """The ``scratch(tag, shape)`` callable the kernels take, made once per dtype."""
        taker = self._takers.get(dtype)
        if taker is None:
            taker = self._takers[dtype] = self._taker(dtype)
        return taker

    def _taker(self, dtype: torch.dtype) -> Callable[[str, tuple[int, ...]], Tensor]:
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


#: On a CPU, buckets of at most this many rows (oriented wide; None: all) keep their NS output and
#: temporaries between steps, trading workspace memory for fresh buffers' page faults. Read at build.
REUSE_MAX_ROWS: int | None = None

#: Buckets of more runs than this are packed with one index copy, while the int64 index stays small.
GATHER_MIN_RUNS = 3
GATHER_MAX_ELEMENTS = 8 * 2**20


@dataclass(slots=True, eq=False)
class BucketRecord:
    """One bucket of a plan and everything the engine knows and keeps for it: the fields up to
    ``gather`` are fixed when the engine is built; the tensors after them are made on first use."""

    bucket: Bucket
    config: NSConfig
    schedule: list[Coefficients]  # the config's coefficients, as the kernels take them
    kernel: Callable[..., Tensor]  # newton_schulz.ns_kernel(method, preconditioning), or its compiled form
    eager: Callable[..., Tensor]  # fp32 products not pinned: run bucket by bucket at "highest"
    compiled: bool  # the kernel runs through torch.compile
    host: bool  # the bucket lives on the host's CPU (device.is_host)
    host_reads: bool  # the eager kernel may read its norms on the host: free there, and allowed
    reuse: bool  # NS output and temporaries kept between steps (ScratchArena, or the workspace)
    fresh_input: bool  # off the host and unpadded: the input buffer is made per call, not kept
    padded: bool  # some member leaves zero padding in its slot
    members: Gather  # picks the bucket's members out of a per-call list, in slot order
    indices: tuple[int, ...]  # the members' positions among the engine's tensors, in slot order
    layouts: tuple[TensorLayout, ...]  # the members' layouts, in slot order
    offsets: tuple[int, ...]  # where each member starts when all are stored back to back
    runs: tuple[_Run, ...]
    gather: Tensor | None  # each member element's place in the buffer (on the host made on first use)
    gathers: bool  # packed and unpacked by ``gather`` (many runs, a small index)
    buffer: Tensor | None = None  # zeros, on first sight of the sources' device
    # views made on the first eager call and kept; never in a compiler's trace
    slot_regions: list[Tensor] | None = None  # each run's region, as (k, *shape)
    places: _Places | None = None
    inputs: list[Tensor] | None = None  # the members' input views, once handed out
    staging: Tensor | None = None  # made by the first pack that copies
    output: Tensor | None = None  # kept on a CPU (see ScratchArena), rewritten by every step
    scratch: Callable[[str, tuple[int, ...]], Tensor] | None = None
    output_views: list[Tensor] | None = None  # the results as views of the kept output
    cast: tuple[torch.dtype, Callable[[Tensor], None], list[Tensor]] | None = None
    cast_buffers: list[Tensor] = field(default_factory=list)
    # the members' flags in a keep vector, per (device, positions) of the vectors seen
    keep_index: dict[tuple[torch.device, tuple[int, ...] | None], Tensor] = field(default_factory=dict)
    shared: BucketLayout | None = None  # bucket by bucket: its layout in the shared workspace


class Orthogonalizer:
    """Executes a :class:`Plan` for tensors of fixed layouts, step after step. ``result_views`` (a
    caller consuming results at once): a CPU run's results are views of its output buffers, valid
    until the next call; ``host_reads=False`` (a capturable step): no value is read on the host."""

    def __init__(
        self,
        plan: Plan,
        layouts: Sequence[TensorLayout],
        configs: dict[Hashable, NSConfig],
        compile: bool = False,
        result_views: bool = False,
        host_reads: bool = True,
    ):
        self.plan = plan
        self.compile = compile
        self.result_views = result_views
        self.host_reads = host_reads
        self.layouts = list(layouts)
        self.configs = configs
        self.records = [self._record(bucket, configs[bucket.key]) for bucket in plan.buckets]
        self._input_views: list[Tensor] | None = None
        self._scratch: ScratchArena | None = None
        self._shared: SharedWorkspace | None = None  # the bucket-by-bucket path's buffers
        self._staged: _StagedGathers | Literal[False] | None = None  # False: nothing to stage
        self.by_bucket = _runs_bucket_by_bucket(self.records)
        self._opened: tuple[int, Tensor] | None = None  # off the host: the bucket handed out

    def _record(self, bucket: Bucket, config: NSConfig) -> BucketRecord:
        layouts = tuple(self.layouts[m.index] for m in bucket.members)
        runs = _split_runs(bucket, layouts)
        host = device.is_host(bucket.device)
        gathers = _gathers(layouts, runs)
        compiled = self.compile and bucket.method != "eigh"  # eigh: one LAPACK call, nothing to fuse
        pre = config.preconditioning
        return BucketRecord(
            bucket=bucket,
            config=config,
            schedule=list(config.coefficients),
            kernel=_bucket_kernel(bucket, pre, compiled),
            eager=ns_kernel(bucket.method, pre),
            compiled=compiled,
            host=host,
            host_reads=self.host_reads and host and not compiled,
            reuse=host and not compiled and (REUSE_MAX_ROWS is None or bucket.shape[1] <= REUSE_MAX_ROWS),
            fresh_input=not host and _unpadded(bucket, layouts),
            padded=not _unpadded(bucket, layouts),
            members=Gather([m.index for m in bucket.members]),
            indices=tuple(m.index for m in bucket.members),
            layouts=layouts,
            offsets=tuple(itertools.accumulate((_numel(lay.shape) for lay in layouts[:-1]), initial=0)),
            runs=runs,
            gather=_gather_index(bucket, layouts) if gathers and not host else None,
            gathers=gathers,
        )

    def __call__(
        self,
        sources: Sequence[Tensor],
        out_dtypes: Sequence[torch.dtype],
        keep: Tensor | Sequence[Tensor] | None = None,
        keep_positions: tuple[int, ...] | None = None,
    ) -> list[Tensor]:
        """Orthogonalise ``sources``; each result has its source's shape and strides, in ``out_dtypes``.
        ``keep`` (one bool per source: a vector, or 0-d tensors) zeroes rejected sources inside
        their bucket; with ``keep_positions`` source ``i``'s flag is ``keep[keep_positions[i]]``."""
        compiling = _compiling()
        results: list[Tensor | None] = [None] * len(sources)
        for rec in self.records:
            if rec.gathers and rec.gather is None and rec.host:
                rec.gather = _gather_index(rec.bucket, rec.layouts)
        if keep is not None and not isinstance(keep, Tensor):
            keep = torch.stack(list(keep))
        staged = None if compiling else self._staged_gathers(sources)
        if staged is not None:
            staged.pack(sources)  # and normalised, where buckets share that (see _StagedGathers)
        for rec in self.records:
            if staged is not None and rec in staged.packed:
                staged.run(rec)
                continue
            batch = _pack(rec, sources, compiling)
            if keep is not None and rec.host:
                # Off the host the rejected matrices are left in: every kernel works slot by
                # slot, so a NaN stays in its own slot, whose parameter the guard puts back.
                index = self._keep_index(rec, keep.device, keep_positions)
                zero_rejected_(batch, keep.index_select(0, index))
            self._unpack(rec, self._run(rec, batch, compiling), out_dtypes, results, compiling)
        if staged is not None:
            staged.unpack(out_dtypes, results)
        return results  # type: ignore[return-value]

    def _staged_gathers(self, sources: Sequence[Tensor]) -> _StagedGathers | None:
        """The gather buckets' shared packing off the host (None if none), made on the first call."""
        staged = self._staged
        if staged is None:  # decided once: False where there is nothing to stage
            staged = False
            if self.records and not any(rec.host for rec in self.records):
                gathers = [
                    rec
                    for rec in self.records
                    if rec.gather is not None and rec.buffer is None and not rec.compiled
                ]
                device = sources[self.records[0].indices[0]].device
                staged = _StagedGathers(gathers, device) if gathers else False
            self._staged = staged
        return staged or None

    @staticmethod
    def _keep_index(rec: BucketRecord, device: torch.device, positions: tuple[int, ...] | None) -> Tensor:
        key = (device, positions)
        index = rec.keep_index.get(key)
        if index is None:
            at = list(rec.indices) if positions is None else [positions[i] for i in rec.indices]
            index = rec.keep_index[key] = torch.tensor(at, device=device)
        return index

    def _run(self, rec: BucketRecord, batch: Tensor, compiling: bool, out: Tensor | None = None) -> Tensor:
        """One batched NS call on the bucket's packed batch, into its kept output where it reuses
        memory (valid until the next call); ``out``: where the result goes instead."""
        eps = rec.config.eps
        if rec.compiled:
            return rec.kernel(batch, rec.schedule, eps, host=rec.host, host_reads=False)
        host_reads = rec.host_reads and not compiling
        if batch.dtype != rec.bucket.dtype:  # packed in the sources' dtype (see _pack)
            wider = functools.partial(_normalized_into, rec.bucket.dtype, batch.device)
            return rec.kernel(batch, rec.schedule, eps, wider, out, host=rec.host, host_reads=host_reads)
        if out is not None:
            return rec.kernel(
                batch, rec.schedule, eps, _no_scratch, out, host=rec.host, host_reads=host_reads
            )
        if compiling or not rec.reuse:
            return rec.kernel(batch, rec.schedule, eps, host=rec.host, host_reads=host_reads)
        out = rec.output
        if out is None:
            out = rec.output = torch.empty_like(batch)
        scratch = rec.scratch
        if scratch is None:
            if self._scratch is None:
                self._scratch = ScratchArena(batch.device)
            scratch = rec.scratch = self._scratch.for_dtype(batch.dtype)
        return rec.kernel(batch, rec.schedule, eps, scratch, out, host=rec.host, host_reads=host_reads)

    def bucketwise(self) -> bool:
        """Whether a step may run the plan one bucket at a time (:meth:`open_bucket`), not in a trace."""
        return self.by_bucket and not _compiling()

    def members(self, b: int) -> tuple[int, ...]:
        """Bucket ``b``'s members, as positions among the engine's tensors, in slot order."""
        return self.records[b].indices

    def bucket_dtype(self, b: int) -> torch.dtype:
        """The dtype bucket ``b``'s NS runs in (its inputs' and results')."""
        return self.records[b].bucket.dtype

    def frame(self, b: int) -> BucketFrame | None:
        """Bucket ``b`` as a :class:`BucketFrame` (off the host, eager, filled, taking ``drop``), or None."""
        rec = self.records[b]
        if rec.host or rec.compiled or not _filled(rec):
            return None
        takes_drop = rec.bucket.method in ("standard", "gram") and rec.config.preconditioning == "frobenius"
        return BucketFrame(rec) if takes_drop else None

    def open_batch(self, b: int) -> Tensor:
        """:meth:`open_bucket` for a :meth:`frame`'s bucket: the ``(B, R, C)`` input buffer itself."""
        batch = _fresh_input(self.records[b])
        self._opened = (b, batch)
        return batch

    def open_bucket(self, b: int) -> list[Tensor]:
        """Bucket ``b``'s NS inputs in slot order, each a view in its own shape and the NS dtype, to
        write before :meth:`run_bucket`: in the shared workspace on the host (padding re-zeroed each
        call, as others write there), else in a fresh buffer (:func:`_fresh_input`)."""
        rec = self.records[b]
        if not rec.host:  # a fresh buffer, held until run_bucket takes it
            batch = _fresh_input(rec)
            self._opened = (b, batch)
            return _slot_views(batch, rec)
        layout = rec.shared
        if layout is None:
            if self._shared is None:
                self._shared = SharedWorkspace(rec.bucket.device)
            layout = rec.shared = self._shared.layout(rec.bucket.dtype, rec.bucket.shape)
        batch = layout.open()
        inputs = layout.cache.get("inputs")
        if inputs is None:  # the first call, or the buffer has grown
            inputs = layout.cache["inputs"] = _slot_views(batch, rec)
            layout.cache["results"] = _ViewsOf(lambda out: _slot_views(out, rec))
        if rec.padded:
            batch.zero_()
        return inputs  # type: ignore[return-value]

    def run_bucket(
        self,
        b: int,
        out_dtype: torch.dtype | None = None,
        keep: Tensor | None = None,
        keep_positions: tuple[int, ...] | None = None,
        drop: Tensor | None = None,
    ) -> list[Tensor]:
        """Bucket ``b``'s NS of what :meth:`open_bucket` handed out, in slot order, in the NS dtype
        or cast to ``out_dtype``: views of a buffer the next bucket reuses, to be consumed first.
        ``keep``, ``keep_positions``: as in :meth:`__call__`; ``drop``: the NS kernels' ``keep``."""
        rec = self.records[b]
        layout: BucketLayout = rec.shared  # type: ignore[assignment]  # None off the host
        if rec.host:
            batch = layout.batch()
        else:
            opened, self._opened = self._opened, None
            if opened is None or opened[0] != b:
                raise RuntimeError(f"run_bucket({b}) without open_bucket({b}) first")
            batch = opened[1]
        if keep is not None:
            zero_rejected_(batch, keep.index_select(0, self._keep_index(rec, keep.device, keep_positions)))
        if not rec.host:
            return _run_fresh(rec, batch, out_dtype, drop)
        eps = rec.config.eps
        kernel = rec.eager if torch.get_float32_matmul_precision() == "highest" else rec.kernel
        if rec.reuse:
            out = kernel(
                batch,
                rec.schedule,
                eps,
                layout.scratch,
                host=True,
                host_reads=rec.host_reads,
                reuse_input=True,
            )
            views: list[Tensor] = layout.cache["results"](out)  # type: ignore[operator]
        else:  # fresh output and temporaries (see REUSE_MAX_ROWS): views made per call
            out = kernel(batch, rec.schedule, eps, host=True, host_reads=rec.host_reads)
            views = _slot_views(out, rec)
        if out_dtype is None or out_dtype == out.dtype:
            return views
        cast = _cast_places(rec, layout, out, out_dtype)
        torch._foreach_copy_(cast, views)
        return cast

    def workspaces(self) -> list[Tensor]:
        """Every tensor this engine keeps between steps (buffers, outputs, scratch, indices)."""
        records = self.records
        kept = [r.buffer for r in records] + [r.staging for r in records]
        kept += [r.output for r in records] + [r.gather for r in records]
        kept += [t for r in records for t in r.cast_buffers]
        kept += self._scratch.tensors() if self._scratch is not None else []
        kept += self._staged.kept if self._staged else []
        kept += [self._shared.flat] if self._shared is not None else []
        return [t for t in kept if t is not None]

    def buffer(self, b: int, device: torch.device) -> Tensor:
        """Bucket ``b``'s persistent input buffer: zeros once, so padding stays zero."""
        rec = self.records[b]
        return rec.buffer if rec.buffer is not None else _make_buffer(rec, device)

    def input_views(self) -> list[Tensor] | None:
        """Where NS reads each tensor from, a view in its own shape and the NS dtype: a caller that
        writes its sources there and passes these views back skips packing. CPU only (else None: on
        a GPU a write per tensor costs a launch each), and never in a compiler's trace."""
        if _compiling():
            return None
        if self._input_views is None:
            views: list[Tensor] = []
            if all(rec.host for rec in self.records):
                views = [None] * len(self.layouts)  # type: ignore[list-item]
                for b, rec in enumerate(self.records):
                    buf = self.buffer(b, rec.bucket.device)
                    rec.inputs = [
                        _slot_view(buf, m.slot, layout, m.transposed)
                        for m, layout in zip(rec.bucket.members, rec.layouts)
                    ]
                    for i, view in zip(rec.indices, rec.inputs):
                        views[i] = view
            self._input_views = views
        return self._input_views or None

    def _unpack(
        self,
        rec: BucketRecord,
        out: Tensor,
        out_dtypes: Sequence[torch.dtype],
        results: list[Tensor | None],
        compiling: bool,
    ) -> None:
        """Write the bucket's results into ``results`` with each source's strides: views (of the
        NS output, or of kept cast buffers) where the caller consumes them at once, else copies."""
        dtype = _one_dtype(rec.members(out_dtypes))
        if self.result_views and out.dtype == dtype and rec.host:
            views = rec.output_views if out is rec.output else None
            if views is None:
                views = [
                    _slot_view(out, m.slot, layout, m.transposed)
                    for m, layout in zip(rec.bucket.members, rec.layouts)
                ]
                if out is rec.output:
                    rec.output_views = views
        elif self.result_views and out.dtype != dtype and rec.host and not compiling:
            cast = rec.cast
            if cast is None or cast[0] != dtype:
                cast = rec.cast = (dtype, *_prepare_cast(rec, out.dtype, dtype, out.device))
            _, fill, views = cast
            fill(out)
        elif rec.gather is not None:
            flat = out.reshape(-1).index_select(0, rec.gather)
            flat = flat if flat.dtype == dtype else flat.to(dtype)
            views = _strided_views(flat, rec)
        else:
            for run in rec.runs:
                _unpack_run(run, out, dtype, results)
            return
        for i, view in zip(rec.indices, views):
            results[i] = view


def _pack(rec: BucketRecord, sources: Sequence[Tensor], compiling: bool) -> Tensor:
    """Copy the bucket's sources, cast to the NS dtype, into its buffer (nothing where they are its
    :meth:`Orthogonalizer.input_views`): one ``stack`` per run, or one gather through staging."""
    inputs = rec.inputs
    if inputs is not None and all(map(operator.is_, rec.members(sources), inputs)):
        return rec.buffer  # type: ignore[return-value]
    device = sources[rec.indices[0]].device
    wide = sources[rec.indices[0]].dtype
    if rec.gather is None and not (rec.host or rec.compiled or compiling) and wide != rec.bucket.dtype:
        # off the host a casting stack copies one input at a time: stack in the sources' dtype, and
        # let the NS normalisation, which writes a new tensor anyway, round (see _run)
        packed = (torch.empty if rec.fresh_input else torch.zeros)(
            rec.bucket.shape, dtype=wide, device=device
        )
        for run in rec.runs:
            torch.stack([sources[i] for i in run.tensors], out=run.slots(packed))
        return packed
    buf = rec.buffer
    fresh = rec.fresh_input and rec.gather is None
    if fresh:  # every element is written below: the allocator's cache serves it, nothing is kept
        buf = torch.empty(rec.bucket.shape, dtype=rec.bucket.dtype, device=sources[rec.indices[0]].device)
    elif buf is None:
        buf = _make_buffer(rec, sources[rec.indices[0]].device)
    index = rec.gather
    if index is None:
        regions = rec.slot_regions
        if compiling or fresh:
            regions = [run.slots(buf) for run in rec.runs]
        elif regions is None:
            regions = rec.slot_regions = [run.slots(buf) for run in rec.runs]
        for run, slots in zip(rec.runs, regions):
            _stack_into(slots, [sources[i] for i in run.tensors], compiling)
        return buf
    if not compiling:
        # the sources' values as a cat of their flat views, without making a view per source per call
        staging, places, target = rec.places or _make_places(rec, buf)
        torch._foreach_copy_(places, rec.members(sources))
        target.index_copy_(0, index, staging)
        return buf
    flat = [_memory_flat(sources[i], layout) for i, layout in zip(rec.indices, rec.layouts)]
    staging = rec.staging if rec.staging is not None else _make_staging(rec, buf)
    torch.cat(flat, out=staging)  # one copy, with the cast to the NS dtype
    buf.view(-1).index_copy_(0, index, staging)
    return buf


class _StagedGathers:
    """The gather buckets of an engine off the host, packed and unpacked in five launches: per NS
    dtype, one foreach copy casts every member into a kept staging buffer, one fill and one index
    copy make all inputs (views of one flat buffer made per call), each bucket's NS writes into a
    view of one flat output, and one index select and one cast give every result."""

    def __init__(self, records: Sequence[BucketRecord], device: torch.device):
        self.packed = set(records)
        # normalised by pack, per (NS dtype, eps) where two or more share them
        alike: dict[tuple[torch.dtype, float], list[BucketRecord]] = {}
        for rec in records:
            if (
                rec.bucket.method == "standard"
                and rec.config.preconditioning == "frobenius"
                and takes_fp64_route(_numel(rec.bucket.shape), rec.bucket.dtype, device, rec.host)
            ):
                alike.setdefault((rec.bucket.dtype, rec.config.eps), []).append(rec)
        self.normalizable = [(eps, recs) for (_, eps), recs in alike.items() if len(recs) > 1]
        self.normalized = {rec for _, recs in self.normalizable for rec in recs}
        by_dtype: dict[torch.dtype, list[BucketRecord]] = {}
        for rec in records:
            by_dtype.setdefault(rec.bucket.dtype, []).append(rec)
        self.stages: list[_Stage] = []
        self.outputs: dict[BucketRecord, tuple[int, int]] = {}  # rec -> (stage, offset of its output)
        for s, (dtype, recs) in enumerate(by_dtype.items()):
            sizes = [_numel(rec.bucket.shape) for rec in recs]
            bases = list(itertools.accumulate(sizes[:-1], initial=0))
            total = sum(sizes)
            index = torch.cat([rec.gather.to(device) + base for rec, base in zip(recs, bases)])  # type: ignore[union-attr]
            staging = torch.empty(index.numel(), dtype=dtype, device=device)
            places: list[Tensor] = []
            members: list[int] = []
            starts: dict[BucketRecord, int] = {}
            start = 0
            for rec, base in zip(recs, bases):
                stop = start + rec.gather.numel()  # type: ignore[union-attr]
                rec.gather = None  # its part of the shared index (the compiled path packs by runs)
                places += _strided_views(staging, rec, start)
                members += rec.indices
                starts[rec] = start
                self.outputs[rec] = (s, base)
                start = stop
            self.stages.append(_Stage(total, index, staging, places, Gather(members), starts))
        self._inputs: list[Tensor] = []
        self._flat: list[Tensor] = []

    @property
    def kept(self) -> list[Tensor]:
        return [t for st in self.stages for t in (st.index, st.staging)]

    def pack(self, sources: Sequence[Tensor]) -> None:
        """This call's input buffers: zeros with every member scattered in, made per call (the
        allocator's cache serves them); ``normalizable`` buckets leave divided by their norms."""
        self._inputs = []
        for st in self.stages:
            torch._foreach_copy_(st.places, st.pick(sources))
            inputs = torch.zeros(st.total, dtype=st.staging.dtype, device=st.staging.device)
            self._inputs.append(inputs.index_copy_(0, st.index, st.staging))
        self._flat = [torch.empty_like(inputs) for inputs in self._inputs]
        for eps, recs in self.normalizable:
            normalize_in_fp64_([self.batch(rec) for rec in recs], eps)

    def run(self, rec: BucketRecord) -> None:
        done = {"normalized": True} if rec in self.normalized else {}
        rec.kernel(
            self.batch(rec),
            rec.schedule,
            rec.config.eps,
            _no_scratch,
            self.output(rec),
            host=False,
            host_reads=False,
            **done,
        )

    def batch(self, rec: BucketRecord) -> Tensor:
        return self._slots(self._inputs, rec)

    def output(self, rec: BucketRecord) -> Tensor:
        return self._slots(self._flat, rec)

    def _slots(self, flats: list[Tensor], rec: BucketRecord) -> Tensor:
        s, base = self.outputs[rec]
        return flats[s][base : base + _numel(rec.bucket.shape)].view(rec.bucket.shape)

    def unpack(self, out_dtypes: Sequence[torch.dtype], results: list[Tensor | None]) -> None:
        flats, self._flat, self._inputs = self._flat, [], []
        for st, flat in zip(self.stages, flats):
            picked = flat.index_select(0, st.index)
            cast: dict[torch.dtype, Tensor] = {}
            for rec, start in st.starts.items():
                dtype = _one_dtype(rec.members(out_dtypes))
                if dtype not in cast:
                    cast[dtype] = picked if dtype == picked.dtype else picked.to(dtype)
                for i, view in zip(rec.indices, _strided_views(cast[dtype], rec, start)):
                    results[i] = view


@dataclass(frozen=True, eq=False)
class _Stage:
    """One NS dtype's share of :class:`_StagedGathers`."""

    total: int  # elements of every bucket's input buffer, back to back
    index: Tensor  # each member element's place there, members back to back
    staging: Tensor  # the members back to back, each in its memory order, in the NS dtype
    places: list[Tensor]  # each member's place in ``staging``, with its layout's strides
    pick: Gather  # the members out of a call's sources, in staging order
    starts: dict[BucketRecord, int]  # where each bucket's members start in ``staging``


def _stack_into(out: Tensor, tensors: list[Tensor], compiling: bool) -> None:
    """``torch.stack(tensors, out=out)``, or in a compiler's trace (no ``stack(out=)``) stack and copy."""
    if compiling:
        out.copy_(torch.stack(tensors))
    else:
        torch.stack(tensors, out=out)


def _normalized_into(
    dtype: torch.dtype, device: torch.device, tag: str, shape: tuple[int, ...]
) -> Tensor | None:
    """Scratch for a batch packed wider than its bucket: the normalised ``"X"`` in the bucket's dtype."""
    return torch.empty(shape, dtype=dtype, device=device) if tag == "X" else None


def _no_scratch(tag: str, shape: tuple[int, ...]) -> None:
    return None


#: Off the host a plan runs bucket by bucket only from this many bytes of NS inputs on: below,
#: packing them all together costs fewer launches than writing each momentum into its slot.
BY_BUCKET_MIN_BYTES = 64 * 2**20


def _bucket_kernel(bucket: Bucket, preconditioning: str, compiled: bool) -> Callable[..., Tensor]:
    """The NS kernel a bucket runs (compiled or eager), fp32 products pinned where it is fp32."""
    method = bucket.method
    kernel = compiled_kernel(method, preconditioning) if compiled else ns_kernel(method, preconditioning)
    return pinned_kernel(kernel, bucket.dtype)


def _fresh_input(rec: BucketRecord) -> Tensor:
    """A fresh NS input buffer off the host (zeros only where padded): the caching allocator hands
    the next bucket the memory this one frees, so nothing is kept between steps."""
    bucket = rec.bucket
    make = torch.zeros if rec.padded else torch.empty
    return make(bucket.shape, dtype=bucket.dtype, device=bucket.device)


def _run_fresh(
    rec: BucketRecord, batch: Tensor, out_dtype: torch.dtype | None, drop: Tensor | None = None
) -> list[Tensor]:
    """:meth:`Orthogonalizer.run_bucket` off the host: ``batch`` is this call's alone, to overwrite."""
    masked = {} if drop is None else {"keep": drop}
    out = rec.kernel(
        batch, rec.schedule, rec.config.eps, host=False, host_reads=False, reuse_input=True, **masked
    )
    if out_dtype is None or out_dtype == out.dtype:
        return _slot_views(out, rec)
    if _filled(rec):
        return _slot_views(out.to(out_dtype), rec)
    return [v.to(out_dtype) for v in _slot_views(out, rec)]


def _filled(rec: BucketRecord) -> bool:
    """Whether the bucket's members fill every slot of it, whole (no padding, no empty slot)."""
    return not rec.padded and len(rec.indices) == rec.bucket.shape[0]


def _runs_bucket_by_bucket(records: Sequence[BucketRecord]) -> bool:
    """Whether a step may run these buckets one at a time: all eager, and all on the host, or all
    off it on one device, packed by runs, of :data:`BY_BUCKET_MIN_BYTES` or more in all."""
    if not records or any(r.compiled for r in records):
        return False
    if all(r.host for r in records):
        return True
    devices = {r.bucket.device for r in records}
    inputs = sum(_numel(r.bucket.shape) * r.bucket.dtype.itemsize for r in records)
    return (
        len(devices) == 1 and not any(r.host or r.gathers for r in records) and inputs >= BY_BUCKET_MIN_BYTES
    )


def _one_dtype(dtypes: Sequence[torch.dtype]) -> torch.dtype:
    dtype = dtypes[0]
    if dtypes.count(dtype) != len(dtypes):
        raise ValueError("tensors packed together must share one output dtype")
    return dtype


def _unpadded(bucket: Bucket, layouts: Sequence[TensorLayout]) -> bool:
    _, R, C = bucket.shape
    return all(
        (layout.matrix[::-1] if m.transposed else layout.matrix) == (R, C)
        for m, layout in zip(bucket.members, layouts)
    )


def _split_runs(bucket: Bucket, layouts: Sequence[TensorLayout]) -> tuple[_Run, ...]:
    """The bucket's members (with their ``layouts``, slot order) as runs of one layout and orientation."""
    runs: list[_Run] = []
    for m, layout in zip(bucket.members, layouts):
        last = runs[-1] if runs else None
        if last and last.layout == layout and last.transposed == m.transposed:
            runs[-1] = _Run(last.start, m.slot + 1, layout, m.transposed, (*last.tensors, m.index))
        else:
            runs.append(_Run(m.slot, m.slot + 1, layout, m.transposed, (m.index,)))
    return tuple(runs)


def _gathers(layouts: Sequence[TensorLayout], runs: Sequence[_Run]) -> bool:
    total = sum(_numel(layout.shape) for layout in layouts)
    return len(runs) >= GATHER_MIN_RUNS and total <= GATHER_MAX_ELEMENTS


def _gather_index(bucket: Bucket, layouts: Sequence[TensorLayout]) -> Tensor:
    """Each member element's place (members concatenated in memory order) in the flat bucket buffer."""
    _, R, C = bucket.shape
    parts = []
    for m, layout in zip(bucket.members, layouts):
        cols = layout.matrix[1]
        logical = torch.arange(_numel(layout.shape)).view(layout.shape).permute(layout.perm).reshape(-1)
        row, col = logical // cols, logical % cols
        if m.transposed:
            row, col = col, row
        parts.append(m.slot * R * C + row * C + col)
    return torch.cat(parts)


def _make_buffer(rec: BucketRecord, device: torch.device) -> Tensor:
    """The bucket's input buffer on ``device``, zeros (the padding is never written again)."""
    bucket = rec.bucket
    rec.buffer = torch.zeros(bucket.shape, dtype=bucket.dtype, device=device)
    if rec.gather is not None and rec.gather.device != device:
        rec.gather = rec.gather.to(device)
    return rec.buffer


def _make_staging(rec: BucketRecord, buf: Tensor) -> Tensor:
    rec.staging = torch.empty(rec.gather.numel(), dtype=buf.dtype, device=buf.device)  # type: ignore[union-attr]
    return rec.staging


class _Places(NamedTuple):
    """A gather bucket's staging buffer, each member's place there as a view, the flat buffer."""

    staging: Tensor
    members: list[Tensor]
    flat: Tensor


def _make_places(rec: BucketRecord, buf: Tensor) -> _Places:
    staging = rec.staging if rec.staging is not None else _make_staging(rec, buf)
    rec.places = _Places(staging, _strided_views(staging, rec), buf.view(-1))
    return rec.places


def _strided_views(flat: Tensor, rec: BucketRecord, base: int | torch.SymInt = 0) -> list[Tensor]:
    """The bucket's members stored back to back in ``flat`` (from ``base`` in its storage), as views."""
    return [
        torch.as_strided(flat, layout.shape, layout.stride, base + offset)
        for layout, offset in zip(rec.layouts, rec.offsets)
    ]


def _prepare_cast(
    rec: BucketRecord, from_dtype: torch.dtype, dtype: torch.dtype, device: torch.device
) -> tuple[Callable[[Tensor], None], list[Tensor]]:
    """The copy that casts the bucket's NS output into kept buffers of ``dtype``, and the results'
    views there: the fresh path's operations and values, with every view made once."""
    index = rec.gather
    if index is not None:
        picked = torch.empty(index.numel(), dtype=from_dtype, device=device)
        cast = torch.empty(index.numel(), dtype=dtype, device=device)
        rec.cast_buffers += [picked, cast]
        flat_of = _ViewsOf(lambda out: out.reshape(-1))

        def fill(out: Tensor) -> None:
            torch.index_select(flat_of(out), 0, index, out=picked)
            cast.copy_(picked)

        return fill, _strided_views(cast, rec)
    runs = rec.runs
    targets = []
    views: dict[int, Tensor] = {}
    for run in runs:
        layout, count = run.layout, run.stop - run.start
        numel = _numel(layout.shape)
        flat = torch.empty(count * numel, dtype=dtype, device=device)
        rec.cast_buffers.append(flat)
        targets.append(layout.logical_view(flat, count))
        for j, i in enumerate(run.tensors):
            views[i] = torch.as_strided(flat, layout.shape, layout.stride, j * numel)
    slots_of = _ViewsOf(lambda out: [run.slots(out) for run in runs])

    def fill_runs(out: Tensor) -> None:
        for target, region in zip(targets, slots_of(out)):
            target.copy_(region)

    return fill_runs, [views[i] for i in rec.indices]


def _unpack_run(run: _Run, out: Tensor, dtype: torch.dtype, results: list[Tensor | None]) -> None:
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


_V = TypeVar("_V")


class _ViewsOf(Generic[_V]):
    """Views of the latest tensor passed in, made once per tensor (held weakly: none kept alive)."""

    def __init__(self, make: Callable[[Tensor], _V]):
        self.make = make
        self.ref: weakref.ref[Tensor] | None = None
        self.views: _V  # made with ``ref``, on the first call

    def __call__(self, t: Tensor) -> _V:
        if self.ref is None or self.ref() is not t:
            self.ref, self.views = weakref.ref(t), self.make(t)
        return self.views


def _compiling() -> bool:
    """Whether ``torch.compile`` is tracing the caller, asked once per call at the engine's entries:
    then no kept buffers are handed out (views written in place are aliased, mutated graph inputs,
    which the compiler handles poorly) and no value is read on the host (no trace branches on it)."""
    return torch.compiler.is_compiling()


@functools.cache
def compiled_kernel(method: str, preconditioning: str = "frobenius") -> Callable[..., Tensor]:
    """The NS loop through ``torch.compile`` (whole graph, static shapes: one compile per bucket
    shape, then the elementwise scaling fuses into the matmul epilogues where the backend can)."""
    return torch.compile(ns_kernel(method, preconditioning), fullgraph=True, dynamic=False)


def _memory_flat(t: Tensor, layout: TensorLayout) -> Tensor:
    """``t``'s elements in the planned layout's memory order, as a 1-D tensor (a view where it can)."""
    t = _in_layout(t, layout)
    if layout.perm == tuple(range(t.ndim)):
        return t.view(-1)
    return t.permute(layout.perm).reshape(-1)


def _in_layout(t: Tensor, layout: TensorLayout) -> Tensor:
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


def spec_of(t: Tensor, config: NSConfig, layout: TensorLayout) -> MatrixSpec:
    """The planner's spec of a >=2D tensor as ``(out, everything else)``, in the dtype NS really
    runs in there; with ``method="auto"`` the planner may run it wider (``device.wider_dtype``)."""
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
        config.preconditioning,
        gram_first_run(config.coefficients),
    )


def zero_rejected_(batch: Tensor, keep: Tensor | Sequence[Tensor]) -> None:
    """Zero the slots of a ``(B, R, C)`` bucket whose ``keep`` flag (a vector, or 0-d tensors) is
    False: a zero matrix orthogonalises to zero, so a NaN never enters the batched NS."""
    keep = keep if isinstance(keep, Tensor) else torch.stack(list(keep))
    rejected = ~keep.view(-1, 1, 1)
    batch.masked_fill_(rejected, 0)


class Gather:
    """Picks fixed positions out of a per-step list (e.g. the gradients of one foreach call)."""

    __slots__ = ("indices",)

    def __init__(self, indices: Sequence[int]):
        self.indices = list(indices)

    def __call__(self, seq: Sequence[Any]) -> list[Any]:
        # map over a bound __getitem__: one C loop, no Python frame per item, and dynamo traces it
        return list(map(seq.__getitem__, self.indices))

    def __len__(self) -> int:
        return len(self.indices)

    def __bool__(self) -> bool:
        """Always true, empty or not: torch.compile tests a callable's truth before calling it,
        and Dynamo may do so on a Gather built in the trace before its ``__init__`` has run."""
        return True


class SharedWorkspace:
    """The flat buffer and each bucket's layout in it. It grows only between buckets, so no buffer
    a kernel holds moves under it (a request that does not fit gets a fresh tensor until then)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.flat = torch.empty(0, dtype=torch.uint8, device=device)
        self.layouts: list[BucketLayout] = []

    def grow(self) -> None:
        """Reach the largest layout known, dropping every view of the old buffer so it is freed now."""
        need = max(layout.end for layout in self.layouts)
        if need > self.flat.numel():
            for layout in self.layouts:
                layout.views.clear()
                layout.cache.clear()
            self.flat = torch.empty(0, dtype=torch.uint8, device=self.device)  # freed first
            self.flat = torch.empty(need, dtype=torch.uint8, device=self.device)

    def layout(self, dtype: torch.dtype, shape: Sequence[int]) -> BucketLayout:
        layout = BucketLayout(self, dtype, tuple(shape))
        self.layouts.append(layout)
        return layout


def _align(n: int) -> int:
    return -(-n // 64) * 64  # every region starts on a cache line, as the allocator's blocks do


class BucketLayout:
    """One bucket's regions of the shared buffer: its input batch at the start, then each
    temporary the kernel asks for by tag (newton_schulz.Scratch), in the order first asked."""

    def __init__(self, space: SharedWorkspace, dtype: torch.dtype, shape: tuple[int, ...]):
        self.space = space
        self.dtype = dtype
        self.shape = shape
        self.offsets: dict[tuple[str, tuple[int, ...]], int] = {}
        self.end = _align(_numel(shape) * dtype.itemsize)
        self.views: dict[tuple[str, tuple[int, ...]], Tensor] = {}
        # what a caller derives from the views, dropped with them when the buffer grows
        self.cache: dict[str, object] = {}

    def open(self) -> Tensor:
        """The input batch, with the buffer grown to this layout first (made once per buffer)."""
        if self.end > self.space.flat.numel():
            self.space.grow()
        return self.batch()

    def batch(self) -> Tensor:
        return self._view("input", self.shape, 0)

    def _view(
        self, tag: str, shape: tuple[int, ...], offset: int, dtype: torch.dtype | None = None
    ) -> Tensor:
        space = self.space
        key = (tag, shape)
        view = self.views.get(key)
        if view is None:
            dtype = dtype or self.dtype
            nbytes = _numel(shape) * dtype.itemsize
            view = self.views[key] = space.flat[offset : offset + nbytes].view(dtype).view(shape)
        return view

    def scratch(self, tag: str, shape: tuple[int, ...]) -> Tensor:
        """The kernel's temporary ``tag`` (newton_schulz.Scratch), in the bucket's dtype."""
        key = (tag, tuple(shape))
        view = self.views.get(key)
        if view is not None:  # made where it fitted: growing the buffer drops every view
            return view
        offset = self.offsets.get(key)
        if offset is None:
            offset = self.offsets[key] = self.end
            self.end += _align(_numel(key[1]) * self.dtype.itemsize)
        if offset + _numel(key[1]) * self.dtype.itemsize > self.space.flat.numel():
            return torch.empty(key[1], dtype=self.dtype, device=self.space.device)  # fits from the next call
        return self._view(tag, key[1], offset)

    def free_after(self, result: Tensor, nbytes: int) -> tuple[int, bool]:
        """Where ``nbytes`` fit without touching ``result``: the buffer's start if they fit before
        it, else just after it; and whether the buffer reaches that far now."""
        flat = self.space.flat
        offset = 0  # a fresh result (one that did not fit yet) leaves all of the buffer free
        if result.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr():
            start = result.data_ptr() - flat.data_ptr()
            if nbytes > start:
                offset = _align(start + _extent(result))
        self.end = max(self.end, offset + nbytes)
        return offset, offset + nbytes <= flat.numel()

    def place(self, tag: str, dtype: torch.dtype, numel: int, offset: int) -> Tensor:
        """A flat view of ``numel`` elements of ``dtype`` at ``offset`` (made once per buffer)."""
        return self._view(f"{tag}:{dtype}@{offset}", (numel,), offset, dtype)


def _extent(t: Tensor) -> int:
    """Bytes from ``t``'s first element to just past its last (dense or strided)."""
    if t.numel() == 0:
        return 0
    last = sum((s - 1) * st for s, st in zip(t.shape, t.stride()))
    return (last + 1) * t.element_size()


def ns_config(group: Mapping[str, Any]) -> NSConfig:
    """:meth:`NSConfig.make` of a group's NS settings, cached per distinct values (a step reads
    every group's); made afresh in a compiler's trace, which warns of any ``lru_cache``."""
    steps, coefficients, eps = group["ns_steps"], group["ns_coefficients"], group["eps"]
    dtype, method = group["ns_dtype"], group["ns_method"]
    if not _plain((steps, eps, coefficients)) or torch.compiler.is_compiling():
        return NSConfig.make(steps, coefficients, eps, dtype, method)
    try:
        # keyed by type too: 5 and 5.0 make different configs (a type is hashable; typeshed says not)
        return _cached_ns_config(
            type(steps),  # type: ignore[arg-type]
            steps,
            coefficients,
            type(eps),  # type: ignore[arg-type]
            eps,
            dtype,
            method,
        )
    except TypeError as e:
        if "unhashable" not in str(e):
            raise
        return NSConfig.make(steps, coefficients, eps, dtype, method)


def _plain(value: Any) -> bool:
    """A string, a Python number, or tuples of them: values that cannot change after hashing."""
    todo = [value]
    while todo:
        v = todo.pop()
        if isinstance(v, tuple):
            todo += v
        elif type(v) not in (str, int, float, bool):
            return False
    return True


@functools.lru_cache(maxsize=64)
def _cached_ns_config(
    _steps_type: type, steps: Any, coefficients: Any, _eps_type: type, eps: Any, dtype: Any, method: Any
) -> NSConfig:
    return NSConfig.make(steps, coefficients, eps, dtype, method)
