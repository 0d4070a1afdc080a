"""One rank of the interleaved-parts distributed test (gloo on CPU); ``test_interleaved_distributed.py``
launches a world of them.

Tensors whose parts are interleaved (GPT-OSS's ``gate_up_proj``, an interleaved row split, a
transposed three-way split) are stepped by Muon and MuSGD in one process, under DDP, FSDP2
(``fully_shard``: ``Shard(0)``), tensor parallelism (each tensor sharded on its interleaved dim,
so every part is cut between ranks) and expert parallelism (the experts sharded on their own
mesh beside plain replicated tensors). Every rank gets the same whole gradients, so each layout
must give one process's result (rel. 1e-6 at fp32 NS), and Muon the de-interleaved per-matrix
reference (rel. 1e-5); the matrices exchanged are counted against a count worked out by hand.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from gloo_rank import run_rank
from reference_impl import deinterleaved, interleaved, muon_reference_pieces
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

import fastmuon

F32 = torch.float32
MUON_KW = dict(lr=0.02, momentum=0.95, nesterov=True, weight_decay=0.1)
MUSGD_KW = dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-2, muon=0.3, sgd=0.7)
ALL = slice(None)
E, H, I = 4, 6, 5  # experts, hidden size, expert width

# name: (shape, map, the interleaved dim and part count, the de-interleaved matrices by hand)
TENSORS = {
    "gate_up": (
        (E, H, 2 * I),
        {"batch_dims": 1, "split": [I, I], "interleaved": True, "transposed": True},
        (2, 2),
        [((e, ALL, slice(a, a + I)), True) for e in range(E) for a in (0, I)],
    ),
    "rows": (
        (10, 6),
        {"split": [5, 5], "interleaved": True},
        (0, 2),
        [((slice(a, a + 5),), False) for a in (0, 5)],
    ),
    "qkv": (
        (6, 12),
        {"split": [4, 4, 4], "interleaved": True, "transposed": True},
        (1, 3),
        [((ALL, slice(a, a + 4)), True) for a in (0, 4, 8)],
    ),
}
#: the dim each tensor is sharded on under tensor parallelism: its interleaved dim
TP_DIM = {"gate_up": 2, "rows": 0, "qkv": 1}
#: exchanged matrices, by hand, for 2 and 3 ranks alike. FSDP2 (Shard(0)): experts 2|2(|0) lie
#: whole on one rank each, "rows" (5|5 or 4|4|2) and "qkv" (3|3 or 2|2|2 rows) spread, 2 + 3.
#: TP: each part of every tensor meets every rank's columns or rows: 8 + 2 + 3. EP: experts
#: stay where they are; the plain tensors are each orthogonalised by one rank for all: 2 + 3.
EXCHANGED = {"fsdp2": 5, "tp": 13, "ep": 5}


def log(msg: str) -> None:
    if dist.get_rank() == 0:
        print(msg, flush=True)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t.detach()


class Holder(nn.Module):
    """The tensors as one module's parameters (what ``fully_shard`` takes)."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        for name, (shape, *_rest) in TENSORS.items():
            self.register_parameter(name, nn.Parameter(0.5 * torch.randn(shape, generator=g)))


def grads(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return {name: torch.randn(shape, generator=g) for name, (shape, *_rest) in TENSORS.items()}


def laid_out(layout: str) -> Holder:
    net = Holder()
    world = dist.get_world_size()
    if layout == "fsdp2":
        fully_shard(net)
    elif layout == "tp":
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
        for name, dim in TP_DIM.items():
            p = getattr(net, name)
            setattr(net, name, nn.Parameter(distribute_tensor(p.detach(), mesh, [Shard(dim)])))
    elif layout == "ep":
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
        net.gate_up = nn.Parameter(distribute_tensor(net.gate_up.detach(), mesh, [Shard(0)]))
    return net


def set_grads(net: Holder, step: int) -> None:
    for name, g in grads(step).items():
        p = getattr(net, name)
        p.grad = distribute_tensor(g, p.device_mesh, p.placements) if isinstance(p, DTensor) else g


def make_opt(net: Holder, opt_name: str, **kw):
    names = list(TENSORS)
    group = {"params": [getattr(net, n) for n in names], "matrices": [TENSORS[n][1] for n in names]}
    if opt_name == "muon":
        return fastmuon.Muon([group], ns_dtype=F32, **MUON_KW, **kw)
    return fastmuon.MuSGD([{**group, "use_muon": True}], ns_dtype=F32, **MUSGD_KW, **kw)


def run(net: Holder, opt, steps: int = 3) -> list[torch.Tensor]:
    for t in range(steps):
        set_grads(net, t)
        opt.step()
    return [full(getattr(net, n)) for n in TENSORS]


def reference() -> list[torch.Tensor]:
    """Three Muon steps of the per-matrix reference on the de-interleaved tensors."""
    net = Holder()
    out = []
    for name, (_, _, (dim, n), pieces) in TENSORS.items():
        p, state = deinterleaved(getattr(net, name).detach(), dim, n), {}
        for t in range(3):
            muon_reference_pieces(p, deinterleaved(grads(t)[name], dim, n), state, pieces, **MUON_KW)
        out.append(interleaved(p, dim, n))
    return out


def check(layout: str, opt_name: str, want: list[torch.Tensor], ref: list[torch.Tensor]) -> None:
    net = laid_out(layout)
    kw = {"process_group": dist.group.WORLD} if layout == "ddp" else {}
    opt = make_opt(net, opt_name, **kw)
    got = run(net, opt)
    for name, g, w in zip(TENSORS, got, want):
        err = rel_err(g, w)
        assert err <= 1e-6, f"{layout} {opt_name}: {name} differs from one process by {err:.2e}"
    if opt_name == "muon":
        for name, g, r in zip(TENSORS, got, ref):
            err = rel_err(g, r)
            assert err <= 1e-5, (
                f"{layout} Muon: {name} differs from the de-interleaved reference by {err:.2e}"
            )
    note = ""
    if layout in EXCHANGED:
        engine = opt.orthogonalizers()[-1]
        exchanged = getattr(engine, "exchanged", engine)
        count = exchanged.plan.num_matrices if exchanged is not None else 0
        assert count == EXCHANGED[layout], (layout, opt_name, count)
        note = f"; {count} exchanged matrices"
    log(
        f"{layout} {opt_name}: equal to one process{' and the reference' if opt_name == 'muon' else ''}{note}"
    )


def checks(args) -> None:
    ref = reference()
    for opt_name in ("muon", "musgd"):
        single = Holder()
        want = run(single, make_opt(single, opt_name))
        for layout in ("ddp", "fsdp2", "tp", "ep"):
            check(layout, opt_name, want, ref)


if __name__ == "__main__":
    run_rank(checks)
