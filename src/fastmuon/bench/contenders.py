"""The optimizers a benchmark run puts side by side, all stepping the same tensors.

Each factory takes the :class:`Workbench` (the materialised parameters, their fixed synthetic
gradients and the manifest's groups) and returns a :class:`Contender`, or raises
:class:`Unavailable` with the reason it cannot run (shown in the report instead of a row).
Factories are listed per update rule in :data:`.lineup.CONTENDERS`, with their labels; add one
there to compare another.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import importlib.metadata
import importlib.util
import inspect
import math
import sys
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ..ns.device import compute_dtype
from ..ns.matrices import maps_of
from ..ns.newton_schulz import newton_schulz
from ..ns.planner import COST_MODELS, Plan, counted, ns_flops
from ..optim.base import MatrixOptimizer
from .fake_cuda import tensors_in
from .manifest import Manifest

#: ``Contender.extra`` key: the manifest's optimizer kwargs the contender's class does not take
UNUSED_KWARGS = "manifest_kwargs_not_taken"


class Unavailable(Exception):
    """A contender that cannot run here (missing package, workload it does not apply to)."""


@dataclass
class Workbench:
    """What every contender shares: one set of parameters with fixed gradients, and the groups."""

    manifest: Manifest
    params: list[nn.Parameter]
    device: torch.device
    optimizer: str
    ns_dtype: torch.dtype
    policy: str
    ns_method: str = "auto"
    cost_model: str = "device"
    step_mode: str = "eager"
    #: fastmuon's class for ``optimizer`` (:data:`.lineup.CLASSES`); the fastmuon rows need it
    fastmuon: type[MatrixOptimizer] | None = None
    #: ``nonfinite=`` for every fastmuon row (None: the class's default)
    nonfinite: str | None = None

    @property
    def fastmuon_class(self) -> type[MatrixOptimizer]:
        """:attr:`fastmuon`, which a fastmuon row cannot do without."""
        if self.fastmuon is None:
            raise ValueError(
                f"this Workbench names no fastmuon class for {self.optimizer!r}: "
                "give Workbench(..., fastmuon=fastmuon.bench.lineup.CLASSES[optimizer])"
            )
        return self.fastmuon

    def groups(self, select: Callable[[nn.Parameter, dict[str, Any]], bool] | None = None) -> list[dict]:
        """Fresh param-group dicts (the manifest's hyperparameters); each optimizer gets its own.

        A group's list of matrix maps (one per parameter) keeps the entries of the parameters
        ``select`` keeps."""
        groups = [{**hyper, "params": [], "param_names": []} for hyper in self.manifest.param_groups]
        maps: list[list[Any]] = [[] for _ in groups]
        for p, spec, m in zip(self.params, self.manifest.params, self.manifest.map_specs()):
            g = groups[spec.group]
            if select is None or select(p, g):
                g["params"].append(p)
                g["param_names"].append(spec.name)
                maps[spec.group].append(m)
        for g, kept in zip(groups, maps):
            if isinstance(g.get("matrices"), list):
                g["matrices"] = kept
        return [g for g in groups if g["params"]]

    def private_copy(self) -> Workbench:
        """The same values in new tensors, for a contender that writes into its gradients."""
        params = []
        for p in self.params:
            q = nn.Parameter(p.detach().clone())
            q.grad = None if p.grad is None else p.grad.clone()
            params.append(q)
        return dataclasses.replace(self, params=params)

    def is_matrix(self, p: Tensor, group: dict[str, Any]) -> bool:
        flag = group.get("use_muon")
        return (flag if flag is not None else p.ndim >= 2) and p.ndim >= 2 and p.numel() > 0

    def matrix_flops(self) -> int:
        """NS FLOPs of the orthogonalised matrices one at a time (no padding), cut by their maps."""
        return sum(
            ns_flops(shape[0], math.prod(shape[1:]), g.get("ns_steps", 5))
            for g in self.groups()
            for p, m in zip(g["params"], maps_of(g.get("matrices"), len(g["params"])))
            if self.is_matrix(p, g)
            for shape in m.shapes(p.shape)
        )


@dataclass
class Unmapped:
    """Groups for an optimizer that knows no matrix maps (see :func:`as_2d_matrices`)."""

    groups: list[dict[str, Any]]
    tensors: int = 0  # mapped parameters replaced by views
    views: int = 0  # the views that replaced them

    @property
    def note(self) -> str:
        if not self.tensors:
            return ""
        return (
            f"; {counted(self.tensors, 'mapped tensor')} given as {counted(self.views, '2-D view')}, "
            "one per matrix of their maps (transposed ones as (out, in))"
        )


def as_2d_matrices(groups: list[dict[str, Any]], is_matrix: Callable[[Tensor, dict], bool]) -> Unmapped:
    """``groups`` for an optimizer that knows no matrix maps: each mapped matrix parameter
    replaced by its matrices as 2-D views ``(out, in)`` (a transposed map's as transposes),
    each with the matching view of the gradient as its ``.grad``, and the ``matrices`` key
    dropped. Updating a view updates the parameter, so the optimizer steps the same tensors
    and orthogonalises the same matrices as fastmuon does with the maps (``NS(Xᵀ) = NS(X)ᵀ``,
    and momentum and weight decay are elementwise). Returns the groups and how many
    parameters were replaced and by how many views."""
    out = Unmapped([])
    for g in groups:
        maps = maps_of(g.get("matrices"), len(g["params"]))
        names = g.get("param_names") or [str(j) for j in range(len(g["params"]))]
        params, kept_names = [], []
        for p, m, name in zip(g["params"], maps, names):
            if m.is_flatten or not is_matrix(p, g):
                params.append(p)
                kept_names.append(name)
                continue
            out.tensors += 1
            for k, (view, grad) in enumerate(zip(m.views(p.detach()), m.views(p.grad))):
                if m.transposed:
                    view, grad = view.T, grad.T
                view.grad = grad
                params.append(view)
                kept_names.append(f"{name}[{k}]")
                out.views += 1
        plain = {k: v for k, v in g.items() if k not in ("matrices", "params", "param_names")}
        out.groups.append({**plain, "params": params, "param_names": kept_names})
    return out


@dataclass
class Contender:
    name: str
    optimizers: list[torch.optim.Optimizer]
    ns_dtype: torch.dtype | None  # None: this contender runs no Newton–Schulz
    note: str = ""
    compute_dtype: torch.dtype | None = None  # what NS matmuls run in, when not ns_dtype
    plan: Callable[[], Plan | None] = lambda: None
    ns_useful_flops: int = 0  # NS FLOPs of the matrices unpadded
    ns_flops: int | None = None  # FLOPs computed, when known without a plan (None: unknown)
    workspaces: Callable[[], list[Tensor]] = list
    extra: dict[str, Any] = field(default_factory=dict)
    #: what each step runs inside (e.g. a peer's switch to eager execution)
    step_context: Callable[[], AbstractContextManager] = contextlib.nullcontext
    #: what each ``opt.step`` is called with (made once, so that the timed step does not make it)
    step_kwargs: dict[str, Any] = field(default_factory=dict)
    #: the lineup's name for it (set by the runner from lineup.CONTENDER_LABELS)
    label: str = ""

    def __post_init__(self) -> None:
        if self.compute_dtype is None:
            self.compute_dtype = self.ns_dtype

    def step(self) -> None:
        with self.step_context():
            for opt in self.optimizers:
                opt.step(**self.step_kwargs)

    def state_bytes(self) -> int:
        """Bytes of optimizer state (momentum buffers and the like), each storage counted once."""
        optimizers = [inner for opt in self.optimizers for inner in delegates(opt)]
        return _unique_bytes(t for opt in optimizers for s in opt.state.values() for t in tensors_in(s))

    def workspace_bytes(self) -> int:
        """Bytes kept between steps outside the state (e.g. fastmuon's bucket buffers)."""
        return _unique_bytes(self.workspaces())


def delegates(opt: torch.optim.Optimizer) -> list[torch.optim.Optimizer]:
    """The optimizers holding the state: a wrapper's inner ones (``.optimizers``), else itself."""
    inner = getattr(opt, "optimizers", None)
    return [opt] if not isinstance(inner, list) else [o for i in inner for o in delegates(i)]


def storage_id(t: Tensor) -> int:
    """The identity of ``t``'s storage: shared by its views, distinct between storages alive at
    once. Not its data pointer: every fake tensor's is 0."""
    storage = t.untyped_storage()
    return storage._cdata


def _unique_bytes(tensors) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        seen[storage_id(t)] = t.untyped_storage().nbytes()
    return sum(seen.values())


def accepted_kwargs(cls: type, kwargs: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """The manifest's optimizer kwargs that ``cls`` takes, and the names it does not.

    A subclass whose ``__init__`` forwards ``**kwargs`` takes what its first base with an explicit
    signature takes.
    """
    for klass in cls.__mro__:
        if "__init__" not in vars(klass):
            continue
        names = inspect.signature(vars(klass)["__init__"]).parameters
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in names.values()):
            break
    return {k: v for k, v in kwargs.items() if k in names}, [k for k in kwargs if k not in names]


def dtype_name(dtype: torch.dtype | None) -> str:
    """``bfloat16`` for ``torch.bfloat16``; ``-`` for None."""
    return "-" if dtype is None else str(dtype).removeprefix("torch.")


def dtype_label(c: Contender) -> str:
    """``bfloat16``, or ``bfloat16→float32`` when the matmuls run in another precision."""
    label = dtype_name(c.ns_dtype)
    return label if c.compute_dtype == c.ns_dtype else f"{label}→{dtype_name(c.compute_dtype)}"


# ----- the contenders --------------------------------------------------------------------------
def fastmuon_contender(wb: Workbench) -> Contender:
    note = f"policy={wb.policy}, ns_method={wb.ns_method}, cost_model={wb.cost_model}"
    return fastmuon_variant(wb, wb.fastmuon_class, "fastmuon", note)


def bf16_state_contender(wb: Workbench) -> Contender:
    """fastmuon with ``state_dtype=torch.bfloat16``: the same batched step, its state stored in
    bf16 and stepped in fp32 (the cost of reading and rounding it; its state bytes)."""
    if all(p.dtype == torch.bfloat16 for p in wb.params):
        raise Unavailable("the parameters are bfloat16: their state is bfloat16 already")
    note = "state_dtype=torch.bfloat16: buffers stored in bf16, each step's arithmetic in fp32"
    return fastmuon_variant(wb, wb.fastmuon_class, "bf16-state", note, state_dtype=torch.bfloat16)


def reference_contender(wb: Workbench) -> Contender:
    """The same optimizer with ``foreach=False``: its per-parameter reference loop."""
    return fastmuon_variant(
        wb, wb.fastmuon_class, "per-parameter", "foreach=False: one NS call per matrix", foreach=False
    )


def fastmuon_variant(
    wb: Workbench, cls: type, label: str, note: str, groups: list[dict] | None = None, **extra: Any
) -> Contender:
    """fastmuon's ``cls`` on ``groups`` (default: the workbench's), with ``extra`` keywords."""
    kwargs, dropped = accepted_kwargs(cls, wb.manifest.optimizer_kwargs)
    if wb.nonfinite is not None:
        kwargs["nonfinite"] = wb.nonfinite
        note += f", nonfinite={wb.nonfinite!r}"
    kwargs.update(extra)
    cost_model = {"device": None, "calibrate": "calibrate"}.get(wb.cost_model) or COST_MODELS.get(
        wb.cost_model
    )
    if wb.step_mode == "compiled" and "capturable" in inspect.signature(cls).parameters:
        kwargs["capturable"] = True  # the step's graph-capture-safe form, where the class offers one
        if kwargs.get("nonfinite", "raise") == "raise":
            kwargs["nonfinite"] = "skip"  # the guard a captured step can keep (it cannot raise)
    opt = cls(
        wb.groups() if groups is None else groups,
        ns_dtype=wb.ns_dtype,
        policy=wb.policy,
        ns_method=wb.ns_method,
        cost_model=cost_model,
        **kwargs,
    )
    mapped = wb.manifest.ns_matrices()
    if mapped != len(wb.manifest.matrices()):
        tensors = counted(len(wb.manifest.matrices()), "tensor")
        note += f"; the manifest's matrix maps: {tensors}, {counted(mapped, 'matrix', 'matrices')}"

    name = f"{label} {cls.__name__}"
    useful = wb.matrix_flops()
    # the batched path reports its padded FLOPs through its plan; the loop computes exactly the useful ones
    computed = useful if getattr(opt, "foreach", None) is False else None
    plan = opt.plan if computed is None else (lambda: None)  # the loop batches nothing
    contender = Contender(name, [opt], wb.ns_dtype, note, plan=plan, ns_useful_flops=useful)
    # the tensors the cached NS executors keep between steps (bucket buffers, indices)
    contender.ns_flops, contender.workspaces = computed, opt.workspaces
    contender.compute_dtype = compute_dtype(wb.ns_dtype, wb.device)
    if dropped:  # the report says it once for the run (see .report.unused_kwargs_line)
        contender.extra[UNUSED_KWARGS] = {k: wb.manifest.optimizer_kwargs[k] for k in dropped}
    return contender


def torch_muon_contender(wb: Workbench) -> Contender:
    """``torch.optim.Muon`` on the matrices (2D only: >2D weights as flattened views), AdamW on the rest."""
    return _torch_muon(wb, torch.optim.Muon if hasattr(torch.optim, "Muon") else None, torch.bfloat16)


def torch_muon_fp32_contender(wb: Workbench) -> Contender:
    """``torch.optim.Muon`` with its NS function swapped for the same iteration in fp32.

    torch fixes its NS to bf16; on a CPU without bf16 matmul units fastmuon computes in fp32,
    so this row is the equal-precision comparison there (and is not shown elsewhere).
    """
    _needs_fp32_row(wb)
    return _torch_muon(wb, _torch_muon_with_fp32_ns(), torch.float32)


def _needs_fp32_row(wb: Workbench) -> None:
    """A peer's fp32-swapped row is the equal-precision one only where fastmuon computes in fp32."""
    if compute_dtype(wb.ns_dtype, wb.device) == torch.bfloat16:
        raise Unavailable("fastmuon runs NS in bfloat16 here too: the bf16 row is the equal-precision one")


def _swapped_suffix(dtype: torch.dtype) -> str:
    """How a peer's row is named when its NS was swapped away from its own bf16."""
    return "" if dtype == torch.bfloat16 else f" (NS in {dtype_name(dtype)})"


def _torch_muon(wb: Workbench, cls: type | None, dtype: torch.dtype) -> Contender:
    if wb.optimizer != "muon":
        raise Unavailable("a Muon optimizer, not MuSGD: run with --optimizer muon to compare it")
    if cls is None:
        raise Unavailable(f"torch {torch.__version__} has no torch.optim.Muon (needs torch >= 2.9)")
    muon_groups, flattened = [], 0
    unmapped = as_2d_matrices(wb.groups(wb.is_matrix), wb.is_matrix)
    for g in unmapped.groups:
        views = []
        for p in g["params"]:
            if p.ndim > 2:  # torch's Muon takes 2D only: a (out, rest) view shares p's memory
                flattened += 1
                v = p.detach().view(p.shape[0], -1)
                v.grad = p.grad.view(p.shape[0], -1)
                views.append(v)
            else:
                views.append(p)
        muon_groups.append(
            {k: g[k] for k in ("lr", "weight_decay", "momentum", "nesterov") if k in g} | {"params": views}
        )
    others = [
        {k: v for k, v in g.items() if k in ("lr", "weight_decay", "params")}
        for g in wb.groups(lambda p, g: not wb.is_matrix(p, g))
    ]
    optimizers: list[torch.optim.Optimizer] = []
    if muon_groups:
        optimizers.append(cls(muon_groups))
    if others:
        optimizers.append(torch.optim.AdamW(others, betas=(0.9, 0.95), foreach=True))
    precision = "bfloat16 (fixed by torch)" if dtype == torch.bfloat16 else "float32 (torch's swapped)"
    note = f"NS in {precision}; rest: torch.optim.AdamW(foreach=True)"
    note += (
        f"; {counted(flattened, '>2D weight')} flattened to (out, rest) views"
        if flattened
        else "; all matrices 2D"
    )
    note += unmapped.note
    return Contender(
        f"torch.optim.Muon{_swapped_suffix(dtype)}",
        optimizers,
        dtype,
        note,
        ns_useful_flops=wb.matrix_flops(),
        ns_flops=wb.matrix_flops(),
        extra={"flattened_weights": flattened, "mapped_tensors_as_views": unmapped.tensors},
    )


def _torch_muon_with_fp32_ns() -> type | None:
    """A ``torch.optim.Muon`` whose steps run its per-matrix NS in fp32 instead of bf16.

    Its step looks the NS function up in its own module, so each step swaps that one global
    for :func:`_fp32_zeropower` and restores it afterwards; everything else is torch's code.
    """
    if not hasattr(torch.optim, "Muon"):
        return None
    module = sys.modules[torch.optim.Muon.__init__.__module__]  # the defining module (torch.optim._muon)
    if not callable(getattr(module, "_zeropower_via_newtonschulz", None)):
        raise Unavailable(f"torch {torch.__version__}: no _zeropower_via_newtonschulz to run in fp32")

    class TorchMuonFp32NS(torch.optim.Muon):
        def step(self, closure=None):
            original = module._zeropower_via_newtonschulz
            module._zeropower_via_newtonschulz = _fp32_zeropower
            try:
                return super().step(closure)
            finally:
                module._zeropower_via_newtonschulz = original

    return TorchMuonFp32NS


def _fp32_zeropower(grad: Tensor, ns_coefficients: tuple, ns_steps: int, eps: float) -> Tensor:
    """torch.optim.Muon's NS contract (2D, its norm clamped at ``eps``) computed in fp32 by our
    own kernel, ``fastmuon.ns.newton_schulz`` (standard form, per matrix as torch does)."""
    X = grad.float()
    X = X / X.norm().clamp(min=eps)
    return newton_schulz(X, ns_steps, ns_coefficients, eps=0.0, dtype=torch.float32, method="standard")


def sgd_contender(wb: Workbench) -> Contender:
    """The floor: ``torch.optim.SGD(foreach=True)`` with the same groups (no orthogonalisation)."""
    # torch's foreach SGD uses p.grad as scratch (Nesterov without weight decay adds the momentum
    # into it), so it steps a copy of the tensors and the others keep their gradients intact.
    own = wb.private_copy()
    groups = [
        {k: v for k, v in g.items() if k in ("lr", "momentum", "nesterov", "weight_decay", "params")}
        for g in own.groups()
    ]
    opt = torch.optim.SGD(groups, foreach=True)
    note = "the floor: same groups, no Newton–Schulz (on a copy: it writes into p.grad)"
    return Contender("torch.optim.SGD foreach", [opt], None, note)


def ultralytics_contender(wb: Workbench) -> Contender:
    """Ultralytics' MuSGD as shipped (run as a black box: its own batching, NS in bfloat16)."""
    _needs_musgd(wb)
    cls, version = load_ultralytics_musgd()
    return _ultralytics(wb, cls, version, torch.bfloat16, "its own batched NS, bfloat16")


def ultralytics_fp32_contender(wb: Workbench) -> Contender:
    """Ultralytics' MuSGD with its NS function swapped for the same iteration in fp32.

    Its batching, padding and foreach code run unchanged; only the matmul precision moves to
    what fastmuon computes in here. Shown when fastmuon's NS does not run in bf16 (a CPU
    without bf16 matmul units), so that one row compares the two at equal precision.
    """
    _needs_musgd(wb)
    _needs_fp32_row(wb)
    cls, version = load_ultralytics_musgd(fp32_ns=True)
    return _ultralytics(wb, cls, version, torch.float32, "its own batched NS, swapped to float32")


def _ultralytics(wb: Workbench, cls: type, version: str, dtype: torch.dtype, note: str) -> Contender:
    kwargs, _ = accepted_kwargs(cls, wb.manifest.optimizer_kwargs)
    unmapped = as_2d_matrices(wb.groups(), wb.is_matrix)
    try:
        opt = cls(unmapped.groups, **kwargs)
    except Exception as e:  # an API we do not know: say so rather than guess
        raise Unavailable(f"ultralytics {version} MuSGD rejected the groups: {e}") from None
    return Contender(
        f"Ultralytics MuSGD {version}{_swapped_suffix(dtype)}",
        [opt],
        dtype,
        note + unmapped.note,
        ns_useful_flops=wb.matrix_flops(),
    )


def _needs_musgd(wb: Workbench) -> None:
    if wb.optimizer != "musgd":
        raise Unavailable("Ultralytics ships MuSGD only: run with --optimizer musgd")


def load_ultralytics_musgd(fp32_ns: bool = False) -> tuple[type, str]:
    """Ultralytics' ``MuSGD`` class and the package version, loaded from its own module file.

    ``import ultralytics`` pulls in torchvision, OpenCV and more, which may not load beside the
    installed torch; the optimizer module itself needs only torch, so it is loaded on its own
    (``pip install --no-deps ultralytics`` is enough). With ``fp32_ns`` a private copy of the
    module gets :func:`_fp32_newton_schulz5` in place of its bf16 NS function. Raises
    :class:`Unavailable` with the reason when it cannot.
    """
    try:
        spec = importlib.util.find_spec("ultralytics")
        version = importlib.metadata.version("ultralytics")
    except (ImportError, ValueError, importlib.metadata.PackageNotFoundError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise Unavailable("the ultralytics package is not installed (pip install --no-deps ultralytics)")
    path = Path(next(iter(spec.submodule_search_locations))) / "optim" / "muon.py"
    if not path.is_file():
        raise Unavailable(f"ultralytics {version} has no optim/muon.py (MuSGD arrived in 8.4)")
    name = f"_fastmuon_bench_ultralytics_muon{'_fp32' if fp32_ns else ''}"
    module_spec = importlib.util.spec_from_file_location(name, path)
    if module_spec is None or module_spec.loader is None:
        raise Unavailable(f"ultralytics {version}: {path} cannot be loaded as a module")
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    cls = getattr(module, "MuSGD", None)
    if cls is None:
        raise Unavailable(f"ultralytics {version}: optim/muon.py defines no MuSGD")
    if fp32_ns:
        if not callable(getattr(module, "zeropower_via_newtonschulz5", None)):
            raise Unavailable(f"ultralytics {version}: no zeropower_via_newtonschulz5 to run in fp32")
        vars(module)["zeropower_via_newtonschulz5"] = _fp32_newton_schulz5
    return cls, version


def _fp32_newton_schulz5(G: Tensor, eps: float = 1e-7) -> Tensor:
    """Standard 5-step NS (Jordan's coefficients) on a matrix or batch, in fp32: what Ultralytics'
    bf16 function computes, at fastmuon's precision here. Our own code (``fastmuon.ns.newton_schulz``)."""
    return newton_schulz(G, steps=5, coefficients="jordan", eps=eps, dtype=torch.float32, method="standard")
