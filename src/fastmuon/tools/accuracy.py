"""``fastmuon accuracy``: how well each NS variant orthogonalises, measured, not assumed.

For each input kind (random, low-rank plus noise, ill-conditioned; each named for what it is at
the size asked for) and each variant (standard, Gram-space or eigendecomposition formulation,
dtype, coefficient preset, AOL preconditioning; among them what a CUDA plan runs for wide bf16
buckets, :func:`cuda_choice`) it reports the band of output singular values
over the input's significant directions, next to standard 5-step "jordan" NS in fp32, and the
error against standard NS computed in fp64 with the same coefficients (and the same
preconditioning, which the "aol" preset selects).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass

import torch

from ..ns.device import cpu_low_precision
from ..ns.newton_schulz import gram_first_run, gram_restarts, newton_schulz, resolve_coefficients
from ..ns.planner import COST_MODELS, MatrixSpec, plan_buckets


@dataclass(frozen=True)
class Variant:
    name: str
    method: str = "standard"
    dtype: torch.dtype = torch.float32
    coefficients: str = "jordan"
    steps: int = 5


def cuda_choice(rows: int = 1024, cols: int = 4096, count: int = 8) -> Variant:
    """What a CUDA plan runs for a bucket of ``count`` wide bf16 matrices (the planner's choice
    with the CUDA cost model: Gram-space NS from twice as wide as tall, restarting as
    ``newton_schulz.gram_restarts`` says), to be computed here on the CPU in that dtype."""
    spec = MatrixSpec(rows, cols, torch.bfloat16, torch.device("cuda"))
    bucket = plan_buckets([spec] * count, cost_model=COST_MODELS["cuda"]).buckets[0]
    dtype = str(bucket.dtype).removeprefix("torch.").replace("bfloat16", "bf16")
    return Variant(f"{bucket.method} {dtype} (CUDA's choice)", method=bucket.method, dtype=bucket.dtype)


VARIANTS = (
    Variant("standard fp32 (baseline)"),
    Variant("gram fp32", method="gram"),
    Variant("standard bf16", dtype=torch.bfloat16),
    cuda_choice(),
    Variant("eigh fp32", method="eigh"),
    Variant("eigh bf16", method="eigh", dtype=torch.bfloat16),
    Variant("polar_express fp32", coefficients="polar_express"),
    Variant("polar_express gram fp32", method="gram", coefficients="polar_express"),
    Variant("you (6 steps) fp32", coefficients="you", steps=6),
    # AOL-preconditioned (Turbo-Muon): one step fewer than Jordan's; then the other named sets,
    # each at the length it was published for
    Variant("aol (4 steps) fp32", coefficients="aol", steps=4),
    Variant("aol (4 steps) bf16", dtype=torch.bfloat16, coefficients="aol", steps=4),
    Variant("cans fp32", coefficients="cans"),
    Variant("deepseekv4 (10) fp32", coefficients="deepseekv4", steps=10),
    Variant("polar_express_paper fp32", coefficients="polar_express_paper", steps=8),
)


#: the rank of the low-rank input, where the matrix has more singular values than that
LOW_RANK = 4


def make_inputs(rows: int = 64, cols: int = 576, seed: int = 0) -> dict[str, torch.Tensor]:
    """Three kinds of matrices that stress NS differently (all ``rows × cols``), each labelled
    with what it is at this size: a matrix of at most 4 rows has no low-rank input, a 1-row one
    no spread of singular values."""
    g = torch.Generator().manual_seed(seed)
    randn = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    U, _ = torch.linalg.qr(randn(rows, rows))
    V, _ = torch.linalg.qr(randn(cols, rows))
    spread = torch.logspace(0, -6, rows, dtype=torch.float64)
    singular_values = min(rows, cols)
    rank = min(LOW_RANK, singular_values)
    random = randn(rows, cols)
    low_rank = randn(rows, rank) @ randn(rank, cols) + 1e-4 * randn(rows, cols)
    return {
        "random": random,
        low_rank_label(rank, singular_values): low_rank,
        spread_label(singular_values): U @ torch.diag(spread) @ V.T,
    }


def low_rank_label(rank: int, singular_values: int) -> str:
    """The low-rank input's name: full rank where ``rank`` reaches the matrix's count of
    singular values."""
    kind = f"low-rank ({rank})" if rank < singular_values else f"full rank ({rank})"
    return f"{kind} + 1e-4 noise"


def spread_label(singular_values: int) -> str:
    """The spread input's name: singular values from 1 down to 1e-6, or 1 alone in a 1-row matrix."""
    return "ill-conditioned (1 .. 1e-6)" if singular_values > 1 else "one singular value (1)"


def measure(variant: Variant, G: torch.Tensor) -> dict[str, float]:
    with cpu_low_precision("native"):  # measure the dtype itself, not fastmuon's CPU fallback
        out = newton_schulz(
            G.float(), variant.steps, variant.coefficients, dtype=variant.dtype, method=variant.method
        ).double()
    exact = newton_schulz(G, variant.steps, variant.coefficients, dtype=torch.float64)
    s_in = torch.linalg.svdvals(G)
    significant = int((s_in > 1e-3 * s_in[0]).sum())
    s_out = torch.linalg.svdvals(out)[:significant]
    return {
        "sv_min": s_out.min().item(),
        "sv_max": s_out.max().item(),
        "rel_err_vs_fp64": ((out - exact).abs().max() / exact.abs().max()).item(),
        "significant_directions": significant,
    }


def run_accuracy(rows: int = 64, cols: int = 576, seed: int = 0) -> list[dict]:
    rows_out = []
    for kind, G in make_inputs(rows, cols, seed).items():
        for v in VARIANTS:
            rows_out.append({"input": kind, "variant": v.name, **measure(v, G), **_describe(v)})
    return rows_out


def _describe(v: Variant) -> dict:
    d = asdict(v)
    d["dtype"] = str(v.dtype).removeprefix("torch.")
    first_run = gram_first_run(resolve_coefficients(v.coefficients, v.steps))
    d["restarts_at"] = list(gram_restarts(v.steps, v.dtype, first_run)) if v.method == "gram" else None
    return d


def run(args: argparse.Namespace) -> int:
    from .cli import STDOUT, UsageError, check_output_file, write_json_output

    if args.rows < 1 or args.cols < 1:
        raise UsageError(f"--rows and --cols must be at least 1, got {args.rows}×{args.cols}")
    if args.rows > args.cols:
        raise UsageError(
            f"--rows {args.rows} is more than --cols {args.cols}; give the wide orientation "
            "(NS runs a tall matrix as its transpose, so the figures are the same)"
        )
    if args.json:
        check_output_file("--json", args.json)
    results = run_accuracy(args.rows, args.cols, args.seed)
    if args.json != STDOUT:
        print_table(results, args.rows, args.cols)
    if args.json:
        write_json_output(args.json, json.dumps(results, indent=2))
    return 0


def print_table(results: list[dict], rows: int, cols: int) -> None:
    """One line per input and variant, within 80 columns."""
    print(f"NS accuracy on {rows}×{cols} inputs; singular values over significant directions")
    # columns as wide as their longest entry (names whole), apart
    iw = max([len("input"), *(len(r["input"]) for r in results)])
    vw = max([len("variant"), *(len(r["variant"]) for r in results)])
    print(f"{'input':{iw}s} {'variant':{vw}s} {'σ min':>6s} {'σ max':>6s}  {'err vs fp64':>11s}")
    for r in results:
        print(
            f"{r['input']:{iw}s} {r['variant']:{vw}s} {r['sv_min']:6.3f} {r['sv_max']:6.3f}  "
            f"{r['rel_err_vs_fp64']:11.2e}"
        )
