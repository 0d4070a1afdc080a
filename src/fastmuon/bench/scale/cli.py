"""``fastmuon plan``: what one step's Newton–Schulz costs every rank at a world size no machine
here has, for fastmuon and the peers' designs; see docs/scale.md."""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch

from ...cli import (
    UsageError,
    check_output_file,
    json_help,
    plot_format_problem,
    require_packages,
    write_json_output,
)
from .devices import DEVICE_NAMES, device
from .figures import DESIGNS, Figures, Settings, figures
from .layouts import LAYOUT_HELP, Layout, check_fits, parse_layout
from .models import WORKLOADS, workload

SWEEP = (8, 64, 256, 1024)
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}
SHOWN_CLASSES = 6


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="llama3-70b", choices=list(WORKLOADS), help="the workload")
    p.add_argument("--world", type=int, default=1024, help="ranks")
    p.add_argument("--layout", default="fsdp", help=f"how parameters lie on the ranks: {LAYOUT_HELP}")
    p.add_argument("--design", default="all", choices=("all", *DESIGNS), help="whose step to compute")
    p.add_argument(
        "--device", default="h100", choices=DEVICE_NAMES, help="the device times are predicted for"
    )
    p.add_argument(
        "--ns-dtype", default=None, choices=list(DTYPES), help="NS dtype (bf16 on GPUs, fp32 on the CPU)"
    )
    p.add_argument("--param-dtype", default="fp32", choices=list(DTYPES), help="the parameters' dtype")
    p.add_argument("--classes", type=int, default=SHOWN_CLASSES, help="rank classes shown per design")
    p.add_argument("--json", metavar="FILE", help=json_help("every design's summary and rank classes"))
    p.add_argument(
        "--plot",
        metavar="FILE",
        help=f"plot imbalance and bytes against world size ({', '.join(map(str, SWEEP))})",
    )
    p.add_argument(
        "--measure", action="store_true",
        help="with --device cpu-measured: run the busiest rank's NS here and print measured against predicted",
    )  # fmt: skip


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


def _layout(args: argparse.Namespace, world: int, num_experts: int, sweep: bool = False) -> Layout:
    spec = args.layout
    if sweep and ":" in spec and spec.startswith(("hsdp", "fsdp+tp")):
        inner = int(spec.partition(":")[2].lower().split("x")[1])  # keep the inner dim, if it fits
        spec = f"{spec.partition(':')[0]}:{max(world // inner, 1)}x{min(inner, world)}"
    elif sweep and spec.startswith("ep:"):
        spec = f"ep:{min(int(spec[3:]), world)}"
    try:
        return parse_layout(spec, world, num_experts)
    except ValueError as e:
        raise UsageError(str(e)) from None


def compute(
    args: argparse.Namespace, world: int, sweep: bool = False
) -> tuple[Layout, dict[str, Figures | str]]:
    w = workload(args.model)
    lay = _layout(args, world, w.num_experts, sweep)
    try:
        check_fits(lay, w)
    except ValueError as e:
        raise UsageError(str(e)) from None
    settings, dev = _settings(args)
    link = dev.link_bytes_per_s(world)
    designs = DESIGNS if args.design == "all" else (args.design,)
    return lay, {d: figures(d, w, lay, settings, dev.cost_model, link) for d in designs}


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
        s = fig.summary()
        kinds = ", ".join(f"{n} {k}" for k, n in s["collectives"].items()) or "none"
        lines.append(
            f"\n{design}: NS imbalance {s['imbalance']:.2f}x (max {s['ns_flops_max'] / 1e12:.2f} TFLOP, mean "
            f"{s['ns_flops_mean'] / 1e12:.2f}); bytes/shard max sent {s['sent_per_shard_max']:.2f}x, received "
            f"{s['received_per_shard_max']:.2f}x; collectives per step: {kinds}; buffers max {_gib(s['buffer_bytes_max'])}"
            + (f"; {s['note']}" if s["note"] else "")
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


def _plot(args, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series: dict[str, dict[str, list]] = {}
    for world in SWEEP:
        _, results = compute(args, world, sweep=True)
        for design, fig in results.items():
            if isinstance(fig, str):
                continue
            s = fig.summary()
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
    fig.suptitle(f"{args.model}, layout {args.layout}")
    fig.tight_layout()
    fig.savefig(path)


def run(args: argparse.Namespace) -> int:
    for flag, path in (("--json", args.json), ("--plot", args.plot)):
        if path:
            check_output_file(flag, path)
    if args.plot:
        require_packages("matplotlib")
        problem = plot_format_problem(args.plot)
        if problem:
            raise UsageError(f"--plot {args.plot}: {problem}")
    if args.measure and args.device != "cpu-measured":
        raise UsageError("--measure times NS on this CPU: give --device cpu-measured with it")
    if args.classes < 0:
        raise UsageError(f"--classes must be >= 0, got {args.classes}")
    lay, results = compute(args, args.world)
    _, dev = _settings(args)
    payload: dict[str, Any] = {
        "model": args.model, "layout": str(lay), "world": lay.world, "device": dev.name, "device_source": dev.source,
        "designs": {
            d: ({"not_applicable": f} if isinstance(f, str) else {**f.summary(), "classes": f.classes()})
            for d, f in results.items()
        },
    }  # fmt: skip
    if args.measure:
        fm = results.get("fastmuon")
        if not isinstance(fm, Figures):
            raise UsageError("--measure times fastmuon's busiest rank: give --design fastmuon or all")
        settings, _ = _settings(args)
        from .measure import measure_busiest

        payload["measured"] = measure_busiest(fm, settings)
    if args.json != "-":
        print(_text(args, lay, results, dev))
        if args.measure:
            m = payload["measured"]
            print(
                f"\nmeasured on this CPU: rank {m['rank']}'s NS took {m['measured_seconds']:.3f} s, predicted "
                f"{m['predicted_seconds']:.3f} s (measured / predicted {m['ratio']:.2f})"
            )
    if args.json:
        write_json_output(args.json, json.dumps(payload, indent=1))
    if args.plot:
        _plot(args, args.plot)
        if args.json != "-":
            print(f"plot: {args.plot}")
    return 0
