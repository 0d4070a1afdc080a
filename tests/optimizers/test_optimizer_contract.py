"""Generic optimizer behaviour, driven by one table of inputs and error inputs per optimizer.

The idea follows ``OptimizerInfo`` in torch's testing helpers (one entry per optimizer listing
constructor variants and inputs that must be refused, and tests written once against the
table); the tests themselves are written for fastmuon.
"""

from __future__ import annotations

import copy
import io
import pickle
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from conftest import rel_err
from torch import Tensor

from fastmuon import Muon, MuSGD

#: Named tolerances (relative to the largest magnitude, see ``conftest.rel_err``).
TOL = {
    # same code path, same inputs: every operation is deterministic on a CPU
    "same_path": 0.0,
    # the batched path sums in another order (padding, stacking) and may pick the Gram form of NS
    "fp32_ns_loop": 1e-5,
    # bf16 NS carries ~3 significant digits, and the batched path may pick another NS formulation
    "bf16_ns_loop": 5e-2,
    # a traced step may round an elementwise product differently (a few ulp over a few steps)
    "compiled": 1e-6,
}

MATRIX_SHAPES = [(8, 4), (4, 8), (6, 5), (8, 2, 3)]
VECTOR_SHAPES = [(4,), (5,)]
STEPS = 3


@dataclass(frozen=True)
class Input:
    """One way to build the optimizer: constructor kwargs and the tolerance against the loop."""

    desc: str
    kwargs: dict[str, Any]
    loop_tol: str = "fp32_ns_loop"


@dataclass(frozen=True)
class ErrorInput:
    """A constructor call or an ``add_param_group`` that must be refused.

    ``group`` set: the optimizer is built fine and then given this extra group (its ``params``
    made by ``extra_param``); otherwise the constructor gets ``kwargs`` (and ``extra_param``
    among its parameters, when given).
    """

    desc: str
    error: type[Exception]
    match: str
    kwargs: dict[str, Any] = field(default_factory=dict)
    group: dict[str, Any] | None = None
    extra_param: Callable[[], Tensor] | None = None


@dataclass(frozen=True)
class OptimizerInfo:
    name: str
    cls: type
    groups: Callable[[list[Tensor]], list[dict[str, Any]]]  # how the parameters are grouped
    base: dict[str, Any]  # kwargs every input starts from
    inputs: tuple[Input, ...]
    errors: tuple[ErrorInput, ...]

    def build(self, params: list[Tensor], kwargs: dict[str, Any]):
        return self.cls(self.groups(params), **{**self.base, **kwargs})


def _one_group(params):
    return [{"params": params}]


def _muon_and_sgd(params):
    """MuSGD as Ultralytics groups it: matrices in a Muon group, the rest on plain SGD."""
    return [
        {"params": [p for p in params if p.ndim >= 2], "use_muon": True},
        {"params": [p for p in params if p.ndim < 2], "use_muon": False},
    ]


def _muon_and_adamw(params):
    """Matrices in a Muon group, the rest in an AdamW group with its own learning rate."""
    return [
        {"params": [p for p in params if p.ndim >= 2], "use_muon": True},
        {"params": [p for p in params if p.ndim < 2], "use_muon": False, "lr": 0.003},
    ]


def _matrix():
    return torch.nn.Parameter(torch.randn(3, 5))


def _complex():
    return torch.nn.Parameter(torch.randn(3, 5, dtype=torch.complex64))


def _integer():
    return torch.nn.Parameter(torch.ones(3, 5, dtype=torch.int64), requires_grad=False)


def _vector():
    return torch.nn.Parameter(torch.randn(5))


COMMON_INPUTS = (
    Input("defaults", {}),
    Input("foreach_false", {"foreach": False}),
    Input("foreach_none", {"foreach": None}),
    Input("weight_decay", {"weight_decay": 0.05}),
    Input("tensor_lr", {"lr": torch.tensor(0.02)}),
    Input("nonfinite_skip", {"nonfinite": "skip"}),
    Input("bf16_ns", {"ns_dtype": torch.bfloat16}, loop_tol="bf16_ns_loop"),
)

COMMON_ERRORS = (
    ErrorInput("negative_lr", ValueError, r"invalid learning rate \(lr\) -1", kwargs={"lr": -1.0}),
    ErrorInput(
        "two_element_tensor_lr",
        ValueError,
        "Tensor lr must be 1-element",
        kwargs={"lr": torch.tensor([1e-3, 1e-3])},
    ),
    ErrorInput("momentum_one", ValueError, "invalid momentum 1", kwargs={"momentum": 1.0}),
    ErrorInput("ns_steps_zero", ValueError, "ns_steps must be an integer >= 1", kwargs={"ns_steps": 0}),
    ErrorInput("negative_weight_decay", ValueError, "invalid weight_decay", kwargs={"weight_decay": -0.1}),
    ErrorInput("bad_ns_dtype", ValueError, "ns_dtype must be a floating", kwargs={"ns_dtype": torch.int32}),
    ErrorInput("bad_ns_method", ValueError, "unknown ns_method", kwargs={"ns_method": "qr"}),
    ErrorInput("bad_policy", ValueError, "invalid policy", kwargs={"policy": "fastest"}),
    ErrorInput("bad_nonfinite", ValueError, "invalid nonfinite", kwargs={"nonfinite": "zero"}),
    ErrorInput(
        "zero_bucket_bytes", ValueError, "max_bucket_bytes must be positive", kwargs={"max_bucket_bytes": 0}
    ),
    ErrorInput(
        "complex_param", ValueError, r"parameter \d+ of param group \d .*is complex", extra_param=_complex
    ),
    ErrorInput(
        "integer_param",
        ValueError,
        r"parameter \d+ of param group \d .*dtype torch.int64",
        extra_param=_integer,
    ),
    # the same refusals for a group added later: the optimizer must stay exactly as it was
    ErrorInput("group_negative_lr", ValueError, "invalid learning rate", group={"lr": -1}),
    ErrorInput("group_tensor_lr", ValueError, "Tensor lr must be 1-element", group={"lr": torch.ones(2)}),
    ErrorInput("group_momentum_one", ValueError, "invalid momentum 1 in param group", group={"momentum": 1}),
    ErrorInput("group_ns_steps_zero", ValueError, "ns_steps must be an integer", group={"ns_steps": 0}),
    ErrorInput("group_use_muon_str", ValueError, "use_muon in param group", group={"use_muon": "yes"}),
    ErrorInput(
        "group_complex",
        ValueError,
        r"parameter 0 of param group \d .*complex",
        group={},
        extra_param=_complex,
    ),
    ErrorInput(
        "group_integer", ValueError, r"parameter 0 of param group \d .*int64", group={}, extra_param=_integer
    ),
)

MUSGD_INPUTS = (
    Input("momentum", {"momentum": 0.9}),
    Input("nesterov", {"momentum": 0.9, "nesterov": True}),
    Input("adjust_lr_original", {"momentum": 0.9, "adjust_lr": "original"}),
)

MUON_INPUTS = (
    Input("nesterov_off", {"nesterov": False}),
    Input("match_rms_adamw", {"adjust_lr_fn": "match_rms_adamw"}),
)

OPTIMIZERS = [
    OptimizerInfo(
        "MuSGD",
        MuSGD,
        _muon_and_sgd,
        {"lr": 0.02, "ns_dtype": torch.float32},
        COMMON_INPUTS + MUSGD_INPUTS,
        COMMON_ERRORS
        + (
            ErrorInput(
                "bad_adjust_lr", ValueError, "unknown adjust_lr_fn 'sqrt'", kwargs={"adjust_lr": "sqrt"}
            ),
            ErrorInput("negative_muon", ValueError, "invalid muon", group={"muon": -0.5}),
        ),
    ),
    OptimizerInfo(
        "Muon",
        Muon,
        _one_group,
        {"lr": 0.02, "ns_dtype": torch.float32},
        COMMON_INPUTS + MUON_INPUTS,
        COMMON_ERRORS
        + (
            ErrorInput("bad_adjust_lr_fn", ValueError, "unknown adjust_lr_fn", kwargs={"adjust_lr_fn": "x"}),
            ErrorInput("short_betas", ValueError, "betas in param group", group={"betas": (0.9,)}),
            ErrorInput(
                "vector_in_muon_group",
                ValueError,
                "is in a use_muon=True group",
                group={"use_muon": True},
                extra_param=_vector,
            ),
        ),
    ),
    OptimizerInfo(
        "Muon+AdamW",
        Muon,
        _muon_and_adamw,
        {"lr": 0.02, "ns_dtype": torch.float32},
        COMMON_INPUTS + MUON_INPUTS,
        COMMON_ERRORS
        + (ErrorInput("adamw_beta_one", ValueError, r"invalid betas\[1\]", group={"betas": (0.9, 1.0)}),),
    ),
]


def _cases(select: Callable[[Input], bool] = lambda i: True):
    return [
        pytest.param(info, inp, id=f"{info.name}-{inp.desc}")
        for info in OPTIMIZERS
        for inp in info.inputs
        if select(inp)
    ]


def _error_cases():
    return [
        pytest.param(info, err, id=f"{info.name}-{err.desc}") for info in OPTIMIZERS for err in info.errors
    ]


INFOS = [pytest.param(i, id=i.name) for i in OPTIMIZERS]


# ----- helpers ---------------------------------------------------------------------------------
def make_params(seed: int = 0) -> list[Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in MATRIX_SHAPES + VECTOR_SHAPES]


def set_grads(params: list[Tensor], step: int) -> None:
    g = torch.Generator().manual_seed(1000 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g, dtype=p.dtype)


def run(opt, params: list[Tensor], steps: range) -> None:
    for k in steps:
        set_grads(params, k)
        opt.step()


def params_of(opt) -> list[Tensor]:
    return [p for g in opt.param_groups for p in g["params"]]


def assert_close(a: list[Tensor], b: list[Tensor], tol: str) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        err = rel_err(x.detach(), y.detach())
        assert err <= TOL[tol], f"relative error {err:.2e} above TOL[{tol!r}] = {TOL[tol]:.0e}"


def same_groups(a: list[dict], b: list[dict]) -> bool:
    def plain(g):
        return {k: (v if k != "params" else [id(p) for p in v]) for k, v in g.items()}

    return len(a) == len(b) and all(str(plain(x)) == str(plain(y)) for x, y in zip(a, b))


def same_state(a, b) -> bool:
    """Two optimizers' per-parameter states hold equal values (matched by parameter order)."""
    sa, sb = a.state_dict()["state"], b.state_dict()["state"]
    if sa.keys() != sb.keys():
        return False
    for k in sa:
        if sa[k].keys() != sb[k].keys():
            return False
        for name in sa[k]:
            x, y = sa[k][name], sb[k][name]
            if isinstance(x, Tensor) and not torch.equal(x, y):
                return False
    return True


# ----- generic tests ---------------------------------------------------------------------------
@pytest.mark.parametrize("info, inp", _cases())
def test_state_dict_round_trip_resumes_identically(info, inp):
    params = make_params()
    opt = info.build(params, inp.kwargs)
    run(opt, params, range(2))
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    resumed_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    resumed = info.build(resumed_params, inp.kwargs)
    resumed.load_state_dict(torch.load(buffer, weights_only=True))
    run(opt, params, range(2, 2 + STEPS))
    run(resumed, resumed_params, range(2, 2 + STEPS))
    assert_close(resumed_params, params, "same_path")


@pytest.mark.parametrize("info, inp", _cases(lambda i: "foreach" not in i.kwargs))
def test_foreach_matches_the_per_parameter_loop(info, inp):
    batched, looped = make_params(), make_params()
    run(info.build(batched, {**inp.kwargs, "foreach": True}), batched, range(STEPS))
    run(info.build(looped, {**inp.kwargs, "foreach": False}), looped, range(STEPS))
    assert_close(batched, looped, inp.loop_tol)


def _public(opt) -> dict[str, Any]:
    return {k: v for k, v in vars(opt).items() if not k.startswith("_")}


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
@pytest.mark.parametrize("info, inp", _cases())
def test_copies_keep_every_setting_and_step_identically(info, inp, how):
    params = make_params()
    opt = info.build(params, {**inp.kwargs, "policy": "min_launches", "max_bucket_bytes": 2**20})
    run(opt, params, range(1))
    clone = copy.deepcopy(opt) if how == "deepcopy" else pickle.loads(pickle.dumps(opt))
    original, copied = _public(opt), _public(clone)
    assert copied.keys() == original.keys()
    assert clone.options == opt.options
    for name in (
        "foreach",
        "policy",
        "compile",
        "max_bucket_bytes",
        "cost_model",
        "nonfinite",
        "process_group",
    ):
        assert getattr(clone, name) == getattr(opt, name), name
    assert str(clone.param_groups) == str(opt.param_groups)
    clone_params = params_of(clone)
    assert all(c is not p for c, p in zip(clone_params, params))
    run(opt, params, range(1, 1 + STEPS))
    run(clone, clone_params, range(1, 1 + STEPS))
    assert_close(clone_params, params, "same_path")
    assert same_state(clone, opt)


@pytest.mark.parametrize("shape", [(), (1,)], ids=["0d", "1d"])
@pytest.mark.parametrize("info, inp", _cases(lambda i: "lr" not in i.kwargs))
def test_tensor_lr_steps_as_the_same_float_lr(info, inp, shape):
    lr = torch.full(shape, 0.03)
    as_tensor, as_float = make_params(), make_params()
    opt = info.build(as_tensor, {**inp.kwargs, "lr": lr})
    assert opt.param_groups[0]["lr"] is lr  # kept as given, not read on the host at construction
    run(opt, as_tensor, range(STEPS))
    run(info.build(as_float, {**inp.kwargs, "lr": lr.item()}), as_float, range(STEPS))
    assert_close(as_tensor, as_float, "same_path")


@pytest.mark.parametrize("info, err", _error_cases())
def test_errors_are_raised_and_leave_the_optimizer_unchanged(info, err):
    params = make_params()
    if err.group is None:
        extra = [err.extra_param()] if err.extra_param else []
        with pytest.raises(err.error, match=err.match):
            info.build(params + extra, err.kwargs)
        return
    opt = info.build(params, {})
    run(opt, params, range(1))
    groups_before = [dict(g) for g in opt.param_groups]
    state_before = copy.deepcopy(opt.state_dict())
    extra = err.extra_param() if err.extra_param else _matrix()
    with pytest.raises(err.error, match=err.match):
        opt.add_param_group({"params": [extra], **err.group})
    assert same_groups(opt.param_groups, groups_before)
    assert str(opt.state_dict()) == str(state_before)
    # and it steps as an optimizer that never saw the refused group
    twin_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    twin = info.build(twin_params, {})
    twin.load_state_dict(state_before)
    run(opt, params, range(1, 1 + STEPS))
    run(twin, twin_params, range(1, 1 + STEPS))
    assert_close(params, twin_params, "same_path")


@pytest.mark.parametrize("info", INFOS)
def test_load_state_dict_pre_and_post_hooks_run(info):
    params = make_params()
    opt = info.build(params, {})
    run(opt, params, range(1))
    saved = opt.state_dict()
    calls = []

    def pre(optimizer, state_dict):
        calls.append(("pre", optimizer is opt))
        state_dict["param_groups"][0]["lr"] = 0.125  # a pre-hook may rewrite what is loaded
        return state_dict

    def post(optimizer):
        calls.append(("post", optimizer is opt, optimizer.param_groups[0]["lr"]))

    opt.register_load_state_dict_pre_hook(pre)
    opt.register_load_state_dict_post_hook(post)
    opt.load_state_dict(saved)
    assert calls == [("pre", True), ("post", True, 0.125)]


@pytest.mark.parametrize("set_to_none", [True, False])
@pytest.mark.parametrize("info", INFOS)
def test_zero_grad(info, set_to_none):
    params = make_params()
    opt = info.build(params, {})
    set_grads(params, 0)
    opt.zero_grad(set_to_none=set_to_none)
    for p in params:
        assert p.grad is None if set_to_none else torch.equal(p.grad, torch.zeros_like(p))


@pytest.mark.parametrize("info", INFOS)
def test_step_with_closure_returns_the_loss(info):
    params = make_params()
    opt = info.build(params, {})
    before = [p.detach().clone() for p in params]

    def closure():
        opt.zero_grad()
        loss = sum((p**2).sum() for p in params)
        loss.backward()
        return loss

    loss = opt.step(closure)
    assert isinstance(loss, Tensor) and loss.item() == pytest.approx(sum((b**2).sum().item() for b in before))
    assert all(not torch.equal(p.detach(), b) for p, b in zip(params, before))


@pytest.mark.parametrize("info, inp", _cases())
def test_params_without_grad_are_skipped_and_keep_no_state(info, inp):
    params = make_params()
    opt = info.build(params, inp.kwargs)
    idle = [params[1], params[-1]]  # a matrix and a vector
    before = [p.detach().clone() for p in idle]
    for k in range(2):
        set_grads(params, k)
        for p in idle:
            p.grad = None
        opt.step()
    for p, b in zip(idle, before):
        assert torch.equal(p.detach(), b)
        assert not opt.state.get(p)
    assert all(opt.state.get(p) for p in params if all(p is not q for q in idle))


@pytest.mark.parametrize("info", INFOS)
def test_refused_steps_leave_no_state_behind(info):
    params = make_params()
    opt = info.build(params, {})
    set_grads(params, 0)
    params[2].grad[0, 0] = float("nan")
    with pytest.raises(FloatingPointError, match=r"parameter 2 of param group 0"):
        opt.step()
    assert len(opt.state) == 0  # no zero buffers from the refused first step
    run(opt, params, range(1, 2))
    saved = copy.deepcopy(opt.state_dict())
    late = torch.nn.Parameter(torch.randn(5, 3))
    opt.add_param_group({"params": [late]})
    set_grads(params, 2)
    late.grad = torch.full_like(late, float("inf"))
    with pytest.raises(FloatingPointError):
        opt.step()
    late.grad = torch.randn(5, 3).to_sparse()
    with pytest.raises(RuntimeError, match="sparse gradient"):
        opt.step()
    assert late not in opt.state
    assert str(opt.state_dict()["state"]) == str(saved["state"])


@pytest.mark.parametrize("info", INFOS)
def test_plan_before_the_first_step_is_the_plan_it_will_use(info):
    params = make_params()
    opt = info.build(params, {"policy": "min_launches"})
    assert "no step taken yet; Muon takes" in opt.plan().describe()
    assert "none has a gradient now" in opt.plan().describe()
    set_grads(params, 0)
    before = opt.plan()
    assert len(opt.state) == 0  # built without stepping
    opt.step()
    assert before == opt.plan() and before.num_matrices == len(MATRIX_SHAPES)
    looped = info.build(make_params(), {"foreach": False})
    assert "per-parameter loop" in looped.plan().describe()


class _ProcessGroupStandIn:
    """Like a real process group: a handle that neither pickles nor deep-copies."""

    def __reduce__(self):
        raise TypeError("cannot pickle a process group")


@pytest.mark.parametrize("info", INFOS)
def test_copies_with_a_process_group_share_it_and_pickle_refuses(info):
    group = _ProcessGroupStandIn()
    opt = info.build(make_params(), {"process_group": group})
    assert copy.deepcopy(opt).process_group is group
    with pytest.raises(TypeError, match="cannot pickle a .* with a process_group.*state_dict"):
        pickle.dumps(opt)


# ----- torch.compile(opt.step) -----------------------------------------------------------------
COMPILE_CASES = [
    pytest.param(
        OPTIMIZERS[0], {"momentum": 0.9, "nonfinite": "skip", "policy": "min_launches"}, id="MuSGD-skip"
    ),
    pytest.param(OPTIMIZERS[2], {"policy": "auto"}, id="Muon+AdamW"),
]


@pytest.mark.slow
@pytest.mark.parametrize("info, kwargs", COMPILE_CASES)
def test_compiled_step_matches_eager_also_after_add_param_group(info, kwargs):
    """The compiled step (the AOT tracer, as inductor uses it, without inductor's slow codegen)
    follows the eager one, also once a new group changes the plan and the compiler makes the
    bucket shapes dynamic."""
    torch._dynamo.reset()
    eager_params, compiled_params = make_params(), make_params()
    eager, compiled = info.build(eager_params, kwargs), info.build(compiled_params, kwargs)
    step = torch.compile(compiled.step, backend="aot_eager")
    for stage, shape in enumerate([None, (8, 4)]):
        if shape is not None:
            for opt, ps in ((eager, eager_params), (compiled, compiled_params)):
                q = torch.nn.Parameter(torch.randn(shape, generator=torch.Generator().manual_seed(stage)))
                ps.append(q)
                opt.add_param_group(
                    {"params": [q], "use_muon": True} if len(opt.param_groups) > 1 else {"params": [q]}
                )
        for k in range(2):
            set_grads(eager_params, 10 * stage + k)
            set_grads(compiled_params, 10 * stage + k)
            eager.step()
            step()
        assert_close(compiled_params, eager_params, "compiled")
    assert re.search(r"\d+ matrices", compiled.plan().describe())


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf Tensor:UserWarning")
def test_a_compiled_training_step_after_another_compiled_step_runs_the_fused_kernels_untraced():
    """After a compiled step whose plan changed, what dynamo learnt of fastmuon's frames can
    leave a second optimizer's driver to run eagerly while the frames it calls are compiled:
    its program, prepared eagerly with torch's fused SGD kernel (which has no fake kernel), is
    then run from a compiled frame. The kernel runs outside the trace; the step matches eager."""
    info, kwargs = COMPILE_CASES[0].values
    test_compiled_step_matches_eager_also_after_add_param_group(info, kwargs)
    torch.manual_seed(0)
    eager = torch.nn.Linear(4, 3)
    compiled = copy.deepcopy(eager)
    x, y = torch.randn(5, 4), torch.randn(5, 3)

    def make_step(model: torch.nn.Module) -> Callable[[], Tensor]:
        params = list(model.parameters())
        groups = [{"params": params[:1], "use_muon": True}, {"params": params[1:], "use_muon": False}]
        opt = MuSGD(groups, lr=0.05, momentum=0.9, nesterov=True, ns_dtype=torch.float32)

        def step() -> Tensor:
            opt.zero_grad(set_to_none=True)
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            return loss

        return step

    eager_step, compiled_step = make_step(eager), torch.compile(make_step(compiled), backend="aot_eager")
    for _ in range(2):
        torch.testing.assert_close(compiled_step(), eager_step(), rtol=1e-5, atol=1e-6)
    for p, q in zip(eager.parameters(), compiled.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
