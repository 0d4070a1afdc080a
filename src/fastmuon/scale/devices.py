"""The devices a plan's times are predicted for: their constants, and where each comes from.

A GPU's NS time is its buckets' matmul FLOPs at a stated fraction of the vendor's dense bf16
peak, plus the planner's per-kernel launch cost for each kernel a bucket runs
(:func:`fastmuon.ns.planner.kernels_per_bucket`); its exchange time is the bytes over the link
they cross: NVLink inside a node of 8, the node's InfiniBand NIC per GPU beyond.

Public sources of the constants (vendor datasheets; the sparse figures they print are halved):

- H100 SXM5 and H200 SXM: 1,979 TFLOP/s bf16 Tensor Core "with sparsity" (NVIDIA H100 and H200
  Tensor Core GPU datasheets) → 989 TFLOP/s dense; NVLink 4: 900 GB/s per GPU, both ways
  together → 450 GB/s each way.
- B200 (HGX B200, 1,000 W): 4.5 PFLOP/s bf16 Tensor Core with sparsity (NVIDIA HGX B200
  specifications) → 2,250 TFLOP/s dense; NVLink 5: 1.8 TB/s per GPU → 900 GB/s each way.
- InfiniBand: one ConnectX-7 NDR 400 Gb/s NIC per GPU (NVIDIA DGX H100/H200/B200 system
  specifications) → 50 GB/s each way per GPU.
- Launch cost: fastmuon's own CUDA cost model (``fastmuon.ns.planner.COST_MODELS["cuda"]``).

``efficiency`` (0.6) is an assumption, not a datasheet figure: the fraction of the dense peak a
batched bf16 NS matmul is taken to reach. ``cpu-measured`` is this machine: the launch and
eigendecomposition costs :func:`fastmuon.ns.calibrate.calibrated_cost_model` measures, and the
FLOP rate of an NS-sized ``bmm`` timed here (the calibration's own comes from a small one, which
runs far below the rate of the large products NS at scale computes).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..ns.calibrate import calibrated_cost_model
from ..ns.planner import COST_MODELS, CostModel
from ..ns.timing import matmul_flops, matmul_seconds

GPU_EFFICIENCY = 0.6  # assumed fraction of dense peak reached by NS's batched matmuls


@dataclass(frozen=True)
class Device:
    name: str
    cost_model: CostModel  # seconds per FLOP by dtype, per kernel launch
    plan_device: str  # the device type the plan is made for: "cuda" (bf16 NS) or "cpu"
    intra_node_bytes_per_s: float  # each way, per rank
    inter_node_bytes_per_s: float  # each way, per rank
    ranks_per_node: int
    source: str

    def link_bytes_per_s(self, world: int) -> float:
        return self.intra_node_bytes_per_s if world <= self.ranks_per_node else self.inter_node_bytes_per_s


def _gpu(name: str, dense_bf16_tflops: float, nvlink_gbs_each_way: float, source: str) -> Device:
    cuda = COST_MODELS["cuda"]
    per_flop = 1 / (dense_bf16_tflops * 1e12 * GPU_EFFICIENCY)
    model = CostModel(
        launch_seconds=cuda.launch_seconds,
        seconds_per_flop={torch.bfloat16: per_flop, torch.float16: per_flop, torch.float32: 2 * per_flop},
        default_seconds_per_flop=per_flop,
    )
    return Device(name, model, "cuda", nvlink_gbs_each_way * 1e9, 50e9, 8, source)


DEVICES = {
    "h100": _gpu("h100", 989.0, 450.0, "H100 SXM5: 989 TFLOP/s dense bf16, NVLink 4 450 GB/s each way"),
    "h200": _gpu("h200", 989.0, 450.0, "H200 SXM: 989 TFLOP/s dense bf16, NVLink 4 450 GB/s each way"),
    "b200": _gpu("b200", 2250.0, 900.0, "HGX B200: 2,250 TFLOP/s dense bf16, NVLink 5 900 GB/s each way"),
}
DEVICE_NAMES = (*DEVICES, "cpu-measured")


def device(name: str, dtypes: tuple[torch.dtype, ...] = (torch.float32,)) -> Device:
    """The device called ``name`` (:data:`DEVICE_NAMES`); ``cpu-measured`` calibrates this CPU."""
    if name in DEVICES:
        return DEVICES[name]
    if name == "cpu-measured":
        calibrated = calibrated_cost_model("cpu", dtypes)
        # the calibration's FLOP rate comes from a small bmm; NS at scale runs large ones, so the
        # rate is measured again on an NS-sized product (its launch and eigh costs are kept)
        rates = {d: _seconds_per_flop(d) for d in set(dtypes) | {torch.float32}}
        model = replace(calibrated, seconds_per_flop=rates)
        # ranks of one machine: the exchange is a memory copy, taken at 10 GB/s (not measured)
        return Device(name, model, "cpu", 10e9, 10e9, 1 << 30, "this CPU, constants measured now")
    raise ValueError(f"unknown device {name!r} for --device; choose one of {', '.join(DEVICE_NAMES)}")


def _seconds_per_flop(dtype: torch.dtype, b: int = 4, r: int = 512, c: int = 2048) -> float:
    """Seconds per FLOP of an NS-sized ``A·X`` (``b`` of ``r×r`` by ``r×c``) here: median of 3."""
    return matmul_seconds(b, r, c, dtype, "cpu", rounds=3) / matmul_flops(b, r, c)
