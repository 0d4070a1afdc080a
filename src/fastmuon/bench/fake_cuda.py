"""How many CUDA kernels one ATen op would launch, judged from its arguments' metadata alone.

On fake ``cuda`` tensors (``torch._subclasses.fake_tensor.FakeTensorMode``) nothing runs, so
the launches an op makes are read off its inputs, following what torch's CUDA kernels do:

* ``_foreach_*`` ops take torch's fast route (``multi_tensor_apply``: one launch per batch of
  tensors and 64K-element chunks, the batch limits of ``ATen/native/cuda/MultiTensorApply.cuh``
  in the wheel, CUDA 13 builds' larger ones included) only when the lists meet
  ``check_fast_path_restrictions`` of ``ATen/native/ForeachUtils.h`` (also in the wheel): every
  tensor on one device, strided, non-overlapping and dense, one dtype over all lists (per list
  for ``_foreach_copy_``, which may cast), each position's tensors of equal sizes and strides
  (size-1 dimensions aside), and the scalars not promoting the tensors' dtype. Otherwise torch
  falls back to one op, so one kernel, per non-empty tensor. Assumed, as the ``.cu`` sources
  are not in the wheel: a 0-dim tensor operand (``_foreach_mul_(xs, t)``) does not change the
  route (a CPU one is read on the host and passed as a Scalar, a device one is read by the
  kernel); ``_foreach_norm``/``_foreach_max`` add one clean-up launch after their partial
  reductions, and take the fallback for integer or complex tensors and norms other than
  1, 2 and inf.
* ``cat``/``stack`` copy their inputs in one batched launch per 128 inputs (64 when an input or
  the ``out=`` tensor is not contiguous: the launch then carries strides) when the result has at
  most 4 dimensions, fits 32-bit indexing and has every input's dtype; otherwise (a cast into
  an ``out=`` of another dtype, say) one copy per non-empty input. So read ``cat``'s meta
  function (``TensorShape.cpp``: an ``out=`` sets the dtype and the contiguity compared) and
  ``cat_out_cuda`` (``cuda/Shape.cu``) in torch's repository; neither is in the wheel, and this
  build is assumed to match them.
* any other op launches one kernel; an op whose tensors all lie on the CPU launches none.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor

aten = torch.ops.aten

#: ``MultiTensorApply.cuh``: elements per chunk (one block each)
CHUNK = 65536
#: per list depth 1..5: tensors and blocks one ``multi_tensor_apply`` launch takes (CUDA 13 builds
#: pass 32 KB of kernel arguments, older ones 4 KB)
MAX_TENSORS = {True: (770, 448, 336, 252, 210), False: (110, 64, 48, 36, 30)}
MAX_TENSORS_SCALARLIST = {True: (672, 448, 336, 252, 210), False: (96, 64, 48, 36, 30)}
MAX_BLOCKS = {True: 2240, False: 320}
#: ``Shape.cu``: inputs per batched ``cat`` launch, and the most dimensions that route takes
CAT_BATCH, CAT_MAX_DIMS = 128, 4
#: the reductions that finish with one clean-up launch over all the tensors
_TWO_PHASE = ("_foreach_norm", "_foreach_max")
#: foreach ops whose results are floating even for integer inputs (their fast route refuses those)
_TO_FLOAT = (
    "_foreach_div",
    "_foreach_sqrt",
    "_foreach_rsqrt",
    "_foreach_exp",
    "_foreach_log",
    "_foreach_reciprocal",
    "_foreach_sigmoid",
    "_foreach_lerp",
    "_foreach_norm",
)


def fake_cuda_problem() -> str | None:
    """Why this torch cannot make fake ``cuda`` tensors (None: it can)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    try:
        with FakeTensorMode(allow_non_fake_inputs=True):  # as the trace makes its parameters
            torch.zeros(1, device="cuda").add_(torch.randn(1).to("cuda"))
    except Exception as e:  # a CPU-only build: "not linked with support for cuda devices"
        text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return f"torch {torch.__version__} cannot make fake cuda tensors ({text}); a CUDA build of torch can"
    return None


def _big_args() -> bool:
    """Whether this build passes 32 KB of kernel arguments (CUDA 13 or newer)."""
    version = torch.version.cuda or ""
    try:
        return int(version.split(".")[0]) >= 13
    except ValueError:
        return False


def _on_gpu(t: Tensor) -> bool:
    return t.device.type not in ("cpu", "meta")


def _tensor_lists(args: Sequence[Any], kwargs: dict[str, Any]) -> list[list[Tensor]]:
    lists = []
    for a in [*args, *kwargs.values()]:
        if isinstance(a, (list, tuple)) and a and all(isinstance(t, Tensor) for t in a):
            lists.append(list(a))
    return lists


def _scalars(args: Sequence[Any], kwargs: dict[str, Any]) -> list[Any]:
    """The Python scalars and scalar lists among the arguments (not the lists' tensors)."""
    out: list[Any] = []
    for a in [*args[1:], *kwargs.values()]:
        if isinstance(a, (bool, int, float, complex)):
            out.append(a)
        elif (
            isinstance(a, (list, tuple)) and a and all(isinstance(s, (bool, int, float, complex)) for s in a)
        ):
            out.append(list(a))
    return out


def non_overlapping_and_dense(t: Tensor) -> bool:
    """Whether ``t``'s elements fill its storage span exactly once, in some order of its
    dimensions (c10's ``is_non_overlapping_and_dense``, recomputed from sizes and strides)."""
    dims = sorted((stride, size) for size, stride in zip(t.shape, t.stride()) if size != 1)
    expected = 1
    for stride, size in dims:
        if stride != expected:
            return False
        expected *= size
    return True


def _same_sizes_and_strides(a: Tensor, b: Tensor) -> bool:
    if a.shape != b.shape:
        return False
    return all(n == 1 or sa == sb for n, sa, sb in zip(a.shape, a.stride(), b.stride()))


def foreach_fallback(name: str, args: Sequence[Any], kwargs: dict[str, Any]) -> str | None:
    """Why torch's CUDA ``_foreach`` op ``name`` would take its per-tensor fallback (None: the
    fast route)."""
    lists = _tensor_lists(args, kwargs)
    if not lists:
        return None
    first = lists[0][0]
    cross_dtype = not name.startswith("_foreach_copy")
    for k, tensors in enumerate(lists):
        for t in tensors:
            if t.device != first.device:
                return f"list {k} mixes devices ({first.device}, {t.device})"
            if t.layout != torch.strided or not non_overlapping_and_dense(t):
                return (
                    f"list {k} holds a tensor that is not non-overlapping and dense (shape {tuple(t.shape)})"
                )
            if t.dtype != tensors[0].dtype or (cross_dtype and t.dtype != first.dtype):
                return f"dtypes differ ({first.dtype}, {t.dtype})"
    for k, tensors in enumerate(lists[1:], 1):
        for a, b in zip(lists[0], tensors):
            if not _same_sizes_and_strides(a, b):
                return f"list {k}'s tensor {tuple(b.shape)} does not match list 0's {tuple(a.shape)} in sizes or strides"
    integral = any(not (t.is_floating_point() or t.is_complex()) for t in lists[0])
    base = name.rstrip("_")
    if integral and base in _TO_FLOAT:
        return "integer tensors in an op whose results are floating"
    for scalar in _scalars(args, kwargs):
        values = scalar if isinstance(scalar, list) else [scalar] * len(lists[0])
        for t, s in zip(lists[0], values):
            if torch.result_type(torch.empty((), dtype=t.dtype, device="meta"), s) != t.dtype:
                return f"scalar {s!r} promotes {t.dtype}"
    if base in _TWO_PHASE:
        if integral or any(t.is_complex() for t in lists[0]):
            return "integer or complex tensors"
        order = args[1] if len(args) > 1 else kwargs.get("ord", 2)
        if order not in (1, 2, math.inf, 1.0, 2.0):
            return f"norm order {order!r}"
    return None


def mta_launches(numels: Iterable[int], depth: int, scalar_list: bool = False) -> int:
    """Launches of one ``multi_tensor_apply`` over tensors of ``numels`` elements with ``depth``
    lists (inputs and outputs): a launch when its tensor slots or its blocks fill up."""
    big = _big_args()
    depth = min(max(depth, 1), 5)
    max_tensors = (MAX_TENSORS_SCALARLIST if scalar_list else MAX_TENSORS)[big][depth - 1]
    max_blocks = MAX_BLOCKS[big]
    launches = tensors = blocks = 0
    for numel in numels:
        if numel == 0:
            continue
        tensors += 1
        chunks = -(-numel // CHUNK)
        for chunk in range(chunks):
            blocks += 1
            last = chunk == chunks - 1
            if (tensors == max_tensors and last) or blocks == max_blocks:
                launches += 1
                blocks = 0
                tensors = 0 if last else 1
    return launches + (blocks > 0)


def foreach_launches(func: torch._ops.OpOverload, args: Sequence[Any], kwargs: dict[str, Any]):
    """(kernels, why the per-tensor fallback or None) of a ``_foreach`` op on the GPU."""
    name = func.overloadpacket.__name__
    lists = _tensor_lists(args, kwargs)
    if not lists or not any(_on_gpu(t) for ts in lists for t in ts):
        return 0, None
    why = foreach_fallback(name, args, kwargs)
    if why is not None:
        return sum(t.numel() > 0 for t in lists[0]), why
    in_place = name.endswith("_")
    depth = len(lists) + (0 if in_place else 1)
    scalar_list = any(isinstance(s, list) for s in _scalars(args, kwargs))
    launches = mta_launches((t.numel() for t in lists[0]), depth, scalar_list)
    if name in _TWO_PHASE and launches:
        launches += 1
    return launches, None


def cat_launches(func: torch._ops.OpOverload, args: Sequence[Any], kwargs: dict[str, Any]):
    """(kernels, why the per-input copies or None) of ``cat``/``stack`` on the GPU."""
    tensors = [t for t in args[0] if isinstance(t, Tensor)]
    out = kwargs.get("out")
    if not any(_on_gpu(t) for t in tensors) and not (isinstance(out, Tensor) and _on_gpu(out)):
        return 0, None
    inputs = [t for t in tensors if t.numel() > 0]
    if not inputs:
        return 0, None
    stacking = func.overloadpacket.__name__ == "stack"
    dims = inputs[0].dim() + (1 if stacking else 0)
    dtype = out.dtype if isinstance(out, Tensor) else inputs[0].dtype
    why = None
    if any(t.dtype != dtype for t in inputs):
        why = "inputs of another dtype than the result (a cast)"
    elif dims > CAT_MAX_DIMS:
        why = f"{dims}-D result (the batched copy takes at most {CAT_MAX_DIMS})"
    elif sum(t.numel() for t in inputs) >= 2**31:
        why = "a result beyond 32-bit indexing"
    if why is not None:
        return len(inputs), why
    # a non-contiguous input or out= takes the batched copy too, with strides: half as many per launch
    dense = all(t.is_contiguous() for t in inputs) and not (
        isinstance(out, Tensor) and not out.is_contiguous()
    )
    return -(-len(inputs) // (CAT_BATCH if dense else CAT_BATCH // 2)), None


_CAT = {aten.cat.default, aten.cat.out, aten.stack.default, aten.stack.out}


#: ops not marked as views that still only relabel memory (no kernel runs)
RELABELLING = frozenset({aten._unsafe_view.default, aten._reshape_alias.default})


def is_fused_optimizer_op(func: torch._ops.OpOverload) -> bool:
    """torch's fused optimizer kernels (``_fused_sgd_``, ``_fused_adamw_``, …): they only write
    their inputs in place and have no fake kernel, so a trace counts them without running them."""
    return func.namespace == "aten" and func.overloadpacket.__name__.startswith("_fused_")


def fused_launches(args: Sequence[Any], kwargs: dict[str, Any]) -> tuple[int, None]:
    """A fused optimizer kernel's launches: one ``multi_tensor_apply`` over its tensor lists."""
    lists = [ts for ts in _tensor_lists(args, kwargs) if ts]
    if not lists or not any(_on_gpu(t) for ts in lists for t in ts):
        return 0, None
    return mta_launches((t.numel() for t in lists[0]), len(lists)), None


def launches(func: torch._ops.OpOverload, args: Sequence[Any], kwargs: dict[str, Any], result: Any):
    """(CUDA kernels, why a per-tensor fallback or None) of one kernel-running ATen op."""
    if func in RELABELLING:
        return 0, None
    if is_fused_optimizer_op(func):
        return fused_launches(args, kwargs)
    if func.overloadpacket.__name__.startswith("_foreach_"):
        return foreach_launches(func, args, kwargs)
    if func in _CAT:
        return cat_launches(func, args, kwargs)
    return (1 if any(_on_gpu(t) for t in tensors_in((args, kwargs, result))) else 0), None


def tensors_in(value: Any) -> Iterator[Tensor]:
    """Every tensor in ``value``, through dicts, lists and tuples."""
    if isinstance(value, Tensor):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from tensors_in(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from tensors_in(v)
