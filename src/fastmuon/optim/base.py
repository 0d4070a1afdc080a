"""What every optimizer shares: group checks, the step's driver, state dicts and copies. A
subclass names its update rule (``_rule``) and checks its own group values."""

from __future__ import annotations

import copy
import warnings
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, ClassVar, overload

import torch
from torch import Tensor
from torch.optim import Optimizer
from torch.optim.optimizer import ParamsT
from torch.utils.hooks import RemovableHandle

from ..distributed.dtensor import local_shard as _local
from ..ns import device
from ..ns.engine import ns_config
from ..ns.matrices import MatrixMap, maps_of
from ..ns.planner import Plan, counted
from ..step.contracts import Rule
from ..step.driver import StepDriver, StepEnv
from ..step.options import Options
from ..step.state_dtype import cast_groups_state, check_state_dtype
from .checkpoint import LoadTarget, adapt_state_dict, with_family_tag
from .param_names import agree_on_names, restore_names
from .qk_clip import TAU as QK_CLIP_TAU
from .qk_clip import QKClip, refuse_unreached_default
from .share import NO_MUON_FIX, MuonShare, empty_plan_note, muon_share
from .validation import (
    check_capturable_setup,
    check_flag,
    check_fraction,
    check_grad,
    check_nonnegative,
    check_param,
    check_rms_scale,
    check_tensor_lr,
    group_lr_factor,
    param_name,
    warn_lost_decays,
    with_implied_ns_steps,
)

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


#: QK-clip's per-head logit maxima of a step, by layer
_Maxima = Mapping[str, Tensor] | None
#: a hook around a batched step's Newton–Schulz: ``hook(run)`` returns ``run()``'s matrices
_NSHook = Callable[[Callable[[], list[Tensor]]], list[Tensor]]


def _option(name: str) -> property:
    return property(
        lambda self: getattr(self.options, name), doc=f"``options.{name}`` (fixed at construction)"
    )


def _lr_value(lr: Any) -> Any:
    """A CPU tensor ``lr`` is read; an accelerator's stays a tensor (reading it makes the host wait)."""
    if isinstance(lr, Tensor) and device.is_host(lr.device):
        return lr.item()
    return lr


def _as_given(lr: Any) -> Any:
    """``capturable``: a tensor ``lr`` stays a tensor."""
    return lr


class MatrixOptimizer(Optimizer):
    """Base for optimizers that orthogonalise matrix updates through the batched engine; groups
    are checked whole before they are stored, and errors name the parameter."""

    _rule: ClassVar[Rule]  # one of fastmuon.rules; mypy checks what a class names
    _lr_factor_alias: ClassVar[str | None] = None  # a second name of adjust_lr_fn (keyword and group key)

    foreach = _option("foreach")
    policy = _option("policy")
    compile = _option("compile")
    max_bucket_bytes = _option("max_bucket_bytes")
    cost_model = _option("cost_model")
    nonfinite = _option("nonfinite")
    capturable = _option("capturable")

    def __init__(
        self,
        params: ParamsT,
        defaults: dict[str, Any],
        options: Options,
        process_group: ProcessGroup | None = None,
    ):
        # the constructor's own arguments first, before ``params`` is read, as torch's optimizers do
        check_tensor_lr(defaults["lr"], "the constructor's lr")
        self.options = options
        self.process_group = process_group  # DDP: ranks share the NS work (see fastmuon.distributed)
        self._driver = StepDriver()
        self._qk_clip = QKClip()
        super().__init__(params, defaults)
        refuse_unreached_default(self.defaults, self.param_groups, type(self).__name__)
        take = self.muon_takes()
        if not take.parameters:
            warnings.warn(
                f"{type(self).__name__} orthogonalises no parameter: {take.why_none()}, so all "
                f"{take.others} parameters take {take.other_update}. {NO_MUON_FIX}",
                UserWarning,
                stacklevel=3,
            )

    @property
    def rule(self) -> Rule:
        """The update rule, one of :mod:`fastmuon.rules`."""
        return self._rule

    @property
    def last_plan(self) -> Plan | None:
        """The plan of the last batched step (None before one)."""
        return self._driver.cache.last_plan

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group checked whole, as it would be stored: a refused group leaves the optimizer
        exactly as it was; one setting ``ns_coefficients`` but no ``ns_steps`` runs their count."""
        where = f"param group {len(self.param_groups)}"
        param_group = group_lr_factor(param_group, self._lr_factor_alias, type(self).__name__, where)
        param_group = with_implied_ns_steps(param_group, self.defaults)
        param_group, held_names = agree_on_names(param_group, self.param_groups)
        if isinstance(param_group, dict) and "params" in param_group:
            # the group dict is stored (as in torch), but only once it has passed
            param_group["params"] = self._check_candidate(param_group)
        super().add_param_group(param_group)
        self._driver.cache.clear()
        restore_names(self.param_groups, held_names)

    def _check_candidate(self, param_group: dict[str, Any]) -> Any:
        """Check a filled copy of the group; its ``params`` as a list (an iterator is read once)."""
        params = param_group["params"]
        if isinstance(params, set):
            return params  # torch refuses sets (no stable order) with its own message
        params = [params] if isinstance(params, Tensor) else list(params)
        tensors = [p[1] if isinstance(p, tuple) and len(p) == 2 else p for p in params]
        if not all(isinstance(t, Tensor) for t in tensors):
            return params  # torch refuses non-tensors with its own message
        candidate = {**self.defaults, **param_group, "params": tensors}
        where = f"param group {len(self.param_groups)}"
        check_capturable_setup(self.options.capturable, self.process_group, candidate["lr"], tensors, where)
        names = [p[0] for p in params if isinstance(p, tuple) and len(p) == 2]
        if names and len(names) == len(tensors):
            candidate["param_names"] = names
        where = f"param group {len(self.param_groups)}"
        self._validate_group(candidate, where)
        for j, p in enumerate(tensors):
            check_param(self._param_name(candidate, j), type(self).__name__, p)
        roles = {role for p in tensors for role in self.rule.state_roles(candidate, p).values()}
        warn_lost_decays(candidate, where, roles)
        return params

    def _validate_group(self, group: dict[str, Any], where: str) -> None:
        """The values every rule reads; a subclass checks its own after these."""
        lr = group["lr"]
        check_tensor_lr(lr, where)
        check_flag("nesterov", group["nesterov"], where)
        check_nonnegative("learning rate (lr)", lr, where)
        check_fraction("momentum", group["momentum"], where)
        check_nonnegative("weight_decay", group["weight_decay"], where)
        check_nonnegative("eps", group["eps"], where)
        check_rms_scale(group, where)
        check_state_dtype(group.get("state_dtype"), where)
        use_muon = group.get("use_muon")
        if use_muon is not None and not isinstance(use_muon, bool):
            raise ValueError(f"use_muon in {where} must be True, False or absent, got {use_muon!r}")
        try:
            ns_config(group)
        except ValueError as e:
            raise ValueError(f"{e} (in {where})") from None

    def _check_matrix_maps(self, group: dict[str, Any], where: str) -> list[MatrixMap]:
        """The group's matrix maps, checked against its shapes (again at build: a map may be set since)."""
        try:
            maps = maps_of(group.get("matrices"), len(group["params"]))
        except ValueError as e:
            raise ValueError(f"{e} (matrices in {where})") from None
        for j, (p, m) in enumerate(zip(group["params"], maps)):
            if m.is_flatten or not self.rule.is_matrix(group, p):
                continue
            try:
                m.check(p.shape)
            except ValueError as e:
                raise ValueError(f"{self._param_name(group, j)} in {where}: {e}") from None
        return maps

    def _param_name(self, group: dict[str, Any], j: int) -> str:
        return param_name(self.param_groups, group, j)

    def _check_grad(self, group: dict[str, Any], j: int, grad: Tensor) -> None:
        check_grad(self._param_name(group, j), type(self).__name__, grad)

    @overload
    def step(self, closure: None = None, *, logit_maxima: _Maxima = None) -> None: ...
    @overload
    def step(self, closure: Callable[[], float], *, logit_maxima: _Maxima = None) -> float: ...
    @torch.no_grad()
    def step(
        self, closure: Callable[[], float] | None = None, *, logit_maxima: _Maxima = None
    ) -> float | None:
        """One update of every parameter with a gradient, then QK-clip by ``logit_maxima``
        (``{layer: per-head maxima}``); a deferred non-finite verdict of the step before raises first."""
        driver, groups = self._driver, self.param_groups
        if driver.pending is not None:
            driver.raise_pending()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        clip = None
        if any([g.get(QK_CLIP_TAU) is not None for g in groups]):  # checked before the update
            host_reads = not self.options.capturable
            clip = self._qk_clip.prepare(
                groups, logit_maxima, self._param_name, self.process_group, host_reads
            )
        if self.options.foreach is False:
            driver.reference_step(self._step_env())
        else:
            driver.step(self._step_env())
        if clip is not None:
            clip()
        return loss

    def _step_env(self) -> StepEnv:
        return StepEnv(
            self.param_groups,
            self.state,
            self.rule,
            self.options,
            self.process_group,
            type(self).__name__,
            self._param_name,
            _lr_value if not self.options.capturable else _as_given,
            self._check_grad,
            self._maps_of,
        )

    def _maps_of(self, group: dict[str, Any], index: int) -> list[MatrixMap]:
        return self._check_matrix_maps(group, f"param group {index}")

    def invalidate(self) -> None:
        """Forget prepared step programs: call it after replacing state tensors or a group's ``params``."""
        self._driver.cache.forget_programs()

    def init_state(self) -> None:
        """Create every parameter's state (zeros) now, as a distributed first step does (so state
        dicts are rank-symmetric); call it before loading a ``torch.distributed.checkpoint``."""
        self._driver.init_state(self._step_env())

    @property
    def state_initialised(self) -> bool:
        """Whether every parameter's state exists (made by :meth:`init_state`)."""
        return self._driver.initialised

    def muon_takes(self) -> MuonShare:
        """What Muon takes and what takes the elementwise update: counts over every group."""
        return muon_share(self.param_groups, self.rule, self._maps_of)

    def plan(self) -> Plan:
        """The last step's batching plan (before one, the next step's; no state is made), its note
        saying what Muon takes; empty, its note saying why, where nothing is batched."""
        take = self.muon_takes()
        driver = self._driver
        plan = driver.plan(self._step_env())
        if plan is not None:
            return driver.cache.noted(plan, take.describe())
        distributed = self.process_group is not None or driver.cache.params(self.param_groups)[1]
        note = empty_plan_note(
            take, driver.steps, any(self.state.values()), self.options.foreach is False, distributed
        )
        ns_steps = max((g["ns_steps"] for g in self.param_groups), default=self.defaults["ns_steps"])
        return Plan((), 0, self.options.policy, ns_steps, self.options.max_bucket_bytes, note)

    def orthogonalizers(self) -> list[Any]:
        """The cached Newton–Schulz executors, least recently used first: each has ``plan`` and
        ``workspaces()``; distributed, also ``stats`` and ``profile`` (True: timed, synchronising)."""
        return list(self._driver.cache.engines.values())

    def workspaces(self) -> list[Tensor]:
        """Every tensor the cached executors keep between steps: memory held beyond the state."""
        return [t for engine in self._driver.cache.engines.values() for t in engine.workspaces()]

    def register_orthogonalize_hook(self, hook: _NSHook) -> RemovableHandle:
        """Call ``hook(run)`` in place of each batched step's Newton–Schulz, for timing and
        inspection: it returns ``run()``'s matrices (plan order) unchanged; ``remove()`` undoes it."""
        handle = RemovableHandle(self._driver.hooks)
        self._driver.hooks[handle.id] = hook
        return handle

    def state_dict(self) -> dict[str, Any]:
        """torch's, naming the rule that wrote it; a deferred non-finite verdict raises first."""
        self._driver.raise_pending()
        return with_family_tag(super().state_dict(), self.rule)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """torch's. A deferred non-finite verdict is read by the next ``step()`` or ``state_dict()``,
        not here: whether its flags have arrived differs by rank, and ranks must raise alike."""
        super().zero_grad(set_to_none)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load as torch does, pre-hooks seeing it as given, also other optimizers' state dicts
        (:mod:`fastmuon.optim.checkpoint`); a refused one raises ``ValueError``, changing nothing."""
        if not isinstance(state_dict, dict):
            raise TypeError(
                f"load_state_dict takes an optimizer's state_dict() (a dict), got {type(state_dict).__name__}"
            )
        state_dict = state_dict.copy()  # shallow, as torch's: a pre-hook may replace entries
        for pre_hook in list(self._optimizer_load_state_dict_pre_hooks.values()):
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result
        target = LoadTarget(
            self.rule.family,
            self.defaults,
            self.param_groups,
            self._param_name,
            self._validate_group,
            self.rule.state_roles,
            self._state_shapes,
        )
        adapted = adapt_state_dict(target, state_dict)
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

    def _state_shapes(self, group: dict[str, Any], where: str) -> list[dict[str, tuple[int, ...]]]:
        """Per parameter of ``group``, the shape of each buffer not simply shaped like it."""
        maps = self._check_matrix_maps(group, where)
        return [self.rule.state_shapes(group, p, m) for p, m in zip(group["params"], maps)]

    def _after_load(self) -> None:
        """AdamW's ``step`` as float32 where read, other buffers in ``state_dtype``; programs rebuilt."""
        for p, state in self.state.items():
            step = state.get("step") if isinstance(state, dict) else None
            where = _local(p).device if self.options.capturable else torch.device("cpu")
            if isinstance(step, Tensor) and (step.dtype != torch.float32 or step.device != where):
                state["step"] = step.to(where, torch.float32)
        cast_groups_state(self.param_groups, self.state, self.rule.state_roles)
        self._driver.cache.clear()
        self._driver.discard_pending()  # its verdict spoke of the state just replaced

    def _copied_state(self) -> dict[str, Any]:
        """torch's state plus the options, process group and plan (not caches, hooks, an unread verdict)."""
        self._driver.complete_pending()
        state = super().__getstate__()
        state.update(
            options=self.options,
            process_group=self.process_group,
            last_plan=self._driver.cache.last_plan,
            state_initialised=self._driver.initialised,
        )
        return state

    def __getstate__(self) -> dict[str, Any]:
        """What ``pickle`` saves; refused with a process group, which belongs to its process."""
        if self.process_group is not None:
            raise TypeError(
                f"cannot pickle a {type(self).__name__} with a process_group (a process group "
                "belongs to the process that created it); save optimizer.state_dict() instead and "
                "load it into an optimizer built with the new process's group, or use copy.deepcopy, "
                "which shares the group"
            )
        return self._copied_state()

    def __deepcopy__(self, memo: dict[int, Any]) -> MatrixOptimizer:
        """A copy with its own state that steps as the original; the process group (a handle) is shared."""
        clone = type(self).__new__(type(self))
        memo[id(self)] = clone
        if self.process_group is not None:
            memo[id(self.process_group)] = self.process_group
        clone.__setstate__(copy.deepcopy(self._copied_state(), memo))
        return clone

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Unpickling, copying and torch's ``load_state_dict`` (which passes only ``state`` and
        ``param_groups``) all come here: what ``state`` lacks is kept, else made fresh."""
        state = dict(state)
        extras = {
            name: state.pop(name)
            for name in ("process_group", "last_plan", "state_initialised")
            if name in state
        }
        options = state.pop("options", None) or self.__dict__.get("options")
        super().__setstate__(state)
        attributes = self.__dict__
        attributes["options"] = options
        if "process_group" in extras:
            attributes["process_group"] = extras["process_group"]
        attributes.setdefault("process_group", None)
        attributes.setdefault("_qk_clip", QKClip())
        driver = attributes.get("_driver")
        if driver is None:  # a copy holds no other optimizer's collectives, caches or hooks
            attributes["_driver"] = StepDriver(
                extras.get("last_plan"), extras.get("state_initialised", False)
            )
        else:
            driver.cache.forget_programs()
            if "state_initialised" in extras:
                driver.initialised = extras["state_initialised"]

    def __repr__(self) -> str:
        return groups_repr(type(self).__name__, self.param_groups)


def groups_repr(name: str, param_groups: list[dict[str, Any]]) -> str:
    """torch's layout with per-parameter lists as counts: hundreds of names would bury the settings."""
    lines = [f"{name} ("]
    for i, group in enumerate(param_groups):
        lines.append(f"Parameter Group {i}")
        lines.append(f"    params: {counted(len(group['params']), 'tensor')}")
        for key in sorted(group):
            if key == "params":
                continue
            value = group[key]
            if key == "param_names" and isinstance(value, (list, tuple)):
                value = counted(len(value), "name")
            lines.append(f"    {key}: {value}")
    lines.append(")")
    return "\n".join(lines)
