"""What MuSGD and Muon share: validation, parameter names, and the cached batching plan."""

from __future__ import annotations

import contextlib
import copy
import functools
import math
import operator
from collections import OrderedDict
from collections.abc import Hashable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from torch.optim import Optimizer
from torch.optim.optimizer import ParamsT

from . import compute
from .calibrate import calibrated_cost_model
from .checkpoint import adapt_state_dict
from .distributed import LocalShards, is_dtensor
from .distributed import local_shard as _local
from .engine import NSConfig, Orthogonalizer, TensorLayout, matrix_spec
from .inflight import InFlight
from .matrices import MatrixMap, maps_of
from .matrix_update import MatrixItem, batch_order
from .newton_schulz import HOST_READS
from .nonfinite import (
    DEFAULT_NONFINITE,
    FiniteCheck,
    SkipGuard,
    SkipPlan,
    agree_across_ranks,
    check_mode,
    finite_flags,
    raise_if_nonfinite,
)
from .param_names import agree_on_names, restore_names
from .planner import DEFAULT_MAX_BUCKET_BYTES, POLICIES, CostModel, Plan, plan_buckets
from .program import Gather, StepProgram
from .state import drop_state_after, mark_state
from .transforms import lr_scale

_PLAN_CACHE_SIZE = 4

# per-step reads over every gradient, as C-level callables for ``map`` (no Python frame per tensor)
_is_none = functools.partial(operator.is_, None)
_is_sparse = operator.attrgetter("is_sparse")
_grad_of = operator.attrgetter("grad")


def _engine_key(p: Any, config: NSConfig) -> Hashable:
    """What an engine depends on for one matrix: its layout, dtype, device and NS settings
    (a sharded matrix: its description, see distributed.py)."""
    if isinstance(p, Tensor):
        return (p.shape, p.stride(), p.dtype, p.device, config)
    return (p, config)


if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


def state_buffer(state: dict[str, Any], key: str, p: Tensor) -> Tensor:
    """The named momentum buffer of ``p``, created as zeros in ``p``'s memory format."""
    buf = state.get(key)
    if buf is None:
        buf = state[key] = torch.zeros_like(p, memory_format=torch.preserve_format)
    return buf


def check_nonnegative(name: str, value: Any, where: str) -> None:
    if isinstance(value, Tensor):
        value = value.item() if value.numel() == 1 else math.nan
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not value >= 0:
        raise ValueError(f"invalid {name} {value!r} in {where}: it must be a number >= 0")


def ns_config_of(steps: Any, coefficients: Any, eps: Any, dtype: Any, method: Any) -> NSConfig:
    """:meth:`NSConfig.make` of a group's values, made once per distinct values: a step reads
    every group's config, and making one resolves and checks its coefficients."""
    if not (_plain(steps) and _plain(eps) and _plain(coefficients)):  # a tensor may change in place
        return NSConfig.make(steps, coefficients, eps, dtype, method)
    try:
        # the types too: equal values of other types (5 and 5.0) make configs that differ
        return _cached_ns_config(type(steps), steps, coefficients, type(eps), eps, dtype, method)
    except TypeError as e:
        if "unhashable" not in str(e):
            raise
        return NSConfig.make(steps, coefficients, eps, dtype, method)


def _plain(value: Any) -> bool:
    """A string, a Python number, or tuples of them: values that cannot change after hashing."""
    if isinstance(value, tuple):
        return all(map(_plain, value))
    return type(value) in (str, int, float, bool)


@functools.lru_cache(maxsize=64)
def _cached_ns_config(_steps_type, steps, coefficients, _eps_type, eps, dtype, method) -> NSConfig:
    return NSConfig.make(steps, coefficients, eps, dtype, method)


class ArgumentTypeError(TypeError, ValueError):
    """A constructor argument or group value of the wrong type (a ``TypeError`` and, like
    torch's optimizers' checks, a ``ValueError``)."""


def check_foreach(foreach: Any) -> bool | None:
    """``foreach`` as torch's optimizers take it: ``None`` (pick the fast path), True or False."""
    if foreach is not None and not isinstance(foreach, bool):
        raise ArgumentTypeError(f"foreach must be None, True or False, got {foreach!r}")
    return foreach


def check_tensor_lr(lr: Any, where: str) -> None:
    """A tensor ``lr`` holds one value (torch.optim's wording)."""
    if isinstance(lr, Tensor) and lr.numel() != 1:
        raise ValueError(
            f"Tensor lr must be 1-element, got shape {tuple(lr.shape)} in {where} "
            "(pass a float or a one-element tensor)"
        )


def check_fraction(name: str, value: Any, where: str) -> None:
    """Momentum-like coefficients live in [0, 1)."""
    check_nonnegative(name, value, where)
    if not value < 1:
        raise ValueError(f"invalid {name} {value!r} in {where}: it must be in [0, 1)")


class MatrixOptimizer(Optimizer):
    """Base for optimizers that orthogonalise matrix updates through the batched engine.

    Subclasses declare how a group's parameters split into "matrix" and "elementwise" ones and
    implement the step; this class validates groups, names parameters in errors, and builds,
    caches and runs the plan (rebuilt when the set of matrices or their layouts changes).
    """

    def __init__(
        self,
        params: ParamsT,
        defaults: dict[str, Any],
        *,
        policy: str,
        max_bucket_bytes: int,
        cost_model,
        compile: bool,
        process_group: ProcessGroup | None = None,
        nonfinite: str = DEFAULT_NONFINITE,
        capturable: bool = False,
    ):
        # the constructor's own arguments first, before ``params`` is read (as torch's optimizers do)
        check_tensor_lr(defaults["lr"], "the constructor's lr")
        if policy not in POLICIES:
            raise ValueError(f"invalid policy {policy!r}; choose one of {POLICIES}")
        if max_bucket_bytes <= 0:
            raise ValueError(f"max_bucket_bytes must be positive, got {max_bucket_bytes}")
        self.policy = policy
        self.compile = bool(compile)
        self.max_bucket_bytes = int(max_bucket_bytes)
        if not (cost_model is None or cost_model == "calibrate" or isinstance(cost_model, CostModel)):
            raise ValueError(f"cost_model must be None, 'calibrate' or a CostModel, got {cost_model!r}")
        self.cost_model: CostModel | str | None = cost_model
        self.nonfinite = check_mode(nonfinite)
        self.capturable = bool(capturable)
        self._plans: OrderedDict[Hashable, Orthogonalizer] = OrderedDict()
        self._programs: dict[Hashable, StepProgram] = {}
        self._version = 0  # bumped whenever the groups or the state are replaced
        self._flat: tuple[int, list[Tensor]] | None = None
        self.last_plan: Plan | None = None
        self.process_group = process_group  # DDP: ranks share the NS work (see distributed.py)
        self.state_initialised = False
        self._global_of: dict[int, Tensor] = {}
        self._sharded = False  # any FSDP2 DTensor parameter
        self._inflight = InFlight()  # this step's agreement collectives (see inflight.py)
        super().__init__(params, defaults)

    # ----- validation ---------------------------------------------------------------------
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group after checking it whole (filled with the defaults, as it would be stored):
        a refused group leaves the optimizer exactly as it was. The constructor adds its groups
        through here too."""
        param_group, held_names = agree_on_names(param_group, self.param_groups)
        if isinstance(param_group, dict) and "params" in param_group:
            # the group dict is stored (as in torch), but only once it has passed
            param_group["params"] = self._check_candidate(param_group)
        super().add_param_group(param_group)
        self._plans.clear()
        if hasattr(self, "_programs"):
            self.invalidate()
        self._sharded = self._sharded or any(is_dtensor(p) for p in param_group["params"])
        restore_names(self.param_groups, held_names)

    def _check_candidate(self, param_group: dict[str, Any]) -> Any:
        """Validate the group ``param_group`` would become (a copy, filled with the defaults);
        returns its ``params`` as a list (an iterator given there is read once, here)."""
        params = param_group["params"]
        if isinstance(params, set):
            return params  # torch refuses sets (no stable order) with its own message
        params = [params] if isinstance(params, Tensor) else list(params)
        tensors = [p[1] if isinstance(p, tuple) and len(p) == 2 else p for p in params]
        if not all(isinstance(t, Tensor) for t in tensors):
            return params  # torch refuses non-tensors with its own message
        candidate = {**self.defaults, **param_group, "params": tensors}
        names = [p[0] for p in params if isinstance(p, tuple) and len(p) == 2]
        if names and len(names) == len(tensors):
            candidate["param_names"] = names
        self._validate_group(candidate, f"param group {len(self.param_groups)}")
        for j, p in enumerate(tensors):
            self._check_param(candidate, j, p)
        return params

    def _check_param(self, group: dict[str, Any], j: int, p: Tensor) -> None:
        if p.is_complex():
            raise ValueError(
                f"{self._param_name(group, j)} is complex; {type(self).__name__} supports real "
                "parameters only (view it as real with torch.view_as_real and optimise that)"
            )
        if not p.is_floating_point():
            raise ValueError(
                f"{self._param_name(group, j)} has dtype {p.dtype}; {type(self).__name__} optimises "
                "floating-point parameters only (convert it, e.g. with .float(), or leave it out "
                "of the optimizer)"
            )

    def _validate_group(self, group: dict[str, Any], where: str) -> None:
        lr = group["lr"]
        check_tensor_lr(lr, where)
        if not isinstance(group["nesterov"], bool):
            raise ArgumentTypeError(f"nesterov in {where} must be True or False, got {group['nesterov']!r}")
        check_nonnegative("learning rate (lr)", lr, where)
        check_fraction("momentum", group["momentum"], where)
        check_nonnegative("weight_decay", group["weight_decay"], where)
        check_nonnegative("eps", group["eps"], where)
        use_muon = group.get("use_muon")
        if use_muon is not None and not isinstance(use_muon, bool):
            raise ValueError(f"use_muon in {where} must be True, False or absent, got {use_muon!r}")
        try:
            self._ns_config(group)
        except ValueError as e:
            raise ValueError(f"{e} (in {where})") from None

    @staticmethod
    def _is_matrix(group: dict[str, Any], p: Tensor) -> bool:
        """Whether ``p`` in ``group`` is orthogonalised (else updated elementwise)."""
        raise NotImplementedError

    @staticmethod
    def _matrix_maps(group: dict[str, Any]) -> list[MatrixMap]:
        """How each parameter of ``group`` maps to matrices (see :mod:`fastmuon.matrices`)."""
        return maps_of(group.get("matrices"), len(group["params"]))

    def _check_matrix_maps(self, group: dict[str, Any], where: str) -> list[MatrixMap]:
        """The group's matrix maps, once they parse and fit the shapes of the parameters they
        apply to. Checked when a group is added, and again where a step's work is collected
        (a program is built): a map may have been set on the group since."""
        try:
            maps = self._matrix_maps(group)
        except ValueError as e:
            raise ValueError(f"{e} (matrices in {where})") from None
        for j, (p, m) in enumerate(zip(group["params"], maps)):
            if m.is_flatten or not self._is_matrix(group, p):
                continue
            try:
                m.check(p.shape)
            except ValueError as e:
                raise ValueError(f"{self._param_name(group, j)} in {where}: {e}") from None
        return maps

    def _matrix_pieces(
        self, m: MatrixMap, p: Tensor, grad: Tensor, buf: Tensor
    ) -> list[tuple[Tensor, Tensor, Tensor, tuple[int, ...], Any, int]]:
        """The matrices ``p`` is orthogonalised as: ``(param, grad, buffer, shape, split, piece)``
        each, views of the tensors; ``shape`` as the learning-rate factor reads it, ``split`` the
        step's way from a gradient of ``p`` to the pieces' (None: ``p`` is one matrix)."""
        if m.is_flatten:
            return [(p, grad, buf, tuple(p.shape), None, 0)]
        if is_dtensor(p):
            from .distributed import sharded_pieces

            return sharded_pieces(self, m, p, grad, buf)
        split = m.views
        return [
            (*views, shape, split, k)
            for k, (*views, shape) in enumerate(zip(split(p), split(grad), split(buf), m.shapes(p.shape)))
        ]

    def _matrix_items(
        self,
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
        group: int,
        index: int,
        decay: Any = 1.0,
    ) -> list[MatrixItem]:
        """The Muon updates of ``p``, one per matrix its map ``m`` makes of it (see
        :meth:`_matrix_pieces`), over its EMA buffer ``state["momentum_buffer"]`` (made here if
        missing): each scaled by ``base`` times the learning-rate factor of its own shape."""
        buf = state_buffer(state, "momentum_buffer", p)
        items = []
        for view, grad_view, buf_view, shape, split, piece in self._matrix_pieces(m, p, grad, buf):
            factor = lr_scale(adjust, shape)
            items.append(
                MatrixItem(
                    view,
                    grad_view,
                    buf_view,
                    beta,
                    nesterov,
                    base * factor,
                    config,
                    decay=decay,
                    group=group,
                    index=index,
                    factor=factor,
                    split=split,
                    piece=piece,
                )
            )
        return items

    @staticmethod
    def _ns_config(group: dict[str, Any]) -> NSConfig:
        return ns_config_of(
            group["ns_steps"], group["ns_coefficients"], group["eps"], group["ns_dtype"], group["ns_method"]
        )

    def _param_name(self, group: dict[str, Any], j: int) -> str:
        names = group.get("param_names")
        p = group["params"][j]
        if names is not None and j < len(names):
            return f"parameter {names[j]!r} (shape {tuple(p.shape)})"
        # a group not (yet) in the optimizer is the one being added
        index = next((i for i, g in enumerate(self.param_groups) if g is group), len(self.param_groups))
        return f"parameter {j} of param group {index} (shape {tuple(p.shape)})"

    def _check_grad(self, group: dict[str, Any], j: int, grad: Tensor) -> None:
        if grad.is_sparse:
            raise RuntimeError(
                f"{self._param_name(group, j)} has a sparse gradient; {type(self).__name__} needs "
                "dense gradients (use a dense nn.Embedding or a sparse optimizer such as SparseAdam)"
            )

    def _lr_value(self, lr: Any) -> Any:
        """A group's ``lr`` as the step uses it: a tensor on the CPU is read there (free: no
        device waits) unless ``capturable``; a tensor on an accelerator, or any tensor when
        ``capturable``, stays a tensor (reading it would make the host wait for the device)."""
        if isinstance(lr, Tensor) and not self.capturable and compute.is_host(lr.device):
            return lr.item()
        return lr

    # ----- the step ---------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        """One update of every parameter with a gradient.

        The batched path runs a :class:`StepProgram`: built on the first step (and again when
        the set of parameters with gradients, their layouts, the groups or the equality classes
        of their hyperparameters change), it holds every list the step needs, so a step reads
        the gradients and the groups' hyperparameters and runs a fixed sequence of foreach and
        NS calls. In a distributed run the set is the one the ranks agree on at every step
        (a gradient on any rank; zeros stand in where a rank has none). The per-parameter
        reference path (``foreach=False``) collects its items anew.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.foreach is False:
            self._reference_step()
            return loss
        pattern, scalars = self._step_scalars()
        compiling = torch.compiler.is_compiling()  # traced Python runs once: nothing to keep
        distributed = self.process_group is not None or self._sharded
        params = grads = program = stale = None
        if distributed and self.state_initialised:
            # the ranks agree on which parameters step with a collective, hit or miss; with the
            # state made, preparing creates nothing a refusal would have to take back
            params, grads = self._step_grads()
        elif not distributed and not compiling:
            grads = list(map(_grad_of, self._flat_params()))
        if grads is not None and not compiling:
            program = self._programs.get((tuple(map(_is_none, grads)), pattern))
        if program is not None:
            live = program.live(grads)
            if not program.fits(live) or any(map(_is_sparse, live)):
                program, stale = None, program
            else:
                keep = self._check_nonfinite(program, live)
        if program is None:
            with self._refusal_leaves_no_state():
                if params is None:
                    params, grads = self._step_grads()
                key = (tuple(g is None for g in grads), pattern)
                engine = stale.matrices.engine if stale is not None and stale.matrices is not None else None
                program = self._make_program(params, grads, key, engine)
                live = program.live(grads)
                keep = self._check_nonfinite(program, live)
            if not compiling:
                self._remember(key, program)
        saved = program.skip.snapshot() if keep is not None else None
        token = HOST_READS.set(False) if self.capturable else None
        try:
            program.run(live, scalars, keep, self._ns_runner(program))
        finally:
            if token is not None:
                HOST_READS.reset(token)
            if saved is not None:
                program.skip.restore(saved, keep)
        return loss

    @contextlib.contextmanager
    def _refusal_leaves_no_state(self) -> Iterator[None]:
        """A step refused while preparing (a bad or non-finite gradient) leaves the optimizer as
        it was: no zero buffers for parameters it never stepped. No program over them remains
        either: a program is remembered only once its step is accepted (so, in a distributed
        run, every rank remembers the same programs: a refusal on one rank changes none)."""
        mark = mark_state(self.state)
        initialised = self.state_initialised
        try:
            yield
        except BaseException:
            drop_state_after(self.state, mark)
            self.state_initialised = initialised
            self._global_of = {}
            raise

    def _step_grads(self) -> tuple[list[Tensor], list[Tensor | None]]:
        """Every parameter and its gradient this step (zeros where only another rank has one)."""
        zero_grads = self._begin_step()
        params = self._flat_params()
        grads = [p.grad for p in params]
        if zero_grads:
            grads = [zero_grads.get(p) if g is None else g for p, g in zip(params, grads)]
        return params, grads

    def _collect(self, params: list[Tensor], grads: list[Tensor | None]) -> tuple[list, ...]:
        """This step's work items (one list per kind of update), creating missing state."""
        raise NotImplementedError

    def _step_scalars(self) -> tuple[Hashable, Any]:
        """This step's hyperparameters, read once per group: ``(pattern, scalars)``, where the
        pattern (equality classes and structure) decides whether a program still fits."""
        raise NotImplementedError

    def _build_program(self, items: tuple[list, ...], pattern: Any, engine_for: Any) -> Any:
        """The subclass's update prepared for these items: ``run(grads, scalars, keep, ns)``;
        ``engine_for(params, configs)`` gives the matrices' orthogonalizer."""
        raise NotImplementedError

    def _apply_reference(self, *items: list) -> None:
        """The per-parameter reference update of the items ``_collect`` gathered."""
        raise NotImplementedError

    def _flat_params(self) -> list[Tensor]:
        flat = self._flat
        if flat is None or flat[0] != self._version:
            flat = self._flat = (self._version, [p for g in self.param_groups for p in g["params"]])
        return flat[1]

    def invalidate(self) -> None:
        """Forget the prepared step programs (done by ``add_param_group`` and ``load_state_dict``;
        call it after replacing state tensors or a group's ``params`` list by hand)."""
        self._version += 1
        self._programs.clear()

    def _make_program(
        self,
        params: list[Tensor],
        grads: list[Tensor | None],
        key: Hashable,
        engine: Orthogonalizer | None = None,
    ) -> StepProgram:
        """The program for this step's ``params`` and ``grads`` (zeros where only another rank
        has one). ``engine``: the orthogonalizer of a program for the same key that no longer
        fits this step's layouts (its matrices are the same); reusing it leaves the engine cache
        untouched, which in a distributed run must change alike on every rank (building an
        engine takes a collective), while a misfit is one rank's own."""
        items = self._local_items(*self._collect(params, grads))
        engine_for = self._engine if engine is None else lambda _params, _configs: engine
        positions = [k for k, g in enumerate(grads) if g is not None]
        local = [_local(params[k]) for k in positions]
        live_grads = [_local(grads[k]) for k in positions]  # type: ignore[arg-type]
        skip = None
        if self.nonfinite == "skip" and positions:
            owners = range(len(positions))
            states = [{k: _local(v) for k, v in self.state[params[k]].items()} for k in positions]
            skip = SkipPlan(local, states, owners)
        owners_names = [self._owner(params[k]) for k in positions]
        return StepProgram(
            self._build_program(items, key[1], engine_for),
            Gather(positions),
            FiniteCheck(live_grads),
            skip,
            owners_names,
            shards=LocalShards([params[k] for k in positions]) if self._sharded else None,
        )

    def _remember(self, key: Hashable, program: StepProgram) -> None:
        """Keep ``program`` for later steps with ``key`` (the oldest goes past a few). A program
        replacing a misfit one takes its place in the order, so the programs a distributed run
        keeps, and which it forgets, are the same on every rank."""
        self._programs[key] = program
        if len(self._programs) > _PLAN_CACHE_SIZE:
            del self._programs[next(iter(self._programs))]

    def _owner(self, p: Tensor) -> tuple[dict[str, Any], int]:
        for g in self.param_groups:
            for j, q in enumerate(g["params"]):
                if q is p:
                    return g, j
        raise KeyError("parameter not in this optimizer")

    def _ns_runner(self, program: StepProgram):
        matrices = program.matrices
        if matrices is None or not matrices.params:
            return None
        engine = matrices.engine
        self.last_plan = engine.plan
        orthogonalize = self._orthogonalize  # looked up per step: an instance may wrap it
        positions, dtypes = matrices.keep_positions, matrices.dtypes
        return lambda sources, keep: orthogonalize(
            sources,
            matrices.params,
            matrices.configs,
            keep=keep,
            engine=engine,
            keep_positions=positions,
            out_dtypes=dtypes,
        )

    def _reference_step(self) -> None:
        with self._refusal_leaves_no_state():
            params, grads = self._step_grads()
            items = self._local_items(*self._collect(params, grads))
            if self._global_of:
                raise ValueError(
                    f"{type(self).__name__}(foreach=False) is the per-parameter reference path and "
                    "cannot orthogonalise FSDP2-sharded (DTensor) parameters; use foreach=True"
                )
            guard = self._guard_nonfinite(params, grads)
        try:
            self._apply_reference(*items)
        finally:
            if guard is not None:
                guard.restore()

    # ----- distributed steps (DDP process group, FSDP2 DTensors): see distributed.py -------
    def init_state(self) -> None:
        """Create every parameter's state (zeros) now, as its first step would.

        Distributed steps call it on the first step, so state dicts are rank-symmetric; call it
        on a fresh optimizer before loading a ``torch.distributed.checkpoint`` into its state dict.
        """
        params = self._flat_params()
        self._collect(params, list(params))
        self.state_initialised = True

    def _begin_step(self) -> dict[Tensor, Tensor]:
        """In a distributed run, agree with the other ranks on which parameters step; returns
        zero gradients for those that step elsewhere but have none here (else ``{}``)."""
        self._global_of = {}
        if self.process_group is not None or self._sharded:
            from .distributed import begin_step

            self._inflight.settle()  # the last step's (finished long ago)
            return begin_step(self, self._inflight)
        return {}

    def _local_items(self, *item_lists):
        """The step's items with DTensors swapped for their local shards (no-op without DTensors)."""
        if not self._sharded:
            return item_lists
        from .distributed import localize

        for items in item_lists:
            self._global_of.update(localize(self, items))
        return item_lists

    def _global_param(self, p: Tensor) -> Tensor:
        """The DTensor a local shard in this step belongs to (``p`` itself when not sharded)."""
        return self._global_of.get(id(p), p)

    # ----- the batching plan --------------------------------------------------------------
    def _orthogonalize(
        self,
        sources: Sequence[Tensor],
        params: Sequence[Tensor],
        configs: Sequence[NSConfig],
        keep: Tensor | None = None,
        engine: Any = None,
        keep_positions: tuple[int, ...] | None = None,
        out_dtypes: Sequence[torch.dtype] | None = None,
    ) -> list[Tensor]:
        """Orthogonalise ``sources`` (each with its parameter's shape) into the params' dtypes.

        ``keep`` (bools on the device: one per source, or with ``keep_positions`` source ``i``'s
        at ``keep_positions[i]``) zeroes the rejected sources first; ``engine``: the plan's
        executor when the caller holds it (else looked up by the params); ``out_dtypes``: the
        params' dtypes when the caller holds them.
        """
        if engine is None:
            engine = self._engine(params, configs)
        dtypes = [p.dtype for p in params] if out_dtypes is None else out_dtypes
        if keep is None:
            return engine(sources, dtypes)
        if isinstance(engine, Orthogonalizer):
            return engine(sources, dtypes, keep=keep, keep_positions=keep_positions)
        flags = keep.unbind(0)
        if keep_positions is not None:
            flags = [flags[k] for k in keep_positions]
        return engine([torch.where(k, s, 0) for k, s in zip(flags, sources)], dtypes)

    def _engine(self, params: Sequence[Tensor], configs: Sequence[NSConfig]) -> Orthogonalizer:
        """The cached engine for these matrices in this order (built on first sight)."""
        policy = self.policy
        keyed = [self._global_param(p) for p in params] if self._global_of else params
        key = (policy, tuple(map(_engine_key, keyed, configs)))
        engine = self._plans.get(key)
        if engine is None:
            engine = self._build(params, configs, policy)
            self._plans[key] = engine
            if len(self._plans) > _PLAN_CACHE_SIZE:
                self._plans.popitem(last=False)
        else:
            self._plans.move_to_end(key)
        self.last_plan = engine.plan
        return engine

    @torch.compiler.disable  # planning is host-side bookkeeping: nothing for a compiler to trace
    def _build(self, params, configs, policy) -> Orthogonalizer:
        if self.process_group is not None or self._global_of:
            from .distributed import build_distributed

            return build_distributed(self, params, configs, policy)
        return self._build_local(params, configs, policy)

    def _build_local(self, params, configs, policy) -> Orthogonalizer:
        """The engine for matrices this process orthogonalises alone."""
        layouts = [TensorLayout.of(p) for p in params]
        specs = [matrix_spec(p, c, lay) for p, c, lay in zip(params, configs, layouts)]
        cost_model = self.cost_model
        if cost_model == "calibrate" and specs:
            cost_model = calibrated_cost_model(specs[0].device, {s.dtype for s in specs})
        plan = plan_buckets(
            specs,
            policy=policy,
            steps=max((c.steps for c in configs), default=5),
            max_bucket_bytes=self.max_bucket_bytes,
            cost_model=cost_model if isinstance(cost_model, CostModel) else None,
        )
        configs_by_key = {(p.dtype, c): c for p, c in zip(params, configs)}
        # the step applies the results at once, so they may be views into reused buffers
        return Orthogonalizer(plan, layouts, configs_by_key, compile=self.compile, result_views=True)

    # ----- non-finite gradients (see nonfinite.py) -----------------------------------------
    def _check_nonfinite(self, program: StepProgram, grads: list[Tensor]) -> Tensor | None:
        """Call after the state buffers exist and before anything is written: raises ("raise"),
        or returns the keep vector (one bool per parameter with a gradient, on the device) whose
        ``False`` entries the step puts back ("skip"); ``None``: nothing to put back.

        In a distributed run every rank must decide alike (a NaN may sit in one rank's shard
        only), so the flags are combined with one all-reduce (MIN)."""
        if self.nonfinite == "ignore" or not grads:
            return None
        distributed = self.process_group is not None or self._sharded
        name = program.name_of(self)
        if self.nonfinite == "raise" and not distributed:
            if not program.check.screen(grads):
                raise_if_nonfinite(grads, name)
            return None
        keep = program.check(grads)
        if distributed:
            keep = agree_across_ranks(keep, self.process_group, self._inflight)
        if self.nonfinite == "raise":
            raise_if_nonfinite(list(keep.unbind(0)), name, flags_given=True)
            return None
        return keep

    def _guard_nonfinite(self, params: list[Tensor], grads: list[Tensor | None]) -> SkipGuard | None:
        """The reference path's guard over this step's ``params`` and ``grads`` (zeros where only
        another rank has one): raises ("raise"), or returns the guard whose ``restore()`` undoes
        the step where gradients were bad ("skip"). Ranks decide alike, as the batched path does."""
        if self.nonfinite == "ignore":
            return None
        owners = [(g, j) for g in self.param_groups for j in range(len(g["params"]))]  # as params
        live = [k for k, g in enumerate(grads) if g is not None]
        live_params = [params[k] for k in live]
        live_grads = [grads[k] for k in live]

        def name(k: int) -> str:
            return self._param_name(*owners[live[k]])

        distributed = self.process_group is not None or self._sharded
        if self.nonfinite == "raise" and not distributed:
            raise_if_nonfinite(live_grads, name)
            return None
        flags = finite_flags(live_grads)
        if distributed and flags:
            flags = list(agree_across_ranks(flags, self.process_group, self._inflight))
        if self.nonfinite == "raise":
            raise_if_nonfinite(flags, name, flags_given=True)
            return None
        return SkipGuard(live_params, flags, [self.state[p] for p in live_params])

    # ----- state --------------------------------------------------------------------------
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load as torch does, from this optimizer's state dicts and from those of Ultralytics'
        MuSGD, ``torch.optim`` SGD/Muon/AdamW and older fastmuon versions (translated by
        :func:`fastmuon.checkpoint.adapt_state_dict`: missing group keys from this optimizer's
        groups, buffers carried where the maths agrees, cast to each parameter's dtype).

        A state dict that cannot be used (another model's layout, a non-numeric hyperparameter,
        a malformed buffer) raises ``ValueError`` naming the group or parameter, and the optimizer
        is left as it was. Hooks run where torch runs them: pre-hooks first (on the state dict as
        given), post-hooks last, after this optimizer's own clean-up.
        """
        if not isinstance(state_dict, dict):
            raise TypeError(
                f"load_state_dict takes an optimizer's state_dict() (a dict), got {type(state_dict).__name__}"
            )
        state_dict = state_dict.copy()  # shallow, as torch's loader (a pre-hook may replace entries)
        for pre_hook in list(self._optimizer_load_state_dict_pre_hooks.values()):
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result
        adapted = adapt_state_dict(self, state_dict)
        pre_hooks, post_hooks = (
            self._optimizer_load_state_dict_pre_hooks,
            self._optimizer_load_state_dict_post_hooks,
        )
        self._optimizer_load_state_dict_pre_hooks = OrderedDict()  # ran above
        self._optimizer_load_state_dict_post_hooks = OrderedDict()  # run below, after the clean-up
        try:
            super().load_state_dict(adapted)
        finally:
            self._optimizer_load_state_dict_pre_hooks = pre_hooks
            self._optimizer_load_state_dict_post_hooks = post_hooks
        self._after_load()
        for post_hook in list(post_hooks.values()):
            post_hook(self)

    def _after_load(self) -> None:
        """AdamW's ``step`` as float32 on the host (read there every step) or, ``capturable``, on
        its parameter's device (never read); the plans and step programs rebuilt."""
        for p, state in self.state.items():
            step = state.get("step") if isinstance(state, dict) else None
            device = _local(p).device if self.capturable else torch.device("cpu")
            if isinstance(step, Tensor) and (step.dtype != torch.float32 or step.device != device):
                state["step"] = step.to(device, torch.float32)
        self._plans.clear()
        self.invalidate()

    def plan(self) -> Plan:
        """The batching plan of the last step.

        Before the first step: the plan the next step would use for the parameters that have
        gradients now, built without stepping (no state is created). An empty plan, saying
        why, where nothing is batched: with ``foreach=False`` (the per-parameter loop) and in a
        distributed run before its first step (building a plan there takes every rank).
        """
        if self.last_plan is not None:
            return self.last_plan
        if getattr(self, "foreach", None) is False:
            return self._empty_plan("foreach=False runs the per-parameter loop, nothing is batched")
        if self.process_group is not None or self._sharded:
            return self._empty_plan("no step taken yet (a distributed plan is built by the first step)")
        mark = mark_state(self.state)
        try:
            params = self._flat_params()
            matrices = self._collect(params, [p.grad for p in params])[0]
        finally:
            drop_state_after(self.state, mark)
        ordered = [item for part in batch_order(matrices) for item in part]
        if not ordered:
            return self._empty_plan("no step taken yet, and no matrix has a gradient")
        return self._build([i.param for i in ordered], [i.config for i in ordered], self.policy).plan

    def _empty_plan(self, note: str) -> Plan:
        steps = max((g["ns_steps"] for g in self.param_groups), default=self.defaults["ns_steps"])
        return Plan((), 0, self.policy, steps, self.max_bucket_bytes, note)

    # ----- copies: copy.deepcopy and pickle ---------------------------------------------------
    #: What a copy keeps besides torch's ``defaults``, ``state`` and ``param_groups``: the
    #: optimizer-wide settings and what the state depends on. Caches (plans, bucket buffers) are
    #: rebuilt by the copy's first step; hooks are not copied (as in ``torch.optim``).
    _COPIED = (
        "foreach",
        "policy",
        "compile",
        "max_bucket_bytes",
        "cost_model",
        "nonfinite",
        "capturable",
        "last_plan",
        "state_initialised",
        "_sharded",
    )

    def _copied_state(self) -> dict[str, Any]:
        state = super().__getstate__()
        state.update({name: getattr(self, name) for name in self._COPIED if hasattr(self, name)})
        state["process_group"] = self.process_group
        return state

    def __getstate__(self) -> dict[str, Any]:
        """What ``pickle`` saves. A process group lives in the process that made it and cannot
        be pickled, so an optimizer with one is refused (``copy.deepcopy`` shares the group)."""
        if self.process_group is not None:
            raise TypeError(
                f"cannot pickle a {type(self).__name__} with a process_group (a process group "
                "belongs to the process that created it); save optimizer.state_dict() instead and "
                "load it into an optimizer built with the new process's group, or use copy.deepcopy, "
                "which shares the group"
            )
        return self._copied_state()

    def __deepcopy__(self, memo: dict[int, Any]) -> MatrixOptimizer:
        """A copy with its own parameters' state and the same settings, which steps as the
        original would; the process group is shared (it is a handle on this process's
        communicator, not data)."""
        clone = type(self).__new__(type(self))
        memo[id(self)] = clone
        if self.process_group is not None:
            memo[id(self.process_group)] = self.process_group
        clone.__setstate__(copy.deepcopy(self._copied_state(), memo))
        return clone

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self.__dict__.setdefault("foreach", True)
        self.__dict__.setdefault("policy", "auto")
        self.__dict__.setdefault("compile", False)
        self.__dict__.setdefault("max_bucket_bytes", DEFAULT_MAX_BUCKET_BYTES)
        self.__dict__.setdefault("cost_model", None)
        self.__dict__.setdefault("_plans", OrderedDict())
        self.__dict__.setdefault("last_plan", None)
        self.__dict__.setdefault("process_group", None)
        self.__dict__.setdefault("state_initialised", False)
        self.__dict__.setdefault("_global_of", {})
        self.__dict__.setdefault("_sharded", False)
        self.__dict__.setdefault("nonfinite", DEFAULT_NONFINITE)
        self.__dict__["_programs"] = {}
        self.__dict__["_flat"] = None
        self.__dict__.setdefault("_version", 0)
        self.__dict__.setdefault("capturable", False)
        self.__dict__["_inflight"] = InFlight()  # a copy holds no other optimizer's collectives

    def __repr__(self) -> str:
        """torch's layout (class, then each group's hyperparameters), with the per-parameter lists
        summarised as counts: a model's hundreds of parameter names would bury the settings."""
        lines = [f"{type(self).__name__} ("]
        for i, group in enumerate(self.param_groups):
            lines.append(f"Parameter Group {i}")
            lines.append(f"    params: {len(group['params'])} tensors")
            for key in sorted(group):
                if key == "params":
                    continue
                value = group[key]
                if key == "param_names" and isinstance(value, (list, tuple)):
                    value = f"{len(value)} names"
                lines.append(f"    {key}: {value}")
        lines.append(")")
        return "\n".join(lines)
