"""The GPU proof in one call (driven by ``scripts/gpu-check.sh``): CUDA tests, then the benchmark.

Parts, each a subprocess under its own ``timeout`` so that one that hangs or runs long costs
only its own slot: each workload's step traced on fake cuda tensors (``fastmuon bench --trace``,
no GPU needed: the kernels and host syncs it predicts, printed beside what the GPU then ran),
the tests that need CUDA (``pytest -m cuda``), then ``fastmuon bench`` for
yolo26n MuSGD beside Ultralytics' MuSGD and GPT-2 Muon beside torch.optim.Muon (and the other
Muon peers), each with eager steps and with steps compiled by ``torch.compile(mode=
"reduce-overhead")``, which captures them in CUDA graphs. Every part's outcome (figures, or why
there are none) goes into one JSON document; a short summary is printed.

``--quick`` is the same flow at the smallest settings (one timed step; a GPT-2-shaped model of
two narrow blocks): a dry run of the whole path, e.g. on a CPU. On a CPU the compiled parts are
listed as skipped (compiling the steps there takes minutes).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

SCHEMA = "fastmuon-gpu-check/1"
TOTAL_BUDGET_S = 450  # the parts together; scripts/gpu-check.sh's set-up comes on top, within 8 min
RESERVE_S = 10  # kept back for writing the document and the summary


@dataclass
class Part:
    name: str
    what: str
    argv: list[str]
    timeout_s: int
    json_path: Path | None = None  # where a bench part writes its document
    skip: str | None = None  # set: not run, and why
    extra: dict[str, Any] = field(default_factory=dict)


def plan_parts(device: str, quick: bool, work: Path, trace_problem: str | None = None) -> list[Part]:
    """The parts in the order they run, with their commands and time slots (a pure function).

    First each workload's step traced on fake cuda tensors (``fastmuon bench --trace``: no GPU
    needed, so its kernel and host-sync counts are there even if a GPU part fails, to set beside
    the measured ones); ``trace_problem``: why this torch cannot trace (those parts are skipped).
    """
    py = sys.executable
    parts = []
    tests = Part(
        "cuda-tests",
        "the tests that need CUDA (pytest -m cuda)",
        [py, "-m", "pytest", "-q", "-rs", "-m", "cuda", "-p", "no:cacheprovider", "tests"],
        60 if quick else 80,
    )
    if not Path("tests").is_dir():
        tests.skip = "no tests/ folder here (run from a fastmuon checkout)"
    timing = (
        ["--steps", "1", "--rounds", "1", "--warmup", "1"] if quick else ["--budget", "1", "--rounds", "3"]
    )
    yolo = str(work / QUICK_YOLO) if quick else "yolo26n"
    gpt2 = str(work / QUICK_GPT2) if quick else "gpt2"
    benches = [
        (
            "yolo26n-musgd",
            "yolo26n MuSGD beside Ultralytics' MuSGD",
            yolo,
            "musgd",
            "fastmuon,ultralytics,torch.optim.sgd",
        ),
        (
            "gpt2-muon",
            "GPT-2 Muon beside torch.optim.Muon",
            gpt2,
            "muon",
            "fastmuon,torch.optim.muon,torch.optim.sgd",
        ),
    ]
    for name, what, model, optimizer, lineup in benches:
        out = work / f"{name}-trace.json"
        argv = [py, "-m", "fastmuon", "bench", "--device", "cuda", "--trace", "--model", model]
        argv += ["--optimizer", optimizer, "--contenders", lineup, "--json", str(out), "--quiet"]
        part = Part(f"{name}-trace", f"{what}, traced on fake cuda tensors", argv, 60 if quick else 25, out)
        part.skip = trace_problem
        parts.append(part)
    parts.append(tests)
    for mode, slot in (("eager", (50, 70)), ("compiled", (95, 95))):
        for (name, what, model, optimizer, compiled_lineup), timeout_s in zip(benches, slot):
            out = work / f"{name}-{mode}.json"
            argv = [
                py,
                "-m",
                "fastmuon",
                "bench",
                "--device",
                device,
                "--model",
                model,
                "--optimizer",
                optimizer,
            ]
            argv += [*timing, "--step-mode", mode, "--json", str(out), "--quiet"]
            if mode == "compiled":  # the per-parameter loop (and the peers) would spend the slot compiling
                argv += ["--contenders", compiled_lineup]
            part = Part(f"{name}-{mode}", f"{what}, {mode} steps", argv, 60 if quick else timeout_s, out)
            if mode == "compiled" and device == "cpu":
                part.skip = "compiled steps are checked on CUDA only (compiling them on a CPU takes minutes)"
            parts.append(part)
    return parts


def run_part(part: Part, limit_s: float) -> dict[str, Any]:
    """Run one part under ``timeout`` (at most ``limit_s``); its outcome as a JSON-ready dict."""
    record: dict[str, Any] = {"what": part.what, "command": " ".join(part.argv), **part.extra}
    if part.skip:
        return record | {"status": "skipped", "reason": part.skip}
    slot = int(min(part.timeout_s, limit_s))
    if slot < 5:
        return record | {"status": "skipped", "reason": "no time left in the 8-minute budget"}
    argv = part.argv
    if shutil.which("timeout"):
        argv = ["timeout", "--kill-after=5", str(slot), *argv]
    started = time.perf_counter()
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=slot + 10)
        rc, output = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as e:  # ``timeout`` itself did not end it
        rc, output = 124, _text(e.stdout) + _text(e.stderr)
    record.update(rc=rc, seconds=round(time.perf_counter() - started, 1), timeout_s=slot)
    if rc in (124, 137):
        record["status"] = "timeout"
    elif rc == 5 and part.json_path is None:  # pytest: no test selected
        record.update(status="ok", note="no test needs CUDA in this checkout")
    else:
        record["status"] = "ok" if rc == 0 else "failed"
    if part.json_path is not None and part.json_path.is_file():
        record["bench"] = json.loads(part.json_path.read_text())
    if rc != 0 or part.json_path is None:
        record["output_tail"] = output[-3000:]
    return record


def _text(stream: str | bytes | None) -> str:
    return stream.decode(errors="replace") if isinstance(stream, bytes) else stream or ""


def machine() -> dict[str, Any]:
    facts: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda_available": torch.cuda.is_available(),
        "host": platform.node(),
        "time_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    if torch.cuda.is_available():
        facts.update(gpu=torch.cuda.get_device_name(0), cuda=torch.version.cuda)
    return facts


def write_document(path: Path, document: dict[str, Any]) -> None:
    """Write atomically: a reader never sees half a document, even if the run is killed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(document, indent=1, default=str) + "\n")
    os.replace(tmp, path)


def summary_lines(document: dict[str, Any]) -> list[str]:
    """A few lines per part: its status, and per contender the median and host time per step,
    with what the GPU ran (kernels, copies, host waits: torch.profiler) beside what the trace
    of the same workload predicted."""
    m = document["machine"]
    lines = [f"gpu-check on {m.get('gpu', 'no GPU')} (torch {m['torch']}, device {document['device']})"]
    for name, part in document["parts"].items():
        head = f"{name}: {part['status']}"
        if "seconds" in part:
            head += f" in {part['seconds']:.0f} s"
        if part["status"] == "skipped":
            head += f" ({part['reason']})"
        lines.append(head)
        if part["status"] == "failed" and "bench" not in part:
            tail = [x for x in part.get("output_tail", "").splitlines() if x.strip()]
            lines += [f"    {x}" for x in tail[-3:]]
        bench = part.get("bench", {})
        if "label" in bench:  # a trace
            lines.append(f"    {bench['label']}")
            for r in bench.get("results", []):
                lines.append(f"    {r['name']:<40} " + (r["error"][:90] if r.get("error") else _traced(r)))
            continue
        traced = _trace_rows(document, name)
        for r in bench.get("results", []):
            if r.get("median_ms"):
                host = "-" if r.get("host_ms") is None else f"{r['host_ms']:.2f}"
                kernels, calls = r.get("kernels_per_step"), r.get("python_calls")
                lines.append(
                    f"    {r['name']:<40} {r['median_ms']:9.2f} ms/step  host {host:>7} ms"
                    + (f"  {kernels} kernels" if kernels else "")
                    + (f"  {calls} Python calls" if calls else "")
                )
                gpu = r.get("extra", {}).get("cuda_activity") or {}
                if "kernels" in gpu:
                    lines.append(
                        f"    {'':<40} GPU ran {gpu['kernels']} kernels, {gpu['memcpy']} copies/sets, "
                        f"{gpu['syncs']} host waits"
                    )
                if r["name"] in traced and not traced[r["name"]].get("error"):
                    lines.append(f"    {'':<40} traced: {_traced(traced[r['name']])}")
            elif r.get("skipped"):
                lines.append(f"    {r['name']:<40} skipped: {r['skipped'][:90]}")
    return lines


def _traced(r: dict[str, Any]) -> str:
    return (
        f"{r['kernels']} kernels ({r['aten_ops']} ATen ops), {r['host_syncs']} host syncs, "
        f"{r['python_calls']} Python calls"
    )


def _trace_rows(document: dict[str, Any], part_name: str) -> dict[str, dict[str, Any]]:
    """The traced rows of the workload a bench part measures (``yolo26n-musgd-eager`` ->
    ``yolo26n-musgd-trace``), by contender name."""
    trace = document["parts"].get(part_name.rsplit("-", 1)[0] + "-trace", {})
    return {r["name"]: r for r in trace.get("bench", {}).get("results", [])}


QUICK_YOLO, QUICK_GPT2 = "yolo26n-quick.json", "gpt2-quick.json"


def write_quick_manifests(work: Path) -> None:
    """The toy-size stand-ins for --quick (:func:`.workloads.quick_manifests`), as ``work/<name>.json``."""
    from .workloads import quick_manifests

    for name, manifest in quick_manifests().items():
        manifest.save(work / f"{name}.json")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m fastmuon.bench.gpucheck",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--quick", action="store_true", help="smallest settings: a dry run of the whole flow")
    p.add_argument("--out", default=os.environ.get("OUT") or "gpu-check", help="folder for gpu-check.json")
    p.add_argument("--budget-s", type=float, default=TOTAL_BUDGET_S, help="seconds for all parts together")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print(
            "gpu-check: error: --device cuda, but this torch sees no CUDA device (--device cpu --quick "
            "runs the same flow on a CPU)",
            file=sys.stderr,
        )
        return 2
    if not args.budget_s > 0:
        print(f"gpu-check: error: --budget-s must be positive, got {args.budget_s}", file=sys.stderr)
        return 2
    out = Path(args.out) / "gpu-check.json"
    deadline = time.monotonic() + args.budget_s - RESERVE_S
    document: dict[str, Any] = {
        "schema": SCHEMA,
        "device": args.device,
        "quick": args.quick,
        "machine": machine(),
        "parts": {},
    }
    write_document(out, document)  # fails now, not after the runs, if the folder is not writable
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as work:
        work_dir = Path(work)
        if args.quick:
            write_quick_manifests(work_dir)
        from .fake_cuda import fake_cuda_problem

        for part in plan_parts(args.device, args.quick, work_dir, fake_cuda_problem()):
            print(f"gpu-check: {part.name} ...", flush=True)
            document["parts"][part.name] = run_part(part, deadline - time.monotonic())
            write_document(out, document)  # what is done is kept, whatever happens next
    for line in summary_lines(document):
        print(line)
    print(f"gpu-check: wrote {out}")
    return 0 if all(p["status"] in ("ok", "skipped") for p in document["parts"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
