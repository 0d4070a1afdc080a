"""What a traced step would cost a GPU: bytes moved, matmul FLOPs, peak extra memory, and a
modelled time from them.

All of it is read off the ops' arguments and results (shapes, strides, dtypes), so it works on
fake tensors and on real ones alike; :class:`.trace.TraceCounter` calls it for every op that
launches a kernel.

* **Bytes moved** (:func:`op_bytes`): what a kernel reads plus what it writes, each tensor as its
  view addresses it (elements times element size, a broadcast dimension, stride 0, counted
  once), not its storage. An argument the op mutates counts as read and written, except where
  the op only writes it (``copy_``'s destination, ``fill_``, ``zero_``, random fills, ``out=``);
  results that alias no argument are written. Approximations: an indexing op reads only the
  rows it selects (``index_select``, ``gather``, ``embedding``: as many as it writes), a scatter
  writes only the rows it is given (``index_copy_``, ``index_add_``, ``scatter_``,
  ``index_put_``: its source's bytes); a fused optimizer kernel (``_fused_adamw_``) reads its
  gradients, which its schema marks mutable, without writing them; ``addmm``-like ops with ``beta=0`` do not read ``self``; a
  0-dim CPU tensor (passed to the kernel by value) moves nothing. Caches are not modelled: every
  kernel reads and writes HBM.
* **Matmul FLOPs** (:func:`matmul_flops`): ``2·m·n·k`` per product, batches included, for
  ``mm``, ``bmm``, ``addmm``, ``baddbmm``, ``addbmm``, ``matmul``, ``mv``/``addmv``/``dot`` and
  ``_scaled_mm``, by the dtype they multiply in; a symmetric eigendecomposition
  (``linalg_eigh``) counts ``9·n³`` per matrix (Golub and Van Loan's figure for the symmetric QR
  algorithm with eigenvectors). Elementwise arithmetic is left to the bytes it moves.
* **Peak extra memory** (:class:`PeakTracker`): of the storages the step's ops create, the most
  bytes alive at once; storages made before the step (parameters, gradients, state and
  workspaces kept from earlier steps) do not count, new state made during the step does. Sizes
  are the storages' own (no caching-allocator rounding).
* **Modelled time** (:func:`modelled_time`): per op a roofline, ``max(FLOPs / matmul rate of
  its dtype, bytes / bandwidth)``, plus the per-launch cost for each of its kernels. The launch
  cost is added, not overlapped: an optimizer step is mostly small dependent kernels, whose
  launch latency and the gaps between them a GPU does not hide.
"""

from __future__ import annotations

import math
import weakref
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from .fake_cuda import tensors_in
from .options import GPU_BANDWIDTH_TBS, GPU_FP32_TFLOPS, GPU_LAUNCH_US, GPU_MODEL, GPU_TFLOPS

aten = torch.ops.aten

# ----- bytes moved ----------------------------------------------------------------------------------
#: ops whose first argument is only written (its old values are not read)
PURE_WRITES = frozenset(
    {
        "copy_",
        "_foreach_copy_",
        "fill_",
        "_foreach_zero_",
        "zero_",
        "normal_",
        "uniform_",
        "random_",
        "bernoulli_",
        "exponential_",
    }
)
#: ops that read from their first argument only the rows they write
_GATHERS = frozenset({"index_select", "gather", "embedding"})
#: ops that write into their first argument only where their source lands
_SCATTERS = frozenset(
    {
        "index_copy_",
        "index_add_",
        "scatter_",
        "scatter_add_",
        "scatter_reduce_",
        "index_put_",
        "_index_put_impl_",
    }
)
#: ops that add ``beta * self``: with ``beta=0`` ``self`` is not read
_BETA = frozenset({"addmm", "baddbmm", "addbmm", "addmv", "addr"})


def view_bytes(t: Tensor) -> int:
    """The bytes ``t``'s view addresses: its elements (a stride-0, broadcast dimension once)
    times the element size. A 0-dim CPU tensor is a scalar passed by value: none."""
    if t.dim() == 0 and t.device.type == "cpu":
        return 0
    elements = math.prod(n for n, s in zip(t.shape, t.stride()) if s != 0)
    return elements * t.element_size()


def _tensors(value: Any) -> Iterator[Tensor]:
    if isinstance(value, Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)


def _bound(func: torch._ops.OpOverload, args: Sequence[Any], kwargs: dict[str, Any]):
    """``(schema argument, value)`` for every argument given, positional or keyword."""
    schema = func._schema.arguments
    for i, value in enumerate(args):
        if i < len(schema):
            yield schema[i], value
    by_name = {a.name: a for a in schema}
    for name, value in kwargs.items():
        if name in by_name:
            yield by_name[name], value


def _size(values: Iterable[Tensor]) -> int:
    return sum(view_bytes(t) for t in values)


@dataclass
class Moved:
    """One op's bytes read and written."""

    read: int = 0
    written: int = 0

    @property
    def total(self) -> int:
        return self.read + self.written


def op_bytes(func: torch._ops.OpOverload, args: Sequence[Any], kwargs: dict[str, Any], result: Any) -> Moved:
    """The bytes one kernel-running op reads and writes (see the module's rules)."""
    name = func.overloadpacket.__name__
    base = name.removesuffix("_") if not name.startswith("_") else name
    moved = Moved()
    first = True
    for arg, value in _bound(func, args, kwargs):
        tensors = list(_tensors(value))
        is_first, first = first, False
        if not tensors:
            continue
        mutated = arg.alias_info is not None and arg.alias_info.is_write
        if is_first and base in _BETA and kwargs.get("beta", 1) == 0:
            continue
        if is_first and name in _SCATTERS:
            continue  # counted from the source below
        if is_first and name in _GATHERS:
            continue  # counted from the result below
        if mutated and not (arg.name == "grads" and name.startswith("_fused_")):
            # (a fused optimizer kernel's schema marks its gradients mutable; it reads them)
            moved.written += _size(tensors)
            pure = arg.kwarg_only or (is_first and name in PURE_WRITES)
            if not pure:
                moved.read += _size(tensors)
        else:
            moved.read += _size(tensors)
    if name in _SCATTERS:
        moved.written += _scattered(name, args, kwargs)
        if name in ("index_add_", "scatter_add_", "scatter_reduce_") or (
            name in ("index_put_", "_index_put_impl_") and _arg(args, kwargs, 3, "accumulate", False)
        ):
            moved.read += _scattered(name, args, kwargs)
    returns = func._schema.returns
    # one return (a Tensor or a Tensor[] list, which may come back as a tuple) or a tuple of them
    values = result if len(returns) > 1 and isinstance(result, tuple) else (result,)
    for ret, value in zip(returns, values):
        if ret.alias_info is None:
            written = _size(_tensors(value))
            moved.written += written
            if name in _GATHERS:
                moved.read += written  # the rows read are as many as those written
    return moved


def _arg(args: Sequence[Any], kwargs: dict[str, Any], i: int, name: str, default: Any) -> Any:
    return args[i] if len(args) > i else kwargs.get(name, default)


def _scattered(name: str, args: Sequence[Any], kwargs: dict[str, Any]) -> int:
    """Bytes a scatter writes into its first argument: its source's (``index_put_``: values')
    elements at the destination's element size; for ``scatter_`` with a Scalar, the index's."""
    dest = args[0]
    if name in ("index_put_", "_index_put_impl_"):
        source = _arg(args, kwargs, 2, "values", None)
    else:
        source = _arg(args, kwargs, 3, "source" if name.startswith("index") else "src", None)
        if not isinstance(source, Tensor):
            source = _arg(args, kwargs, 2, "index", None)
    if not isinstance(source, Tensor):
        return 0
    return source.numel() * dest.element_size()


# ----- matmul FLOPs ---------------------------------------------------------------------------------
_PRODUCTS = {
    # name -> positions of (A, B) among the arguments
    "mm": (0, 1),
    "bmm": (0, 1),
    "matmul": (0, 1),
    "mv": (0, 1),
    "dot": (0, 1),
    "vdot": (0, 1),
    "_scaled_mm": (0, 1),
    "addmm": (1, 2),
    "baddbmm": (1, 2),
    "addbmm": (1, 2),
    "addmv": (1, 2),
}
_EIGH = frozenset({"_linalg_eigh", "linalg_eigh"})


def matmul_flops(
    func: torch._ops.OpOverload, args: Sequence[Any], kwargs: dict[str, Any]
) -> tuple[int, torch.dtype | None]:
    """``(FLOPs, dtype multiplied in)`` of a matrix product or decomposition; ``(0, None)`` for
    any other op."""
    name = func.overloadpacket.__name__.removesuffix("_")
    if name in _EIGH and isinstance(args[0], Tensor) and args[0].dim() >= 2:
        m = args[0]
        return 9 * m.shape[-1] ** 3 * math.prod(m.shape[:-2]), m.dtype
    where = _PRODUCTS.get(name)
    if where is None:
        return 0, None
    a, b = (args[i] if len(args) > i else None for i in where)
    if not (isinstance(a, Tensor) and isinstance(b, Tensor)):
        return 0, None
    return product_flops(tuple(a.shape), tuple(b.shape)), a.dtype


def product_flops(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    """``2·m·n·k`` times the broadcast batch of ``a @ b`` (``torch.matmul``'s shape rules)."""
    if len(a) == 1 and len(b) == 1:
        return 2 * a[0]
    m = 1 if len(a) == 1 else a[-2]
    k = a[-1]
    n = 1 if len(b) == 1 else b[-1]
    batch = torch.broadcast_shapes(tuple(a[:-2]), tuple(b[:-2])) if len(a) > 2 or len(b) > 2 else ()
    return 2 * m * n * k * math.prod(batch)


# ----- one op's cost, and a step's -----------------------------------------------------------------
@dataclass(frozen=True)
class OpCost:
    """What one op asks of the GPU: its kernels, the bytes it moves, its matmul FLOPs."""

    kernels: int
    bytes: int
    flops: int = 0
    dtype: torch.dtype | None = None  # what the FLOPs multiply in


def op_cost(
    func: torch._ops.OpOverload, args: Sequence[Any], kwargs: dict[str, Any], result: Any, kernels: int
) -> OpCost:
    flops, dtype = matmul_flops(func, args, kwargs)
    return OpCost(kernels, op_bytes(func, args, kwargs, result).total, flops, dtype)


def flops_by_dtype(costs: Iterable[OpCost]) -> dict[str, int]:
    """Matmul FLOPs per dtype name (``bfloat16``, ``float32``), the dtypes with none left out."""
    out: Counter[str] = Counter()
    for c in costs:
        if c.flops and c.dtype is not None:
            out[str(c.dtype).removeprefix("torch.")] += c.flops
    return dict(out)


# ----- modelled time --------------------------------------------------------------------------------
_HALF = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class GpuModel:
    """The rates a modelled time is computed with; the defaults are an H200's.

    ``matmul_tflops``: dense bf16/fp16 (and fp8) matmuls on tensor cores, 790 TFLOP/s (0.8 of
    the 989 of NVIDIA's datasheet, what large cuBLAS GEMMs reach); ``fp32_tflops``: fp32 and
    fp64 matmuls, 67 TFLOP/s, the datasheet's fp32 (non-tensor-core) and fp64 tensor-core
    figure: torch runs fp32 matmuls without TF32 unless told
    (``torch.backends.cuda.matmul.allow_tf32``), so this is what an fp32 NS gets;
    ``bandwidth_tbs``: HBM, 4.3 TB/s (0.9 of the datasheet's 4.8); ``launch_us``: per kernel."""

    name: str = GPU_MODEL
    matmul_tflops: float = GPU_TFLOPS
    fp32_tflops: float = GPU_FP32_TFLOPS
    bandwidth_tbs: float = GPU_BANDWIDTH_TBS
    launch_us: float = GPU_LAUNCH_US

    def __post_init__(self) -> None:
        for key in ("matmul_tflops", "fp32_tflops", "bandwidth_tbs"):
            if not getattr(self, key) > 0:
                raise ValueError(f"GpuModel {key} must be a positive rate, got {getattr(self, key)!r}")
        if not self.launch_us >= 0:
            raise ValueError(f"GpuModel launch_us must be 0 or more, got {self.launch_us!r}")

    def matmul_rate(self, dtype: torch.dtype | None) -> float:
        """FLOP/s of a matmul in ``dtype``."""
        fast = dtype in _HALF or (dtype is not None and dtype.itemsize == 1)
        return 1e12 * (self.matmul_tflops if fast else self.fp32_tflops)


@dataclass(frozen=True)
class Modelled:
    """A modelled step time and its parts: ops bound by their FLOPs, ops bound by their bytes,
    and the launches."""

    ms: float
    compute_bound_ms: float
    memory_bound_ms: float
    launch_ms: float


def modelled_time(costs: Iterable[OpCost], gpu: GpuModel) -> Modelled:
    """``Σ max(FLOPs / rate(dtype), bytes / bandwidth) + kernels × launch`` over the ops."""
    compute = memory = launch = 0.0
    bandwidth = 1e12 * gpu.bandwidth_tbs
    for c in costs:
        t_flops = c.flops / gpu.matmul_rate(c.dtype) if c.flops else 0.0
        t_bytes = c.bytes / bandwidth
        if t_flops > t_bytes:
            compute += t_flops
        else:
            memory += t_bytes
        launch += c.kernels * gpu.launch_us * 1e-6
    return Modelled(1e3 * (compute + memory + launch), 1e3 * compute, 1e3 * memory, 1e3 * launch)


# ----- peak extra memory ----------------------------------------------------------------------------
def _on_device(t: Tensor) -> bool:
    return t.device.type not in ("cpu", "meta")


@dataclass
class PeakTracker:
    """The bytes of storages created while it is open, alive at once: ``live`` now, ``peak``
    the most.

    Feed it every op (:meth:`saw`): a result whose storage is none of the op's arguments' is
    a new allocation. Each is followed to its end with :func:`weakref.finalize` on its Python
    storage object, which torch keeps for as long as the storage itself lives (views included).
    ``counted``: which tensors' storages count (by default those on a device).
    """

    counted: Callable[[Tensor], bool] = _on_device
    live: int = 0
    peak: int = 0
    _sizes: dict[int, int] = field(default_factory=dict)
    _open: bool = True

    def saw(self, args: Any, result: Any) -> None:
        """Account for the storages among ``result`` that none of ``args`` holds."""
        outputs = [t for t in _tensors(result) if self.counted(t)]
        if not outputs:
            return
        inputs = {_storage_key(t) for t in tensors_in(args)}
        for t in outputs:
            storage = t.untyped_storage()
            key = storage._cdata
            if key in inputs or key in self._sizes:
                continue
            size = storage.nbytes()
            self._sizes[key] = size
            self.live += size
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._freed, key)

    def _freed(self, key: int) -> None:
        size = self._sizes.pop(key, None)
        if size is not None and self._open:
            self.live -= size

    def close(self) -> None:
        """Stop following: frees after this no longer change the figures."""
        self._open = False


def _storage_key(t: Tensor) -> int:
    try:
        return int(t.untyped_storage()._cdata)
    except Exception:  # a tensor without storage (sparse, nested) shares none
        return -1
