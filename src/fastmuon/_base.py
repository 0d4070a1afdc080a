"""What MuSGD and Muon share: validation, parameter names, and the cached batching plan."""

from __future__ import annotations

import copy
import math
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from .calibrate import calibrated_cost_model
from .checkpoint import adapt_state_dict
from .distributed import is_dtensor
from .engine import NSConfig, Orthogonalizer, TensorLayout, matrix_spec
from .matrix_update import batch_order
from .nonfinite import (
    DEFAULT_NONFINITE,
    SkipGuard,
    agree_across_ranks,
    check_mode,
    finite_flags,
    raise_if_nonfinite,
)
from .param_names import agree_on_names, restore_names
from .planner import DEFAULT_MAX_BUCKET_BYTES, POLICIES, CostModel, Plan, plan_buckets
from .state import drop_state_after, mark_state

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


class ArgumentTypeError(TypeError, ValueError):
    """A constructor argument or group value of the wrong type (a ``TypeError`` and, like
    torch's optimizers' checks, a ``ValueError``)."""


def check_foreach(foreach: Any) -> bool | None:
    """``foreach`` as torch's optimizers take it: ``None`` (pick the fast path), True or False."""
    if foreach is not None and not isinstance(foreach, bool):
        raise ArgumentTypeError(f"foreach must be None, True or False, got {foreach!r}")
    return foreach


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
        self.validate_group(candidate, f"param group {len(self.param_groups)}")
        for j, p in enumerate(tensors):
            self._check_param(candidate, j, p)
        return params

    def _check_param(self, group: dict[str, Any], j: int, p: Tensor) -> None:
        if p.is_complex():
            raise ValueError(
                f"{self.param_name(group, j)} is complex; {type(self).__name__} supports real "
                "parameters only (view it as real with torch.view_as_real and optimise that)"
            )
        if not p.is_floating_point():
            raise ValueError(
                f"{self.param_name(group, j)} has dtype {p.dtype}; {type(self).__name__} optimises "
                "floating-point parameters only (convert it, e.g. with .float(), or leave it out "
                "of the optimizer)"
            )

    def validate_group(self, group: dict[str, Any], where: str) -> None:
        lr = group["lr"]
        if isinstance(lr, Tensor) and lr.numel() != 1:  # torch.optim's wording
            raise ValueError(
                f"Tensor lr must be 1-element, got shape {tuple(lr.shape)} in {where} "
                "(pass a float or a one-element tensor)"
            )
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
        # a group not (yet) in the optimizer is the one being added
        index = next((i for i, g in enumerate(self.param_groups) if g is group), len(self.param_groups))
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
        mark = mark_state(self.state)
        initialised = self.state_initialised
        try:
            self.begin_step()
            items = self.local_items(*self._collect())
            guard = self.guard_nonfinite()
        except BaseException:
            # a refused step (a bad or non-finite gradient) leaves the optimizer as it was:
            # no zero buffers for parameters it never stepped
            drop_state_after(self.state, mark)
            self.state_initialised = initialised
            self._zero_grads, self._global_of, self._keep = {}, {}, None
            raise
        try:
            self._apply(*items)
        finally:
            self.end_nonfinite(guard)
        return loss

    def _collect(self) -> tuple[list, ...]:
        """This step's work items (one list per kind of update; the first holds the
        :class:`~fastmuon.matrix_update.MatrixItem` s), creating missing state buffers."""
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

            self._zero_grads = begin_step(self)

    def local_items(self, *item_lists):
        """The step's items with DTensors swapped for their local shards (no-op without DTensors)."""
        self._zero_grads = {}
        if not self._sharded:
            return item_lists
        from .distributed import localize

        for items in item_lists:
            self._global_of.update(localize(self, items))
        if self._global_of and getattr(self, "foreach", None) is False:
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

    @torch.compiler.disable  # planning is host-side bookkeeping: nothing for a compiler to trace
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
            flags = list(agree_across_ranks(flags, self.process_group))
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
        """AdamW's ``step`` back on the host as float32 (read there every step); the plans rebuilt."""
        for state in self.state.values():
            step = state.get("step") if isinstance(state, dict) else None
            if isinstance(step, Tensor) and (step.dtype != torch.float32 or step.device.type != "cpu"):
                state["step"] = step.to("cpu", torch.float32)
        self._plans.clear()

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
            matrices = self._collect()[0]
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
        self.__dict__.setdefault("_zero_grads", {})
        self.__dict__.setdefault("_global_of", {})
        self.__dict__.setdefault("_sharded", False)
        self.__dict__.setdefault("nonfinite", DEFAULT_NONFINITE)
        self.__dict__.setdefault("_keep", None)
        self.__dict__.setdefault("_prepared", None)
