"""The GPU proof in one call (driven by ``scripts/gpu-check.sh``): is each claim true on a GPU?

Parts, each a subprocess under its own ``timeout`` so that one that hangs or runs long costs
only its own slot, in this order (the cheap and most telling first):

* the checks of :mod:`.gpu_parts`: steps of MuSGD, Muon, NorMuon and AdaMuon against the CPU
  per-parameter fp32 reference, a NaN gradient under ``nonfinite="skip"``, torch's fused SGD
  against ours (``correctness``); measured peak memory, host syncs and step time beside the
  trace's predictions (``memory``); the CUDA-graph recipe of docs/performance.md captured,
  replayed and timed (``cuda-graph``); a one-process NCCL world with a DDP-style and an FSDP2
  step (``distributed``);
* each bench workload's step traced on fake cuda tensors (``fastmuon bench --trace``, no GPU
  needed: the modelled times the speed claims predict from);
* ``fastmuon bench`` for yolo26n MuSGD beside Ultralytics' MuSGD and GPT-2 Muon beside
  torch.optim.Muon (and the other Muon peers), eager;
* the tests that need CUDA (``pytest -m cuda``);
* the same benchmarks with steps compiled by ``torch.compile(mode="reduce-overhead")``, which
  captures them in CUDA graphs.

Every part's outcome (figures, or why there are none) goes into one JSON document, written
after every part; then a closing table of claims (:mod:`.gpu_verdict`: claim, predicted,
measured, holds?) is printed and added to it.

``--quick`` is the same flow at the smallest settings (one timed step; toy-size stand-ins of
the workloads; the main contenders only): a dry run of the whole path, e.g. on a CPU, where
the parts that need CUDA (graphs, compiled steps, the CUDA tests) are listed as skipped with
their reason.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.util
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

from .gpu_verdict import failed_required, table_lines, verdicts

SCHEMA = "fastmuon-gpu-check/1"
TOTAL_BUDGET_S = 450  # the parts together; scripts/gpu-check.sh's set-up comes on top, within 8 min
RESERVE_S = 10  # kept back for writing the document and the summary
#: each check's own slot in seconds (:mod:`.gpu_parts`); the bench parts' are set in plan_parts
CHECK_SLOTS = {"correctness": 45, "memory": 50, "cuda-graph": 25, "distributed": 30}


@dataclass
class Part:
    name: str
    what: str
    argv: list[str]
    timeout_s: int
    json_path: Path | None = None  # where a bench part writes its document
    skip: str | None = None  # set: not run, and why
    result_key: str = "bench"  # the key of the record that holds what the part wrote to json_path
    extra: dict[str, Any] = field(default_factory=dict)


def plan_parts(device: str, quick: bool, work: Path, trace_problem: str | None = None) -> list[Part]:
    """The parts in the order they run, with their commands and time slots (a pure function).

    The cheap and most telling first: the checks of :mod:`.gpu_parts` (correctness against the
    CPU reference, measured memory beside the trace, the CUDA-graph recipe, a one-process
    NCCL world), then each workload's step traced on fake cuda tensors (``fastmuon bench
    --trace``: its modelled times set the speed claims' predictions), the eager benchmarks, the
    tests that need CUDA, the compiled benchmarks. ``trace_problem``: why this torch cannot
    trace (those parts are skipped).
    """
    from .gpu_parts import CHECKS

    py = sys.executable
    parts = []
    for check in CHECKS.values():
        out = work / f"{check.name}.json"
        argv = [
            py,
            "-m",
            "fastmuon.bench.gpu_parts",
            "--check",
            check.name,
            "--device",
            device,
            "--json",
            str(out),
        ]
        part = Part(
            check.name,
            check.what,
            argv + (["--quick"] if quick else []),
            60 if quick else CHECK_SLOTS[check.name],
            out,
            result_key="check",
        )
        if check.cuda_only and device != "cuda":
            part.skip = check.cuda_only
        parts.append(part)
    tests = Part(
        "cuda-tests",
        "the tests that need CUDA (pytest -m cuda)",
        [py, "-m", "pytest", "-q", "-rs", "-m", "cuda", "-p", "no:cacheprovider", "tests"],
        60 if quick else 50,
    )
    missing = [m for m in ("pytest", "hypothesis") if importlib.util.find_spec(m) is None]
    if not Path("tests").is_dir():
        tests.skip = "no tests/ folder here (run from a fastmuon checkout)"
    elif device != "cuda":
        tests.skip = "no CUDA device: every test marked cuda would be skipped"
    elif missing:
        tests.skip = f"{' and '.join(missing)} not importable (their wheels can go in .gpu-wheels/: scripts/gpu-check.sh)"
    timing = (
        ["--steps", "1", "--rounds", "1", "--warmup", "1"] if quick else ["--budget", "0.5", "--rounds", "3"]
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
    for mode, slot in (("eager", (40, 50)), ("compiled", (50, 50))):
        if mode == "compiled":
            parts.append(tests)
        for (name, what, model, optimizer, main_lineup), timeout_s in zip(benches, slot):
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
            # compiled: the per-parameter loop (and the other peers) would spend the slot
            # compiling; quick: a dry run needs the main rows only
            if mode == "compiled" or quick:
                argv += ["--contenders", main_lineup]
            part = Part(f"{name}-{mode}", f"{what}, {mode} steps", argv, 60 if quick else timeout_s, out)
            if mode == "compiled" and device == "cpu":
                part.skip = "compiled steps are checked on CUDA only (compiling them on a CPU takes minutes)"
            parts.append(part)
    return parts


def part_limit(timeout_s: float, left_s: float, later_s: float) -> float:
    """The seconds a part may run: what is left less the slots of the parts still to run (so
    that time the parts before it did not use goes to it), at least its own slot while that
    much is left."""
    return max(left_s - later_s, min(timeout_s, left_s), 0.0)


def run_part(part: Part, limit_s: float) -> dict[str, Any]:
    """Run one part under ``timeout`` for at most ``limit_s`` (see :func:`part_limit`); its
    outcome as a JSON-ready dict."""
    record: dict[str, Any] = {"what": part.what, "command": " ".join(part.argv), **part.extra}
    if part.skip:
        return record | {"status": "skipped", "reason": part.skip}
    slot = int(limit_s)
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
        record[part.result_key] = json.loads(part.json_path.read_text())
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
        lines += _check_lines(part.get("check"))
        if part["status"] in ("failed", "timeout") and "bench" not in part and "check" not in part:
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


def _check_lines(check: dict[str, Any] | None) -> list[str]:
    """A check part's records per section, and the first line of each error it recorded."""
    if not check:
        return []
    sections = check.get("sections", {})
    counts = ", ".join(f"{name} {len(rows)}" for name, rows in sections.items())
    lines = [f"    records: {counts or 'none'}"]
    for rows in sections.values():
        lines += [f"    {r['item']}: {r['error'][:100]}" for r in rows if "error" in r]
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

        parts = plan_parts(args.device, args.quick, work_dir, fake_cuda_problem())
        later = sum(p.timeout_s for p in parts if not p.skip)
        for part in parts:
            if not part.skip:
                later -= part.timeout_s
                print(f"gpu-check: {part.name} ...", flush=True)
            limit = part_limit(part.timeout_s, deadline - time.monotonic(), later)
            document["parts"][part.name] = run_part(part, limit)
            write_document(out, document)  # what is done is kept, whatever happens next
    rows = verdicts(document)
    document["verdict"] = [dataclasses.asdict(v) for v in rows]
    write_document(out, document)
    for line in summary_lines(document) + ["", "verdict:", *table_lines(rows)]:
        print(line)
    print(f"gpu-check: wrote {out}")
    ran = all(p["status"] in ("ok", "skipped") for p in document["parts"].values())
    return 0 if ran and not failed_required(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
