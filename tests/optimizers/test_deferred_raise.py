"""``nonfinite="raise"`` on an accelerator: the step runs masked, the next call raises.

Run on CPU tensors with :func:`fastmuon.ns.device.is_host` answering "no" (the accelerator's
paths, as in ``test_accelerator_paths.py``), against the per-parameter fp32 reference; and
traced on fake CUDA tensors, where every host read of a CUDA tensor is counted.
"""

from __future__ import annotations

import copy
import math
import traceback

import pytest
import torch
from conftest import MIXED_SHAPES, rel_err
from helpers import clone_params, make_grads, make_params, run_muon_reference, run_musgd_reference

import fastmuon
from fastmuon import Muon, MuSGD
from fastmuon.ns import device as ns_device
from fastmuon.ns.planner import COST_MODELS
from fastmuon.step import deferred
from fastmuon.step.driver import NonFiniteGuard

SHAPES = MIXED_SHAPES + [(24,), (7,)]
N = len(MIXED_SHAPES)
BAD = (1, N)  # a matrix with a bucket mate of its shape, and a vector (SGD / AdamW)
MUSGD = dict(lr=0.02, momentum=0.9, nesterov=True, weight_decay=5e-4, muon=0.5, sgd=0.5)
MUON = dict(lr=0.02, momentum=0.95, nesterov=True, weight_decay=0.1)
ADAMW = dict(lr=0.02, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
NAMED = r"parameter 1 of param group 0 \(shape \(32, 16, 3, 3\)\) \(and 1 more\) had a non-finite"


@pytest.fixture
def accelerator_paths(monkeypatch):
    monkeypatch.setattr(ns_device, "is_host", lambda device: False)


def _optimizer(cls, params, **kw):
    groups = [{"params": params[:N], "use_muon": True}, {"params": params[N:], "use_muon": False}]
    if cls is MuSGD:
        return MuSGD(groups, **MUSGD, ns_dtype=torch.float32, cost_model=COST_MODELS["cuda"], **kw)
    return Muon(
        groups, **MUON, adamw_lr=ADAMW["lr"], ns_dtype=torch.float32, cost_model=COST_MODELS["cuda"], **kw
    )


def _reference(cls, params, grads):
    groups = [(list(range(N)), {"use_muon": True}), ([N, N + 1], {"use_muon": False})]
    if cls is MuSGD:
        return run_musgd_reference(params, grads, groups, MUSGD)[0]
    return run_muon_reference(params, grads, groups, MUON, ADAMW)[0]


def _bad_grads(params, steps, at):
    """``steps`` steps of gradients, NaN in ``BAD[0]``'s and Inf in ``BAD[1]``'s at step ``at``."""
    grads = make_grads(params, steps=steps)
    grads[at][BAD[0]][0, 0, 0, 0] = math.nan
    grads[at][BAD[1]][3] = math.inf
    return grads


def _set_grads(params, grads):
    for p, g in zip(params, grads):
        p.grad = g.clone()


def _snapshot(opt, params):
    return [p.detach().clone() for p in params], [copy.deepcopy(opt.state[p]) for p in params]


def _assert_unchanged(opt, params, snapshot):
    for p, before, state in zip(params, *snapshot):
        assert torch.equal(p, before)
        assert opt.state[p].keys() == state.keys()
        for key, value in state.items():
            assert torch.equal(opt.state[p][key], value), key


@pytest.mark.parametrize("cls", [MuSGD, Muon])
def test_a_bad_step_leaves_its_parameters_untouched_and_the_next_step_raises_changing_nothing(
    accelerator_paths, cls
):
    params = make_params(SHAPES)
    grads = _bad_grads(params, steps=3, at=1)
    ours = clone_params(params)
    opt = _optimizer(cls, ours)
    _set_grads(ours, grads[0])
    opt.step()
    before_bad = _snapshot(opt, ours)
    _set_grads(ours, grads[1])
    opt.step()  # accepted on the device: masked, no error yet
    applied = [grads[0], [None if i in BAD else g for i, g in enumerate(grads[1])]]
    for i, (o, r) in enumerate(zip(ours, _reference(cls, params, applied))):
        assert rel_err(o.detach(), r) <= 1e-5, i
    for i in BAD:  # untouched, bit for bit, with every state tensor
        _assert_unchanged(opt, [ours[i]], ([before_bad[0][i]], [before_bad[1][i]]))

    _set_grads(ours, grads[2])
    before_raise = _snapshot(opt, ours)
    with pytest.raises(FloatingPointError, match=NAMED + r".* in step 2; step 2's update left"):
        opt.step()
    _assert_unchanged(opt, ours, before_raise)
    assert all(torch.equal(p.grad, g) for p, g in zip(ours, grads[2]))

    opt.step()  # the verdict was read: this step goes on
    for i, (o, r) in enumerate(zip(ours, _reference(cls, params, [*applied, grads[2]]))):
        assert rel_err(o.detach(), r) <= 1e-5, i
    if cls is Muon:  # the AdamW step count of the bad vector skipped step 2
        assert [float(opt.state[ours[i]]["step"]) for i in (N, N + 1)] == [2.0, 3.0]


def test_state_dict_after_a_bad_step_raises_once(accelerator_paths):
    params = make_params(SHAPES)
    grads = _bad_grads(params, steps=2, at=1)
    opt = _optimizer(MuSGD, params)
    for g in grads:
        _set_grads(params, g)
        opt.step()
    with pytest.raises(FloatingPointError, match=NAMED + r".* in step 2"):
        opt.state_dict()
    assert set(opt.state_dict()["state"]) == set(range(len(params)))


def test_a_copy_takes_the_state_and_leaves_the_verdict_to_the_original(accelerator_paths):
    params = make_params(SHAPES)
    grads = _bad_grads(params, steps=3, at=1)
    opt = _optimizer(Muon, params)
    for g in grads[:2]:
        _set_grads(params, g)
        opt.step()
    twin = copy.deepcopy((params, opt))
    _set_grads(params, grads[2])
    _set_grads(twin[0], grads[2])
    twin[1].step()
    with pytest.raises(FloatingPointError, match=NAMED):
        opt.step()
    opt.step()
    assert all(torch.equal(p, q) for p, q in zip(params, twin[0]))


class _Event:
    """A stand-in for a device event whose passing the test decides."""

    def __init__(self, done: bool):
        self.done, self.waited = done, False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.waited, self.done = True, True


def test_zero_grad_never_reads_the_verdict(accelerator_paths, monkeypatch):
    """Arrived or not, ``zero_grad`` clears the gradients and raises nothing (whether the flags
    have arrived differs by rank); the next step waits for them and raises."""
    events: list[_Event] = []
    monkeypatch.setattr(deferred, "recorded_event", lambda device: events.append(_Event(False)) or events[-1])
    params = make_params(SHAPES)
    grads = _bad_grads(params, steps=3, at=1)
    opt = _optimizer(MuSGD, params)
    for g in grads[:2]:
        _set_grads(params, g)
        opt.step()
    opt.zero_grad()  # the flags are still on their way: no wait, no error, the gradients go
    assert not events[-1].waited and all(p.grad is None for p in params)
    events[-1].done = True
    opt.zero_grad()  # arrived: still nothing read
    assert opt._driver.pending is not None
    _set_grads(params, grads[2])
    with pytest.raises(FloatingPointError, match=NAMED + r".* in step 2"):
        opt.step()
    opt.step()  # read once: the retry goes on


def test_the_cpu_refuses_the_bad_step_itself():
    """On the host's CPU reading the verdict makes nothing wait: the bad step raises."""
    params = make_params(SHAPES)
    grads = _bad_grads(params, steps=2, at=1)
    opt = _optimizer(MuSGD, params)
    _set_grads(params, grads[0])
    opt.step()
    _set_grads(params, grads[1])
    before = _snapshot(opt, params)
    with pytest.raises(FloatingPointError, match="has a non-finite gradient"):
        opt.step()
    _assert_unchanged(opt, params, before)
    assert opt._driver.pending is None


def test_what_lives_on_the_host_goes_back_once_the_flags_are_read(accelerator_paths):
    """A bad parameter's tensors on the device go back with the step; those on the host (AdamW's
    step counts beside CUDA tensors) when its flags are read, once: no step waits for them."""
    params = [torch.randn(3, 2), torch.randn(4)]
    states = [{"m": torch.zeros(3, 2)}, {"m": torch.zeros(4), "step": torch.zeros((), dtype=torch.float64)}]
    grads = [torch.randn(3, 2), torch.full((4,), math.nan)]
    guard = NonFiniteGuard("raise", grads, params, states, defer=True)
    for group in guard.skip._groups:  # the float64 step count plays the host's tensor
        group.host = group.views[0].dtype == torch.float64
    name = "parameter {}".format
    keep = guard.keep(grads, name)
    saved = guard.snapshot(keep)
    before = [p.clone() for p in params]
    for p, state in zip(params, states):  # the update: every tensor moves
        p.add_(1)
        for v in state.values():
            v.add_(1)
    pending = guard.settle(saved, keep, name, 7)
    assert torch.equal(params[0], before[0] + 1) and torch.equal(states[0]["m"], torch.ones(3, 2))
    assert torch.equal(params[1], before[1]) and torch.equal(states[1]["m"], torch.zeros(4))
    assert float(states[1]["step"]) == 1  # still to go back
    assert not pending.complete() and float(states[1]["step"]) == 0
    states[1]["step"].fill_(5)
    with pytest.raises(FloatingPointError, match=r"parameter 1 had a non-finite .* in step 7"):
        pending.check()
    assert float(states[1]["step"]) == 5  # put back once only


def test_skip_puts_back_what_lives_on_the_host_when_the_flags_arrive_and_never_raises(accelerator_paths):
    """ "skip" over accelerator gradients: the host's share of a bad parameter (AdamW's step
    counts) goes back when the flags reach the host, before the next step reads it, instead
    of by a read that would make every step wait for the device; nothing raises."""
    params = [torch.randn(3, 2), torch.randn(4)]
    states = [{"m": torch.zeros(3, 2)}, {"m": torch.zeros(4), "step": torch.zeros((), dtype=torch.float64)}]
    grads = [torch.randn(3, 2), torch.full((4,), math.nan)]
    guard = NonFiniteGuard("skip", grads, params, states)
    assert not guard.host_later  # every tensor here is the accelerator's
    for group in guard.skip._groups:  # the float64 step count plays the host's tensor
        group.host = group.views[0].dtype == torch.float64
    guard = copy.copy(guard)
    guard.host_later, guard._flags = True, deferred.host_buffer(len(grads))
    name = "parameter {}".format
    keep = guard.keep(grads, name)
    saved = guard.snapshot(keep)
    before = [p.clone() for p in params]
    for p, state in zip(params, states):
        p.add_(1)
        for v in state.values():
            v.add_(1)
    pending = guard.settle(saved, keep, name, 3)
    assert torch.equal(params[0], before[0] + 1) and torch.equal(params[1], before[1])
    assert float(states[1]["step"]) == 1  # the host's share: still to go back
    pending.check()  # no error: "skip" only puts back
    assert float(states[1]["step"]) == 0


@pytest.mark.parametrize("cls", [MuSGD, Muon, fastmuon.NorMuon, fastmuon.AdaMuon])
def test_capturable_with_raise_is_refused_naming_both_and_the_fix(cls):
    p = torch.nn.Parameter(torch.randn(4, 4))
    groups = [{"params": [p], "use_muon": True}]
    fix = r"capturable=True .* nonfinite='raise'.* nonfinite='skip'.* nonfinite='ignore'"
    with pytest.raises(ValueError, match=fix):
        cls(groups, capturable=True)
    with pytest.raises(ValueError, match=fix):
        cls(groups, capturable=True, nonfinite="raise")
    assert p.grad is None and groups == [{"params": [p], "use_muon": True}]
    for mode in ("skip", "ignore"):
        assert cls(groups, capturable=True, nonfinite=mode).capturable


@pytest.mark.skipif(not torch.distributed.is_gloo_available(), reason="needs torch.distributed with gloo")
def test_ranks_raise_a_verdict_only_one_of_them_saw_alike(tmp_path):
    """Rank 1 alone has a NaN at step 1: both ranks skip that parameter there, both raise at
    step 2 changing nothing, and both go on at the retry, bit for bit alike."""
    from reliability_support import deferred_raise_worker

    torch.multiprocessing.spawn(
        deferred_raise_worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True
    )
    results = [torch.load(tmp_path / f"{r}.pt", weights_only=True) for r in range(2)]
    for r in results:
        stepped, bad, raised, retried = r["outcomes"]
        assert (stepped, bad, retried) == ("stepped",) * 3
        assert raised.startswith("parameter 0 of param group 0 (shape (6, 4)) had a non-finite")
        assert "in step 2" in raised
        before, after_bad, after_raise, _ = r["weights"]
        assert torch.equal(after_bad[0], before[0]) and not torch.equal(after_bad[1], before[1])
        assert all(torch.equal(a, b) for a, b in zip(after_raise, after_bad))
    for a, b in zip(*(r["weights"] for r in results)):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


def _fake_cuda_available() -> bool:
    """A CUDA build of torch (a CPU build makes fake CUDA tensors but lacks some of their ops)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    if torch.version.cuda is None:
        return False
    try:
        with FakeTensorMode():
            return (~torch.ones(1, dtype=torch.bool, device="cuda")).device.type == "cuda"
    except (RuntimeError, AssertionError):
        return False


#: the guard's frames: NonFiniteGuard and FiniteCheck in the driver, the restore in step/nonfinite.py
_GUARD = {"keep", "snapshot", "restore", "settle", "screen", "__call__", "_finite", "_max_abs"}


def _in_guard(frame: traceback.FrameSummary) -> bool:
    name = frame.filename.replace("\\", "/")
    return name.endswith("step/nonfinite.py") or (name.endswith("step/driver.py") and frame.name in _GUARD)


@pytest.mark.skipif(not _fake_cuda_available(), reason="needs a CUDA build of torch (fake CUDA tensors)")
def test_a_default_cuda_step_reads_nothing_of_the_device():
    """yolo26n's MuSGD with the default ``nonfinite="raise"`` on fake CUDA tensors: steps 2 and 3
    (the first reads step 1's verdict, now on the host) read no CUDA tensor on the host, and the
    guard costs one norm, stack and compare, one snapshot, a five-kernel restore and the flags'
    copy."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode

    from fastmuon.bench.contenders import Workbench
    from fastmuon.bench.counter import is_kernel
    from fastmuon.bench.manifest import materialize
    from fastmuon.bench.workloads import resolve_workload

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.cuda_reads, self.host_reads, self.guard = 0, 0, []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.__name__.startswith("_fused_"):
                return None  # torch's fused optimizer kernels (in place) have no fake kernel
            if func is torch.ops.aten._local_scalar_dense.default:
                if args[0].device.type == "cuda":
                    self.cuda_reads += 1
                    return 0
                self.host_reads += 1
                return 1  # the flags, on the host: all finite
            if is_kernel(func) and func.namespace != "prim":
                frames = traceback.extract_stack(limit=12)
                if any(_in_guard(f) for f in frames):
                    self.guard.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    manifest = resolve_workload("yolo26n")
    cuda = torch.device("cuda")
    with FakeTensorMode(allow_non_fake_inputs=True):
        params = materialize(manifest, cuda, 0)
        bench = Workbench(manifest, params, cuda, "MuSGD", torch.bfloat16, "auto")
        opt = MuSGD(bench.groups())
        assert opt.nonfinite == "raise"
        with Count():
            opt.step()  # builds the program
        for _ in range(2):
            with Count() as count:
                opt.step()
            assert count.cuda_reads == 0
            assert count.host_reads == 1  # the previous step's flags, copied to the host
            assert count.guard == [
                *("_foreach_norm", "stack", "lt"),  # the finite check
                "_foreach_copy_",  # the snapshot (a foreach copy: fewer launches than a cat)
                *(
                    "index_select",  # the owners' flags, one per block
                    "_foreach_copy_",
                    "where",
                    "_foreach_copy_",
                ),  # restore
                "copy_",  # the flags, on their way to the host
            ]
