"""Running a step: find or prepare its program, check its gradients, run it; or the rule's reference.

A program is prepared on the first step and again when the set of parameters with gradients, their
layouts, the groups or the equality classes of their hyperparameters change, under a guard that
takes back the state a refused step made; a later step only reads the gradients and the
hyperparameters and runs a fixed sequence of foreach and NS calls. In a distributed run the set is
the one the ranks agree on (zeros stand in where a rank has no gradient)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import operator
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator, MutableMapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, Literal, NamedTuple

import torch
from torch import Tensor

from ..distributed.context import DistContext, agree_across_ranks, begin_step, build_distributed
from ..distributed.dtensor import LocalShards, is_dtensor, localize
from ..distributed.dtensor import local_shard as _local
from ..distributed.inflight import InFlight
from ..distributed.parts import PartsTable, provisional_parts
from ..ns import device
from ..ns.build import build_orthogonalizer
from ..ns.engine import Gather, NSConfig
from ..ns.matrices import MatrixMap
from ..ns.planner import Plan
from .collecting import CollectEnv
from .contracts import HalfProgram, Rule
from .deferred import PendingFlags, host_buffer, nothing_to_finish
from .elementwise import Scalar
from .matrix import MatrixProgram, batch_order
from .nonfinite import SkipPlan
from .options import Options
from .state_marks import drop_state_after, mark_state

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

# per-step reads over every gradient, as C-level callables for ``map`` (no Python frame per tensor)
_is_none = functools.partial(operator.is_, None)


def _grads_of(params: Sequence[Tensor]) -> list[Tensor | None]:
    """Every ``.grad``: a comprehension, which dynamo traces (an ``attrgetter`` breaks the graph)."""
    return [p.grad for p in params]


Group = dict[str, Any]
Agree = Callable[[Tensor], Tensor]


@dataclass
class Ready:
    """A kept or prepared program with this step's gradients (a dataclass: cheaper than a NamedTuple)."""

    program: StepProgram
    live: list[Tensor]  # the gradients of the parameters it updates
    keep: Tensor | None  # one flag per live gradient, False where not finite (None: nothing to put back)


class StepEnv(NamedTuple):
    """What the driver reads of the optimizer for one call (never the optimizer itself)."""

    groups: list[dict[str, Any]]
    state: MutableMapping[Tensor, dict[str, Any]]  # per-parameter state (a defaultdict: made on first use)
    rule: Rule  # one of fastmuon.rules
    options: Options  # the optimizer's Options
    process_group: ProcessGroup | None  # DDP's, or None
    optimizer: str  # its class name, for errors
    param_name: Callable[[dict[str, Any], int], str]
    lr_value: Callable[[Any], Scalar]
    check_grad: Callable[[dict[str, Any], int, Tensor], None]
    check_maps: Callable[[dict[str, Any], int], list[MatrixMap]]  # (group, index) -> its checked maps


#: Where a step runs: this process alone; ranks that each hold every parameter (DDP); ranks that
#: hold parts of DTensor parameters (FSDP2 and other meshes).
SINGLE: Final = "single"
REPLICATED: Final = "replicated"
SHARDED: Final = "sharded"
Kind = Literal["single", "replicated", "sharded"]


@dataclass(frozen=True)
class Site:
    """Where a step runs and over what, worked out once per parameter list and process group;
    ``owners[k]``, ``(group, index)``, names ``params[k]`` (in the order a step reads gradients)."""

    params: list[Tensor]
    owners: list[tuple[Group, int]]
    kind: Kind
    process_group: ProcessGroup | None

    @classmethod
    def of(
        cls, groups: list[Group], params: list[Tensor], sharded: bool, process_group: ProcessGroup | None
    ) -> Site:
        kind: Kind = SHARDED if sharded else SINGLE if process_group is None else REPLICATED
        owners = [(g, j) for g in groups for j in range(len(g["params"]))]
        return cls(params, owners, kind, process_group)

    def namer(self, param_name: Callable[[Group, int], str]) -> Callable[[int], str]:
        """A parameter's name from its index in :attr:`params`."""
        owners = self.owners
        return lambda k: param_name(*owners[k])


def _engine_key(whole: Any, config: NSConfig) -> Hashable:
    """What an engine depends on for one matrix: its layout, dtype, device and NS settings."""
    if isinstance(whole, Tensor):
        return (whole.shape, whole.stride(), whole.dtype, whole.device, config)
    return (whole, config)


class StepDriver:
    """One optimizer's steps: its cache of programs and executors, the keeper of its in-flight
    collectives, the hooks around its NS, and whether every parameter's state exists yet."""

    def __init__(self, last_plan: Plan | None = None, initialised: bool = False):
        self.cache = StepCache(last_plan)
        self.inflight = InFlight()  # this step's agreement collectives (see inflight.py)
        self.hooks: OrderedDict[int, Callable[..., Any]] = OrderedDict()
        self.initialised = initialised  # distributed steps make every parameter's state first
        self.steps = 0  # steps this driver has run (accepted ones: a refused step counts none)
        self.pending: PendingFlags | None = None  # the last step's deferred "raise" verdict
        self._site: Site | None = None  # the last step's, while its parameter list holds

    def raise_pending(self) -> None:
        """Raise if the last step's deferred verdict found a non-finite gradient (read once)."""
        pending = self.pending
        if pending is None:
            return
        self.pending = None
        pending.check()

    def complete_pending(self) -> None:
        """Finish the last step's restore without raising (the verdict stays for the next call)."""
        if self.pending is not None:
            self.pending.complete()

    def discard_pending(self) -> None:
        """Drop an unread verdict (loading a state dict replaces the state it speaks of)."""
        self.pending = None

    def step(self, env: StepEnv) -> None:
        """One batched update of every parameter with a gradient."""
        pattern, scalars = env.rule.scalars(env.groups, env.lr_value)
        flat, sharded = self.cache.params(env.groups)
        site = self._site  # the last step's, checked here as :meth:`site` does (no call per step)
        if site is None or site.params is not flat or site.process_group is not env.process_group:
            site = self._site = Site.of(env.groups, flat, sharded, env.process_group)
        compiling = torch.compiler.is_compiling()  # traced Python runs once: nothing to keep
        agree = None if site.kind == SINGLE else functools.partial(self._agree, site)
        # a distributed run's first gradients make every state: read only where a refusal undoes it
        ready = misfit = grads = None
        if not compiling and (site.kind == SINGLE or self.initialised):
            grads = _grads_of(site.params) if site.kind == SINGLE else self._gradients(env, site)
            ready, misfit = self._kept(env, grads, pattern, agree)
        if ready is None:
            ready = self._prepare(env, site, grads, pattern, agree, misfit, remember=not compiling)
        program, live, keep = ready.program, ready.live, ready.keep
        matrices = program.matrices
        if matrices is not None and matrices.params:
            self.cache.last_plan = matrices.plan
        guard = program.guard
        # hooks around NS or a compiler's trace: the matrices run unmasked (see guard.snapshot)
        whole = bool(self.hooks) or compiling
        saved = guard.snapshot(keep, whole) if keep is not None else None
        try:
            update = program.update
            update.matrices.run(live, scalars.matrices, keep, self.hooks)
            update.elementwise.run(live, scalars.elementwise, keep)
        except BaseException:
            if saved is not None:
                guard.restore(saved, keep, whole)
            raise
        self.steps += 1
        if keep is not None:
            self.pending = guard.settle(saved, keep, program.name_of(env.param_name), self.steps, whole)

    def site(self, env: StepEnv) -> Site:
        """Where this call runs (the last call's :class:`Site` while parameters and group hold)."""
        flat, sharded = self.cache.params(env.groups)
        site = self._site
        if site is None or site.params is not flat or site.process_group is not env.process_group:
            site = self._site = Site.of(env.groups, flat, sharded, env.process_group)
        return site

    def _kept(
        self, env: StepEnv, grads: list[Tensor | None], pattern: Hashable, agree: Agree | None
    ) -> tuple[Ready | None, StepProgram | None]:
        """The kept program for this key, ready, if it fits; else None and the misfit (None: none kept)."""
        program: StepProgram | None = self.cache.programs.get((tuple(map(_is_none, grads)), pattern))
        if program is None:
            return None, None
        live = program.live(grads)
        if not program.fits(live) or any([g.is_sparse for g in live]):
            return None, program
        return Ready(program, live, program.guard.keep(live, program.name_of(env.param_name), agree)), None

    def _prepare(
        self,
        env: StepEnv,
        site: Site,
        grads: list[Tensor | None] | None,
        pattern: Hashable,
        agree: Agree | None,
        misfit: StepProgram | None,
        remember: bool,
    ) -> Ready:
        """A program prepared for this step, kept for later steps if ``remember``. ``misfit``: the
        kept program for this key whose layouts no longer fit: its engine serves."""
        with self._refusal_leaves_no_state(env):
            if grads is None:
                grads = self._gradients(env, site)
            engine = misfit.matrices.engine if misfit is not None and misfit.matrices is not None else None
            program = self._make_program(env, site, grads, pattern, engine)
            live = program.live(grads)
            keep = program.guard.keep(live, program.name_of(env.param_name), agree)
        if remember:
            self.cache.remember((tuple(map(_is_none, grads)), pattern), program)
        return Ready(program, live, keep)

    def reference_step(self, env: StepEnv) -> None:
        """The same update through the rule's per-parameter reference (``foreach=False``)."""
        guard = keep = saved = None
        site = self.site(env)
        with self._refusal_leaves_no_state(env):
            grads = self._gradients(env, site)
            items = self._collect(env, site, grads)
            if site.kind == SHARDED and any(
                is_dtensor(i.param) or getattr(i, "whole", None) is not None for part in items for i in part
            ):
                raise ValueError(
                    f"{env.optimizer}(foreach=False) is the per-parameter reference path and "
                    "cannot orthogonalise FSDP2-sharded (DTensor) parameters; use foreach=True"
                )
            mode = env.options.nonfinite
            if mode != "ignore":
                live = [k for k, g in enumerate(grads) if g is not None]
                live_params = [site.params[k] for k in live]
                live_grads: list[Tensor] = [grads[k] for k in live]  # type: ignore[misc]  # the live ones
                states = [env.state[p] for p in live_params] if mode == "skip" else ()
                guard = NonFiniteGuard(mode, live_grads, live_params, states)
                name = site.namer(env.param_name)
                agree = None if site.kind == SINGLE else functools.partial(self._agree, site)
                keep = guard.keep(live_grads, lambda k: name(live[k]), agree)
                saved = guard.snapshot(keep) if keep is not None else None
        try:
            env.rule.reference(items)
        finally:
            if saved is not None:
                guard.restore(saved, keep)  # type: ignore[union-attr]
        self.steps += 1

    def init_state(self, env: StepEnv) -> None:
        """Every parameter's state (zeros), as its first step would make it."""
        site = self.site(env)
        self._collect(env, site, list(site.params))
        self.initialised = True

    @contextlib.contextmanager
    def _refusal_leaves_no_state(self, env: StepEnv) -> Iterator[None]:
        """A step refused while preparing leaves the optimizer as it was: no new state, and no
        program (one is remembered only once its step is accepted, alike on every rank)."""
        mark = mark_state(env.state)
        initialised = self.initialised
        try:
            yield
        except BaseException:
            drop_state_after(env.state, mark)
            self.initialised = initialised
            raise

    def _gradients(self, env: StepEnv, site: Site) -> list[Tensor | None]:
        """Every parameter's gradient this step (distributed: zeros where only another rank has one)."""
        flat = site.params
        if site.kind == SINGLE:
            return _grads_of(flat)
        self.inflight.settle()  # the last step's (finished long ago)
        parts = self.cache.parts
        name = site.namer(env.param_name)
        if site.kind == SHARDED and not parts.fits(flat):  # every rank's part of every parameter, once
            parts.build(flat, self.inflight, name, env.optimizer)
        if not self.initialised:
            self.init_state(env)
        zero_grads = begin_step(flat, self.ranks(site), self.inflight)
        grads = [p.grad for p in flat]
        if zero_grads:
            grads = [zero_grads.get(p) if g is None else g for p, g in zip(flat, grads)]
        if site.kind == SHARDED and not parts.checked:  # once per table: not on every step's path
            parts.check_plain(flat, grads, self.inflight, name, env.optimizer)
        return grads

    def ranks(self, site: Site) -> ProcessGroup | None:
        """The group a distributed step's collectives go over: DDP's, or the ranks the DTensors' meshes span."""
        return self.cache.parts.group if site.kind == SHARDED else site.process_group

    def _collect(self, env: StepEnv, site: Site, grads: Sequence[Tensor | None]) -> Any:
        """This step's work items (the rule's ``Items``), creating missing state."""
        parts = None
        if site.kind == SHARDED:
            parts = self.cache.parts if self.cache.parts.fits(site.params) else provisional_parts
        collecting = CollectEnv(
            env.state,
            env.lr_value,
            env.check_grad,
            env.check_maps,
            env.options.capturable,
            env.optimizer,
            parts,
        )
        return env.rule.collect(env.groups, grads, collecting)

    def _make_program(
        self,
        env: StepEnv,
        site: Site,
        grads: list[Tensor | None],
        pattern: Hashable,
        engine: Any = None,
    ) -> StepProgram:
        """The program for this step's ``grads``. ``engine``: a misfit program's orthogonalizer for
        the same key; reusing it leaves the engine cache untouched, which in a distributed run
        must change alike on every rank, while a misfit is one rank's own."""
        items = self._collect(env, site, grads)
        if site.kind == SHARDED:
            for part in items:
                localize(part, env.optimizer)
        engine_for: Callable[[Sequence[Tensor], Sequence[NSConfig], Sequence[Any]], Any]
        if engine is None:
            engine_for = functools.partial(self._engine, env, site)
        else:
            engine_for = lambda _params, _configs, _wholes: engine  # noqa: E731
        params = site.params
        positions = [k for k, g in enumerate(grads) if g is not None]
        live_grads = [_local(grads[k]) for k in positions]  # type: ignore[arg-type]  # the live ones
        masking = env.options.nonfinite != "ignore"  # "skip", and "raise" deferred on an accelerator
        local = [_local(params[k]) for k in positions] if masking else ()
        update = env.rule.build(items, pattern, engine_for, env.options)
        # read after the build, which may move buffers (see fastmuon.step.bucket_momentum)
        states = (
            [{k: _local(v) for k, v in env.state[params[k]].items()} for k in positions] if masking else ()
        )
        guard = NonFiniteGuard(
            env.options.nonfinite, live_grads, local, states, defer=True, self_masked=update.self_masked()
        )
        return StepProgram(
            update,
            Gather(positions),
            guard,
            [site.owners[k] for k in positions],
            shards=LocalShards([params[k] for k in positions]) if site.kind == SHARDED else None,
        )

    def _agree(self, site: Site, keep: Tensor) -> Tensor:
        """Every rank's verdict on its gradients combined: a NaN may sit in one rank's shard only."""
        return agree_across_ranks(keep, self.ranks(site), self.inflight)

    def _engine(
        self,
        env: StepEnv,
        site: Site,
        params: Sequence[Tensor],
        configs: Sequence[NSConfig],
        wholes: Sequence[Any],
    ) -> Any:
        """The cached engine for these matrices in this order (built on first sight)."""
        policy = env.options.policy
        key = (policy, tuple(map(_engine_key, wholes, configs)))
        return self.cache.engine(key, lambda: self._build(env, site, params, configs, wholes, policy))

    # host-side planning, nothing to trace (torch.compiler.disable's lazy form: no dynamo import)
    @torch._disable_dynamo
    def _build(
        self,
        env: StepEnv,
        site: Site,
        params: Sequence[Tensor],
        configs: Sequence[NSConfig],
        wholes: Sequence[Any],
        policy: str,
    ) -> Any:
        """The engine for these matrices: distributed under DDP or where any is held in parts."""
        if site.process_group is not None or any(map(operator.is_not, wholes, params)):
            build_local = functools.partial(self._build_local, env.options)
            ctx = DistContext(
                site.process_group,
                self.inflight,
                env.options,
                env.optimizer,
                site.namer(env.param_name),
                build_local,
            )
            return build_distributed(ctx, params, configs, wholes, policy, self.cache.parts.group)
        return self._build_local(env.options, params, configs, policy)

    @staticmethod
    def _build_local(options: Any, params: Sequence[Tensor], configs: Sequence[NSConfig], policy: str) -> Any:
        return build_orthogonalizer(
            params,
            configs,
            policy,
            cost_model=options.cost_model,
            max_bucket_bytes=options.max_bucket_bytes,
            compile=options.compile,
            host_reads=not options.capturable,
        )

    def plan(self, env: StepEnv) -> Plan | None:
        """The last step's plan or, before one, the next step's, built without creating state (or None)."""
        if self.cache.last_plan is not None or env.options.foreach is False:
            return self.cache.last_plan
        site = self.site(env)
        if site.kind != SINGLE:
            return None
        mark = mark_state(env.state)
        try:
            matrices = self._collect(env, site, _grads_of(site.params)).matrices
        finally:
            drop_state_after(env.state, mark)
        ordered = [item for part in batch_order(matrices) for item in part]
        if not ordered:
            return None
        params = [i.param for i in ordered]
        plan: Plan = self._build(
            env, site, params, [i.config for i in ordered], params, env.options.policy
        ).plan
        return plan


def classes_each(*values: Sequence[Hashable]) -> list[tuple[int, ...]]:
    """Each value's class in each sequence: the index of its first equal value. Two steps with
    equal classes partition the parameters alike."""
    out: list[tuple[int, ...]] = []
    for vs in values:
        first: dict[Hashable, int] = {}
        out += (tuple(first.setdefault(v, i) for i, v in enumerate(vs)),)  # no call per sequence
    return out


@dataclass
class TwoHalves:
    """A rule's update prepared as two halves, run in turn: the matrices', then the elementwise one."""

    matrices: MatrixProgram
    elementwise: HalfProgram

    def self_masked(self) -> frozenset[int]:
        """The parameters whose update leaves them and their device state as they were where
        ``keep`` rejects their gradient: those every half stepping them masks."""
        matrices, elementwise = self.matrices.self_masked(), self.elementwise.self_masked()
        on_matrices, on_elementwise = self.matrices.positions, self.elementwise.positions
        return frozenset(
            i
            for i in matrices | elementwise
            if (i in matrices or i not in on_matrices) and (i in elementwise or i not in on_elementwise)
        )


class StepProgram:
    """One step, prepared: the update's program and what every step around it needs. ``live``
    picks the parameters with gradients out of the flat list; ``owners`` (``(group, j)``) name them
    in errors; ``shards`` (sharded parameters) are the local tensors the program updates."""

    def __init__(
        self,
        update: TwoHalves,
        live: Gather,
        guard: NonFiniteGuard,
        owners: list[tuple[dict[str, Any], int]],
        shards: LocalShards | None = None,
    ):
        self.update = update
        self.matrices = update.matrices
        self.live_pick = live
        self.guard = guard
        self.owners = owners
        self.shards = shards

    @property
    def plan(self) -> Plan | None:
        """The batching plan the program's Newton–Schulz runs (None: no matrix)."""
        return self.matrices.plan if self.matrices is not None else None

    def live(self, grads: Sequence[Any]) -> list[Tensor]:
        """This step's gradients of the parameters the program updates (local shards if sharded)."""
        picked = self.live_pick(grads)
        if self.shards is not None:
            picked = [g.to_local() if hasattr(g, "to_local") else g for g in picked]
        return picked

    def fits(self, grads: list[Tensor]) -> bool:
        """Whether this step's gradients (and sharded parameters) still have the layouts built for."""
        return self.update.elementwise.fits(grads) and (self.shards is None or self.shards.current())

    def name_of(self, param_name: Callable[[dict[str, Any], int], str]) -> Callable[[int], str]:
        """Names the ``k``-th parameter of the program, through ``param_name(group, j)``."""
        return lambda k: param_name(*self.owners[k])


#: Programs (and executors) kept: a run alternates between a few step shapes, each with matrix-sized buffers.
CACHE_SIZE = 4


class StepCache:
    """Programs by step key, executors by matrix key, the flat parameters, the last plan."""

    def __init__(self, last_plan: Plan | None = None):
        self.programs: dict[Hashable, Any] = {}
        self.engines: OrderedDict[Hashable, Any] = OrderedDict()
        self.last_plan = last_plan
        self._noted: Plan | None = None  # the last plan noted, and what it was noted from
        self._noted_from: tuple[Plan | None, str] = (None, "")
        self._params: tuple[list[Tensor], bool] | None = None
        self.parts = PartsTable()  # where each rank's part of every parameter lies (DTensors)

    def params(self, groups: list[dict[str, Any]]) -> tuple[list[Tensor], bool]:
        """Every group's parameters in order, and whether any is a DTensor (a distributed step)."""
        if self._params is None:
            flat = [p for g in groups for p in g["params"]]
            self._params = (flat, any(map(is_dtensor, flat)))
        return self._params

    def program(self, key: Hashable) -> Any:
        return self.programs.get(key)

    def remember(self, key: Hashable, program: Any) -> None:
        """Keep ``program`` for ``key`` (the oldest goes past :data:`CACHE_SIZE`); a replaced misfit
        keeps its place, so every rank of a distributed run keeps and forgets the same programs."""
        self.programs[key] = program
        if len(self.programs) > CACHE_SIZE:
            del self.programs[next(iter(self.programs))]

    def engine(self, key: Hashable, build: Callable[[], Any]) -> Any:
        """The executor for ``key``, built on first sight; the most recently used is kept longest."""
        engine = self.engines.get(key)
        if engine is None:
            engine = build()
            self.engines[key] = engine
            if len(self.engines) > CACHE_SIZE:
                self.engines.popitem(last=False)
        else:
            self.engines.move_to_end(key)
        self.last_plan = engine.plan
        return engine

    def noted(self, plan: Plan, note: str) -> Plan:
        """``plan`` with ``note`` added: the same object while neither changes."""
        if self._noted is not None and self._noted_from[0] is plan and self._noted_from[1] == note:
            return self._noted
        self._noted_from = (plan, note)
        self._noted = dataclasses.replace(plan, note=f"{plan.note}; {note}" if plan.note else note)
        return self._noted

    def forget_programs(self) -> None:
        """After the groups, their ``params`` or the state changed: programs are rebuilt."""
        self.programs.clear()
        self._params = None

    def clear(self) -> None:
        """Programs and executors both (new parameters or a loaded state)."""
        self.forget_programs()
        self.engines.clear()


def _finite_by_group(grads: Sequence[Tensor]) -> list[tuple[list[int], Tensor]]:
    """``(indices, ok)`` per (device, dtype) of the non-empty gradients: which of them are all finite."""
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, g in enumerate(grads):
        if g.numel() > 0:  # nothing to be non-finite (and the inf-norm of nothing is undefined)
            groups.setdefault((g.device, g.dtype), []).append(i)
    return [
        (indices, _finite([grads[i] for i in indices], device.is_host(where)))
        for (where, _), indices in groups.items()
    ]


def _finite(tensors: list[Tensor], host: bool) -> Tensor:
    """Whether each tensor is all finite, as a bool vector: max-abs below inf (NaN compares False)."""
    return _max_abs(tensors, host) < math.inf


def _max_abs(tensors: list[Tensor], host: bool) -> Tensor:
    """Each tensor's largest |entry|, stacked: abs + max on the host's CPU, where the fused inf-norm
    is slow; the inf-norm in a compiler's trace, which cannot trace ``_foreach_max``."""
    if host and not torch.compiler.is_compiling():
        return torch.stack(torch._foreach_max(torch._foreach_abs(tensors)))
    return torch.stack(torch._foreach_norm(tensors, ord=float("inf")))


def raise_if_nonfinite(
    grads: Sequence[Tensor], name: Callable[[int], str], *, flags_given: bool = False
) -> None:
    """Raise naming the first parameter with a NaN/Inf gradient (``flags_given``: 0-d flags given)."""
    if flags_given:
        groups = [(list(range(len(grads))), torch.stack(list(grads)))] if grads else []
    else:
        # screen first with the cheapest fused reduction: an L2 norm is finite whenever every entry
        # is (it errs only the other way, on overflow); only a failed screen pays for max-abs
        by_device: dict[torch.device, list[Tensor]] = {}
        for g in grads:
            if g.numel() > 0:
                by_device.setdefault(g.device, []).append(g)
        if all(bool((torch.stack(torch._foreach_norm(gs)) < math.inf).all()) for gs in by_device.values()):
            return
        groups = _finite_by_group(grads)
    flags_by_device: dict[torch.device, list[Tensor]] = {}
    for _, ok in groups:
        flags_by_device.setdefault(ok.device, []).append(ok)
    if all(bool(torch.cat(oks).all()) for oks in flags_by_device.values()):
        return
    for indices, ok in groups:
        if bool(ok.all()):
            continue
        bad = [indices[k] for k in (~ok).nonzero().flatten().tolist()]
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        raise FloatingPointError(
            f"{name(bad[0])} has a non-finite gradient (NaN or Inf){more}; the step was not applied. "
            "Find the cause (learning rate, loss scale, data), use torch.amp.GradScaler for fp16 "
            "training, or pass nonfinite='skip' to leave such parameters untouched for the step"
        )


class _FiniteGroup(NamedTuple):
    """Gradients of one (device, dtype): where they sit in the list, and whether on the host's CPU."""

    pick: Gather
    positions: Tensor
    host: bool


class FiniteCheck:
    """Which of a fixed list of gradients are finite, as one bool vector on the device: no host read."""

    def __init__(self, grads: Sequence[Tensor]):
        self.size = len(grads)
        self.device = grads[0].device if grads else torch.device("cpu")
        groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
        for i, g in enumerate(grads):
            if g.numel() > 0:
                groups.setdefault((g.device, g.dtype), []).append(i)
        self._groups = [
            _FiniteGroup(Gather(idx), torch.tensor(idx, device=self.device), device.is_host(where))
            for (where, _), idx in groups.items()
        ]
        by_device: dict[torch.device, list[int]] = {}
        for (where, _), idx in groups.items():
            by_device.setdefault(where, []).extend(idx)
        self._by_device = [Gather(idx) for idx in by_device.values()]

    def __call__(self, grads: Sequence[Tensor]) -> Tensor:
        if len(self._groups) == 1 and len(self._groups[0][0]) == self.size:  # all in one, in order
            pick, _, host = self._groups[0]
            return _finite(pick(grads), host)
        keep = torch.ones(self.size, dtype=torch.bool, device=self.device)
        for pick, positions, host in self._groups:
            ok = _finite(pick(grads), host)
            keep.index_copy_(0, positions, ok.to(self.device))
        return keep

    def screen(self, grads: Sequence[Tensor]) -> bool:
        """Whether every gradient is finite (one host read per device): the cheap test of "raise"."""
        return all(
            bool((torch.stack(torch._foreach_norm(pick(grads))) < math.inf).all()) for pick in self._by_device
        )


class NonFiniteGuard:
    """A step's handling of NaN/Inf gradients over a fixed list (see :mod:`fastmuon.step.nonfinite`;
    ``defer``: the prepared step's, :mod:`fastmuon.step.deferred`): ``params[i]`` owns ``grads[i]``
    and ``states[i]``. :meth:`keep`'s ``agree`` combines every rank's flags, so the ranks decide alike."""

    def __init__(
        self,
        mode: str,
        grads: Sequence[Tensor],
        params: Sequence[Tensor] = (),
        states: Sequence[dict[str, Any]] = (),
        *,
        defer: bool = False,
        self_masked: frozenset[int] = frozenset(),
    ):
        self.mode = mode
        self.check = FiniteCheck(grads)
        self.deferred = (
            mode == "raise" and defer and bool(params) and not all(device.is_host(g.device) for g in grads)
        )
        masking = mode == "skip" or self.deferred
        # what the update leaves as it was by itself is never copied, but for a step count
        rest = [
            i
            for i in range(len(params))
            if i not in self_masked or any(isinstance(t, Tensor) and t.dim() == 0 for t in states[i].values())
        ]
        self.skip = (
            SkipPlan([params[i] for i in rest], [states[i] for i in rest], rest, self_masked)
            if masking and rest
            else None
        )
        # everything, for a step that does not take the self-masking path (see :meth:`snapshot`)
        self.skip_all = (
            SkipPlan(params, states, range(len(params))) if masking and params and self_masked else self.skip
        )
        self.masking = masking and bool(params)
        # a "skip" whose state lies partly on the host (AdamW's step counts) puts that part back
        # when the flags reach the host: reading them now would wait for the device every step
        self.host_later = (
            mode == "skip"
            and self.skip_all is not None
            and self.skip_all.holds_host()
            and not all(device.is_host(g.device) for g in grads)
        )
        self._flags = host_buffer(len(grads)) if self.deferred or self.host_later else None

    def keep(
        self,
        grads: Sequence[Tensor],
        name: Callable[[int], str],
        agree: Callable[[Tensor], Tensor] | None = None,
    ) -> Tensor | None:
        """Call once the state exists and before anything is written: raises, or returns the keep
        vector (one bool per gradient, on the device); None: nothing to put back."""
        if self.mode == "ignore" or not grads:
            return None
        # a traced step decides on the host as the CPU does: nothing of it outlives the trace
        if self.mode == "raise" and (not self.deferred or torch.compiler.is_compiling()):
            if agree is None:
                if not self.check.screen(grads):
                    raise_if_nonfinite(grads, name)
                return None
            keep = agree(self.check(grads))
            raise_if_nonfinite(list(keep.unbind(0)), name, flags_given=True)
            return None
        keep = self.check(grads)
        return agree(keep) if agree is not None else keep

    def snapshot(self, keep: Tensor | None, whole: bool = False) -> list[Tensor] | None:
        """What the update may overwrite and does not keep by itself, saved; with ``whole`` (the matrix
        half runs unmasked: a hook or a trace) everything, and restore and settle get the same."""
        plan = self.skip_all if whole else self.skip
        return plan.snapshot() if keep is not None and plan is not None else None

    def restore(self, saved: list[Tensor] | None, keep: Tensor | None, whole: bool = False) -> None:
        """Put back every tensor of a parameter whose gradient was not finite."""
        plan = self.skip_all if whole else self.skip
        if saved is not None and keep is not None and plan is not None:
            plan.restore(saved, keep)

    def settle(
        self,
        saved: list[Tensor] | None,
        keep: Tensor,
        name: Callable[[int], str],
        step: int,
        whole: bool = False,
    ) -> PendingFlags | None:
        """After a completed update: "skip" puts back everything now (None); a deferred "raise" puts
        back what lives on the device and returns the flags, pending, to finish and raise later."""
        if not self.masking:
            return None
        plan = self.skip_all if whole else self.skip
        if not (self.deferred or self.host_later) or torch.compiler.is_compiling():
            if plan is not None and saved is not None:
                plan.restore(saved, keep)
            return None
        finish: Callable[[Tensor], None] = nothing_to_finish
        if plan is not None and saved is not None:
            plan.restore(saved, keep, on_host=False)
            finish = functools.partial(_restore_on_host, plan, plan.on_host(saved))
        return PendingFlags.start(
            keep,
            self._flags,  # type: ignore[arg-type]
            step,
            name,
            finish,
            raises=self.deferred,
        )


def _restore_on_host(plan: SkipPlan, held: list[Tensor | None], flags: Tensor) -> None:
    plan.restore(held, flags, on_host=True)
