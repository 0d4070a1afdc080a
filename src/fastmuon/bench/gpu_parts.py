"""The GPU check's own measurements, each run as one process by :mod:`.gpucheck`.

``python -m fastmuon.bench.gpu_parts --check NAME --device cuda --json PATH`` runs one of
:func:`checks` and writes its records to ``PATH`` after every item (a comparison, a workload,
a step), so that a check stopped by its time slot keeps what it had measured. An item that
raises is recorded with its error and the check goes on to the next; the exit status is 1
when one did. A check that needs CUDA says so (:attr:`Check.cuda_only`) and is skipped on a
CPU by the driver, with that reason.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from .contenders import Workbench
from .manifest import Manifest

SCHEMA = "fastmuon-gpu-check-part/1"


@dataclass
class Recorder:
    """Where a check puts its records: ``sections`` of dataclass records and ``notes`` (how a
    figure was obtained), the whole written to ``path`` after every change."""

    path: Path | None
    device: torch.device
    quick: bool
    sections: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)
    errors: int = 0

    def add(self, section: str, record: Any) -> None:
        is_record = dataclasses.is_dataclass(record) and not isinstance(record, type)
        row = dataclasses.asdict(record) if is_record else dict(record)
        self.sections.setdefault(section, []).append(row)
        self.write()

    def note(self, key: str, text: str) -> None:
        self.notes[key] = text
        self.write()

    def attempt(self, section: str, item: str, run: Callable[[], None]) -> None:
        """``run()``, or its error recorded as ``{"item", "error", "traceback"}`` in ``section``."""
        try:
            run()
        except Exception as e:
            self.errors += 1
            tail = traceback.format_exc().strip().splitlines()[-6:]
            self.add(section, {"item": item, "error": f"{type(e).__name__}: {e}"[:400], "traceback": tail})

    @property
    def on_cuda(self) -> bool:
        return self.device.type == "cuda"

    def document(self) -> dict[str, Any]:
        return {"schema": SCHEMA, "sections": self.sections, "notes": self.notes, "errors": self.errors}

    def write(self) -> None:
        if self.path is None:
            return
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.document(), indent=1, default=str) + "\n")
        os.replace(tmp, self.path)


@dataclass(frozen=True)
class Check:
    """One check: what it shows, its function, and why it cannot run on a CPU (None: it can)."""

    name: str
    what: str
    run: Callable[[Recorder], None]
    cuda_only: str | None = None


@functools.cache
def checks() -> dict[str, Check]:
    """name -> check, in the order the driver runs them."""
    from .gpu_distributed import distributed
    from .gpu_measured import memory
    from .gpu_numerics import correctness, cuda_graph

    checks = [
        Check(
            "correctness",
            "MuSGD, Muon, NorMuon, AdaMuon steps (NS in bf16 and fp32) against the CPU per-parameter "
            "fp32 reference; a NaN gradient under nonfinite='skip'; torch's fused SGD against MuSGD's SGD",
            correctness,
        ),
        Check(
            "memory",
            "measured peak memory and step time beside the trace's predictions, per workload",
            memory,
        ),
        Check(
            "cuda-graph",
            "the CUDA-graph recipe of docs/performance.md captured and replayed, timed beside eager",
            cuda_graph,
            cuda_only="CUDA graphs need a CUDA device",
        ),
        Check(
            "distributed",
            "a one-process world (NCCL on CUDA, gloo on a CPU): a DDP-style step and an FSDP2 step, "
            "their host syncs counted",
            distributed,
        ),
    ]
    return {c.name: c for c in checks}


# ----- what the checks share ----------------------------------------------------------------------
@dataclass(frozen=True)
class Workload:
    """A bench workload the checks step: its name, manifest and update rule."""

    name: str
    manifest: Manifest
    optimizer: str


def workloads(quick: bool) -> list[Workload]:
    """yolo26n (MuSGD), GPT-2 (Muon) and Llama 3 8B's layer matrices (Muon); ``quick``: the
    toy-size stand-ins of the first two (:func:`.workloads.quick_manifests`)."""
    from .workloads import quick_manifests, resolve_workload

    if quick:
        small = quick_manifests()
        return [Workload(n, small[n], o) for n, o in (("yolo26n-quick", "musgd"), ("gpt2-quick", "muon"))]
    chosen = (("yolo26n", "musgd"), ("gpt2", "muon"), ("llama-8b-layers", "muon"))
    return [Workload(n, resolve_workload(n), o) for n, o in chosen]


def device_params(manifest: Manifest, device: torch.device, seed: int) -> list[nn.Parameter]:
    """The manifest's parameters with random values and gradients made on ``device`` (on a GPU
    that takes no host time, which the 3 GiB of Llama's layers would)."""
    gen = torch.Generator(device).manual_seed(seed)
    params = []
    for spec in manifest.params:
        p = nn.Parameter(0.02 * torch.randn(spec.shape, generator=gen, device=device))
        p.grad = torch.randn(spec.shape, generator=gen, device=device)
        params.append(p)
    return params


def bench_workbench(
    manifest: Manifest,
    params: list[nn.Parameter],
    device: torch.device,
    optimizer: str,
    ns_dtype: torch.dtype,
    step_mode: str = "eager",
) -> Workbench:
    """The bench's workbench with its default options (policy, NS method and cost model
    ``auto``/``auto``/``device``), as ``fastmuon bench`` builds it."""
    from .lineup import CLASSES

    return Workbench(
        manifest,
        params,
        device,
        optimizer,
        ns_dtype,
        "auto",
        step_mode=step_mode,
        fastmuon=CLASSES[optimizer],
    )


def device_ms(step: Callable[[], object], steps: int, device: torch.device) -> float:
    """Mean ms per call of ``step`` over ``steps`` calls, from CUDA events on a GPU (the
    device's time, the queue drained first), from the wall clock on a CPU."""
    if device.type != "cuda":
        began = time.perf_counter()
        for _ in range(steps):
            step()
        return (time.perf_counter() - began) * 1e3 / steps
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        step()
    end.record()
    end.synchronize()
    return float(start.elapsed_time(end)) / steps


def sync_warnings(step: Callable[[], object], device: torch.device) -> int:
    """The host syncs one call of ``step`` makes on a GPU, as ``torch.cuda.set_sync_debug_mode
    ("warn")`` reports them (one warning per blocking copy, ``.item()``, synchronize call)."""
    torch.cuda.synchronize(device)
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    return sum("synchroniz" in str(w.message) for w in caught)


def rel_err(ours: Tensor, ref: Tensor) -> float:
    """max|ours − ref| / max|ref| in fp64 (the suite's measure), on the CPU."""
    a, b = ours.detach().double().cpu(), ref.detach().double().cpu()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m fastmuon.bench.gpu_parts", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--check", choices=tuple(checks()), required=True)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--quick", action="store_true", help="the smallest settings (a dry run)")
    p.add_argument("--json", default=None, help="where the records go (written after every item)")
    args = p.parse_args(argv)
    check = checks()[args.check]
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_parts: error: --device cuda, but this torch sees no CUDA device", file=sys.stderr)
        return 2
    if check.cuda_only and args.device != "cuda":
        print(f"gpu_parts: error: {check.name}: {check.cuda_only}", file=sys.stderr)
        return 2
    if args.device == "cpu":
        # a dry run steps small tensors: one thread, so that a thread pool waiting on cores
        # other processes hold does not stall it
        torch.set_num_threads(1)
    recorder = Recorder(None if args.json is None else Path(args.json), torch.device(args.device), args.quick)
    recorder.write()
    started = time.perf_counter()
    check.run(recorder)
    recorder.note("seconds", f"{time.perf_counter() - started:.1f}")
    if args.json is None:
        print(json.dumps(recorder.document(), indent=1, default=str))
    return 1 if recorder.errors else 0


if __name__ == "__main__":
    sys.exit(main())
