"""The at-scale targets fastmuon is judged by, computed (``fastmuon plan --targets``).

Four models written out from their public configurations, each under the layouts it is trained
with, at 8, 64 and 1,024 ranks (H100 constants, bf16 NS and fp32 parameters by default): 33
configurations. In each, fastmuon's step holds when

- **ideal**: its busiest rank's optimizer time is within :data:`IDEAL_FACTOR` of the balanced
  ideal (:func:`~.balance.ideal_seconds`, of fastmuon's own figures);
- **peers**: it is no slower than any peer design that applies to the layout (every design of
  :data:`~.figures.DESIGNS` but fastmuon; one that returns why it does not apply is left out);
- **buffers**: every rank's exchange buffers stay within its bound (:func:`~.balance.buffer_bounds`).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from .balance import buffer_bounds, buffers_fit, busiest_seconds, ideal_seconds, tightest_rank
from .designs import DESIGNS, figures
from .devices import Device
from .figures import Settings
from .layouts import NODE, parse_layout
from .models import Workload, workload

TARGET_WORLDS = (8, 64, 1024)
#: how far above the balanced ideal the busiest rank's optimizer time may be
IDEAL_FACTOR = 2.0
#: peers within this relative margin count as equal (the same figures summed in another order)
TIE = 1e-9
#: model -> its layouts: ``hsdp`` and ``fsdp+tp`` are (W/8)×8 meshes, beyond one node only;
#: ``ep:E`` takes min(E, W) ranks per expert stack
TARGET_LAYOUTS: dict[str, tuple[str, ...]] = {
    "llama3-8b": ("ddp", "fsdp", "hsdp", "fsdp+tp"),
    "llama3-70b": ("fsdp", "hsdp", "fsdp+tp"),
    "mixtral-8x7b": ("fsdp", "hsdp", "ep:8", "fsdp+tp"),
    "deepseek-v3": ("fsdp", "ep:64"),
}


def target_spec(family: str, world: int) -> str | None:
    """The layout ``family`` (a :data:`TARGET_LAYOUTS` entry) at ``world`` ranks; None where the
    targets leave it out (a two-dim mesh within one node)."""
    kind, _, size = family.partition(":")
    if kind in ("hsdp", "fsdp+tp"):
        return None if world <= NODE else f"{kind}:{world // NODE}x{NODE}"
    if kind == "ep" and size:
        return f"ep:{min(int(size), world)}"
    return family


def target_configs() -> list[tuple[str, str, int]]:
    """Every target configuration, ``(model, layout spec, world)``, model by model."""
    out = []
    for model, families in TARGET_LAYOUTS.items():
        for world in TARGET_WORLDS:
            out += [(model, s, world) for f in families if (s := target_spec(f, world)) is not None]
    return out


@dataclass(frozen=True)
class Outcome:
    """One configuration's figures and its three criteria. Times in seconds, buffers in bytes
    (the buffers and bound of the rank closest to its bound); peer None where none applies."""

    model: str
    layout: str
    world: int
    seconds: float
    ideal_seconds: float
    peer: str | None
    peer_seconds: float | None
    buffer_bytes: int
    bound_bytes: int
    within_ideal: bool
    beats_peers: bool
    buffers_fit: bool

    @property
    def ratio(self) -> float:
        return self.seconds / self.ideal_seconds if self.ideal_seconds else 1.0

    @property
    def holds(self) -> bool:
        return self.within_ideal and self.beats_peers and self.buffers_fit

    def failing(self) -> list[str]:
        """The criteria that fail, by name."""
        names = ("ideal", "peers", "buffers")
        return [n for n, ok in zip(names, (self.within_ideal, self.beats_peers, self.buffers_fit)) if not ok]

    def row(self) -> dict[str, Any]:
        return {**asdict(self), "ratio": self.ratio, "holds": self.holds, "failing": self.failing()}


def evaluate(w: Workload, spec: str, world: int, settings: Settings, dev: Device) -> Outcome:
    """``w`` under ``spec`` at ``world`` ranks: fastmuon's figures against its ideal, the peers
    and its buffer bound."""
    lay = parse_layout(spec, world, w.num_experts)
    link = dev.link_bytes_per_s(world)
    results = {
        d: figures(d, w, lay, settings, dev.cost_model, link, dev.intra_node_bytes_per_s) for d in DESIGNS
    }
    fm = results["fastmuon"]
    assert not isinstance(fm, str)  # fastmuon's figures apply to every layout
    seconds, ideal = busiest_seconds(fm), ideal_seconds(fm)
    peers = {d: busiest_seconds(f) for d, f in results.items() if d != "fastmuon" and not isinstance(f, str)}
    best = min(peers, key=peers.__getitem__) if peers else None
    r = tightest_rank(fm)
    return Outcome(
        w.name, str(lay), world, seconds, ideal, best, None if best is None else peers[best],
        int(fm.buffers[r]), int(buffer_bounds(fm)[r]),
        seconds <= IDEAL_FACTOR * ideal, all(seconds <= s * (1 + TIE) for s in peers.values()), buffers_fit(fm),
    )  # fmt: skip


def evaluate_all(
    configs: Iterable[tuple[str, str, int]],
    settings: Settings,
    dev: Device,
    progress: Callable[[int, int, tuple[str, str, int]], None] | None = None,
) -> list[Outcome]:
    """:func:`evaluate` of every ``(model, spec, world)``, each workload built once."""
    configs = list(configs)
    built: dict[str, Workload] = {}
    out = []
    for i, (model, spec, world) in enumerate(configs):
        if progress is not None:
            progress(i, len(configs), (model, spec, world))
        w = built.setdefault(model, workload(model))
        out.append(evaluate(w, spec, world, settings, dev))
    return out


HEADER = (
    "model", "layout", "world", "fastmuon ms", "ideal ms", "ratio", "best peer", "peer ms",
    "buffers GiB", "bound GiB", "ideal", "peers", "buffers", "holds",
)  # fmt: skip


def _ms(s: float | None) -> str:
    return "-" if s is None else f"{1e3 * s:,.1f}"


def _mark(ok: bool) -> str:
    return "pass" if ok else "FAIL"


def cells(o: Outcome) -> list[str]:
    """One table row's cells, in :data:`HEADER`'s order."""
    return [
        o.model, o.layout, f"{o.world:,}", _ms(o.seconds), _ms(o.ideal_seconds), f"{o.ratio:.2f}",
        o.peer or "none", _ms(o.peer_seconds), f"{o.buffer_bytes / 2**30:.2f}", f"{o.bound_bytes / 2**30:.2f}",
        _mark(o.within_ideal), _mark(o.beats_peers), _mark(o.buffers_fit), "yes" if o.holds else "no",
    ]  # fmt: skip


def table(outcomes: Sequence[Outcome]) -> str:
    """The outcomes as an aligned text table, then how many hold."""
    rows = [list(HEADER), *(cells(o) for o in outcomes)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(HEADER))]
    left = {0, 1, 6}  # text columns
    lines = [
        "  ".join(c.ljust(n) if i in left else c.rjust(n) for i, (c, n) in enumerate(zip(r, widths)))
        for r in rows
    ]
    held = sum(o.holds for o in outcomes)
    return "\n".join([*lines, f"{held} of {len(outcomes)} configurations hold"])


def criteria_note() -> str:
    """What the table's criteria columns mean."""
    return (
        f"ideal: busiest rank's optimizer time (NS + exchange) <= {IDEAL_FACTOR:g}x the balanced ideal "
        "(the mean rank's NS time + the largest shard once over the link); peers: no slower "
        "than any peer design that applies; buffers: every rank's exchange buffers <= max(2x its "
        "shard, 2 GiB) (shown: the rank closest to its bound)"
    )


def usage_problem(args: Any, default_model: str, default_layout: str) -> str | None:
    """What ``--targets`` cannot take beside it (None: nothing): it sets its own models, layouts
    and worlds, and computes every design."""
    given = [
        ("--model", args.model != default_model), ("--layout", args.layout != default_layout),
        ("--world", args.world is not None), ("--design", args.design != "all"),
        ("--plot", bool(args.plot)), ("--measure", args.measure),
    ]  # fmt: skip
    clash = [flag for flag, on in given if on]
    if not clash:
        return None
    return (
        f"--targets computes its own {len(target_configs())} configurations (models, layouts, worlds) "
        f"with every design; leave out {', '.join(clash)}, or leave out --targets"
    )


def run(args: Any, settings: Settings, dev: Device) -> int:
    """``fastmuon plan --targets``: the table (or ``--json``), progress on standard error."""
    from ..tools.cli import write_json_output

    def progress(i: int, n: int, config: tuple[str, str, int]) -> None:
        model, spec, world = config
        print(f"computing {i + 1}/{n}: {model} {spec} at {world:,} ranks ...", file=sys.stderr, flush=True)

    ns_name, param_name = (str(d).removeprefix("torch.") for d in (settings.ns_dtype, settings.param_dtype))
    start = time.perf_counter()
    outcomes = evaluate_all(target_configs(), settings, dev, progress)
    seconds = time.perf_counter() - start
    if args.json != "-":
        print(
            f"targets on {dev.name} ({dev.source}), {ns_name} NS, {param_name} parameters\n{criteria_note()}\n"
        )
        print(table(outcomes))
        print(f"computed in {seconds:.1f} s")
    if args.json:
        payload = {
            "device": dev.name, "device_source": dev.source, "ns_dtype": ns_name,
            "param_dtype": param_name, "criteria": criteria_note(),
            "targets": [o.row() for o in outcomes], "hold": sum(o.holds for o in outcomes),
            "total": len(outcomes), "seconds": seconds,
        }  # fmt: skip
        write_json_output(args.json, json.dumps(payload, indent=1))
    return 0
