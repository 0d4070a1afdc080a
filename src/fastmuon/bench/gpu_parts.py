"""The GPU check's own measurements, each run as one process by :mod:`.gpucheck`.

``python -m fastmuon.bench.gpu_parts --check NAME --device cuda --json PATH`` runs one of
:data:`CHECKS` and writes its records to ``PATH`` after every item (a comparison, a workload,
a step), so that a check stopped by its time slot keeps what it had measured. An item that
raises is recorded with its error and the check goes on to the next; the exit status is 1
when one did. A check that needs CUDA says so (:attr:`Check.cuda_only`) and is skipped on a
CPU by the driver, with that reason.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from .gpu_distributed import distributed
from .gpu_measured import memory
from .gpu_numerics import correctness, cuda_graph
from .gpu_shared import Recorder


@dataclass(frozen=True)
class Check:
    """One check: what it shows, its function, and why it cannot run on a CPU (None: it can)."""

    name: str
    what: str
    run: Callable[[Recorder], None]
    cuda_only: str | None = None


#: the registry: name -> check, in the order the driver runs them
CHECKS: dict[str, Check] = {
    c.name: c
    for c in (
        Check(
            "correctness",
            "MuSGD, Muon, NorMuon, AdaMuon steps (NS in bf16 and fp32) against the CPU per-parameter "
            "fp32 reference; a NaN gradient under nonfinite='skip'; torch's fused SGD against MuSGD's SGD",
            correctness,
        ),
        Check(
            "memory",
            "measured peak memory, host syncs and step time beside the trace's predictions, per workload",
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
    )
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m fastmuon.bench.gpu_parts", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--check", choices=tuple(CHECKS), required=True)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--quick", action="store_true", help="the smallest settings (a dry run)")
    p.add_argument("--json", default=None, help="where the records go (written after every item)")
    args = p.parse_args(argv)
    check = CHECKS[args.check]
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
