"""The GPU check's closing table: each claim, what was predicted, what was measured, and whether
it holds, read from the check's document (:mod:`.gpucheck`) once every part has run.

A claim whose part did not run (skipped, failed, timed out) is listed as not measured, with
why. Correctness claims are *required*: the check's exit status is 1 when one does not hold.
Speed claims are reported, not required: they are what the run measured on that machine.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

#: the measured peak extra memory may exceed the trace's prediction by this factor
PEAK_SLACK = 1.25

#: (bench part, fastmuon's row, the peer's row prefix, the claim's words)
SPEED_CLAIMS = (
    (
        "yolo26n-musgd",
        "fastmuon MuSGD",
        "Ultralytics MuSGD",
        "fastmuon MuSGD faster than Ultralytics' MuSGD (yolo26n",
    ),
    ("gpt2-muon", "fastmuon Muon", "torch.optim.Muon", "fastmuon Muon faster than torch.optim.Muon (GPT-2"),
)


#: a step's host syncs as measured: (sync-debug warnings, host waits, of them event waits)
WAITS_TEXT = "{0[0]} sync-debug warnings, {0[1]} host waits of which {0[2]} for an event"


def _sync_free(warned: int, waits: int, event_waits: int) -> bool:
    """No synchronising call, and no host wait but one for an event: the deferred verdict's read
    of the previous step's flags (:mod:`fastmuon.step.deferred`), which waits only for a device
    more than a step behind."""
    return warned == 0 and waits == event_waits <= 1


@dataclass
class Verdict:
    claim: str
    predicted: str
    measured: str
    holds: bool | None  # None: not measured (or not a yes/no claim)
    required: bool = False  # a correctness claim: the check fails when it does not hold
    part: str = ""  # the part it was read from


def verdicts(document: dict[str, Any]) -> list[Verdict]:
    """Every claim of the check, in the order of :data:`CLAIMS`. A part that stopped early
    (timed out, failed) keeps the records it wrote; a claim they do not refute is then not
    shown to hold, as the records missing might have."""
    rows = [v for claim in CLAIMS for v in claim(document)]
    for v in rows:
        status = document["parts"].get(v.part, {}).get("status")
        if v.holds and status not in ("ok", None):
            v.holds, v.measured = None, f"{v.measured} (part {status}: partial)"
    return rows


def failed_required(rows: list[Verdict]) -> list[Verdict]:
    return [v for v in rows if v.required and v.holds is False]


def table_lines(rows: list[Verdict]) -> list[str]:
    """The verdicts as a Markdown table (readable in a log as it is)."""
    lines = ["| claim | predicted | measured | holds? |", "| --- | --- | --- | --- |"]
    for v in rows:
        holds = "-" if v.holds is None else ("yes" if v.holds else "NO")
        lines.append(f"| {v.claim} | {v.predicted} | {v.measured} | {holds} |")
    return lines


# ----- reading the document ------------------------------------------------------------------------
def _sections(document: dict[str, Any], part: str) -> dict[str, list[dict[str, Any]]] | None:
    sections: dict[str, list[dict[str, Any]]] | None = (
        document["parts"].get(part, {}).get("check", {}).get("sections")
    )
    return sections


def _missing(document: dict[str, Any], part: str, what: str = "measured") -> str:
    """Why ``part`` has no figures, in a few words: its status (its reason is in the summary)."""
    record = document["parts"].get(part)
    if record is None:
        return f"not {what}: {part} did not run"
    return f"not {what}: {part} {record['status']}" + (
        f" ({_short(record['reason'])})" if record.get("reason") else ""
    )


def _short(reason: str, limit: int = 60) -> str:
    """A reason's first clause, at most ``limit`` characters."""
    first = reason.split(" (")[0].split(";")[0]
    return first if len(first) <= limit else first[: limit - 3] + "..."


def _rows(
    sections: dict[str, list[dict[str, Any]]], name: str
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """A section's records that measured something, and those that recorded an error."""
    rows = sections.get(name, [])
    return [r for r in rows if "error" not in r], [r for r in rows if "error" in r]


def _unmeasured(
    document: dict[str, Any], part: str, claim: str, predicted: str, required: bool
) -> list[Verdict]:
    return [Verdict(claim, predicted, _missing(document, part), None, required, part)]


def _raised(
    claim: str, error: dict[str, Any], predicted: str, part: str, *, holds: bool | None, required: bool
) -> Verdict:
    """The verdict on an item of ``part`` that raised instead of giving a figure."""
    return Verdict(
        f"{claim} ({error['item']})", predicted, f"raised: {error['error'][:100]}", holds, required, part
    )


def _errors(errors: list[dict[str, Any]]) -> str:
    return "" if not errors else f"; {len(errors)} raised ({errors[0]['item']}: {errors[0]['error'][:80]})"


# ----- the claims ----------------------------------------------------------------------------------
def correctness_claims(document: dict[str, Any]) -> list[Verdict]:
    claim = (
        "steps equal the CPU per-parameter fp32 reference (MuSGD, Muon, NorMuon, AdaMuon; NS bf16 and fp32)"
    )
    predicted = "all within the suite's bounds"
    sections = _sections(document, "correctness")
    if sections is None:
        return _unmeasured(document, "correctness", claim, predicted, True)
    rows, errors = _rows(sections, "comparisons")
    held = sum(r["holds"] for r in rows)
    worst = max((r["worst_err_over_bound"] for r in rows), default=0.0)
    out = [
        Verdict(
            claim,
            predicted,
            f"{held}/{len(rows)} within; worst error {worst:.2g} x its bound" + _errors(errors),
            bool(rows) and held == len(rows) and not errors,
            True,
            "correctness",
        )
    ]
    paths = {r["model"]: r["path"] for r in rows if r["path"] != "none"}
    expected = expected_paths(document["device"], document.get("quick", False))
    out.append(
        Verdict(
            "NS takes the packed path and the bucket-by-bucket path (>= 64 MiB of NS inputs)",
            ", ".join(f"{m}: {p}" for m, p in expected.items()),
            ", ".join(f"{m}: {p}" for m, p in paths.items()) or "no NS ran",
            paths == expected if paths else None,
            False,
            "correctness",
        )
    )
    nan, nan_errors = _rows(sections, "nonfinite_skip")
    untouched = sum(r["holds"] for r in nan)
    out.append(
        Verdict(
            "a NaN gradient under nonfinite='skip' leaves its parameter and state bitwise untouched",
            "untouched, the others stepped",
            f"{untouched}/{len(nan)} optimizers" + _errors(nan_errors),
            bool(nan) and untouched == len(nan) and not nan_errors,
            True,
            "correctness",
        )
    )
    fused, fused_errors = _rows(sections, "fused_sgd")
    measured = "; ".join("equal bits" if r["bitwise"] else f"rel err {r['worst_rel_err']:.2g}" for r in fused)
    out.append(
        Verdict(
            "torch's fused SGD (fused=True) equals MuSGD's SGD half (use_muon=False)",
            "equal bits, or rel err <= 1e-6",
            (measured or "no figure") + _errors(fused_errors),
            bool(fused) and all(r["holds"] for r in fused) and not fused_errors,
            True,
            "correctness",
        )
    )
    return out


def expected_paths(device: str, quick: bool) -> dict[str, str]:
    """How NS should run the correctness models: on the host every plan steps bucket by bucket;
    off it the mixed model is packed, the large one (over 64 MiB of NS inputs) bucket by bucket
    (``quick``: it is small, so packed too)."""
    if device == "cpu":
        return {"mixed": "bucket by bucket", "large": "bucket by bucket"}
    return {"mixed": "packed", "large": "packed" if quick else "bucket by bucket"}


def memory_claims(document: dict[str, Any]) -> list[Verdict]:
    sections = _sections(document, "memory")
    if sections is None:
        return _unmeasured(
            document, "memory", "no host sync, peak extra memory as traced", "trace figures", False
        )
    rows, errors = _rows(sections, "workloads")
    out = []
    for r in rows:
        w = r["workload"]
        synced = r["measured_sync_warnings"], r["measured_host_waits"], r.get("measured_event_waits") or 0
        out.append(
            Verdict(
                f"no host sync in a default step but its wait for the previous step's flags ({w}, {r['optimizer']})",
                _or(
                    r["predicted_host_syncs"],
                    r["trace_problem"],
                    "{} (trace), at most 1 event wait",
                    "predicted",
                ),
                _or(None if synced[0] is None else synced, r["measured_problem"], WAITS_TEXT),
                None if synced[0] is None else _sync_free(*synced),
                False,
                "memory",
            )
        )
        predicted, measured = r["predicted_peak_extra_bytes"], r["measured_peak_extra_bytes"]
        out.append(
            Verdict(
                f"peak extra memory <= predicted x {PEAK_SLACK} ({w})",
                _or(_mib(predicted), r["trace_problem"], "{} (trace)", "predicted"),
                _or(_mib(measured), r["measured_problem"], "{} (allocator)"),
                None if predicted is None or measured is None else measured <= PEAK_SLACK * predicted,
                False,
                "memory",
            )
        )
        out.append(
            Verdict(
                f"step time ({w}): the trace's roofline beside the measurement (not a claim)",
                _or(r["modelled_ms"], r["trace_problem"], "{:.3f} ms (modelled)", "modelled"),
                _or(r["measured_ms"], r["measured_problem"], "{:.3f} ms (CUDA events)"),
                None,
                False,
                "memory",
            )
        )
        if r.get("measured_ms_ignore") is not None:
            out.append(
                Verdict(
                    f"steps alone back to back ({w}): the default beside nonfinite='ignore' (not a claim)",
                    "the masking's kernels, and the wait for the previous step's flags",
                    f"{r['measured_ms']:.3f} ms default, {r['measured_ms_ignore']:.3f} ms ignore",
                    None,
                    False,
                    "memory",
                )
            )
    for m in sections.get("machine", [])[:1]:
        if "error" not in m:  # the model's figures: fastmuon.bench.gpu_cost.GpuModel's defaults
            out.append(
                Verdict(
                    "this machine's rates beside the model's (not a claim)",
                    "4 us a launch, 790 TFLOP/s bf16 (H200 defaults)",
                    f"{m['launch_us']:.1f} us a launch (tiny kernels back to back), {m['bf16_tflops']:.0f} TFLOP/s bf16",
                    None,
                    False,
                    "memory",
                )
            )
    out += [_raised("memory and syncs", e, "-", "memory", holds=None, required=False) for e in errors]
    return out


def speed_claims(document: dict[str, Any]) -> list[Verdict]:
    out = []
    for workload, ours, peer, words in SPEED_CLAIMS:
        trace = _results(document, f"{workload}-trace")
        modelled = _ratio(trace, ours, peer, "modelled_ms")
        if modelled:
            predicted = f"{modelled:.2f}x (modelled ms ratio)"
        elif trace:
            predicted = "not predicted: one of the two rows has no modelled time"
        else:
            predicted = _missing(document, f"{workload}-trace", "predicted")
        for mode in ("eager", "compiled"):
            part = f"{workload}-{mode}"
            claim = f"{words}, {mode})"
            results = _results(document, part)
            if results is None:
                out.append(Verdict(claim, predicted, _missing(document, part), None, False, part))
                continue
            ratio = _ratio(results, ours, peer, "median_ms")
            measured = f"{ratio:.2f}x (ms/step ratio)" if ratio else "one of the two rows has no time"
            out.append(
                Verdict(claim, predicted, measured, None if ratio is None else ratio > 1.0, False, part)
            )
    return out


def graph_claims(document: dict[str, Any]) -> list[Verdict]:
    sections = _sections(document, "cuda-graph")
    claim = "a captured step (docs/performance.md's recipe) equals eager"
    if sections is None:
        return _unmeasured(document, "cuda-graph", claim, "equal bits", True)
    rows, errors = _rows(sections, "captured")
    out = []
    for r in rows:
        w = f"{r['workload']}, {r['optimizer']}"
        equal = "equal bits" if r["bitwise_equal"] else f"differs: rel err {r['worst_rel_err']:.2g}"
        out.append(Verdict(f"{claim} ({w})", "equal bits", equal, r["bitwise_equal"], True, "cuda-graph"))
        out.append(
            Verdict(
                f"a replayed step is faster than an eager one ({w})",
                "faster: one graph launch per step",
                f"eager {r['eager_ms']:.3f} ms, replay {r['replay_ms']:.3f} ms",
                r["replay_ms"] < r["eager_ms"],
                False,
                "cuda-graph",
            )
        )
    out += [_raised(claim, e, "equal bits", "cuda-graph", holds=False, required=True) for e in errors]
    return out


def distributed_claims(document: dict[str, Any]) -> list[Verdict]:
    sections = _sections(document, "distributed")
    claim = "a one-process distributed step equals the plain step, with no host sync"
    if sections is None:
        return _unmeasured(document, "distributed", claim, "equal, 0 syncs", True)
    rows, errors = _rows(sections, "steps")
    out = []
    for r in rows:
        where = f"{r['mode']}, {r['backend']}"
        out.append(
            Verdict(
                f"a distributed step equals the one-process step ({where})",
                "rel err <= 1e-5",
                f"rel err {r['worst_rel_err']:.2g}",
                r["equals_twin"],
                True,
                "distributed",
            )
        )
        ops = sum(r["host_sync_ops"].values())
        if r["sync_warnings"] is None:  # a CPU: host reads wait for nothing there, by design
            measured, holds = f"{ops} host-reading ops (a CPU: they wait for nothing)", None
        else:
            synced = r["sync_warnings"], r["host_waits"], r.get("event_waits") or 0
            measured = WAITS_TEXT.format(synced) + f", {ops} host-reading ops"
            holds = _sync_free(*synced)
        out.append(
            Verdict(
                f"no host sync in a distributed step but its wait for the previous step's flags ({where})",
                "0, at most 1 event wait",
                measured,
                holds,
                False,
                "distributed",
            )
        )
    out += [_raised(claim, e, "-", "distributed", holds=False, required=True) for e in errors]
    return out


#: the claims, in the order of the table
CLAIMS: tuple[Callable[[dict[str, Any]], list[Verdict]], ...] = (
    correctness_claims,
    memory_claims,
    graph_claims,
    distributed_claims,
    speed_claims,
)


def _results(document: dict[str, Any], part: str) -> list[dict[str, Any]] | None:
    results: list[dict[str, Any]] | None = document["parts"].get(part, {}).get("bench", {}).get("results")
    return results


def _ratio(results: list[dict[str, Any]] | None, ours: str, peer: str, key: str) -> float | None:
    """The peer's ``key`` over ours (above 1: ours is faster); None where either is missing.
    The peer's row is the one named ``peer`` (with its version), not its fp32-NS variant."""
    if not results:
        return None
    mine = next((r.get(key) for r in results if r["name"] == ours), None)
    theirs = next(
        (r.get(key) for r in results if r["name"].startswith(peer) and "float32" not in r["name"]), None
    )
    return theirs / mine if mine and theirs else None


def _mib(n: int | None) -> str | None:
    return None if n is None else f"{n / 2**20:.1f} MiB"


def _or(value: Any, problem: str | None, form: str, what: str = "measured") -> str:
    if value is None:
        return f"not {what}: {_short(problem)}" if problem else f"not {what}"
    return form.format(value)
