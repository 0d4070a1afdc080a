"""The Muon half of a step, shared by MuSGD and Muon: momentum → orthogonalise → scale → apply.

Both update every matrix as ``p ← decay·p − scale·NS(EMA momentum)``, differing only in ``decay``
(Muon's decoupled weight decay; 1 for MuSGD) and in what ``scale`` holds."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import Tensor

from ..distributed.dtensor import local_shard
from ..distributed.sharded import Piece, held_pieces
from ..ns import device as ns_device
from ..ns.device import compute_dtype
from ..ns.engine import Gather, NSConfig, Orthogonalizer, ns_config
from ..ns.matrices import MatrixMap, maps_key
from ..ns.newton_schulz import newton_schulz
from ..ns.planner import Plan
from .before_ns import SignInputs
from .bucket_momentum import BucketMomentum, in_layout
from .contracts import AfterNSStage, Engine, EngineFor
from .elementwise import ADJUST_LR, ADJUST_LR_ALIAS, RMS_SCALE, Scalar, partition, scale_limit
from .matrix_item import MatrixItem
from .state_dtype import arithmetic_dtype, store_, widened


def state_buffer(state: dict[str, Any], key: str, p: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """``p``'s momentum buffer ``key``, made as zeros in ``p``'s memory format and ``dtype`` (None: ``p``'s)."""
    buf = state.get(key)
    if buf is None:
        buf = state[key] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
    return buf


def matrix_items(
    m: MatrixMap,
    p: Tensor,
    grad: Tensor,
    state: dict[str, Any],
    *,
    beta: float,
    nesterov: bool,
    base: Any,
    adjust: str,
    config: NSConfig,
    rms_scale: float = RMS_SCALE,
    group: int,
    index: int,
    decay: Any = 1.0,
    cautious: bool = False,
    parts: Any = None,
    state_dtype: torch.dtype | None = None,
) -> list[MatrixItem]:
    """The Muon updates of ``p``, one per matrix of its map ``m`` (views), each scaled by ``base``
    times its shape's lr factor; ``parts``: over DTensors, where each rank's part of ``p`` lies."""
    buf = state_buffer(state, "momentum_buffer", p, state_dtype)
    pieces: list[Piece]
    if parts is not None:
        pieces = held_pieces(m, local_shard(p), local_shard(grad), local_shard(buf), parts)
    elif m.is_flatten:
        pieces = [Piece(p, grad, buf, tuple(p.shape))]
    else:
        views_of = m.views
        pieces = [
            Piece(pv, gv, bv, shape, views_of, k)
            for k, (pv, gv, bv, shape) in enumerate(
                zip(views_of(p), views_of(grad), views_of(buf), m.shapes(p.shape))
            )
        ]
    items = []
    for piece in pieces:
        factor = lr_scale(adjust, piece.shape, rms_scale)
        items.append(
            MatrixItem(
                piece.param,
                piece.grad,
                piece.buf,
                beta,
                nesterov,
                base * factor,
                config,
                decay=decay,
                group=group,
                index=index,
                factor=factor,
                split=piece.split,
                piece=piece.number,
                whole=piece.whole,
                cautious=cautious,
                state=state if piece.buf is buf else None,
            )
        )
    return items


def batch_order(items: list[MatrixItem]) -> list[list[MatrixItem]]:
    """The matrices split by what their momentum step shares, in the order the engine gets them."""
    return list(
        partition(items, lambda i: (i.beta, i.nesterov, i.param.device, i.param.dtype, i.buf.dtype)).values()
    )


def momentum_update(it: MatrixItem) -> Tensor:
    """``M ← β·M + (1−β)·g`` in place; returns NS's input (Nesterov ``β·M + (1−β)·g``, else ``M``)."""
    dtype = arithmetic_dtype(it.param.dtype, it.buf.dtype)
    if dtype is None:
        it.buf.lerp_(it.grad, 1 - it.beta)
        return it.grad.lerp(it.buf, it.beta) if it.nesterov else it.buf
    m, g = it.buf.to(dtype), it.grad.to(dtype)
    m.lerp_(g, 1 - it.beta)
    if m is not it.buf:
        it.buf.copy_(m)
    return g.lerp(m, it.beta) if it.nesterov else m


def single_tensor_matrix_update(
    items: list[MatrixItem],
    after_ns: Callable[[MatrixItem, Tensor], Tensor] | None = None,
) -> None:
    """The per-parameter reference path; ``after_ns(item, o)``: a rule's stage on a matrix's NS result."""
    for it in items:
        u = momentum_update(it)
        if it.sign_input:
            u = u.sign()
        c = it.config
        dtype = compute_dtype(c.dtype, u.device)  # the precision the batched path runs in too
        o = newton_schulz(
            u.reshape(u.shape[0], -1),
            c.steps,
            list(c.coefficients),
            c.eps,
            dtype,
            preconditioning=c.preconditioning,
        )
        o = o.reshape(it.param.shape).to(it.param.dtype)
        if after_ns is not None:
            o = after_ns(it, o)
        if it.cautious:
            if it.decay != 1:
                it.param.sub_(cautious_decay(it.param, o) * (1 - it.decay))
        elif it.decay != 1:
            it.param.mul_(it.decay)
        it.param.sub_(o * it.scale)


def cautious_decay(p: Tensor, update: Tensor) -> Tensor:
    """``p`` where it and ``update`` (the direction subtracted from it) agree in sign, or either
    is zero, else 0: the decayed part under cautious weight decay (Chen et al., "Cautious
    Weight Decay", arXiv 2510.12402, eq. for CWD: ``x ← x − η(u + λ·𝟙[u⊙x ≥ 0]⊙x)``)."""
    return torch.where(update * p >= 0, p, 0)


@dataclass
class MatrixScalars:
    """This step's hyperparameters of the matrix update, one entry per param group."""

    beta: Sequence[float]
    nesterov: Sequence[bool]
    base: Sequence[Scalar]  # scale = base · factor (lr·muon for MuSGD, lr for Muon)
    decay: Sequence[Scalar] | None = None  # 1 − lr·wd (Muon); None: no decay


def orthogonalize_step(
    engine: Engine,
    sources: Sequence[Tensor],
    dtypes: Sequence[torch.dtype],
    keep: Tensor | None,
    keep_positions: tuple[int, ...],
) -> list[Tensor]:
    """The plan's NS over a step's sources, into ``dtypes``. ``keep`` (one bool per gradient of the
    step; source ``i``'s at ``keep_positions[i]``) zeroes the rejected sources first."""
    if keep is None:
        return engine(sources, dtypes)
    if isinstance(engine, Orthogonalizer):
        return engine(sources, dtypes, keep=keep, keep_positions=keep_positions)
    every = keep.unbind(0)
    flags = [every[k] for k in keep_positions]
    return engine([torch.where(k, s, 0) for k, s in zip(flags, sources)], dtypes)


#: Off the host, matrices of at least this many elements are applied straight from their NS
#: results' dtype: from about this size a launch per matrix costs less than a cast copy.
NARROW_APPLY_MIN_ELEMENTS = 2**20

Momentum = Callable[..., list[Tensor]]  # ``(bufs, grads, beta, nesterov, out=views) -> NS inputs``


class MatrixProgram:
    """The batched matrix update prepared once for a fixed set of matrices; a later step with the
    same hyperparameter classes runs the same calls with its own values. Where the engine runs
    bucket by bucket (``Orthogonalizer.open_bucket``) each bucket goes through the whole update
    before the next, its momentum written straight into the bucket's NS input, so a step holds no
    more than the largest bucket's buffers; with hooks around NS, in a compiler's trace or with a
    distributed engine all buckets run in one engine call (:meth:`_run_whole`)."""

    def __init__(
        self,
        items: list[MatrixItem],
        base_class: Sequence[int],
        engine_for: EngineFor,
        stage: Callable[[list[MatrixItem]], AfterNSStage] | None = None,
        mask_packed: bool = False,
        flagged: bool = False,
    ):
        parts = batch_order(items)
        if mask_packed:  # large maskable matrices in parts of their own (see PACKED_MASK_MIN_ELEMENTS)
            parts = [sub for part in parts for sub in partition(part, _masks_when_packed).values()]
        ordered = [i for part in parts for i in part]  # not kept: the items hold this step's gradients
        self.flagged = flagged  # steps come with keep flags: masked buckets may keep momentum in their layout
        self.params = [i.param for i in ordered]
        self.configs = [i.config for i in ordered]
        self.dtypes = [p.dtype for p in self.params]
        self.keep_positions = tuple(i.index for i in ordered)  # among the step's gradients
        self.positions = frozenset(self.keep_positions)
        # tensors of several matrices: their gradients split each step, put before the step's gradients
        splits: dict[int, Callable[[Tensor], list[Tensor]]] = {}
        pieces: dict[int, int] = {}
        for i in ordered:
            if i.split is not None:
                splits.setdefault(i.index, i.split)
                pieces[i.index] = max(pieces.get(i.index, 0), i.piece + 1)
        self.splits = list(splits.items())
        starts, count = {}, 0
        for index, _ in self.splits:
            starts[index], count = count, count + pieces[index]
        position = [starts[i.index] + i.piece if i.split is not None else count + i.index for i in ordered]
        # the plan's executor, and where it reads each source from (momentum is written there)
        wholes = [i.param if i.whole is None else i.whole for i in ordered]
        self.engine: Engine | None = engine_for(self.params, self.configs, wholes) if ordered else None
        self.part_specs: list[PartSpec] = []
        start = 0
        for part in parts:
            work = arithmetic_dtype(part[0].param.dtype, part[0].buf.dtype)
            masked = tuple(i.index for i in part) if mask_packed and _masks_when_packed(part[0]) else None
            self.part_specs.append(
                PartSpec(list(range(start, start + len(part))), part[0].group, work, masked)
            )
            start += len(part)
        unmasked = {  # parameters with a matrix that does not mask itself (a split one may mix both)
            i.index for part, spec in zip(parts, self.part_specs) if spec.flag_places is None for i in part
        }
        self.packed_masked = (
            frozenset(k for spec in self.part_specs for k in spec.flag_places or ()) - unmasked
        )
        self._part_flag_index: dict[tuple[int, torch.device], Tensor] = {}
        self._part_every = {
            p: Gather(list(range(len(spec.positions)))) for p, spec in enumerate(self.part_specs)
        }
        self.bufs = [i.buf for i in ordered]
        self.grad_positions = position
        self.item_groups = [i.group for i in ordered]
        self.groups = sorted(set(self.item_groups))
        signed = [k for k, i in enumerate(ordered) if i.sign_input]
        self.sign = SignInputs(signed) if signed else None
        # scale = base · factor: one class per (class of the group's base, factor)
        by_scale = partition(range(len(ordered)), lambda k: (base_class[ordered[k].group], ordered[k].factor))
        self.scale_keys = [(ordered[idx[0]].group, ordered[idx[0]].factor) for idx in by_scale.values()]
        scale_class = [0] * len(ordered)
        for c, idx in enumerate(by_scale.values()):
            for k in idx:
                scale_class[k] = c
        limit = scale_limit(self.params[0].device) if ordered else 0
        self.one_pass = len(self.scale_keys) <= limit
        whole = stage(ordered) if stage is not None and ordered else None
        self.stage = whole
        self.after = AfterNS.over(ordered, self.params, self.item_groups, scale_class, whole)
        self._parts: list[MomentumPart] | None = None
        self.owned_inputs = False
        self.bucketwise_engine: Orthogonalizer | None = None  # set where the steps below are made
        self.any_narrow = False  # some bucket applies from the NS dtype (set there too)
        self.masked_positions: frozenset[int] = frozenset()  # see self_masked (set there too)
        self.stage_masks = False  # the stage after NS masks rejected matrices itself (set there too)
        self.buckets = self._bucket_steps(ordered, scale_class, whole)
        if self.buckets is None:
            self.masked_positions = self.packed_masked

    def _bucket_steps(
        self, ordered: list[MatrixItem], scale_class: list[int], whole: Any
    ) -> list[BucketStep] | None:
        """The step bucket by bucket, where the engine runs that way (else None)."""
        engine = self.engine
        if not isinstance(engine, Orthogonalizer) or not engine.by_bucket or engine.plan is None:
            return None
        self.bucketwise_engine = engine
        self.stage_masks = whole is None or getattr(whole, "masks_rejected", False)
        buckets = [list(engine.members(b)) for b in range(len(engine.plan.buckets))]
        classes = [c[0] for c in whole.classes] if whole is not None else []
        bucket_of = {k: b for b, members in enumerate(buckets) for k in members}
        last = [max(bucket_of[k] for k in idx) for idx in classes]
        spans = [len({bucket_of[k] for k in idx}) > 1 for idx in classes]
        place = {k: (c, j) for c, idx in enumerate(classes) for j, k in enumerate(idx)}
        self.class_after = [  # the stage's classes, applied as each completes (its stage, then the rest)
            AfterNS.over(
                [ordered[k] for k in idx],
                [self.params[k] for k in idx],
                [self.item_groups[k] for k in idx],
                [scale_class[k] for k in idx],
                None,
            )
            for idx in classes
        ]
        self.class_spans = spans
        part_of = {k: p for p, (ks, _, _, _) in enumerate(self.part_specs) for k in ks}
        signed = set(self.sign.positions) if self.sign is not None else set()
        steps = []
        masked_here: set[int] = set()
        unmasked_here: set[int] = set()
        for b, members in enumerate(buckets):
            ks = sorted(members)  # the program's order: each stage's batches as over all matrices
            slot = {k: j for j, k in enumerate(members)}
            ns_dtype = engine.bucket_dtype(b)
            masked = self.stage_masks and all(_masks_itself(ordered[k]) for k in ks)
            parts = {part_of[k] for k in members}  # one part, stepped in the buffers' dtype
            flat = None
            if masked and self.flagged and len(parts) == 1 and self.part_specs[parts.pop()].work is None:
                items = [ordered[k] for k in members]
                flat = in_layout(engine, b, items, self.grad_positions, self.keep_positions)
                if flat is not None:  # the former buffers freed now: a bucket's worth at a time
                    for k in members:
                        self.bufs[k] = ordered[k].buf
            moms = []
            parts_here = []
            for p, (_, group, work, _) in enumerate(self.part_specs):
                mine = [k for k in ks if part_of[k] == p]
                if not mine:
                    continue
                parts_here.append(p)
                bufs = [ordered[k].buf for k in mine]  # moved into the layout where flat
                momentum: Momentum
                if work is not None:
                    momentum = functools.partial(ema_momentum_widened_, dtype=work)
                elif any(b_.dtype != ns_dtype for b_ in bufs):
                    momentum = ema_momentum_cast_
                else:
                    momentum = ema_momentum_
                grads = Gather([self.grad_positions[k] for k in mine])
                moms.append(MomentumPart(bufs, grads, group, Gather([slot[k] for k in mine]), momentum))
            feeds: dict[int, tuple[list[int], list[int]]] = {}
            for n, k in enumerate(ks):
                if k in place:
                    c, j = place[k]
                    feeds.setdefault(c, ([], []))
                    feeds[c][0].append(n)
                    feeds[c][1].append(j)
            out_dtype = self.dtypes[ks[0]]
            exact_cast = torch.promote_types(ns_dtype, out_dtype) == out_dtype
            narrow = (
                exact_cast
                and not ns_device.is_host(self.params[ks[0]].device)
                and whole is None
                and not any(ordered[k].cautious for k in ks)
                and min(self.params[k].numel() for k in ks) >= NARROW_APPLY_MIN_ELEMENTS
            )
            self.any_narrow = self.any_narrow or narrow
            (masked_here if masked else unmasked_here).update(ordered[k].index for k in ks)
            steps.append(
                BucketStep(
                    index=b,
                    momentum=moms,
                    signed=Gather([slot[k] for k in ks if k in signed]),
                    order=Gather([slot[k] for k in ks]),
                    out_dtype=out_dtype,
                    exact_cast=exact_cast,
                    narrow_apply=narrow,
                    after=AfterNS.over(
                        [ordered[k] for k in ks],
                        [self.params[k] for k in ks],
                        [self.item_groups[k] for k in ks],
                        [scale_class[k] for k in ks],
                        None,
                    ),
                    feeds=[Feed(c, Gather(at), js) for c, (at, js) in sorted(feeds.items())],
                    completes=[c for c in range(len(classes)) if last[c] == b],
                    masked=masked,
                    flag_places=tuple(self.keep_positions[k] for k in ks),
                    momentum_flags=[Gather([ks.index(k) for k in ks if part_of[k] == p]) for p in parts_here],
                    flat=flat,
                )
            )
        self.masked_positions = frozenset(masked_here - unmasked_here)
        return steps

    def fits(self, grads: Sequence[Tensor]) -> bool:
        return True

    def self_masked(self) -> frozenset[int]:
        """The parameters (places among the step's gradients) this half leaves as they were, momentum
        included, where ``keep`` rejects their gradient, with no copy: those whose matrices all mask
        themselves (:func:`_masks_itself`, :func:`_masked_momentum`), their decay factor masked to 1."""
        return self.masked_positions

    @property
    def plan(self) -> Plan | None:
        """The batching plan its Newton–Schulz runs (None: no matrix)."""
        return self.engine.plan if self.engine is not None else None

    def run(
        self, grads: Sequence[Tensor], scalars: MatrixScalars, keep: Tensor | None, hooks: Mapping[int, Any]
    ) -> None:
        """One step over ``grads`` (see the class); ``hooks`` (``register_orthogonalize_hook``) wrap
        NS. A rule's stage after NS gets results in the NS dtype where widening is exact, else cast."""
        engine = self.engine
        if engine is None:  # no matrix
            return
        if self.splits:
            grads = [g for index, split in self.splits for g in split(grads[index])] + list(grads)
        scales = [scalars.base[g] * f for g, f in self.scale_keys]
        for step in self.buckets or ():  # the momentum steps read the buffers the state holds
            if step.flat is not None:
                step.flat.held()
        bucketwise = self.bucketwise_engine
        if bucketwise is None or hooks or not bucketwise.bucketwise():
            self._run_whole(engine, grads, scalars, scales, keep, hooks)
            return
        engine = bucketwise
        stage = self.stage
        beta, nesterov = scalars.beta, scalars.nesterov
        pending: dict[int, list[Any]] = {}  # stage classes seen in part (None: a slot not fed yet)
        # a tensor scale multiplies the updates in place: those must come in the full dtype
        narrow_ok = self.any_narrow and not any(isinstance(s, Tensor) for s in scales)
        for step in self.buckets or ():
            flags = step.flags(keep) if keep is not None and step.masked else None
            drop = None  # a flat bucket's rejected members, zeroed in the normalisation
            if step.flat is not None and keep is not None:  # the momentum in the bucket's layout
                batch = engine.open_batch(step.index)
                g = step.momentum[0].group
                drop = step.flat.step(grads, batch, keep, beta[g], nesterov[g])
                views = step.flat.frame.members(batch) if len(step.signed) else []
                del batch
            elif flags is None:
                views = engine.open_bucket(step.index)
                for bufs, pick, g, out, momentum in step.momentum:
                    momentum(bufs, pick(grads), beta[g], nesterov[g], out=out(views))
            else:
                views = engine.open_bucket(step.index)
                rejected = list((~flags).unbind(0))
                for (bufs, pick, g, out, _), mine in zip(step.momentum, step.momentum_flags):
                    _masked_momentum(
                        bufs, pick(grads), flags, mine, mine(rejected), beta[g], nesterov[g], out(views)
                    )
            if len(step.signed):  # a Gather is always true (see Gather.__bool__)
                torch._foreach_sign_(step.signed(views))
            narrow = narrow_ok and step.narrow_apply
            dtype = None if narrow or (stage is not None and step.exact_cast) else step.out_dtype
            zeroed = keep if flags is None else None  # a masked bucket's rejected inputs are zeros already
            updates = step.order(engine.run_bucket(step.index, dtype, zeroed, self.keep_positions, drop))
            del views  # off the host, free this bucket's buffers before the next one allocates
            if stage is None:
                # narrow: one add per scale class, each a launch per matrix anyway
                step.after.run(updates, scalars, scales, self.groups, narrow or self.one_pass, keep=flags)
                del updates
                continue
            for c, pick, places in step.feeds:
                got = pick(updates)
                if self.class_spans[c]:  # kept past this bucket: copied, in the parameters' dtype
                    held = pending.setdefault(c, [None] * len(self.class_after[c].params))
                    for j, u in zip(places, got):
                        held[j] = u.to(step.out_dtype, copy=True)
                else:
                    pending[c] = got
            del updates
            for c in step.completes:
                if keep is not None and self.masked_positions:  # flags mask the stage and decay
                    class_flags = stage.flags(c, keep)
                    results = stage.run_class(c, pending.pop(c), scalars, class_flags)
                    self.class_after[c].run(
                        results, scalars, scales, self.groups, self.one_pass, keep=class_flags
                    )
                else:
                    results = stage.run_class(c, pending.pop(c), scalars)
                    self.class_after[c].run(results, scalars, scales, self.groups, self.one_pass)

    def _run_whole(
        self,
        engine: Engine,
        grads: Sequence[Tensor],
        scalars: MatrixScalars,
        scales: list[Scalar],
        keep: Tensor | None,
        hooks: Mapping[int, Any],
    ) -> None:
        """The step with every bucket's NS in one engine call (see :meth:`run`)."""
        sources: list[Tensor] = []
        for p, (bufs, pick, g, out, momentum) in enumerate(self._momentum_parts()):
            places = self.part_specs[p].flag_places
            if places is not None and keep is not None and out is None:  # large ones masking themselves
                flags = self._part_flags(p, places, keep)
                inputs = [torch.empty_like(b) for b in bufs]  # what NS reads: exact zeros where rejected
                every = self._part_every[p]
                rejected = list((~flags).unbind(0))
                _masked_momentum(
                    bufs, pick(grads), flags, every, rejected, scalars.beta[g], scalars.nesterov[g], inputs
                )
                sources += inputs
                continue
            sources += momentum(bufs, pick(grads), scalars.beta[g], scalars.nesterov[g], out=out)
        if self.sign is not None:
            self.sign.run(sources, self.owned_inputs)
        args = (engine, sources, self.dtypes, keep, self.keep_positions)
        if hooks:
            call = functools.partial(orthogonalize_step, *args)
            for hook in hooks.values():
                call = functools.partial(hook, call)
            updates = call()
        else:
            updates = orthogonalize_step(*args)
        self.after.run(updates, scalars, scales, self.groups, self.one_pass)

    def _part_flags(self, p: int, places: tuple[int, ...], keep: Tensor) -> Tensor:
        index = self._part_flag_index.get((p, keep.device))
        if index is None:
            index = self._part_flag_index[p, keep.device] = torch.tensor(places, device=keep.device)
        return keep.index_select(0, index)

    def _momentum_parts(self) -> list[MomentumPart]:
        """Per part: what its momentum step reads and writes, made on the first step that takes them."""
        if self._parts is not None and not torch.compiler.is_compiling():
            return self._parts
        views = getattr(self.engine, "input_views", None)
        inputs = views() if views is not None else None
        parts: list[MomentumPart] = []
        for ks, group, work, _ in self.part_specs:
            out = [inputs[k] for k in ks] if inputs is not None else None
            bufs = [self.bufs[k] for k in ks]
            momentum: Momentum
            if work is not None:
                momentum = functools.partial(ema_momentum_widened_, dtype=work)
            elif out is not None and any(o.dtype != b.dtype for o, b in zip(out, bufs)):
                momentum = ema_momentum_cast_
            else:
                momentum = ema_momentum_
            parts.append(
                MomentumPart(bufs, Gather([self.grad_positions[k] for k in ks]), group, out, momentum)
            )
        self.owned_inputs = inputs is not None
        if inputs is not None or not torch.compiler.is_compiling():
            self._parts = parts
        return parts


class PartSpec(NamedTuple):
    """A momentum part of the program: matrices stepped by one foreach call."""

    positions: list[int]  # its matrices' places in the program
    group: int  # the param group whose β and nesterov it reads
    work: torch.dtype | None  # the dtype its arithmetic runs in where not the buffers' (else None)
    flag_places: tuple[int, ...] | None = None  # self-masking matrices on the packed path: keep-vector places


#: Off the host, matrices of this many elements stepped all buckets at once mask their own momentum
#: (``_masked_momentum``) where no decay follows NS (MuSGD): a few launches, not a copy and a restore.
PACKED_MASK_MIN_ELEMENTS = 2**20


def _masks_when_packed(item: MatrixItem) -> bool:
    return _masks_itself(item) and item.param.numel() >= PACKED_MASK_MIN_ELEMENTS


class MomentumPart(NamedTuple):
    """A momentum part made ready to step: what its foreach call reads and writes."""

    bufs: list[Tensor]
    grads: Gather  # picks its gradients out of the step's
    group: int
    out: Any  # where its NS inputs go: views (all buckets at once), a Gather over a bucket's, or None
    step: Momentum  # the EMA step that writes them


class Feed(NamedTuple):
    """Where a bucket's results go in a class of the rule's stage after NS."""

    cls: int  # the class
    pick: Gather  # its matrices among the bucket's results (program order)
    places: list[int]  # and their places in the class


def _masks_itself(item: MatrixItem) -> bool:
    """Whether a matrix may take the masked bucket step (fp32: only there does a masked factor round alike)."""
    p = item.param
    return (
        not ns_device.is_host(p.device)
        and p.dtype == torch.float32
        and item.buf.dtype == p.dtype
        and not item.cautious
        and item.whole is None
    )


def _masked_momentum(
    bufs: list[Tensor],
    grads: list[Tensor],
    flags: Tensor,
    mine: Gather,
    rejected: list[Tensor],
    beta: float,
    nesterov: bool,
    out: list[Tensor],
) -> None:
    """A masked bucket's EMA step, one matrix at a time, its weights 0-d device tensors (``mine``
    picks this part's ``flags``): where kept ``1−β`` and ``β``, as the plain step computes; where
    rejected 0, the gradient read as zeros: ``M + 0·(0 − M)`` is ``M``, NS's input ``0 + 0·M`` exactly 0."""
    weights = mine(list(torch.mul(flags, 1 - beta).unbind(0)))
    if nesterov:
        lerps = mine(list(torch.mul(flags, beta).unbind(0)))
        for buf, grad, r, w, b, o in zip(bufs, grads, rejected, weights, lerps, out):
            g = grad.masked_fill(r, 0)
            buf.lerp_(g, w)
            torch.lerp(g, buf, b, out=o)
        return
    ones = mine(list(flags.to(bufs[0].dtype).unbind(0)))
    for buf, grad, r, w, one, o in zip(bufs, grads, rejected, weights, ones, out):
        buf.lerp_(grad.masked_fill(r, 0), w)
        torch.mul(buf, one, out=o)


@dataclass
class BucketStep:
    """One bucket's share of a step."""

    index: int  # the bucket's place in the plan
    momentum: list[MomentumPart]  # per momentum part here (``out``: picks of its NS input views)
    signed: Gather  # the sign-input matrices' places among the bucket's, slot order
    order: Gather  # the bucket's results (slot order) in the program's order
    out_dtype: torch.dtype  # the parameters'
    exact_cast: bool  # widening the NS dtype to the parameters' is exact
    narrow_apply: bool  # off the host, large matrices: applied from the NS dtype, not a cast copy
    after: AfterNS  # the stages after NS over the bucket's matrices (the rule's stage after NS apart)
    feeds: list[Feed]  # with a rule's stage: where its classes' matrices sit
    completes: list[int]  # and which of its classes end here
    masked: bool  # the bucket masks rejected gradients itself
    flag_places: tuple[int, ...]  # its members' places in the keep vector
    momentum_flags: list[Gather]  # each momentum part's among them
    flag_index: dict[torch.device, Tensor] = field(default_factory=dict)
    flat: BucketMomentum | None = None  # the momentum kept in the bucket's layout, if it is

    def flags(self, keep: Tensor) -> Tensor:
        """The members' keep flags (program order): one index select, no host read."""
        index = self.flag_index.get(keep.device)
        if index is None:
            index = self.flag_index[keep.device] = torch.tensor(self.flag_places, device=keep.device)
        return keep.index_select(0, index)


class Decayed(NamedTuple):
    """Matrices that take one kind of decay: their parameters and param groups."""

    params: list[Tensor]
    groups: list[int]


class Cautious(NamedTuple):
    """The cautious matrices: where their updates sit, their parameters and param groups."""

    pick: Gather
    params: list[Tensor]
    groups: list[int]


class ScaleClass(NamedTuple):
    """A scale class of the program with matrices here, and where they sit among them."""

    scale: int  # the class's place among the program's scales
    pick: Gather


@dataclass
class AfterNS:
    """The stages after NS over some matrices of a program, in the program's order."""

    params: list[Tensor]
    item_groups: list[int]
    variant: Callable[[list[Tensor], Any], list[Tensor]] | None
    cautious: Cautious | None  # the cautious matrices, apart
    plain: Decayed  # the others
    scale_classes: list[ScaleClass]
    scale_params: list[list[Tensor]]

    @classmethod
    def over(
        cls,
        items: Sequence[Any],
        params: Sequence[Tensor],
        item_groups: Sequence[int],
        scale_class: Sequence[int],
        variant: Callable[[list[Tensor], Any], list[Tensor]] | None,
    ) -> AfterNS:
        """The stages over ``items``; ``variant``: the variant's stage over them, or None."""
        n = len(items)
        cautious = [k for k in range(n) if items[k].cautious]
        plain = [k for k in range(n) if not items[k].cautious]
        by_class: dict[int, list[int]] = {}
        for k in range(n):
            by_class.setdefault(scale_class[k], []).append(k)
        classes = sorted(by_class)
        return cls(
            params=list(params),
            item_groups=list(item_groups),
            variant=variant,
            cautious=(
                Cautious(Gather(cautious), [params[k] for k in cautious], [item_groups[k] for k in cautious])
                if cautious
                else None
            ),
            plain=Decayed([params[k] for k in plain], [item_groups[k] for k in plain]),
            scale_classes=[ScaleClass(c, Gather(by_class[c])) for c in classes],
            scale_params=[[params[k] for k in by_class[c]] for c in classes],
        )

    def run(
        self,
        updates: list[Tensor],
        scalars: Any,
        scales: Sequence[Scalar],
        groups: Sequence[int],
        one_pass: bool,
        owned: bool = True,
        keep: Tensor | None = None,
    ) -> None:
        """Apply ``updates`` (these matrices' NS results); ``scales``: one per scale class of the
        program. ``keep`` (one bool per matrix, on the device) masks a rejected matrix's decay
        factor to 1 (``where(keep, decay, 1)``, the same fp32 value a Python factor gives)."""
        if self.variant is not None:
            updates = self.variant(updates, scalars)
        decay = scalars.decay
        if decay is not None and keep is not None:
            factors: dict[int, list[Tensor]] = {}
            for g in sorted(set(self.item_groups)):
                if isinstance(decay[g], Tensor) or decay[g] != 1:
                    factors[g] = list(torch.where(keep, decay[g], 1.0).unbind(0))
            for j, (p, g) in enumerate(zip(self.params, self.item_groups)):
                if g in factors:
                    p.mul_(factors[g][j])
        elif decay is not None:
            if self.cautious is not None:
                cautious_decay_(updates, decay, *self.cautious)
            params, item_groups = self.plain
            if any(isinstance(decay[g], Tensor) for g in groups):
                for g in groups:
                    mine = [p for p, h in zip(params, item_groups) if h == g]
                    if mine:
                        torch._foreach_mul_(mine, decay[g])
            elif any(decay[g] != 1 for g in groups) and params:
                torch._foreach_mul_(params, [decay[g] for g in item_groups])
        apply_scaled_(
            self.scale_params,
            [pick(updates) for _, pick in self.scale_classes],
            [scales[c] for c, _ in self.scale_classes],
            owned=owned,
            one_pass=one_pass,
        )


def cautious_decay_(
    updates: Sequence[Tensor],
    decay: Sequence[Scalar],
    pick: Gather,
    params: list[Tensor],
    item_groups: list[int],
) -> None:
    """``p ← p − lr·wd·𝟙[u⊙p ≥ 0]⊙p`` over the cautious matrices in a fixed number of foreach calls."""
    masked = torch._foreach_mul(pick(updates), params)
    torch._foreach_sign_(masked)
    torch._foreach_add_(masked, 1)
    torch._foreach_clamp_max_(masked, 1)  # 1 where u·p ≥ 0, else 0
    torch._foreach_mul_(masked, params)
    rates = [1 - decay[g] for g in item_groups]  # lr·wd
    if any(isinstance(r, Tensor) for r in rates):
        for m, r in zip(masked, rates):
            m.mul_(r)
    else:
        torch._foreach_mul_(masked, rates)
    torch._foreach_sub_(params, masked)


def apply_scaled_(
    params: Sequence[list[Tensor]],
    updates: Sequence[list[Tensor]],
    scales: Sequence[Scalar],
    *,
    owned: bool,
    limit: int | None = None,
    one_pass: bool | None = None,
) -> None:
    """``p ← p − scale·u`` for each class of (params, updates, scale): at most ``limit`` classes
    (or ``one_pass``) take one fused ``add_`` each, more a scaling and a subtracting pass over all.
    A tensor scale is used as a tensor (no host read); ``owned``: updates may be scaled in place."""
    if any(isinstance(s, Tensor) for s in scales):
        for ps, us, s in zip(params, updates, scales):
            if not ps:
                continue
            if owned:
                torch._foreach_mul_(us, s)
                torch._foreach_sub_(ps, us)
            else:
                torch._foreach_sub_(ps, torch._foreach_mul(us, s))
        return
    if one_pass is None:
        one_pass = len(scales) <= limit  # type: ignore[operator]
    if one_pass:
        for ps, us, s in zip(params, updates, scales):
            if ps:
                torch._foreach_add_(ps, us, alpha=-s)
        return
    all_params = [p for ps in params for p in ps]
    all_updates = [u for us in updates for u in us]
    per_item = [s for ps, s in zip(params, scales) for _ in ps]
    if not all_params:
        return
    if owned:
        torch._foreach_mul_(all_updates, per_item)
        torch._foreach_sub_(all_params, all_updates)
    else:
        torch._foreach_sub_(all_params, torch._foreach_mul(all_updates, per_item))


def ema_momentum_(
    bufs: list[Tensor], grads: list[Tensor], beta: float, nesterov: bool, out: list[Tensor] | None = None
) -> list[Tensor]:
    """:func:`momentum_update` over lists, the result written into ``out`` (NS's inputs) where given."""
    torch._foreach_lerp_(bufs, grads, 1 - beta)
    if out is None:
        # the foreach ops return a list (torch's stub says a tuple)
        return torch._foreach_lerp(grads, bufs, beta) if nesterov else bufs  # type: ignore[return-value]
    torch._foreach_copy_(out, grads if nesterov else bufs)
    if nesterov:
        torch._foreach_lerp_(out, bufs, beta)  # g + β·(M − g), as the out-of-place lerp computes it
    return out


def ema_momentum_cast_(
    bufs: list[Tensor], grads: list[Tensor], beta: float, nesterov: bool, out: list[Tensor]
) -> list[Tensor]:
    """:func:`ema_momentum_` into ``out`` of another dtype (e.g. bf16 NS inputs for fp32 momentum):
    each value rounded once on the store, as computing and then casting does, in one pass."""
    torch._foreach_lerp_(bufs, grads, 1 - beta)
    if nesterov:
        for g, m, o in zip(grads, bufs, out):
            torch.lerp(g, m, beta, out=o)
    else:
        torch._foreach_copy_(out, bufs)
    return out


def ema_momentum_widened_(
    bufs: list[Tensor],
    grads: list[Tensor],
    beta: float,
    nesterov: bool,
    out: list[Tensor] | None = None,
    *,
    dtype: torch.dtype,
) -> list[Tensor]:
    """:func:`ema_momentum_` for buffers stored in another dtype than the arithmetic ``dtype``."""
    m, g = widened(bufs, dtype), widened(grads, dtype)
    if out is not None and any(o.dtype != dtype for o in out):
        update = ema_momentum_cast_(m, g, beta, nesterov, out)
    else:
        update = ema_momentum_(m, g, beta, nesterov, out)
    store_(bufs, m)
    return update


def lr_factor(group: Mapping[str, Any], index: int, default: str) -> tuple[str, float]:
    """A group's ``adjust_lr_fn`` (``default`` where None) and ``rms_scale``; refuses a late ``adjust_lr``."""
    if ADJUST_LR_ALIAS in group:
        raise ValueError(
            f"param group {index} has {ADJUST_LR_ALIAS}={group[ADJUST_LR_ALIAS]!r}, set after the group "
            "was added, which the step does not read; set group['adjust_lr_fn'] instead and delete "
            "the adjust_lr entry"
        )
    mode = group["adjust_lr_fn"]
    return (default if mode is None else mode), group.get("rms_scale", RMS_SCALE)


def matrix_structure(group: Mapping[str, Any], index: int, default: str) -> tuple[Any, ...]:
    """What of a group shapes its matrices' program, read every step (``default``: the rule's
    ``adjust_lr_fn``); a string of matrix maps, the usual case, is its own hashable stand-in."""
    spec = group.get("matrices")
    return (
        group.get("use_muon"),
        lr_factor(group, index, default),
        ns_config(group),
        spec if spec is None or type(spec) is str else maps_key(spec),
    )


def lr_scale(mode: str, shape: Sequence[int], rms_scale: float = RMS_SCALE) -> float:
    """The per-matrix factor on the orthogonalised update (``s`` in "Update rules" in
    docs/optimizers.md); ``rms_scale`` is the update RMS "match_rms_adamw" aims at."""
    rows, cols = shape[0], math.prod(shape[1:])
    if mode == "ultralytics":  # on the raw tensor's last two dims: 1 for square conv kernels
        return math.sqrt(max(1.0, shape[-2] / shape[-1]))
    if mode == "original":
        return math.sqrt(max(1.0, rows / cols))
    if mode == "match_rms_adamw":
        return rms_scale * math.sqrt(max(rows, cols))
    if mode == "spectral_unclamped":  # keeps the update's spectral norm at sqrt(rows/cols), wide ones too
        return math.sqrt(rows / cols)
    if mode == "none":
        return 1.0
    raise ValueError(f"unknown adjust_lr_fn {mode!r}; choose one of {ADJUST_LR}")
