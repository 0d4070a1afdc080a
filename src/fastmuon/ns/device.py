"""Device facts: whether a tensor lives on the host, and which dtype NS matmuls really run in. The
engine asks these once, when built. bf16 is asked for speed, but CPUs without AVX512-BF16/AMX
emulate it far slower than fp32, so there NS runs in fp32 (faster and more accurate) unless the
caller insists on native low precision; a one-off probe per (device type, dtype), cached.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from .timing import matmul_seconds

#: "auto": probe; "native": always run in the requested dtype; "fp32": low precision on CPU runs in fp32.
_MODES = ("auto", "native", "fp32")
_mode = os.environ.get("FASTMUON_CPU_LOW_PRECISION", "auto")


def set_cpu_low_precision(mode: str) -> None:
    """Choose how bf16/fp16 NS runs on CPUs: "auto" (probe), "native", or "fp32"."""
    global _mode
    if mode not in _MODES:
        raise ValueError(f"unknown CPU low-precision mode {mode!r}; choose one of {_MODES}")
    _mode = mode


@contextmanager
def cpu_low_precision(mode: str) -> Iterator[None]:
    """Temporarily set the CPU low-precision mode (e.g. to compare with a native-bf16 peer)."""
    previous = _mode
    set_cpu_low_precision(mode)
    try:
        yield
    finally:
        set_cpu_low_precision(previous)


def is_host(device: torch.device) -> bool:
    """Whether ``device`` is the host's CPU: there a value read makes nothing wait, an op per tensor
    costs no launch, kept memory costs no device memory, and torch's fused CPU kernels run. Every
    such choice asks this, so tests can run the accelerators' paths on CPU tensors."""
    return device.type == "cpu"


def compute_dtype(dtype: torch.dtype, device: torch.device | str) -> torch.dtype:
    """The dtype NS matmuls run in for a requested ``dtype`` on ``device``."""
    if torch.device(device).type != "cpu" or dtype not in (torch.bfloat16, torch.float16):
        return dtype
    if _mode == "native":
        return dtype
    if _mode == "fp32":
        return torch.float32
    return dtype if _native_is_fast(dtype, torch.get_num_threads()) else torch.float32


def wider_dtype(dtype: torch.dtype, device: torch.device | str) -> torch.dtype | None:
    """A wider dtype the planner may run a ``dtype`` request in, where faster: on a CPU with bf16
    matmul units small or very wide buckets lose to per-op overheads and to FLOPs that the Gram and
    eigh routes, accurate enough only in fp32, would save. fp32 is never less accurate."""
    if (
        torch.device(device).type == "cpu"
        and dtype in (torch.bfloat16, torch.float16)
        and _mode == "auto"
        and compute_dtype(dtype, device) == dtype
    ):
        return torch.float32
    return None


#: CPU classes the planner keeps cost constants for: matrix units for bf16 (AMX), vector bf16
#: dot products (AVX512-BF16), or neither (bf16 requests run in fp32 there).
CPU_CLASSES = ("amx_bf16", "avx512_bf16", "no_bf16")


def cpu_class() -> str:
    """This CPU's class (:data:`CPU_CLASSES`): ``FASTMUON_CPU_CLASS`` if set, else detected."""
    forced = os.environ.get("FASTMUON_CPU_CLASS")
    if forced:
        if forced not in CPU_CLASSES:
            raise ValueError(f"FASTMUON_CPU_CLASS={forced!r} is not a CPU class; choose one of {CPU_CLASSES}")
        return forced
    return _detected_cpu_class()


#: ``ONEDNN_MAX_CPU_ISA`` values that leave oneDNN (which runs torch's CPU bf16/fp16 matmuls) no
#: bf16 dot-product instructions, and those that leave it no AMX tiles (or no fp16 ones).
ONEDNN_NO_BF16 = frozenset(
    {"SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI"}
)
ONEDNN_NO_AMX = ONEDNN_NO_BF16 | {"AVX512_CORE_BF16", "AVX512_CORE_FP16", "AVX10_1_512"}
ONEDNN_NO_FP16 = ONEDNN_NO_BF16 | {"AVX512_CORE_BF16", "AVX512_CORE_AMX"}


def onednn_isa_cap() -> str | None:
    """The instruction-set cap oneDNN runs under (``ONEDNN_MAX_CPU_ISA``), if one is set: a CPU
    capped below its bf16 instructions computes bf16 matmuls in emulation, as one without them."""
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA")
    return cap.upper() if cap else None


def _detected_cpu_class() -> str:
    cls = _hardware_cpu_class()
    cap = onednn_isa_cap()
    if cap in ONEDNN_NO_BF16:
        return "no_bf16"
    if cap in ONEDNN_NO_AMX and cls == "amx_bf16":
        return "avx512_bf16"
    return cls


@functools.cache
def _hardware_cpu_class() -> str:
    flags = cpu_flags()
    if flags is None:
        return "avx512_bf16" if _native_is_fast(torch.bfloat16, torch.get_num_threads()) else "no_bf16"
    for name in ("amx_bf16", "avx512_bf16"):
        if name in flags:
            return name
    return "no_bf16"


def _native_is_fast(dtype: torch.dtype, threads: int) -> bool:
    """Does this CPU have matmul instructions for ``dtype`` that no cap or ``FASTMUON_CPU_CLASS`` hides?"""
    cap = onednn_isa_cap()
    if dtype == torch.bfloat16 and (
        os.environ.get("FASTMUON_CPU_CLASS") == "no_bf16" or cap in ONEDNN_NO_BF16
    ):
        return False
    if dtype == torch.float16 and cap in ONEDNN_NO_FP16:
        return False
    return _hardware_native(dtype, threads)


@functools.cache
def _hardware_native(dtype: torch.dtype, threads: int) -> bool:
    """Does the CPU have matmul instructions for ``dtype``? Read from the CPU flags on Linux
    (deterministic, unlike a timing on a shared machine); elsewhere, time a small product."""
    del threads  # part of the cache key: a timing can depend on the thread count
    flags = cpu_flags()
    if flags is not None:
        wanted = {torch.bfloat16: ("avx512_bf16", "amx_bf16"), torch.float16: ("avx512_fp16", "amx_fp16")}
        return any(f in flags for f in wanted[dtype])
    return _cpu_seconds(dtype) <= _cpu_seconds(torch.float32)


def _cpu_seconds(dtype: torch.dtype) -> float:
    return matmul_seconds(4, 128, 512, dtype, "cpu", rounds=3)


def cpu_flags() -> set[str] | None:
    """The CPU's feature flags from ``/proc/cpuinfo`` (``flags`` on x86, ``Features`` on Arm), or None."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return None
