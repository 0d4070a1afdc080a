"""``fastmuon plan``: what one step's Newton–Schulz costs every rank at a world size no machine
here has, for fastmuon and the peers' designs; see docs/scale.md."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import torch

from ..tools.cli import (
    UsageError,
    check_output_file,
    plot_format_problem,
    require_packages,
    write_json_output,
)
from ..tools.plan_options import (
    DEFAULT_LAYOUT,
    DEFAULT_MODEL,
    DEFAULT_WORLD,
    DTYPE_NAMES,
    ROUNDS,
    SWEEP,
)
from .designs import DESIGNS, figures, summary
from .devices import device
from .figures import Figures, Settings
from .layouts import INNER_DIM, NODE, Layout, given_mesh, layout_for, mesh_world
from .measure import busiest_rank, predicted_measure_seconds
from .models import Workload, workload

DTYPES = dict(zip(DTYPE_NAMES, (torch.bfloat16, torch.float32, torch.float16)))


def _settings(args: argparse.Namespace) -> tuple[Settings, Any]:
    ns = (
        DTYPES[args.ns_dtype]
        if args.ns_dtype
        else (torch.float32 if args.device == "cpu-measured" else torch.bfloat16)
    )
    dev = device(args.device, (ns,))
    settings = Settings(
        ns_dtype=ns,
        param_dtype=DTYPES[args.param_dtype],
        plan_device=dev.plan_device,
        cost_model=dev.cost_model,
    )
    return settings, dev


def world_of(args: argparse.Namespace) -> int:
    """``--world``, else the ranks of a mesh naming both its dims, else :data:`DEFAULT_WORLD`."""
    if args.world is not None:
        return args.world
    return mesh_world(args.layout) or DEFAULT_WORLD


def layout_of(spec: str, world: int, w: Workload, expert_shard: str = "auto") -> Layout:
    """``spec`` at ``world`` ranks for ``w``, or the UsageError naming the fix."""
    try:
        return layout_for(spec, world, w, expert_shard)
    except ValueError as e:
        raise UsageError(str(e)) from None


def compute(args: argparse.Namespace, lay: Layout) -> dict[str, Figures | str]:
    """Every design's figures (or why it does not apply) for ``args.model`` under ``lay``."""
    w = workload(args.model)
    settings, dev = _settings(args)
    link = dev.link_bytes_per_s(lay.world)
    designs = DESIGNS if args.design == "all" else (args.design,)
    return {
        d: figures(d, w, lay, settings, dev.cost_model, link, dev.intra_node_bytes_per_s) for d in designs
    }


# ----- the --plot sweep ---------------------------------------------------------------------------
def _given_inner(spec: str) -> int | None:
    """The inner dim of a mesh ``spec`` names (``hsdp:2x4``: 4); None where it names none."""
    dims = given_mesh(spec)
    return None if dims is None else dims[1]


def _kept_dim(spec: str) -> tuple[str, int] | None:
    """What the sweep keeps of ``spec`` at every world size, and its size: a given mesh's inner
    dim, ``ep:E``'s E (None: nothing kept; the layout is remade at each size)."""
    kind, _, mesh = spec.partition(":")
    inner = _given_inner(spec)
    if inner is not None:
        return f"inner ({INNER_DIM[kind]}) dim", inner
    if kind == "ep" and mesh:
        return "ep size", int(mesh)
    return None


def sweep_spec(spec: str, world: int) -> str:
    """``spec`` at ``world`` ranks, its inner dim kept (``hsdp:2x4`` at 64: ``hsdp:16x4``)."""
    inner = _given_inner(spec)
    return spec if inner is None else f"{spec.partition(':')[0]}:{world // inner}x{inner}"


def sweep_worlds(spec: str, w: Workload, expert_shard: str = "auto") -> tuple[list[int], str]:
    """The sweep's world sizes ``spec`` can take, and a note on those left out ('' if none);
    UsageError, naming the fix, where it takes none."""
    kept, left_out, problem = [], [], ""
    for world in SWEEP:
        try:
            layout_for(sweep_spec(spec, world), world, w, expert_shard)
            kept.append(world)
        except ValueError as e:
            left_out.append(world)
            problem = problem or str(e)
    if not left_out:
        return kept, ""
    dim = _kept_dim(spec)
    if dim is None:
        why = problem
    else:
        what, n = dim
        which = (
            "none of them is a multiple"
            if not kept
            else f"{_sizes(left_out)} {'is' if len(left_out) == 1 else 'are'} not a multiple"
        )
        why = f"the plot keeps {spec}'s {what} {n} at every size, and {which} of {n}"
    if not kept:
        raise UsageError(
            f"--plot sweeps {_sizes(SWEEP)} ranks, and --layout {spec} takes none of them: {why}; "
            f"give {_sweep_fix(spec)} to plot, or leave out --plot"
        )
    return kept, f"left out {_sizes(left_out)} ranks: {why}"


def _sweep_fix(spec: str) -> str:
    kind = spec.partition(":")[0]
    fits = [d for d in range(1, SWEEP[0] + 1) if SWEEP[0] % d == 0]
    if kind in INNER_DIM:
        return f"a mesh whose inner dim divides {SWEEP[0]} ({', '.join(f'{kind}:Rx{d}' for d in fits)})"
    if kind == "ep":
        return f"an ep size dividing {SWEEP[0]} and the experts ({', '.join(f'ep:{d}' for d in fits)})"
    return "another layout"


def _sizes(worlds) -> str:
    names = [f"{n:,}" for n in worlds]
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


def sweep_title(args: argparse.Namespace) -> str:
    """What every point of the plot shares: the model and the layout family, with the inner dim
    it keeps (the mesh itself changes with the world size W)."""
    spec = args.layout
    kind, _, mesh = spec.partition(":")
    if kind in INNER_DIM:
        inner = _given_inner(spec) or NODE
        return f"{args.model}, layout {kind}:(W/{inner})x{inner} (inner {INNER_DIM[kind]} dim {inner})"
    if kind == "ep" and not mesh:
        return f"{args.model}, layout ep:E, E = min(experts, W)"
    return f"{args.model}, layout {spec}"


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**28 else f"{n / 2**20:.1f} MiB"


def _text(args, lay: Layout, results: dict[str, Figures | str], dev) -> str:
    w = workload(args.model)
    lines = [
        f"{w.name}: {w.source}; {len(w.tensors)} orthogonalised tensors, {w.numel() / 1e9:.2f} B elements",
        f"layout {lay} on {lay.world} ranks; times on {dev.name} ({dev.source}; "
        f"link {dev.link_bytes_per_s(lay.world) / 1e9:.0f} GB/s each way)",
    ]
    for design, fig in results.items():
        if isinstance(fig, str):
            lines.append(f"\n{design}: n/a — {fig}")
            continue
        s = summary(fig)
        kinds = ", ".join(f"{n} {k}" for k, n in s["collectives"].items()) or "none"
        lines.append(
            f"\n{design}: NS imbalance {s['imbalance']:.2f}x (max {s['ns_flops_max'] / 1e12:.2f} TFLOP, mean "
            f"{s['ns_flops_mean'] / 1e12:.2f}); bytes/shard max sent {s['sent_per_shard_max']:.2f}x, received "
            f"{s['received_per_shard_max']:.2f}x; collectives per step: {kinds}; buffers max {_gib(s['buffer_bytes_max'])}"
            + (f"; {s['note']}" if s["note"] else "")
        )
        lines.append(
            f"  optimizer step (NS + exchange, busiest rank) {1e3 * s['optimizer_seconds_max']:,.1f} ms; balanced "
            f"ideal of its own work {1e3 * s['ideal_seconds']:,.1f} ms (its mean NS + largest shard once over the link): "
            f"{s['ideal_ratio']:.2f}x"
        )
        lines.append(
            f"  {'ranks':<22} {'n':>5} {'NS TFLOP':>9} {'sent':>11} {'received':>11} {'shard':>11} "
            f"{'buffers':>11} {'NS ms':>9} {'comm ms':>9}"
        )
        classes = fig.classes()
        for c in classes[: args.classes]:
            ranks = c["ranks"] if len(c["ranks"]) <= 22 else c["ranks"][:19] + "..."
            lines.append(
                f"  {ranks:<22} {c['count']:>5} {c['ns_flops'] / 1e12:>9.3f} {_gib(c['bytes_sent']):>11} "
                f"{_gib(c['bytes_received']):>11} {_gib(c['shard_bytes']):>11} {_gib(c['buffer_bytes']):>11} "
                f"{1e3 * c['ns_seconds']:>9.2f} {1e3 * c['comm_seconds']:>9.2f}"
            )
        if len(classes) > args.classes:
            lines.append(f"  ... {len(classes) - args.classes} more classes (--classes, --json)")
    return "\n".join(lines)


def _plot(args, path: str, worlds: list[int]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    w = workload(args.model)
    series: dict[str, dict[str, list]] = {}
    for world in worlds:
        results = compute(args, layout_of(sweep_spec(args.layout, world), world, w, args.expert_shard))
        for design, figs in results.items():
            if isinstance(figs, str):
                continue
            s = summary(figs)
            d = series.setdefault(design, {"world": [], "imbalance": [], "bytes": []})
            d["world"].append(world)
            d["imbalance"].append(s["imbalance"])
            d["bytes"].append(max(s["sent_per_shard_max"], s["received_per_shard_max"]))
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for design, d in series.items():
        a.plot(d["world"], d["imbalance"], marker="o", label=design)
        b.plot(d["world"], d["bytes"], marker="o", label=design)
    for ax, title in ((a, "NS imbalance (max / mean FLOPs)"), (b, "max bytes per rank / its shard")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("ranks")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
    a.axhline(1.1, color="grey", ls="--", lw=0.8)
    b.axhline(2.0, color="grey", ls="--", lw=0.8)
    b.set_yscale("log")
    a.legend()
    fig.suptitle(sweep_title(args))
    fig.tight_layout()
    fig.savefig(path)


def usage_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with the options alone, checked before any work (None: nothing)."""
    if args.measure and args.device != "cpu-measured":
        return "--measure times NS on this CPU: give --device cpu-measured with it"
    if args.measure and args.design not in ("all", "fastmuon"):
        return "--measure times fastmuon's busiest rank: give --design fastmuon or all"
    if not args.max_measure_seconds >= 0:
        return f"--max-measure-seconds must be 0 or more, got {args.max_measure_seconds}"
    if args.classes < 0:
        return f"--classes must be >= 0, got {args.classes}"
    return None


def _check_measure_time(args: argparse.Namespace, fig: Figures) -> None:
    """Refuse to measure what the prediction says would take longer than ``--max-measure-seconds``."""
    limit = args.max_measure_seconds
    seconds = predicted_measure_seconds(fig)
    if limit and seconds > limit:
        raise UsageError(
            f"--measure would take ~{seconds:,.0f} s here (rank {busiest_rank(fig)}'s NS, predicted at "
            f"{float(fig.ns_seconds.max()):,.1f} s, once to warm up and {ROUNDS} times timed), over "
            f"--max-measure-seconds {limit:g}; give a smaller --model (or a larger --world: less NS per "
            "rank), or raise --max-measure-seconds (0: no limit)"
        )


def _measure(args: argparse.Namespace, fig: Figures) -> dict[str, float]:
    """The busiest rank's NS timed here, its progress on standard error."""
    from .measure import measure_busiest

    def progress(done: int, total: int) -> None:
        print(
            f"measuring {done}/{total} matrices of rank {busiest_rank(fig)} ...", file=sys.stderr, flush=True
        )

    settings, _ = _settings(args)
    return measure_busiest(fig, settings, progress=progress)


def run(args: argparse.Namespace) -> int:
    for flag, path in (("--json", args.json), ("--plot", args.plot)):
        if path:
            check_output_file(flag, path)
    if args.targets:
        from . import targets

        problem = targets.usage_problem(args, DEFAULT_MODEL, DEFAULT_LAYOUT)
        if problem:
            raise UsageError(problem)
        return targets.run(args, *_settings(args))
    if args.plot:
        require_packages("matplotlib")
        problem = plot_format_problem(args.plot)
        if problem:
            raise UsageError(f"--plot {args.plot}: {problem}")
    problem = usage_problem(args)
    if problem:
        raise UsageError(problem)
    w = workload(args.model)
    lay = layout_of(args.layout, world_of(args), w, args.expert_shard)
    worlds, sweep_note = sweep_worlds(args.layout, w, args.expert_shard) if args.plot else ([], "")
    results = compute(args, lay)
    _, dev = _settings(args)
    payload: dict[str, Any] = {
        "model": args.model, "layout": str(lay), "world": lay.world, "device": dev.name, "device_source": dev.source,
        "designs": {
            d: ({"not_applicable": f} if isinstance(f, str) else {**summary(f), "classes": f.classes()})
            for d, f in results.items()
        },
    }  # fmt: skip
    text = args.json != "-"
    if text:
        print(_text(args, lay, results, dev), flush=True)
    if args.measure:
        fm = results["fastmuon"]
        assert isinstance(fm, Figures)  # fastmuon's figures apply to every layout
        _check_measure_time(args, fm)
        payload["measured"] = m = _measure(args, fm)
        if text:
            print(
                f"\nmeasured on this CPU: rank {m['rank']}'s NS took {m['measured_seconds']:.3f} s, predicted "
                f"{m['predicted_seconds']:.3f} s (measured / predicted {m['ratio']:.2f})"
            )
    if args.json:
        write_json_output(args.json, json.dumps(payload, indent=1))
    if args.plot:
        _plot(args, args.plot, worlds)
        if text:
            print(f"plot: {args.plot}" + (f"; {sweep_note}" if sweep_note else ""))
        elif sweep_note:
            print(f"plot: {sweep_note}", file=sys.stderr)
    return 0
