"""The tables of docs/scale.md: ``fastmuon plan``'s summaries at 8, 64, 256 and 1,024 ranks for
every layout and design, as Markdown (``python scripts/scale_tables.py llama3-70b deepseek-v3``)."""

from __future__ import annotations

import sys

from fastmuon.scale import DESIGNS, figures, parse_layout, workload
from fastmuon.scale.designs import summary
from fastmuon.scale.devices import device
from fastmuon.scale.figures import Settings

WORLDS = (8, 64, 256, 1024)


def layouts(world: int, experts: int) -> list[str]:
    inner = min(8, world)
    out = ["ddp", "fsdp", f"hsdp:{world // inner}x{inner}", f"fsdp+tp:{world // inner}x{inner}"]
    return out + ([f"ep:{min(experts, world)}"] if experts else [])


def table(model: str, dev: str = "h100") -> str:
    w = workload(model)
    d = device(dev)
    settings = Settings(cost_model=d.cost_model)
    rows = [
        f"### {model} ({w.numel() / 1e9:.1f} B orthogonalised elements; times on {dev})\n",
        "| ranks | layout | design | NS imbalance | max sent / shard | max received / shard "
        "| buffers / rank (max) | NS ms (max) | exchange ms (max) | collectives / step |",
        "|---:|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for world in WORLDS:
        for spec in layouts(world, w.num_experts):
            lay = parse_layout(spec, world, w.num_experts)
            for design in DESIGNS:
                f = figures(
                    design,
                    w,
                    lay,
                    settings,
                    d.cost_model,
                    d.link_bytes_per_s(world),
                    d.intra_node_bytes_per_s,
                )
                if isinstance(f, str):
                    rows.append(f"| {world} | {lay} | {design} | n/a: {f} | | | | | | |")
                    continue
                s = summary(f)
                kinds = ", ".join(f"{n} {k}" for k, n in s["collectives"].items()) or "none"
                rows.append(
                    f"| {world} | {lay} | {design} | {s['imbalance']:.2f} | {s['sent_per_shard_max']:.2f} "
                    f"| {s['received_per_shard_max']:.2f} | {s['buffer_bytes_max'] / 2**30:.2f} GiB "
                    f"| {1e3 * s['ns_seconds_max']:.1f} | {1e3 * s['comm_seconds_max']:.1f} | {kinds} |"
                )
    return "\n".join(rows)


if __name__ == "__main__":
    for name in sys.argv[1:] or ["llama3-70b", "deepseek-v3"]:
        print(table(name) + "\n")
