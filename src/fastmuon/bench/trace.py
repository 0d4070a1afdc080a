"""A step traced on fake ``cuda`` tensors: what it would launch and where it would wait, with no GPU.

Under ``torch._subclasses.fake_tensor.FakeTensorMode`` parameters, gradients and state are fake
``cuda`` tensors: every device branch takes the CUDA side and nothing is computed. A
:class:`TraceCounter` on top of the fake mode sees each ATen op the step dispatches and counts

* kernels: the CUDA launches of the ops that run one (views, bare allocations and ``prim``/
  ``profiler`` ops left out, see :func:`.counter.is_kernel`), as :mod:`.fake_cuda` reads them
  off the arguments: a ``_foreach`` op whose lists miss torch's fast route, or a ``cat``/
  ``stack`` of non-contiguous tensors, counts one kernel per tensor, as it runs on a GPU;
* host syncs: reads of a device value on the host (``item``, ``bool``, ``tolist`` reach
  ``_local_scalar_dense``; ``equal``; blocking copies between the host and the device; ops whose
  output size depends on the values), each with the line of the contender's own code that made
  it. A read gets a stand-in answer (see :func:`_stand_in`): the one finite values give, so a
  step's checks find nothing to report;
* what a GPU pays (:mod:`.gpu_cost`): the bytes its kernels read and write, its matmul FLOPs,
  the peak of the storages it creates, and a time modelled from them (a roofline per op plus a
  cost per launch, labelled "modelled": not a measurement).

Python calls are counted with :func:`sys.setprofile`, only those made from the contender's own
code. All of it is counts: kernel times, what cuBLAS fuses and the caching allocator are not
seen.
"""

from __future__ import annotations

import contextlib
import gc
import inspect
import logging
import os
import sys
import warnings
import weakref
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

from .contenders import Contender, Unavailable, Workbench, delegates, storage_id
from .counter import is_kernel
from .fake_cuda import fake_cuda_problem, is_fused_optimizer_op, launches, tensors_in
from .gpu_cost import GpuModel, OpCost, PeakTracker, flops_by_dtype, modelled_time, op_cost

aten = torch.ops.aten

#: the heading every traced figure carries
LABEL = "traced on fake cuda tensors: counts, not times"
#: steps a trace runs; the figures are the last one's (the first builds state and plans)
TRACE_STEPS = 3

_HERE = str(Path(__file__).resolve().parent)  # fastmuon/bench: the tools, not the optimizer
_TORCH = str(Path(torch.__file__).resolve().parent)
#: Python the dispatcher enters on its own (a dispatch mode's handler and its look-ups), also
#: from an operator such as ``a + b`` that makes no call event: never a call of the step's own
_DISPATCH = (
    os.path.join(_TORCH, "_compile.py"),
    os.path.join(_TORCH, "_library"),
    os.path.join(_TORCH, "_ops.py"),
    os.path.join(_TORCH, "utils", "_python_dispatch.py"),
    weakref.__file__,  # finalizers, run when a tensor is freed
    _HERE,
)
_NON_KERNEL_NAMESPACES = ("prim", "prims", "profiler")


class TraceError(RuntimeError):
    """A step the trace cannot follow (an op whose output size depends on device values)."""


@dataclass
class Sync:
    """One host read of a device value: what read it and the contender's line that asked."""

    what: str
    where: str
    answer: Any = None  # the stand-in value the read was given (None: the op ran)


@dataclass
class Fallback:
    """One op that takes torch's per-tensor route on a GPU: its kernels and why."""

    op: str
    kernels: int
    why: str
    where: str


class TraceCounter(TorchDispatchMode):
    """``with TraceCounter(roots): step()`` on fake tensors: kernels, host syncs and fallbacks.

    ``roots``: the folders (or files) of the contender's code, where a sync's source line is
    looked for (innermost frame first). Set ``recording`` False for steps not to count; syncs
    are answered either way.
    """

    def __init__(self, roots: Sequence[str] = (), excluded: Sequence[str] = (_HERE,)) -> None:
        super().__init__()
        self.roots, self.excluded = tuple(roots), tuple(excluded)
        self.recording = True
        self.reset()

    def reset(self) -> None:
        self.kernels = 0  # CUDA launches
        self.aten_ops = 0  # kernel-running ATen ops, one each (what .counter.KernelCounter counts)
        self.host_ops = 0  # of those, the ones on CPU tensors only (no CUDA launch)
        self.ops: Counter[str] = Counter()  # op name -> CUDA launches
        self.syncs: list[Sync] = []
        self.fallbacks: list[Fallback] = []
        self.costs: list[OpCost] = []  # per kernel-launching op: its kernels, bytes, matmul FLOPs
        self.op_bytes: Counter[str] = Counter()  # op name -> bytes moved
        self.peak = PeakTracker()  # the storages the recorded ops create

    @property
    def bytes_moved(self) -> int:
        return sum(c.bytes for c in self.costs)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        sync = _sync_of(func, args, kwargs)
        if sync is not None:
            answer = None
            if func is aten._local_scalar_dense.default:
                answer = _stand_in(args[0])
            elif func is aten.equal.default:
                answer = True
            if self.recording:
                self.syncs.append(Sync(sync, self.where(), answer))
            if answer is not None:
                return answer
        elif func is aten._local_scalar_dense.default and _is_fake(args[0]):
            constant = getattr(args[0], "constant", None)  # a fake CPU tensor made from a value
            return constant.item() if constant is not None else _stand_in(args[0])
        try:
            result = None if is_fused_optimizer_op(func) and _any_fake(args) else func(*args, **kwargs)
        except Exception as e:
            if type(e).__name__ in ("DynamicOutputShapeException", "DataDependentOutputException"):
                where = self.where()
                raise TraceError(
                    f"{func} needs device values on the host (a host sync on a GPU) at {where}: "
                    "the trace cannot follow it"
                ) from None
            raise
        if isinstance(result, Tensor) and result.dtype == torch.bool and result.dim() == 0:
            result.fastmuon_trace_made_by = func.overloadpacket.__name__  # read by _stand_in
        if self.recording:
            self.peak.saw((args, kwargs), result)
        if self.recording and is_kernel(func) and func.namespace not in _NON_KERNEL_NAMESPACES:
            n, why = launches(func, args, kwargs, result)
            self.aten_ops += 1
            if n:
                self.kernels += n
                self.ops[str(func.overloadpacket.__name__)] += n
                cost = op_cost(func, args, kwargs, result, n)
                self.costs.append(cost)
                self.op_bytes[str(func.overloadpacket.__name__)] += cost.bytes
            else:
                self.host_ops += 1
            if why is not None:
                self.fallbacks.append(Fallback(str(func.overloadpacket.__name__), n, why, self.where()))
        return result

    def where(self) -> str:
        """``file:line function`` of the innermost frame in ``roots`` (files relative to the root's
        folder); ``?`` and the innermost frame outside torch when none is."""
        frame = inspect.currentframe()
        outside = None
        while frame is not None:
            file = frame.f_code.co_filename
            if _under(file, self.roots) and not _under(file, self.excluded):
                root = next(r for r in self.roots if _under(file, (r,)))
                return (
                    f"{os.path.relpath(file, os.path.dirname(root))}:{frame.f_lineno} {frame.f_code.co_name}"
                )
            if outside is None and not _under(file, (_TORCH, _HERE)):
                outside = f"{os.path.basename(file)}:{frame.f_lineno} {frame.f_code.co_name}"
            frame = frame.f_back
        return f"? {outside or ''}".strip()


def _under(file: str, roots: Sequence[str]) -> bool:
    return any(file == r or file.startswith(r.rstrip(os.sep) + os.sep) for r in roots)


def _any_fake(args: Any) -> bool:
    """Whether any tensor in ``args`` (lists and tuples included) is a fake tensor."""
    return any(map(_is_fake, tensors_in(args)))


def _is_fake(t: Any) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


def _on_device(t: Any) -> bool:
    return isinstance(t, Tensor) and t.device.type not in ("cpu", "meta")


def _sync_of(func, args: Sequence[Any], kwargs: dict[str, Any]) -> str | None:
    """What makes the host wait for the device in this op (None: nothing)."""
    if func is aten._local_scalar_dense.default:
        return "item (_local_scalar_dense)" if _on_device(args[0]) else None
    if func is aten.equal.default:
        return "equal" if any(_on_device(a) for a in args) else None
    if kwargs.get("non_blocking") or (len(args) > 2 and func is aten.copy_.default and args[2]):
        return None
    if func is aten._to_copy.default and isinstance(args[0], Tensor):
        device = kwargs.get("device")
        if device is not None and torch.device(device).type != args[0].device.type:
            return f"blocking copy {args[0].device.type}→{torch.device(device).type}"
    if (
        func is aten.copy_.default
        and isinstance(args[1], Tensor)
        and args[0].device.type != args[1].device.type
    ):
        if args[1].dim() == 0 and not _on_device(args[1]):
            return None  # a CPU scalar is passed to the kernel by value
        return f"blocking copy {args[1].device.type}→{args[0].device.type}"
    return None


#: a boolean read of these ops' results is answered True, of any other op's False: a step's
#: checks then find every value finite and nothing to report (``isfinite(x).all()``, ``isnan(x).any()``)
_TRUE_WHEN_FINITE = ("all", "isfinite", "eq", "equal", "logical_and")


def _stand_in(t: Tensor) -> bool | int | float:
    """The value a host read is answered with: the one of finite, ordinary values for a boolean,
    0 for an integer (no bad entries counted), 1.0 for a float (a safe divisor)."""
    if t.dtype == torch.bool:
        return getattr(t, "fastmuon_trace_made_by", None) in _TRUE_WHEN_FINITE
    return 0 if not (t.is_floating_point() or t.is_complex()) else 1.0


@contextlib.contextmanager
def own_calls(roots: Sequence[str], excluded: Sequence[str] = (_HERE,)) -> Iterator[list[int]]:
    """Count the function calls (Python functions and built-ins, torch's ops among them) made
    from code under ``roots``: ``with own_calls(roots) as n: step()``, then ``n[0]``.

    The caller's file decides. Python entered from inside a built-in the contender's code
    called counts only when it is the contender's own (a key function, say): the rest is what
    the dispatcher calls back into (dispatch modes, fake tensors), not a call the step makes;
    nor do the dispatcher's own entries (:data:`_DISPATCH`).
    """
    counted = [0]
    own: dict[Any, bool] = {}
    in_builtin: list[Any] = []  # the own frames now inside a built-in they called

    def is_own(code) -> bool:
        hit = own.get(code)
        if hit is None:
            file = code.co_filename
            hit = own[code] = _under(file, roots) and not _under(file, excluded)
        return hit

    def count(frame, event, arg):
        if event == "call":
            caller = frame.f_back
            if caller is None or not is_own(caller.f_code) or _under(frame.f_code.co_filename, _DISPATCH):
                return
            if not in_builtin or in_builtin[-1] is not caller or is_own(frame.f_code):
                counted[0] += 1
        elif event == "c_call":
            if is_own(frame.f_code):
                counted[0] += 1
                in_builtin.append(frame)
        elif event in ("c_return", "c_exception") and in_builtin and in_builtin[-1] is frame:
            in_builtin.pop()

    previous = sys.getprofile()
    sys.setprofile(count)
    try:
        yield counted
    finally:
        sys.setprofile(previous)


# ----- a contender's trace ------------------------------------------------------------------------
@dataclass
class Trace:
    """Every traced figure of one contender's step (``error`` set instead when it did not trace)."""

    name: str
    kernels: int | None = None
    aten_ops: int | None = None
    host_ops: int | None = None
    top_ops: dict[str, int] = field(default_factory=dict)
    syncs: list[Sync] = field(default_factory=list)
    fallbacks: list[Fallback] = field(default_factory=list)
    python_calls: int | None = None
    ns_flops: int | None = None
    ns_useful_flops: int | None = None
    state_bytes: int | None = None
    workspace_bytes: int | None = None
    kept_bytes: int | None = None
    #: what the GPU pays (fastmuon.bench.gpu_cost): bytes the kernels read and write, matmul FLOPs
    #: per dtype, the most bytes of storages made during the step alive at once
    bytes_moved: int | None = None
    top_bytes: dict[str, int] = field(default_factory=dict)  # the ops moving the most, op name -> bytes
    matmul_flops: dict[str, int] = field(default_factory=dict)
    peak_extra_bytes: int | None = None
    #: the step's time on ``modelled_gpu`` by the roofline of gpu_cost.modelled_time (not measured)
    modelled_ms: float | None = None
    modelled_gpu: dict[str, Any] = field(default_factory=dict)
    roots: list[str] = field(default_factory=list)
    note: str = ""  # how the contender was built (its options)
    error: str | None = None

    @property
    def host_syncs(self) -> int | None:
        return None if self.error else len(self.syncs)

    def summary(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d.update(
            label=LABEL,
            host_syncs=self.host_syncs,
            syncs=[s.__dict__ for s in self.syncs],
            sync_sites=dict(Counter(f"{s.what} at {s.where}" for s in self.syncs)),
            fallbacks=[f.__dict__ for f in self.fallbacks],
            matmul_flops_total=None if self.error else sum(self.matmul_flops.values()),
        )
        return d


def package_roots(optimizers: Sequence[torch.optim.Optimizer]) -> list[str]:
    """Where the optimizers' own code lies: torch's optimizers' folder (``torch/optim``) for
    torch's classes, else the top-level package folder of each class's file (``fastmuon``,
    ``heavyball``, ``pytorch_optimizer``, ``ultralytics`` for its ``optim/muon.py`` loaded alone)."""
    roots: list[str] = []
    for opt in optimizers:
        for inner in [opt, *delegates(opt)]:
            for klass in type(inner).__mro__:
                if (
                    klass is torch.optim.Optimizer
                    or klass.__module__.split(".")[0] in sys.stdlib_module_names
                ):
                    continue  # the base class, and mixins such as abc.ABC, are nobody's own code
                file = _class_file(klass)
                if file is None:
                    continue
                root = os.path.dirname(file)
                if not _under(root, (_TORCH,)):
                    while os.path.isfile(os.path.join(os.path.dirname(root), "__init__.py")):
                        root = os.path.dirname(root)
                if root not in roots:
                    roots.append(root)
    return roots


def _class_file(klass: type) -> str | None:
    """The file defining ``klass``, also for a module loaded from a path and not registered."""
    try:
        return os.path.abspath(inspect.getfile(klass))
    except (TypeError, OSError):
        for value in vars(klass).values():
            code = getattr(value, "__code__", None)
            if code is not None:
                return os.path.abspath(code.co_filename)
    return None


def live_storages() -> dict[int, int]:
    """Every storage a Python tensor holds now: its identity -> bytes (found with gc). A storage
    of symbolic size (a fake tensor a ``torch.compile`` earlier in the process left alive, whose
    sizes are symbols of its shape environment) is no memory of any step and is left out: its
    size would make every sum over it symbolic."""
    out: dict[int, int] = {}
    for obj in gc.get_objects():
        if issubclass(type(obj), Tensor):  # not isinstance: that reads lazy modules' __class__
            with contextlib.suppress(Exception):  # tensors without storage (sparse, nested)
                nbytes = obj.untyped_storage().nbytes()
                if isinstance(nbytes, int):
                    out[storage_id(obj)] = nbytes
    return out


#: the attribute :func:`mark_older` sets on every live tensor
_OLDER = "fastmuon_trace_older"


def mark_older() -> None:
    """Mark every tensor alive now as older than what is built next (see :func:`trace_contender`).

    A mark on the tensor, not a list of storage identities: an identity freed since may be
    reused by a new storage, while a marked tensor alive keeps its storage, and so its identity."""
    for obj in gc.get_objects():
        if issubclass(type(obj), Tensor):
            with contextlib.suppress(Exception):
                setattr(obj, _OLDER, True)


def _older_storages() -> set[int]:
    out = set()
    for obj in gc.get_objects():
        if issubclass(type(obj), Tensor) and getattr(obj, _OLDER, False):
            with contextlib.suppress(Exception):
                out.add(storage_id(obj))
    return out


def _storage_ids(tensors) -> set[int]:
    return {storage_id(t) for t in tensors if isinstance(t, Tensor)}


def trace_step(
    step: Callable[[], object],
    roots: Sequence[str],
    steps: int = TRACE_STEPS,
    before_last: Callable[[], None] | None = None,
) -> tuple[TraceCounter, int]:
    """Call ``step`` ``steps`` times under a :class:`TraceCounter` (inside an active fake mode)
    and count the last call: the counter, and the Python calls made from ``roots``.
    ``before_last`` runs right before the last call, outside the counts."""
    counter = TraceCounter(roots)
    counter.recording = False
    with counter:
        for _ in range(steps - 1):
            step()
        if before_last is not None:
            before_last()
        counter.recording = True
        try:
            with own_calls(roots) as calls:
                step()
        finally:
            counter.recording = False
            counter.peak.close()
    return counter, calls[0]


def trace_contender(contender: Contender, steps: int = TRACE_STEPS, gpu: GpuModel | None = None) -> Trace:
    """Run ``contender``'s step ``steps`` times (inside an active fake mode) and trace the last;
    its modelled time is on ``gpu`` (default: :class:`.gpu_cost.GpuModel`'s H200).

    "Kept" is every storage alive before the last step (after two, by default) that is
    neither a parameter or gradient of its optimizers nor held by a tensor marked older than
    the contender (:func:`mark_older`, called before it was built): state, workspaces, caches,
    found with :func:`gc.get_objects` (a tensor only C++ holds is not seen).
    """
    optimizers = [inner for opt in contender.optimizers for inner in delegates(opt)]
    roots = package_roots(contender.optimizers)
    trace = Trace(contender.name, roots=roots, note=contender.note)

    def kept() -> None:
        trace.kept_bytes = _kept_bytes(optimizers)

    try:
        counter, calls = trace_step(contender.step, roots, steps, kept)
    except Exception as e:
        text = str(e).strip().splitlines()[0] if str(e).strip() else ""
        trace.error = f"{type(e).__name__}: {text}"[:300]
        return trace
    trace.kernels, trace.aten_ops, trace.host_ops = counter.kernels, counter.aten_ops, counter.host_ops
    trace.top_ops = dict(counter.ops.most_common(8))
    trace.syncs, trace.fallbacks, trace.python_calls = counter.syncs, counter.fallbacks, calls
    trace.state_bytes, trace.workspace_bytes = contender.state_bytes(), contender.workspace_bytes()
    gpu = gpu or GpuModel()
    modelled = modelled_time(counter.costs, gpu)
    trace.bytes_moved, trace.matmul_flops = counter.bytes_moved, flops_by_dtype(counter.costs)
    trace.top_bytes = dict(counter.op_bytes.most_common(8))
    trace.peak_extra_bytes, trace.modelled_ms = counter.peak.peak, modelled.ms
    trace.modelled_gpu = {**gpu.__dict__, **{k: v for k, v in modelled.__dict__.items() if k != "ms"}}
    plan = contender.plan()
    if plan is not None:
        trace.ns_flops, trace.ns_useful_flops = plan.flops(), plan.useful_flops()
    else:
        trace.ns_useful_flops = contender.ns_useful_flops or (0 if contender.ns_dtype is None else None)
        trace.ns_flops = contender.ns_flops if contender.ns_dtype is not None else 0
    return trace


def _kept_bytes(optimizers: list[torch.optim.Optimizer]) -> int:
    params = [p for opt in optimizers for g in opt.param_groups for p in g["params"]]
    grads = [p.grad for p in params if p.grad is not None]
    mine = _storage_ids(params) | _storage_ids(grads) | _older_storages()
    return sum(n for s, n in live_storages().items() if s not in mine)


# ----- a lineup on fake cuda tensors ----------------------------------------------------------------
@contextlib.contextmanager
def fake_cuda() -> Iterator[Any]:
    """The fake mode the trace runs in (``allow_non_fake_inputs``: real CPU tensors made before,
    such as a tensor learning rate, are taken as they are); :class:`Unavailable` with the reason
    where this torch cannot make fake cuda tensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    problem = fake_cuda_problem()
    if problem:
        raise Unavailable(problem)
    # an op a peer's step fails on is reported in its row; the fake mode also logs its traceback
    log = logging.getLogger("torch._subclasses.fake_tensor")
    level = log.level
    log.setLevel(logging.CRITICAL)
    try:
        with warnings.catch_warnings(), FakeTensorMode(allow_non_fake_inputs=True) as mode:
            # a peer that reads data pointers (to key a cache) gets 0 from every fake tensor
            warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
            yield mode
    finally:
        log.setLevel(level)


def trace_lineup(
    workbench: Callable[[], Workbench],
    factories: Sequence[tuple[str, Callable[[Workbench], Contender]]],
    steps: int = TRACE_STEPS,
    gpu: GpuModel | None = None,
) -> list[Trace]:
    """Build ``workbench()`` on fake cuda tensors and trace each ``(label, factory)``'s step
    (modelled on ``gpu``); a contender that cannot be built is a trace with ``error`` set (its reason)."""
    traces = []
    with fake_cuda():
        wb = workbench()
        for label, factory in factories:
            mark_older()
            try:
                contender = factory(wb)
            except Unavailable as e:
                traces.append(Trace(label, error=f"not available: {e}"))
                continue
            except Exception as e:
                traces.append(Trace(label, error=f"failed to build: {type(e).__name__}: {e}"[:300]))
                continue
            traces.append(trace_contender(contender, steps, gpu))
            del contender
    return traces


def factories_for(optimizer: str, chosen: tuple[str, ...] | None = None):
    """The lineup's ``(label, factory)`` pairs for ``optimizer`` (``chosen``: label prefixes)."""
    from .lineup import CONTENDER_LABELS, CONTENDERS
    from .runner import selected

    pairs = [(CONTENDER_LABELS.get(f, f.__name__), f) for f in CONTENDERS[optimizer]]
    return [(label, f) for label, f in pairs if selected(label, chosen)]


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.1f}"


def _gflop(t: Trace) -> str:
    if t.ns_flops is None:
        return "?" if not t.ns_useful_flops else f"≥{t.ns_useful_flops / 1e9:.2f}"
    return f"{t.ns_flops / 1e9:.2f}"


HEADER = [
    "contender",
    "kernels",
    "host syncs",
    "Python calls",
    "NS GFLOP",
    "state MiB",
    "workspace MiB",
    "kept MiB",
]
#: what the GPU pays (fastmuon.bench.gpu_cost), after :data:`HEADER`'s columns
COST_HEADER = ["GiB moved", "matmul GFLOP", "peak extra MiB"]


def header(traces: Sequence[Trace]) -> list[str]:
    """The table's columns; the last names the GPU the time is modelled on."""
    gpu = next((t.modelled_gpu.get("name") for t in traces if t.modelled_gpu), None) or GpuModel().name
    return [*HEADER, *COST_HEADER, f"modelled {gpu} ms"]


def _gib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**30:.2f}"


def rows(traces: Sequence[Trace]) -> list[list[str]]:
    width = len(HEADER) + len(COST_HEADER) + 1
    body = []
    for t in traces:
        if t.error:
            body.append([t.name, t.error, *[""] * (width - 2)])
            continue
        body.append(
            [
                t.name,
                str(t.kernels),
                str(t.host_syncs),
                str(t.python_calls),
                _gflop(t),
                _mib(t.state_bytes),
                _mib(t.workspace_bytes),
                _mib(t.kept_bytes),
                _gib(t.bytes_moved),
                f"{sum(t.matmul_flops.values()) / 1e9:.2f}",
                _mib(t.peak_extra_bytes),
                "-" if t.modelled_ms is None else f"{t.modelled_ms:.2f}",
            ]
        )
    return body


def table_lines(traces: Sequence[Trace], title: str = "", details: int = 6) -> list[str]:
    """The table under its label, then per contender its top ops, host syncs (with their lines)
    and per-tensor fallbacks (at most ``details`` lines of each)."""
    body, head = rows(traces), header(traces)
    shown = [head, *(r for t, r in zip(traces, body) if not t.error)]
    widths = [max(len(r[i]) for r in shown) for i in range(len(head))]
    fmt = lambda r: "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))  # noqa: E731
    lines = [f"{title}{' — ' if title else ''}{LABEL}", fmt(head)]
    lines += [fmt(r) if not t.error else f"{t.name}: {t.error}" for t, r in zip(traces, body)]
    for t in traces:
        if t.error:
            continue
        lines.append(f"{t.name}: top ops " + ", ".join(f"{k} {v}" for k, v in t.top_ops.items()))
        lines.append("    most bytes (GiB): " + ", ".join(f"{k} {_gib(v)}" for k, v in t.top_bytes.items()))
        sites = Counter(f"{s.what} at {s.where}" for s in t.syncs)
        for site, n in list(sites.items())[:details]:
            lines.append(f"    host sync ×{n}: {site}")
        falls = Counter(f"{f.op} ({f.why}) at {f.where}" for f in t.fallbacks)
        for site, n in list(falls.items())[:details]:
            lines.append(f"    per-tensor fallback ×{n}: {site}")
    return lines


def markdown_table(traces: Sequence[Trace], title: str = "") -> str:
    """The table as Markdown, under its label."""
    head = header(traces)
    lines = [f"**{title}{' — ' if title else ''}{LABEL}**", "", "| " + " | ".join(head) + " |"]
    lines.append("|" + "|".join(["---"] + ["---:"] * (len(head) - 1)) + "|")
    for t, r in zip(traces, rows(traces)):
        cells = [t.name, t.error, *[""] * (len(head) - 2)] if t.error else r
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
