"""Running a step: find or prepare its program, check its gradients, run it; or run the rule's
per-parameter reference. Everything the driver needs of the optimizer comes in a :class:`StepEnv`.

A program is prepared on the first step and again when the set of parameters with gradients,
their layouts, the groups or the equality classes of their hyperparameters change; a later step
reads the gradients and the groups' hyperparameters and runs a fixed sequence of foreach and NS
calls. In a distributed run the set is the one the ranks agree on at every step (a gradient on
any rank; zeros stand in where a rank has none).
"""

from __future__ import annotations

import contextlib
import functools
import operator
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator, MutableMapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch import Tensor

from ..distributed.context import DistContext, agree_across_ranks, begin_step, build_distributed, flat_namer
from ..distributed.dtensor import LocalShards, is_dtensor, localize
from ..distributed.dtensor import local_shard as _local
from ..distributed.inflight import InFlight
from ..distributed.parts import provisional_parts
from ..ns.build import build_orthogonalizer
from ..ns.engine import NSConfig
from ..ns.gather import Gather
from ..ns.matrices import MatrixMap
from ..ns.planner import Plan
from .cache import StepCache
from .collecting import CollectEnv
from .contracts import Rule, StepOptions
from .deferred import PendingFlags
from .matrix import batch_order
from .nonfinite import NonFiniteGuard
from .program import Scalar, StepProgram
from .state_marks import drop_state_after, mark_state

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

# per-step reads over every gradient, as C-level callables for ``map`` (no Python frame per tensor)
_is_none = functools.partial(operator.is_, None)
_is_sparse = operator.attrgetter("is_sparse")
_grad_of = operator.attrgetter("grad")


class StepEnv(NamedTuple):
    """What the driver reads of the optimizer for one call (never the optimizer itself)."""

    groups: list[dict[str, Any]]
    state: MutableMapping[Tensor, dict[str, Any]]  # per-parameter state (a defaultdict: made on first use)
    rule: Rule  # a module of fastmuon.rules
    options: StepOptions  # the optimizer's Options
    process_group: ProcessGroup | None  # DDP's, or None
    optimizer: str  # its class name, for errors
    param_name: Callable[[dict[str, Any], int], str]
    lr_value: Callable[[Any], Scalar]
    check_grad: Callable[[dict[str, Any], int, Tensor], None]
    check_maps: Callable[[dict[str, Any], int], list[MatrixMap]]  # (group, index) -> its checked maps


def _engine_key(whole: Any, config: NSConfig) -> Hashable:
    """What an engine depends on for one matrix: its layout, dtype, device and NS settings
    (a sharded matrix: its description, see fastmuon.distributed)."""
    if isinstance(whole, Tensor):
        return (whole.shape, whole.stride(), whole.dtype, whole.device, config)
    return (whole, config)


class StepDriver:
    """One optimizer's steps: its cache of programs and executors, the keeper of its in-flight
    collectives, the hooks around its NS, and whether every parameter's state exists yet."""

    def __init__(self, last_plan: Plan | None = None, initialised: bool = False):
        self.cache = StepCache(last_plan)
        self.inflight = InFlight()  # this step's agreement collectives (see inflight.py)
        self.hooks: OrderedDict[int, Callable] = OrderedDict()
        self.initialised = initialised  # distributed steps make every parameter's state first
        self.steps = 0  # steps this driver has run (accepted ones: a refused step counts none)
        self.pending: PendingFlags | None = None  # the last step's deferred "raise" verdict

    def raise_pending(self, wait: bool = True) -> None:
        """Read the last step's deferred non-finite verdict, if any (see
        :mod:`fastmuon.step.deferred`), and raise if a gradient was not finite. The verdict is
        read once: after the error the next call goes on. Without ``wait`` it is read only if
        it has reached the host already (never waiting for the device)."""
        pending = self.pending
        if pending is None or (not wait and not pending.finished()):
            return
        self.pending = None
        pending.check()

    def complete_pending(self) -> None:
        """Finish the last step's restore of parameters with a non-finite gradient without
        raising (the verdict stays for the next call): what a copy of the optimizer holds."""
        if self.pending is not None:
            self.pending.complete()

    def discard_pending(self) -> None:
        """Drop an unread verdict (loading a state dict replaces the state it speaks of)."""
        self.pending = None

    def step(self, env: StepEnv) -> None:
        """One batched update of every parameter with a gradient."""
        cache = self.cache
        pattern, scalars = env.rule.scalars(env.groups, env.lr_value)
        compiling = torch.compiler.is_compiling()  # traced Python runs once: nothing to keep
        flat, sharded = cache.params(env.groups)
        distributed = env.process_group is not None or sharded
        agree = functools.partial(self._agree, env, sharded) if distributed else None
        params = grads = program = stale = None
        if distributed and self.initialised:
            # the ranks agree on which parameters step with a collective, hit or miss; with the
            # state made, preparing creates nothing a refusal would have to take back
            params, grads = self._step_grads(env, flat, sharded)
        elif not distributed and not compiling:
            grads = list(map(_grad_of, flat))
        if grads is not None and not compiling:
            program = cache.program((tuple(map(_is_none, grads)), pattern))
        if program is not None:
            live = program.live(grads)
            if not program.fits(live) or any(map(_is_sparse, live)):
                program, stale = None, program
            else:
                keep = program.guard.keep(live, program.name_of(env.param_name), agree)
        if program is None:
            with self._refusal_leaves_no_state(env):
                if params is None:
                    params, grads = self._step_grads(env, flat, sharded)
                key = (tuple(g is None for g in grads), pattern)
                engine = stale.matrices.engine if stale is not None and stale.matrices is not None else None
                program = self._make_program(env, params, grads, pattern, sharded, engine)
                live = program.live(grads)
                keep = program.guard.keep(live, program.name_of(env.param_name), agree)
            if not compiling:
                cache.remember(key, program)
        if program.matrices is not None and program.matrices.params:
            cache.last_plan = program.plan
        saved = program.guard.snapshot(keep) if keep is not None else None
        try:
            program.run(live, scalars, keep, self.hooks)
        except BaseException:
            if saved is not None:
                program.guard.restore(saved, keep)
            raise
        self.steps += 1
        if saved is not None:
            self.pending = program.guard.settle(saved, keep, program.name_of(env.param_name), self.steps)

    def reference_step(self, env: StepEnv) -> None:
        """The same update through the rule's per-parameter reference (``foreach=False``)."""
        guard = keep = saved = None
        with self._refusal_leaves_no_state(env):
            flat, sharded = self.cache.params(env.groups)
            params, grads = self._step_grads(env, flat, sharded)
            items = self._collect(env, grads)
            if sharded and any(
                is_dtensor(i.param) or getattr(i, "whole", None) is not None for part in items for i in part
            ):
                raise ValueError(
                    f"{env.optimizer}(foreach=False) is the per-parameter reference path and "
                    "cannot orthogonalise FSDP2-sharded (DTensor) parameters; use foreach=True"
                )
            mode = env.options.nonfinite
            if mode != "ignore":
                live = [k for k, g in enumerate(grads) if g is not None]
                owners = [(g, j) for g in env.groups for j in range(len(g["params"]))]
                live_params, live_grads = [params[k] for k in live], [grads[k] for k in live]
                states = [env.state[p] for p in live_params] if mode == "skip" else ()
                guard = NonFiniteGuard(mode, live_grads, live_params, states)
                distributed = env.process_group is not None or sharded
                agree = functools.partial(self._agree, env, sharded) if distributed else None
                keep = guard.keep(live_grads, lambda k: env.param_name(*owners[live[k]]), agree)
                saved = guard.snapshot(keep) if keep is not None else None
        try:
            env.rule.reference(items)
        finally:
            if saved is not None:
                guard.restore(saved, keep)  # type: ignore[union-attr]
        self.steps += 1

    def init_state(self, env: StepEnv) -> None:
        """Every parameter's state (zeros), as its first step would make it."""
        flat, _ = self.cache.params(env.groups)
        self._collect(env, list(flat))
        self.initialised = True

    @contextlib.contextmanager
    def _refusal_leaves_no_state(self, env: StepEnv) -> Iterator[None]:
        """A step refused while preparing (a bad or non-finite gradient) leaves the optimizer as
        it was: no zero buffers for parameters it never stepped. No program over them remains
        either: a program is remembered only once its step is accepted (so, in a distributed
        run, every rank remembers the same programs: a refusal on one rank changes none)."""
        mark = mark_state(env.state)
        initialised = self.initialised
        try:
            yield
        except BaseException:
            drop_state_after(env.state, mark)
            self.initialised = initialised
            raise

    def _step_grads(
        self, env: StepEnv, flat: list[Tensor], sharded: bool
    ) -> tuple[list[Tensor], list[Tensor | None]]:
        """Every parameter and its gradient this step (zeros where only another rank has one)."""
        zero_grads = {}
        parts = self.cache.parts
        if env.process_group is not None or sharded:
            self.inflight.settle()  # the last step's (finished long ago)
            ctx = self._dist_context(env)
            if sharded and not parts.fits(flat):  # every rank's part of every parameter, once
                parts.build(flat, self.inflight, flat_namer(ctx), env.optimizer)
            if not self.initialised:
                self.init_state(env)  # every rank holds every parameter's state (rank-symmetric)
            zero_grads = begin_step(ctx, flat, parts.group if sharded else env.process_group)
        grads = [p.grad for p in flat]
        if zero_grads:
            grads = [zero_grads.get(p) if g is None else g for p, g in zip(flat, grads)]
        if sharded and not parts.checked:  # once per table: not on every step's path
            parts.check_plain(flat, grads, self.inflight, flat_namer(ctx), env.optimizer)
        return flat, grads

    def _collect(self, env: StepEnv, grads: Sequence[Tensor | None]) -> Any:
        """This step's work items (the rule's ``Items``), creating missing state."""
        parts = None
        flat, sharded = self.cache.params(env.groups)
        if sharded:
            parts = self.cache.parts if self.cache.parts.fits(flat) else provisional_parts
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
        params: list[Tensor],
        grads: list[Tensor | None],
        pattern: Any,
        sharded: bool,
        engine: Any = None,
    ) -> StepProgram:
        """The program for this step's ``params`` and ``grads`` (zeros where only another rank
        has one). ``engine``: the orthogonalizer of a program for the same key that no longer
        fits this step's layouts (its matrices are the same); reusing it leaves the engine cache
        untouched, which in a distributed run must change alike on every rank (building an
        engine takes a collective), while a misfit is one rank's own."""
        items = self._collect(env, grads)
        if sharded:
            for part in items:
                localize(part, env.optimizer)
        if engine is None:
            engine_for = functools.partial(self._engine, env)
        else:
            engine_for = lambda _params, _configs, _wholes: engine  # noqa: E731
        positions = [k for k, g in enumerate(grads) if g is not None]
        owners = [(g, j) for g in env.groups for j in range(len(g["params"]))]
        live_grads = [_local(grads[k]) for k in positions]  # type: ignore[arg-type]
        masking = env.options.nonfinite != "ignore"  # "skip", and "raise" deferred on an accelerator
        local = [_local(params[k]) for k in positions] if masking else ()
        states = (
            [{k: _local(v) for k, v in env.state[params[k]].items()} for k in positions] if masking else ()
        )
        return StepProgram(
            env.rule.build(items, pattern, engine_for, env.options),
            Gather(positions),
            NonFiniteGuard(env.options.nonfinite, live_grads, local, states, defer=True),
            [owners[k] for k in positions],
            shards=LocalShards([params[k] for k in positions]) if sharded else None,
        )

    def _agree(self, env: StepEnv, sharded: bool, keep: Tensor) -> Tensor:
        """Every rank's verdict on its gradients combined: a NaN may sit in one rank's shard only."""
        group = self.cache.parts.group if sharded else env.process_group
        return agree_across_ranks(keep, group, self.inflight)

    # ----- the executors ------------------------------------------------------------------
    def _engine(
        self, env: StepEnv, params: Sequence[Tensor], configs: Sequence[NSConfig], wholes: Sequence[Any]
    ):
        """The cached engine for these matrices in this order (built on first sight)."""
        policy = env.options.policy
        key = (policy, tuple(map(_engine_key, wholes, configs)))
        return self.cache.engine(key, lambda: self._build(env, params, configs, wholes, policy))

    @torch.compiler.disable  # planning is host-side bookkeeping: nothing for a compiler to trace
    def _build(self, env: StepEnv, params, configs, wholes, policy) -> Any:
        if env.process_group is not None or any(w is not p for w, p in zip(wholes, params)):
            return build_distributed(
                self._dist_context(env), params, configs, wholes, policy, self.cache.parts.group
            )
        return self._build_local(env.options, params, configs, policy)

    @staticmethod
    def _build_local(options: Any, params, configs, policy) -> Any:
        return build_orthogonalizer(
            params,
            configs,
            policy,
            cost_model=options.cost_model,
            max_bucket_bytes=options.max_bucket_bytes,
            compile=options.compile,
            host_reads=not options.capturable,
        )

    def _dist_context(self, env: StepEnv) -> DistContext:
        return DistContext(
            env.process_group,
            self.inflight,
            env.options,
            env.optimizer,
            env.groups,
            env.param_name,
            functools.partial(self._build_local, env.options),
        )

    def plan(self, env: StepEnv) -> Plan | None:
        """The plan of the last step or, before one, the plan the next step would use for the
        parameters that have gradients now, built without stepping (no state is created).
        None where nothing is batched yet (see ``MatrixOptimizer.plan``)."""
        if self.cache.last_plan is not None or env.options.foreach is False:
            return self.cache.last_plan
        flat, sharded = self.cache.params(env.groups)
        if env.process_group is not None or sharded:
            return None
        mark = mark_state(env.state)
        try:
            matrices = self._collect(env, [p.grad for p in flat]).matrices
        finally:
            drop_state_after(env.state, mark)
        ordered = [item for part in batch_order(matrices) for item in part]
        if not ordered:
            return None
        params = [i.param for i in ordered]
        return self._build(env, params, [i.config for i in ordered], params, env.options.policy).plan
