"""What MuSGD and Muon share: validation, parameter names, and the cached batching plan."""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from .calibrate import calibrated_cost_model
from .distributed import is_dtensor
from .engine import NSConfig, Orthogonalizer, TensorLayout, matrix_spec
from .inflight import InFlight
from .nonfinite import (
    DEFAULT_NONFINITE,
    SkipGuard,
    agree_across_ranks,
    check_mode,
    finite_flags,
    raise_if_nonfinite,
)
from .planner import POLICIES, CostModel, Plan, plan_buckets
from .state import check_state_layout

_PLAN_CACHE_SIZE = 4


def _local(t: Tensor) -> Tensor:
    """A DTensor's local shard (a view: writing to it writes the DTensor), else ``t``."""
    return t.to_local() if is_dtensor(t) else t


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
        params,
        defaults: dict[str, Any],
        *,
        policy: str,
        max_bucket_bytes: int,
        cost_model,
        compile: bool,
        process_group=None,
        nonfinite: str = DEFAULT_NONFINITE,
    ):
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
        self._keep: dict[int, Tensor] | None = None  # id(param) -> finite flag, during a "skip" step
        self._plans: OrderedDict[Hashable, Orthogonalizer] = OrderedDict()
        self._prepared: tuple[Sequence[Tensor], Orthogonalizer] | None = None  # see ns_inputs
        self.last_plan: Plan | None = None
        self.process_group = process_group  # DDP: ranks share the NS work (see distributed.py)
        self.state_initialised = False
        self._zero_grads: dict[Tensor, Tensor] = {}
        self._global_of: dict[int, Tensor] = {}
        self._sharded = False  # any FSDP2 DTensor parameter
        self._inflight = InFlight()  # this step's agreement collectives (see inflight.py)
        super().__init__(params, defaults)

    # ----- validation ---------------------------------------------------------------------
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        index = len(self.param_groups) - 1
        group = self.param_groups[index]
        where = f"param group {index}"
        self.validate_group(group, where)
        for j, p in enumerate(group["params"]):
            if p.is_complex():
                raise ValueError(
                    f"{self.param_name(group, j)} is complex; {type(self).__name__} supports real "
                    "parameters only (view it as real with torch.view_as_real and optimise that)"
                )
        self._plans.clear()
        self._sharded = self._sharded or any(is_dtensor(p) for p in group["params"])

    def validate_group(self, group: dict[str, Any], where: str) -> None:
        check_nonnegative("learning rate (lr)", group["lr"], where)
        check_fraction("momentum", group["momentum"], where)
        check_nonnegative("weight_decay", group["weight_decay"], where)
        check_nonnegative("eps", group["eps"], where)
        use_muon = group.get("use_muon")
        if use_muon is not None and not isinstance(use_muon, bool):
            raise ValueError(f"use_muon in {where} must be True, False or absent, got {use_muon!r}")
        try:
            self.ns_config(group)
        except ValueError as e:
            raise ValueError(f"{e} (in {where})") from None

    @staticmethod
    def ns_config(group: dict[str, Any]) -> NSConfig:
        return NSConfig.make(
            group["ns_steps"], group["ns_coefficients"], group["eps"], group["ns_dtype"], group["ns_method"]
        )

    def param_name(self, group: dict[str, Any], j: int) -> str:
        names = group.get("param_names")
        p = group["params"][j]
        if names is not None and j < len(names):
            return f"parameter {names[j]!r} (shape {tuple(p.shape)})"
        index = next(i for i, g in enumerate(self.param_groups) if g is group)
        return f"parameter {j} of param group {index} (shape {tuple(p.shape)})"

    def check_grad(self, group: dict[str, Any], j: int, grad: Tensor) -> None:
        if grad.is_sparse:
            raise RuntimeError(
                f"{self.param_name(group, j)} has a sparse gradient; {type(self).__name__} needs "
                "dense gradients (use a dense nn.Embedding or a sparse optimizer such as SparseAdam)"
            )

    @staticmethod
    def float_lr(group: dict[str, Any]) -> float:
        lr = group["lr"]
        return float(lr.item()) if isinstance(lr, Tensor) else float(lr)

    # ----- the step ---------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        """One update of every parameter with a gradient: gather the lists (``_collect``), then
        run the subclass's update (``_apply``) between the non-finite guard's check and restore."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.begin_step()
        items = self.local_items(*self._collect())
        guard = self.guard_nonfinite()
        try:
            self._apply(*items)
        finally:
            self.end_nonfinite(guard)
        return loss

    def _collect(self) -> tuple[list, ...]:
        """This step's work items (one list per kind of update)."""
        raise NotImplementedError

    def _apply(self, *items: list) -> None:
        """Update the parameters from the items ``_collect`` gathered."""
        raise NotImplementedError

    # ----- distributed steps (DDP process group, FSDP2 DTensors): see distributed.py -------
    def grad_of(self, p: Tensor) -> Tensor | None:
        """``p.grad``, or zeros when another rank has a gradient for ``p`` and this one has none."""
        return p.grad if p.grad is not None else self._zero_grads.get(p)

    def init_state(self) -> None:
        """Create every parameter's state (zeros) now, as its first step would.

        Distributed steps call it on the first step, so state dicts are rank-symmetric; call it
        on a fresh optimizer before loading a ``torch.distributed.checkpoint`` into its state dict.
        """
        saved, self._zero_grads = self._zero_grads, {p: p for g in self.param_groups for p in g["params"]}
        try:
            self._collect()
        finally:
            self._zero_grads = saved
        self.state_initialised = True

    def begin_step(self) -> None:
        """In a distributed run, agree with the other ranks on which parameters step."""
        self._global_of = {}
        if self.process_group is not None or self._sharded:
            from .distributed import begin_step

            self._inflight.settle()  # the last step's (finished long ago)
            self._zero_grads = begin_step(self, self._inflight)

    def local_items(self, *item_lists):
        """The step's items with DTensors swapped for their local shards (no-op without DTensors)."""
        self._zero_grads = {}
        if not self._sharded:
            return item_lists
        from .distributed import localize

        for items in item_lists:
            self._global_of.update(localize(self, items))
        if self._global_of and not getattr(self, "foreach", True):
            raise ValueError(
                f"{type(self).__name__}(foreach=False) is the per-parameter reference path and cannot "
                "orthogonalise FSDP2-sharded (DTensor) parameters; use foreach=True"
            )
        return item_lists

    def global_param(self, p: Tensor) -> Tensor:
        """The DTensor a local shard in this step belongs to (``p`` itself when not sharded)."""
        return self._global_of.get(id(p), p)

    # ----- the batching plan --------------------------------------------------------------
    def ns_inputs(self, params: Sequence[Tensor], configs: Sequence[NSConfig]) -> list[Tensor] | None:
        """Where this step's NS will read each matrix's source from, for the momentum step to write
        there directly (see :meth:`Orthogonalizer.input_views`); ``None``: hand the sources over
        to :meth:`orthogonalize` as tensors. The engine found here serves that call too."""
        engine = self._engine(params, configs)
        self._prepared = (params, engine)
        if not isinstance(engine, Orthogonalizer):
            return None  # distributed engines exchange the sources themselves
        return engine.input_views([p.dtype for p in params])

    def orthogonalize(
        self,
        sources: Sequence[Tensor],
        params: Sequence[Tensor],
        configs: Sequence[NSConfig],
    ) -> list[Tensor]:
        """Orthogonalise ``sources`` (each with its parameter's shape) into the params' dtypes."""
        prepared, self._prepared = self._prepared, None
        engine = (
            prepared[1] if prepared is not None and prepared[0] is params else self._engine(params, configs)
        )
        dtypes = [p.dtype for p in params]
        if self._keep is None:
            return engine(sources, dtypes)
        keep = [self._keep[id(self.global_param(p))] for p in params]
        if isinstance(engine, Orthogonalizer):
            return engine(sources, dtypes, keep=keep)
        return engine([torch.where(k, s, 0) for k, s in zip(keep, sources)], dtypes)  # distributed

    def _engine(self, params: Sequence[Tensor], configs: Sequence[NSConfig]) -> Orthogonalizer:
        """The cached engine for these matrices in this order (built on first sight)."""
        policy = self.policy
        keyed = [self.global_param(p) for p in params] if self._global_of else params
        key = (
            policy,
            tuple((id(p), p.shape, p.stride(), p.dtype, p.device, c) for p, c in zip(keyed, configs)),
        )
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

    def _build(self, params, configs, policy) -> Orthogonalizer:
        if self.process_group is not None or self._global_of:
            from .distributed import build_distributed

            return build_distributed(self, params, configs, policy)
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
    def guard_nonfinite(self) -> SkipGuard | None:
        """Call after the state buffers exist and before anything is written: raises ("raise"),
        or returns the guard whose ``restore()`` undoes the step where gradients were bad ("skip").

        In a distributed run every rank must decide alike (a NaN may sit in one rank's shard
        only), so the flags of all parameters are combined with one all-reduce (MIN)."""
        if self.nonfinite == "ignore":
            return None
        distributed = self.process_group is not None or self._sharded
        owners = [
            (g, j)
            for g in self.param_groups
            for j, p in enumerate(g["params"])
            if distributed or p.grad is not None
        ]
        params = [g["params"][j] for g, j in owners]
        grads = [_local(p.grad) if p.grad is not None else _local(p).new_empty(0) for p in params]
        if self.nonfinite == "raise" and not distributed:
            raise_if_nonfinite(grads, lambda k: self.param_name(*owners[k]))
            return None
        flags = finite_flags(grads)
        if distributed and flags:
            flags = list(agree_across_ranks(flags, self.process_group, self._inflight))
        if self.nonfinite == "raise":
            raise_if_nonfinite(flags, lambda k: self.param_name(*owners[k]), flags_given=True)
            return None
        self._keep = {id(p): f for p, f in zip(params, flags)}
        live = [k for k, p in enumerate(params) if p.grad is not None]
        return SkipGuard(
            [_local(params[k]) for k in live],
            [flags[k] for k in live],
            [{key: _local(v) for key, v in self.state[params[k]].items()} for k in live],
        )

    def end_nonfinite(self, guard: SkipGuard | None) -> None:
        self._keep = None
        if guard is not None:
            guard.restore()

    # ----- state --------------------------------------------------------------------------
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load as torch does (casting buffers to each parameter's dtype and device), after
        checking that every saved buffer fits its parameter: a state dict from another model
        layout fails clearly instead of pairing buffers with the wrong parameters."""
        check_state_layout(self, state_dict)
        super().load_state_dict(state_dict)
        for state in self.state.values():
            step = state.get("step")
            if isinstance(step, Tensor) and (step.dtype != torch.float32 or step.device.type != "cpu"):
                state["step"] = step.to("cpu", torch.float32)  # read on the host every step
        self._plans.clear()

    def plan(self) -> Plan | None:
        """The plan the last step used (``None`` before the first step)."""
        return self.last_plan

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self.__dict__.setdefault("_plans", OrderedDict())
        self.__dict__.setdefault("last_plan", None)
        self.__dict__.setdefault("process_group", None)
        self.__dict__.setdefault("state_initialised", False)
        self.__dict__.setdefault("_zero_grads", {})
        self.__dict__.setdefault("_global_of", {})
        self.__dict__.setdefault("_sharded", False)
        self.__dict__.setdefault("nonfinite", DEFAULT_NONFINITE)
        self.__dict__.setdefault("_keep", None)
        self.__dict__.setdefault("_prepared", None)
        self.__dict__.setdefault("_inflight", InFlight())
