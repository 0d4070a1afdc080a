"""Does the GPU compute what the CPU reference computes? The GPU check's numeric checks.

* :func:`correctness`: three steps of MuSGD, Muon, NorMuon and AdaMuon with NS in bf16 and in
  fp32 on the device, against the same optimizer's own per-parameter loop (``foreach=False``,
  NS in fp32) on CPU copies, on a small mixed model (convolutions, linears, vectors: one packed
  NS bucket on a GPU) and on large same-shape matrices (over ``BY_BUCKET_MIN_BYTES`` of NS
  inputs: stepped bucket by bucket on a GPU), at the suite's bounds; a NaN gradient under
  ``nonfinite="skip"``; torch's fused SGD against MuSGD's SGD half.
* :func:`cuda_graph`: the recipe of docs/performance.md (``capturable=True``, a device ``lr``,
  warm-up on a side stream, ``torch.cuda.graph``) captured and replayed, timed beside eager
  steps of a twin, and compared with them bit for bit.
"""

from __future__ import annotations

import functools
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from .. import AdaMuon, Muon, MuSGD, NorMuon
from ..ns.engine import BY_BUCKET_MIN_BYTES
from .gpu_shared import Recorder, Workload, bench_workbench, device_ms, device_params, rel_err, workloads

#: the suite's bound for NS in fp32: max|ours − ref| ≤ 1e-5·max|ref| (tests/optimizers/test_accelerator_paths.py)
FP32_REL = 1e-5
#: the suite's bound for low-precision steps: max|ours − ref| ≤ 5e-2·max|update| + 8 ulp·max|p|
#: (tests/optimizers/test_hypothesis_against_reference.py), the update being the reference's total change
LOW_UPDATE, LOW_ULPS = 5e-2, 8
#: fused SGD against MuSGD's SGD half: equal bits, or within this relative error
FUSED_SGD_REL = 1e-6
STEPS = 3
#: optimizers whose update is compared in the Frobenius norm, tensor by tensor, not entry by entry.
#: AdaMuon divides each entry of the NS output by that entry's own running RMS (its second
#: moment), so at an entry whose NS output is near zero any rounding difference in NS comes out
#: as large as the update itself: the same steps on a CPU, NS in bf16 against fp32, differ by
#: ~0.47·max|update| entry-wise but 8e-3 of the update in norm; Gram-space fp32 NS against
#: standard differs by up to 4e-4·max|p| entry-wise and 1e-5 of the update in norm (nine
#: 512×8192 matrices, three steps). The bounds are the same numbers, applied to norms.
NORMWISE = frozenset({"AdaMuon"})

MIXED_MATRICES: list[tuple[int, ...]] = [
    (16, 3, 3, 3),
    (32, 16, 3, 3),
    (32, 16, 3, 3),
    (64, 32, 1, 1),
    (100, 20),
    (20, 100),
    (48, 48),
    (1, 50),
    (50, 1),
    (8, 1, 3, 3),
    (24, 8, 1, 1),
]
MIXED_VECTORS: list[tuple[int, ...]] = [(24,), (7,)]

#: name -> (class, hyperparameters), the suite's for MuSGD and Muon
OPTIMIZERS: dict[str, tuple[type[Any], dict[str, Any]]] = {
    "MuSGD": (MuSGD, dict(lr=0.02, momentum=0.9, nesterov=True, weight_decay=5e-4, muon=0.5, sgd=0.5)),
    "Muon": (Muon, dict(lr=0.02, momentum=0.95, nesterov=True, weight_decay=0.1, adamw_lr=0.02)),
    "NorMuon": (NorMuon, dict(lr=0.02, momentum=0.95, weight_decay=0.1, adamw_lr=0.02)),
    "AdaMuon": (AdaMuon, dict(lr=0.02, momentum=0.95, weight_decay=0.1, adamw_lr=0.02)),
}


def large_shapes(quick: bool) -> list[tuple[int, ...]]:
    """Same-shape matrices whose bf16 NS inputs exceed ``BY_BUCKET_MIN_BYTES`` (``quick``: a
    few small ones, which on a GPU stay packed)."""
    if quick:
        return [(32, 256)] * 4
    rows, cols = 512, 8192
    count = BY_BUCKET_MIN_BYTES // (rows * cols * torch.bfloat16.itemsize) + 1
    return [(rows, cols)] * count


@dataclass
class Comparison:
    """One optimizer's steps on the device against its CPU per-parameter fp32 reference."""

    optimizer: str
    model: str
    ns_dtype: str
    path: str  # how the device step ran NS: "packed", "bucket by bucket", "none"
    methods: list[str]  # the NS method of each bucket
    tensors: int
    steps: int
    norm: str  # "max" (entry-wise, the suite's) or "frobenius" (see NORMWISE)
    worst_rel_err: float  # |ours − ref| / |ref| in that norm, worst tensor (max: the suite's rel_err)
    worst_update_err: float  # |ours − ref| / |ref − start| in that norm, worst tensor
    bound: str
    worst_err_over_bound: float
    holds: bool
    seconds: float


@dataclass
class SkippedNaN:
    """A NaN in one gradient under ``nonfinite="skip"``: its parameter and state keep their bits."""

    optimizer: str
    shape: list[int]
    param_untouched: bool
    state_untouched: bool
    state_keys: list[str]
    others_moved_and_finite: bool
    holds: bool


@dataclass
class FusedSGD:
    """torch's fused SGD against MuSGD's SGD half (a ``use_muon=False`` group), same tensors."""

    dtype: str
    tensors: int
    steps: int
    bitwise: bool
    worst_rel_err: float
    bound: float
    holds: bool


@dataclass
class CapturedStep:
    """The docs' CUDA-graph recipe on one workload: replays timed beside eager steps of a twin."""

    workload: str
    optimizer: str
    warmup_steps: int
    timed_steps: int
    eager_ms: float
    replay_ms: float
    bitwise_equal: bool
    worst_rel_err: float


# ----- correctness ---------------------------------------------------------------------------------
@dataclass
class Case:
    """A model to step: its start values and gradients per step (CPU, fp32); the first
    ``matrices`` tensors go in the Muon group, the rest in a ``use_muon=False`` group."""

    model: str
    start: list[Tensor]
    grads: list[list[Tensor]]
    matrices: int


def correctness(rec: Recorder) -> None:
    """Every optimizer, both models, NS in bf16 and fp32; then the NaN and fused-SGD checks."""
    rec.note(
        "correctness",
        f"{STEPS} steps from the same start and gradients; the reference is the optimizer's own "
        "foreach=False loop on CPU copies with NS in fp32. Bounds: NS fp32 max|ours - ref| <= "
        f"{FP32_REL:g}*max|ref|; NS bf16 <= {LOW_UPDATE:g}*max|ref - start| + {LOW_ULPS} ulp*max|start| "
        "(the suite's, tests/optimizers/test_accelerator_paths.py and tests/optimizers/test_hypothesis_against_reference.py)",
    )
    for model, matrices, vectors in (
        ("mixed", MIXED_MATRICES, MIXED_VECTORS),
        ("large", large_shapes(rec.quick), []),
    ):
        start = start_values(matrices + vectors, seed=1)
        case = Case(model, start, gradients(start, STEPS, seed=2), len(matrices))
        for name in OPTIMIZERS:
            rec.attempt(
                "comparisons", f"{name} on {model}", functools.partial(_compare_both, rec, case, name)
            )
    for name in OPTIMIZERS:
        rec.attempt("nonfinite_skip", name, functools.partial(_nan_skipped, rec, name))
    rec.attempt("fused_sgd", "fused SGD", lambda: rec.add("fused_sgd", _fused_sgd(rec.device)))


def _compare_both(rec: Recorder, case: Case, name: str) -> None:
    """The CPU reference once, then the device's steps with NS in bf16 and in fp32 against it."""
    reference, _ = _stepped(name, case, torch.device("cpu"), foreach=False, ns_dtype=torch.float32)
    for ns_dtype in (torch.bfloat16, torch.float32):
        rec.add("comparisons", _compare(rec.device, name, case, reference, ns_dtype))


def start_values(shapes: Sequence[tuple[int, ...]], seed: int) -> list[Tensor]:
    """Parameter values of the suite's scale (``0.1·randn``), on the CPU."""
    gen = torch.Generator().manual_seed(seed)
    return [0.1 * torch.randn(s, generator=gen) for s in shapes]


def gradients(start: Sequence[Tensor], steps: int, seed: int) -> list[list[Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randn(t.shape, generator=gen) for t in start] for _ in range(steps)]


def split_groups(params: list[nn.Parameter], matrices: int) -> list[dict[str, Any]]:
    """The first ``matrices`` parameters in a Muon group, the rest in a ``use_muon=False`` one."""
    groups = [{"params": params[:matrices], "use_muon": True}]
    if params[matrices:]:
        groups.append({"params": params[matrices:], "use_muon": False})
    return groups


def _stepped(name: str, case: Case, device: torch.device, **options: Any) -> tuple[list[Tensor], Any]:
    """Optimizer ``name`` stepped on copies of the case on ``device``: the parameters after the
    steps (on the CPU, fp32) and the optimizer. Gradients are fresh copies every step."""
    cls, hyper = OPTIMIZERS[name]
    params = [nn.Parameter(t.to(device, copy=True)) for t in case.start]
    opt = cls(split_groups(params, case.matrices), **hyper, **options)
    for step_grads in case.grads:
        for p, g in zip(params, step_grads):
            p.grad = g.to(device, copy=True)
        opt.step()
    return [p.detach().float().cpu() for p in params], opt


def _compare(
    device: torch.device, name: str, case: Case, reference: list[Tensor], ns_dtype: torch.dtype
) -> Comparison:
    began = time.perf_counter()
    ours, opt = _stepped(name, case, device, ns_dtype=ns_dtype)
    low = ns_dtype != torch.float32
    norm = "frobenius" if name in NORMWISE else "max"

    def size(t: Tensor) -> float:
        return float(t.double().norm() if norm == "frobenius" else t.double().abs().max())

    worst_rel = worst_update = worst_ratio = 0.0
    for o, r, s in zip(ours, reference, case.start):
        err, scale, update = size(o.double() - r.double()), size(r), size(r.double() - s.double())
        if low:
            bound = LOW_UPDATE * update + LOW_ULPS * torch.finfo(torch.float32).eps * size(s)
        else:
            bound = FP32_REL * scale
        worst_rel = max(worst_rel, err / max(scale, 1e-30))
        worst_update = max(worst_update, err / max(update, 1e-30))
        worst_ratio = max(worst_ratio, err / max(bound, 1e-30))
    engines = opt.orthogonalizers()
    path = (
        "none" if not engines else ("bucket by bucket" if any(e.bucketwise() for e in engines) else "packed")
    )
    if norm == "frobenius":
        bound_text = f"{LOW_UPDATE:g}*||update|| + {LOW_ULPS} ulp*||p||" if low else f"{FP32_REL:g}*||ref||"
        bound_text += " (Frobenius norms, per tensor)"
    else:
        bound_text = (
            f"{LOW_UPDATE:g}*max|update| + {LOW_ULPS} ulp*max|p|"
            if low
            else f"{FP32_REL:g}*max|ref| (rel_err)"
        )
    return Comparison(
        name,
        case.model,
        str(ns_dtype).removeprefix("torch."),
        path,
        [b.method for b in opt.plan().buckets],
        len(case.start),
        len(case.grads),
        norm,
        worst_rel,
        worst_update,
        bound_text,
        worst_ratio,
        worst_ratio <= 1.0,
        round(time.perf_counter() - began, 2),
    )


def _nan_skipped(rec: Recorder, name: str) -> None:
    """One clean step (state made), then a step where one matrix's gradient holds a NaN."""
    device = rec.device
    cls, hyper = OPTIMIZERS[name]
    start = start_values(MIXED_MATRICES + MIXED_VECTORS, seed=3)
    grads = gradients(start, 2, seed=4)
    target = MIXED_MATRICES.index((100, 20))
    params = [nn.Parameter(t.to(device, copy=True)) for t in start]
    opt = cls(split_groups(params, len(MIXED_MATRICES)), **hyper, nonfinite="skip")
    for p, g in zip(params, grads[0]):
        p.grad = g.to(device, copy=True)
    opt.step()
    before = [p.detach().clone() for p in params]
    state = {k: v.clone() if isinstance(v, Tensor) else v for k, v in opt.state[params[target]].items()}
    for p, g in zip(params, grads[1]):
        p.grad = g.to(device, copy=True)
    params[target].grad[0, 0] = float("nan")  # type: ignore[index]
    opt.step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    after = opt.state[params[target]]
    same_state = set(after) == set(state) and all(_same(after[k], v) for k, v in state.items())
    same_param = torch.equal(params[target].detach(), before[target])
    others = [i for i in range(len(params)) if i != target]
    moved = all(
        bool(torch.isfinite(params[i]).all()) and not torch.equal(params[i].detach(), before[i])
        for i in others
    )
    record = SkippedNaN(
        name,
        list(start[target].shape),
        same_param,
        same_state,
        sorted(state),
        moved,
        same_param and same_state and moved,
    )
    rec.add("nonfinite_skip", record)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, Tensor) and isinstance(b, Tensor):
        return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)
    return bool(a == b)


def _fused_sgd(device: torch.device) -> FusedSGD:
    """torch.optim.SGD(fused=True) and MuSGD's SGD half on copies of the same tensors."""
    hyper = dict(lr=0.02, momentum=0.9, nesterov=True, weight_decay=5e-4)
    start = start_values(MIXED_MATRICES + MIXED_VECTORS, seed=5)
    grads = gradients(start, STEPS, seed=6)
    theirs = [nn.Parameter(t.to(device, copy=True)) for t in start]
    ours = [nn.Parameter(t.to(device, copy=True)) for t in start]
    fused = torch.optim.SGD(theirs, **hyper, fused=True)  # type: ignore[arg-type]
    with warnings.catch_warnings():  # that it orthogonalises nothing is the point here
        warnings.filterwarnings("ignore", message="MuSGD orthogonalises no parameter")
        musgd = MuSGD([{"params": ours, "use_muon": False}], **hyper)  # type: ignore[arg-type]
    for step_grads in grads:
        for a, b, g in zip(theirs, ours, step_grads):
            a.grad, b.grad = g.to(device, copy=True), g.to(device, copy=True)
        fused.step()
        musgd.step()
    bitwise = all(torch.equal(a.detach(), b.detach()) for a, b in zip(theirs, ours))
    worst = max(rel_err(b.detach(), a.detach()) for a, b in zip(theirs, ours))
    return FusedSGD(
        "float32", len(start), STEPS, bitwise, worst, FUSED_SGD_REL, bitwise or worst <= FUSED_SGD_REL
    )


# ----- the CUDA-graph recipe -----------------------------------------------------------------------
WARMUP = 3


def cuda_graph(rec: Recorder) -> None:
    """The recipe on yolo26n (MuSGD) and GPT-2 (Muon): capture, replay, time, compare."""
    rec.note(
        "cuda_graph",
        "fastmuon's step with capturable=True, nonfinite='skip', each group's lr a 0-d device tensor; "
        f"{WARMUP} warm-up steps on a side stream, one step captured with torch.cuda.graph, then replayed; "
        "a twin built alike steps eagerly the same number of times; ms/step from CUDA events",
    )
    for workload in workloads(rec.quick)[:2]:
        rec.attempt(
            "captured",
            workload.name,
            functools.partial(_captured, rec, workload),
        )


def _captured(rec: Recorder, workload: Workload) -> None:
    device, manifest, optimizer = rec.device, workload.manifest, workload.optimizer
    params = device_params(manifest, device, seed=0)
    wb = bench_workbench(manifest, params, device, optimizer, torch.bfloat16, step_mode="compiled")
    from .contenders import fastmuon_contender

    eager, captured = fastmuon_contender(wb.private_copy()), fastmuon_contender(wb.private_copy())
    for contender in (eager, captured):
        for opt in contender.optimizers:
            for group in opt.param_groups:
                group["lr"] = torch.tensor(float(group["lr"]), device=device)
    for _ in range(WARMUP):
        eager.step()
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(WARMUP):
            captured.step()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured.step()
    steps = 5 if rec.quick else 20
    eager_ms = device_ms(eager.step, steps, device)
    replay_ms = device_ms(graph.replay, steps, device)
    a, b = _params_of(eager.optimizers), _params_of(captured.optimizers)
    record = CapturedStep(
        workload.name,
        optimizer,
        WARMUP,
        steps,
        round(eager_ms, 4),
        round(replay_ms, 4),
        all(torch.equal(x.detach(), y.detach()) for x, y in zip(a, b)),
        max(rel_err(y.detach(), x.detach()) for x, y in zip(a, b)),
    )
    rec.add("captured", record)


def _params_of(optimizers: Sequence[torch.optim.Optimizer]) -> list[Tensor]:
    return [p for opt in optimizers for g in opt.param_groups for p in g["params"]]
