"""What the GPU check's checks (:mod:`.gpu_parts`) share: the :class:`Recorder` their records go
to, the workloads they step, and how they time a step and count its host syncs."""

from __future__ import annotations

import dataclasses
import json
import os
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
    nonfinite: str | None = None,
) -> Workbench:
    """The bench's workbench with its default options (policy, NS method and cost model
    ``auto``/``auto``/``device``), as ``fastmuon bench`` builds it; ``nonfinite``: fastmuon's
    mode (None: the class's default)."""
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
        nonfinite=nonfinite,
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


#: what ``torch.cuda.set_sync_debug_mode("warn")`` says of each synchronising call; setting the
#: mode also warns once per process that the mode is a prototype, which is no sync
SYNC_WARNING = "called a synchronizing CUDA operation"


def sync_warnings(step: Callable[[], object], device: torch.device) -> list[str]:
    """The host syncs one call of ``step`` makes on a GPU, as ``torch.cuda.set_sync_debug_mode
    ("warn")`` reports them (one warning per blocking copy, ``.item()``, synchronize call): the
    Python line that made each, ``file:line``."""
    torch.cuda.synchronize(device)
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    return [f"{w.filename}:{w.lineno}" for w in caught if SYNC_WARNING in str(w.message)]


def rel_err(ours: Tensor, ref: Tensor) -> float:
    """max|ours − ref| / max|ref| in fp64 (the suite's measure), computed where the tensors are
    (a GPT-2's parameters need not travel to the host for it)."""
    a, b = ours.detach().double(), ref.detach().to(ours.device).double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))
