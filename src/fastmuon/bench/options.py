"""``fastmuon bench``'s options. Imports no torch, so that ``fastmuon bench --help`` answers at
once; the names it offers are the registries' (tests hold them equal)."""

from __future__ import annotations

import argparse

from ..tools.cli import DefaultsHelpFormatter, json_help

#: fastmuon.bench.workloads.WORKLOADS
WORKLOAD_NAMES = (
    "yolo26n", "yolo26s", "yolo26m", "yolo26l", "yolo26x", "gpt2", "gpt2-blocks", "gpt2-split", "granite-moe",
    "gpt-oss-like", "llama-1b", "llama-8b-layers", "resnet50",
)  # fmt: skip
#: fastmuon.bench.lineup.OPTIMIZERS
OPTIMIZERS = ("musgd", "muon", "normuon", "adamuon")
#: fastmuon.ns.planner.POLICIES
POLICIES = ("auto", "exact", "min_launches")
#: how each contender's step runs: as written, or wrapped in torch.compile's "reduce-overhead"
#: mode, which on CUDA captures the compiled step in CUDA graphs and replays them
STEP_MODES = ("eager", "compiled")
COMPILE_MODE = "reduce-overhead"
#: --ns-dtype's names, in fastmuon.bench.cli.NS_DTYPES's order
NS_DTYPE_NAMES = ("float32", "bfloat16", "float16")

#: fastmuon.step.nonfinite.NONFINITE_MODES
NONFINITE_MODES = ("raise", "skip", "ignore")
#: the GPU a trace's modelled time is for (fastmuon.bench.gpu_cost.GpuModel's defaults: an
#: H200's rates, explained there)
GPU_MODEL, GPU_TFLOPS, GPU_FP32_TFLOPS, GPU_BANDWIDTH_TBS, GPU_LAUNCH_US = "H200", 790.0, 67.0, 4.3, 4.0

#: --max-step-seconds when neither it nor --steps is given
DEFAULT_MAX_STEP_SECONDS = 15.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    """All of ``bench``'s options; extensions (e.g. ``--nproc``) add theirs after these."""
    p.formatter_class = DefaultsHelpFormatter
    p.add_argument(
        "--model", default="yolo26n", help=f"workload: {', '.join(WORKLOAD_NAMES)} or a manifest .json"
    )
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="musgd", help="update rule to compare")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the parameters live")
    p.add_argument(
        "--ns-dtype",
        choices=("auto", *NS_DTYPE_NAMES),
        default="auto",
        help="Newton–Schulz precision for fastmuon and the per-parameter loop; auto: the "
        "optimizers' bfloat16, except on a CPU where it would really run in bf16 (bf16 matmul "
        "units, or --cpu-low-precision native): there whichever of bfloat16/float32 multiplies "
        "faster (measured)",
    )
    p.add_argument(
        "--cpu-low-precision",
        choices=("auto", "native", "fp32"),
        default=None,
        help="how fastmuon runs bf16/fp16 NS on a CPU (fastmuon.ns.device): native forces the "
        "requested dtype, e.g. to compare at equal precision with a native-bf16 peer; unset: "
        "FASTMUON_CPU_LOW_PRECISION or auto",
    )
    p.add_argument("--policy", choices=POLICIES, default="auto", help="fastmuon's batching policy")
    p.add_argument(
        "--cost-model",
        choices=("device", "cpu", "cuda", "calibrate"),
        default="device",
        help="the planner's cost constants for policy=auto: the device's built-in ones, another "
        "device type's (e.g. to see what auto picks for a GPU), or measured on this machine",
    )
    p.add_argument(
        "--ns-method",
        choices=("auto", "standard", "gram", "eigh"),
        default="auto",
        help="fastmuon's NS formulation: auto picks the cheapest accurate one per bucket (Gram-space "
        "NS for wide fp32 buckets; on CPUs where bf16 NS runs in fp32, the eigh route where it costs less)",
    )
    p.add_argument(
        "--steps", type=int, default=None, help="timed steps per round; unset: as many as fit --budget"
    )
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (A B C A B C ...)")
    p.add_argument(
        "--warmup",
        type=int,
        default=2,
        help="untimed steps per contender before measuring (the first builds state and plans, and runs "
        "even with 0; the last one's time sets how many steps fit the budget)",
    )
    p.add_argument(
        "--budget", type=float, default=3.0, help="timed seconds per contender when --steps is unset"
    )
    p.add_argument(
        "--max-step-seconds",
        type=float,
        default=None,
        help="skip a contender whose step is estimated (NS FLOPs / measured matmul rate) to take longer; "
        f"0: no limit; unset: {DEFAULT_MAX_STEP_SECONDS:g} s, or no limit when --steps is given (the "
        "steps asked for are run)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch.set_num_threads; unset: torch's default, fewer if other processes already keep CPUs busy",
    )
    p.add_argument(
        "--step-mode",
        choices=STEP_MODES,
        default="eager",
        help=f"compiled: every contender's step wrapped in torch.compile(mode={COMPILE_MODE!r}), which "
        "on CUDA captures it in CUDA graphs; a contender that cannot be compiled is listed as not supported",
    )
    p.add_argument(
        "--contenders",
        metavar="NAMES",
        default=None,
        help="comma-separated contenders to run (name prefixes, any case, e.g. 'fastmuon,ultralytics'); "
        "unset: all of the optimizer's lineup",
    )
    p.add_argument(
        "--trace",
        action="store_true",
        help="with --device cuda: trace each contender's step on fake cuda tensors instead of timing it "
        "(kernels, host syncs, Python calls, NS FLOPs, memory: counts, not times; no GPU needed); "
        "implied where this torch sees no CUDA device",
    )
    p.add_argument(
        "--nonfinite",
        choices=NONFINITE_MODES,
        default=None,
        help="nonfinite= for fastmuon's rows (what a NaN/Inf gradient does: see fastmuon.Muon); "
        "unset: the class's default",
    )
    p.add_argument(
        "--gpu-model",
        metavar="NAME",
        default=GPU_MODEL,
        help="a trace's modelled time: the GPU it is for, named in the report (its rates are the --gpu-* options)",
    )
    p.add_argument(
        "--gpu-tflops",
        type=float,
        default=GPU_TFLOPS,
        help="a trace's modelled time: dense bf16/fp16 matmul TFLOP/s",
    )
    p.add_argument(
        "--gpu-fp32-tflops",
        type=float,
        default=GPU_FP32_TFLOPS,
        help="a trace's modelled time: fp32 matmul TFLOP/s (torch's default: no TF32)",
    )
    p.add_argument(
        "--gpu-bandwidth", type=float, default=GPU_BANDWIDTH_TBS, help="a trace's modelled time: memory TB/s"
    )
    p.add_argument(
        "--gpu-launch-us",
        type=float,
        default=GPU_LAUNCH_US,
        help="a trace's modelled time: µs added per kernel launch",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic parameters and gradients")
    p.add_argument("--json", metavar="FILE", help=json_help("every figure and the machine facts"))
    p.add_argument("--markdown", metavar="FILE.md", help="write the table as Markdown (for docs)")
    p.add_argument("--plot", metavar="FILE.png", help="bar chart of time and kernels per step (matplotlib)")
    p.add_argument("--quiet", action="store_true", help="no progress display")
    p.add_argument(
        "--verbose",
        action="store_true",
        help="also the NS floors, every ratio between contenders and the notes on each column "
        "(--json holds all of them either way)",
    )

    p.add_argument(
        "--nproc",
        type=int,
        default=1,
        help="ranks (N > 1: the multi-rank benchmark of fastmuon's --optimizer, gloo on CPU, NCCL on CUDA): "
        "NS time per rank, bytes exchanged, NS speedup per rank against every rank doing every matrix",
    )
    p.add_argument(
        "--dist-mode",
        choices=("ddp", "fsdp", "hsdp"),
        default="ddp",
        help="with --nproc: replicated params, Shard(0) DTensors on a 1-D mesh, or HSDP "
        "(Replicate over 2 groups, Shard(0) within; an even --nproc); NorMuon and AdaMuon: ddp only",
    )
