"""Which class of CPU a benchmark ran on, since it decides what bf16 Newton–Schulz costs.

The classes that matter for NS: x86-64 with AVX512-BF16 and/or AMX (bf16 matmuls run natively,
several times fp32's rate), x86-64 with AVX-512 or AVX2 but no bf16 instructions (bf16 is
emulated, far slower than fp32, so fastmuon computes in fp32 there), and aarch64 (with or
without its BF16/SVE extensions). Read from the CPU's flags (``/proc/cpuinfo``) where present.
"""

from __future__ import annotations

import platform

import torch

from ..ns.device import compute_dtype, cpu_class, cpu_flags, onednn_isa_cap

_X86 = ("x86_64", "amd64", "i386", "i686")
_ARM = ("aarch64", "arm64")


def cpu_label(machine: str, flags: set[str] | None) -> str:
    """The report's name for a CPU, such as ``x86-64 AVX512-BF16/AMX``, ``x86-64 AVX2-only`` or
    ``aarch64 BF16``: finer than the planner's :func:`~fastmuon.ns.device.cpu_class` (a pure
    function of the architecture name and the CPU's flag set; None: flags unknown)."""
    arch = machine.lower()
    if arch in _X86:
        if flags is None:
            return "x86-64 (flags unknown)"
        bf16, amx = "avx512_bf16" in flags, "amx_bf16" in flags
        if bf16 or amx:
            return "x86-64 " + "/".join(n for n, has in (("AVX512-BF16", bf16), ("AMX", amx)) if has)
        if "avx512f" in flags:
            return "x86-64 AVX512 (no BF16)"
        if "avx2" in flags:
            return "x86-64 AVX2-only"
        return "x86-64 (no AVX2)"
    if arch in _ARM:
        if flags is None:
            return "aarch64 (features unknown)"
        extras = [n for n, flag in (("BF16", "bf16"), ("SVE", "sve"), ("SME", "sme")) if flag in flags]
        return " ".join(["aarch64", *extras])
    return arch or "unknown"


def cpu_facts() -> dict[str, str]:
    """The class label, torch's kernel capability level, and the dtype bf16 NS really runs in."""
    runs_in = compute_dtype(torch.bfloat16, "cpu")
    return {
        "cpu_class": cpu_label(platform.machine(), cpu_flags()),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "planner_class": cpu_class(),  # whose cost constants the planner uses (CPU_CLASSES)
        "bf16_ns_runs_in": str(runs_in).removeprefix("torch."),
        "onednn_isa_cap": onednn_isa_cap() or "",  # ONEDNN_MAX_CPU_ISA: bf16 units unused below it
    }


def describe_cpu(facts: dict[str, str]) -> str:
    """One line for the report header."""
    native = facts["bf16_ns_runs_in"] == "bfloat16"
    cap = facts.get("onednn_isa_cap")
    units = (
        f"oneDNN capped at {cap}: no bf16 matmul instructions in use" if cap else "no bf16 matmul units here"
    )
    how = "natively in bf16" if native else f"in {facts['bf16_ns_runs_in']} ({units})"
    capped = f", oneDNN ISA capped at {cap}" if cap else ""
    return (
        f"CPU class {facts['cpu_class']} (torch kernels: {facts['cpu_capability']}{capped}): "
        f"fastmuon's bf16 Newton–Schulz runs {how}"
    )
