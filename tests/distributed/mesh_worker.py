"""One rank of the device-mesh tests (gloo on CPU); ``test_distributed_mesh.py`` launches them.

Every layout a multi-node run uses, built with torch's own APIs on the same input on every rank:
HSDP (``fully_shard`` on a 2-D mesh), tensor parallel alone (``ColwiseParallel`` /
``RowwiseParallel``, the head left a plain tensor), FSDP + TP, expert parallel (an expert
stack sharded on its expert dim over its own mesh, beside dense layers on another), and an
expert stack FSDP2-sharded on dim 1 (``fully_shard``'s ``shard_placement_fn``, as torchtitan
shards experts its FSDP ranks outnumber), alone and over the dp dim of expert parallel. Each is
compared after three steps with the same model stepped in one process (rel. 1e-6 at fp32 NS) and,
for Muon, with the per-parameter reference; which matrices move and the bytes every rank sends
are checked against counts worked out by hand from the layout. A checkpoint saved on one layout
is loaded on another and on one process, and the run goes on with the same updates.
"""

from __future__ import annotations

import os
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from gloo_rank import run_rank
from reference_impl import adamw_reference_step, muon_reference_pieces, muon_reference_step
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import fastmuon
from fastmuon.distributed.exchange import exchange_bytes

F32 = torch.float32
MUON_KW = dict(lr=0.02, momentum=0.95, nesterov=True, weight_decay=0.1)
MUSGD_KW = dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-2, muon=0.3, sgd=0.7)
ADAMW_LR = 0.01  # Muon's lr for the parameters it does not orthogonalise
EXPERTS = 8


def log(msg: str) -> None:
    if dist.get_rank() == 0:
        print(msg, flush=True)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t.detach()


class Dense(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(12, 16)
        self.down = nn.Linear(16, 12)
        self.head = nn.Linear(12, 6)

    def forward(self, x):
        return self.head(self.down(torch.relu(self.up(x))))


class MoE(nn.Module):
    """A dense layer and a stack of experts; every token goes to every expert, so each
    expert's gradient is its own term's (a rank holding some experts computes theirs)."""

    def __init__(self):
        super().__init__()
        self.dense = nn.Linear(12, 12)
        self.experts = nn.Parameter(torch.randn(EXPERTS, 12, 12) * 0.3)

    def forward(self, x):
        h = torch.tanh(self.dense(x))
        w = self.experts
        first = 0
        if isinstance(w, DTensor):
            (chunk,) = w.__create_chunk_list__()
            first, w = chunk.offsets[0], w.to_local()
        weights = torch.arange(first + 1, first + 1 + w.shape[0], dtype=F32)
        per_expert = torch.tanh(torch.einsum("bi,eoi->ebo", x, w)).pow(2).sum(dim=(1, 2))
        # the dense part's gradient is every rank's alike (the experts read x, not h), so the
        # average FSDP2 takes over ranks is one process's
        return (per_expert * weights).sum() + h.sum()


def batch(step: int) -> torch.Tensor:
    return torch.randn(5, 12, generator=torch.Generator().manual_seed(100 + step))


#: matrix maps by parameter name: the experts one matrix each; ``up.weight`` per head in the
#: "heads" layouts (4 heads of 4 rows: inside one rank's part under tensor parallelism)
MAPS = {"experts": "experts"}
HEADS = {"up.weight": {"heads": 4}}


def groups_of(net: nn.Module, maps: dict) -> list[dict]:
    named = dict(net.named_parameters())
    mapped = [{"params": [named[n]], "use_muon": True, "matrices": m} for n, m in maps.items() if n in named]
    matrices = [p for n, p in named.items() if p.ndim >= 2 and n not in maps]
    vectors = [p for p in named.values() if p.ndim < 2]
    return [{"params": matrices, "use_muon": True}, *mapped, {"params": vectors, "use_muon": False}]


def make_opt(net: nn.Module, opt_name: str, maps: dict = MAPS):
    """Muon with whole-matrix owners (its bytes are worked out by hand below); MuSGD with the
    placement's own choice, owner groups where a matrix exceeds a rank's share."""
    if opt_name == "muon":
        return fastmuon.Muon(
            groups_of(net, maps), ns_dtype=F32, adamw_lr=ADAMW_LR, owner_group_size=1, **MUON_KW
        )
    return fastmuon.MuSGD(groups_of(net, maps), ns_dtype=F32, **MUSGD_KW)


def run(net: nn.Module, opt, steps: range) -> None:
    for t in steps:
        opt.zero_grad()
        net(batch(t)).sum().backward()
        opt.step()


# ----- the layouts ---------------------------------------------------------------------------
def hsdp(net: Dense, mesh_shape) -> Dense:
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("replicate", "shard"))
    for layer in (net.up, net.down, net.head):
        fully_shard(layer, mesh=mesh)
    fully_shard(net, mesh=mesh)
    return net


def tensor_parallel(net: Dense, mesh_shape) -> Dense:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    parallelize_module(net, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    return net  # the head stays a plain tensor, replicated


def fsdp_tp(net: Dense, mesh_shape) -> Dense:
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("dp", "tp"))
    parallelize_module(net, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    for layer in (net.up, net.down, net.head):
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(net, mesh=mesh["dp"])
    return net


def fsdp_1d(net: Dense, mesh_shape) -> Dense:
    for layer in (net.up, net.down, net.head):
        fully_shard(layer)
    fully_shard(net)
    return net


def expert_parallel(net: MoE, mesh_shape) -> MoE:
    """The dense layer FSDP2-sharded over every rank, the experts over their own "ep" mesh."""
    world = dist.get_world_size()
    dp = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    ep = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    net.experts = nn.Parameter(distribute_tensor(net.experts.detach(), ep, [Shard(0)]))
    fully_shard(net.dense, mesh=dp)
    return net


def experts_on(dim: int, net: MoE):
    """``fully_shard``'s ``shard_placement_fn``: the experts on ``dim``, the rest FSDP2's Shard(0)."""
    return lambda p: Shard(dim) if p is net.experts else None


def fsdp_experts_dim1(net: MoE, mesh_shape) -> MoE:
    """FSDP2 over every rank, the experts on dim 1: every rank holds its rows of every expert."""
    fully_shard(net.dense)
    fully_shard(net, shard_placement_fn=experts_on(1, net))
    return net


def ep_fsdp_experts_dim1(net: MoE, mesh_shape) -> MoE:
    """The experts sharded on their expert dim over "ep" and FSDP2-sharded on dim 1 over "dp"
    (``(Shard(1), Shard(0))``); the dense layer FSDP2 over every rank."""
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("dp", "ep"))
    net.experts = nn.Parameter(distribute_tensor(net.experts.detach(), mesh["ep"], [Shard(0)]))
    fully_shard(net.dense)
    fully_shard(net, mesh=mesh["dp"], shard_placement_fn=experts_on(1, net))
    return net


def hsdp_ep(net: MoE, mesh_shape) -> MoE:
    """HSDP for the dense layer, the experts sharded over "ep" and replicated over "dp"."""
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("dp", "ep"))
    net.experts = nn.Parameter(distribute_tensor(net.experts.detach(), mesh, [Replicate(), Shard(0)]))
    fully_shard(net.dense, mesh=mesh)
    return net


def numel(*shapes) -> int:
    return sum(torch.Size(s).numel() for s in shapes)


def expected_bytes(layout: str, world: int, rows: int, apart: int = 0) -> tuple[int, int]:
    """(exchanged matrices, bytes all ranks send together per step) worked out from the layout:
    a matrix in ``k`` disjoint equal parts, each held by ``r`` ranks, costs its owner the parts
    it lacks (``1 − 1/k`` of it) and every other holder its part (``r − 1/k`` of it); ``apart``
    of them have an owner holding no part (held whole by none, a matrix may go to any rank),
    which lacks all of it and sends all of it back."""
    up, down, head = numel((16, 12)), numel((12, 16)), numel((6, 12))

    def cost(n: int, parts: int, replicas: int) -> float:
        return n * (1 - 1 / parts) + n * (replicas - 1 / parts)

    if layout == "hsdp":
        replicas, parts = rows, world // rows
        total = sum(cost(n, parts, replicas) for n in (up, down, head))
        return 3, int(4 * total)
    if layout == "tp":
        total = cost(up, world, 1) + cost(down, world, 1) + cost(head, 1, world)
        return 3, int(4 * total)
    if layout == "tp+heads":  # each head inside one rank's rows (world ≤ 4): up.weight stays put
        return 2, int(4 * (cost(down, world, 1) + cost(head, 1, world)))
    if layout == "fsdp+tp":
        dp, tp = rows, world // rows
        total = cost(up, world, 1) + cost(down, world, 1) + cost(head, dp, tp)
        return 3, int(4 * total)
    if layout == "ep":  # experts stay where they are; the dense weight moves
        return 1, int(4 * cost(numel((12, 12)), world, 1))
    if layout == "hsdp+ep":
        dp, ep = rows, world // rows
        n = numel((12, 12))
        # an expert (held whole by its dp replicas) owned by one of them sends the others the
        # result; one the placement moved to a rank holding none comes in once and goes to all dp
        experts = (EXPERTS - apart) * cost(n, 1, dp) + apart * (n + dp * n)
        return 1 + EXPERTS, int(4 * (cost(n, ep, dp) + experts))
    if layout == "fsdp-experts-dim1":  # every expert in world row blocks, one rank each
        return 1 + EXPERTS, int(4 * (1 + EXPERTS) * cost(numel((12, 12)), world, 1))
    if layout == "ep+fsdp-experts-dim1":  # every expert in dp row blocks, one rank each
        n = numel((12, 12))
        experts = (EXPERTS - apart) * cost(n, rows, 1) + apart * 2 * n
        return 1 + EXPERTS, int(4 * (cost(n, world, 1) + experts))
    raise AssertionError(layout)


LAYOUTS = {  # name: (model, how it is laid out, matrix maps)
    "hsdp": (Dense, hsdp, MAPS),
    "tp": (Dense, tensor_parallel, MAPS),
    "tp+heads": (Dense, tensor_parallel, HEADS),
    "fsdp+tp": (Dense, fsdp_tp, MAPS),
    "ep": (MoE, expert_parallel, MAPS),
    "hsdp+ep": (MoE, hsdp_ep, MAPS),
    "fsdp-experts-dim1": (MoE, fsdp_experts_dim1, MAPS),
    "ep+fsdp-experts-dim1": (MoE, ep_fsdp_experts_dim1, MAPS),
}


def reference_muon(model_cls, maps: dict) -> list[torch.Tensor]:
    """Three Muon steps of the per-parameter reference (fp32), on one process's gradients."""
    torch.manual_seed(0)
    net = model_cls()
    params = [p.detach().clone() for p in net.parameters()]
    names = [n for n, _ in net.named_parameters()]
    states = [{} for _ in params]
    for t in range(3):
        net.zero_grad()
        with torch.no_grad():
            for q, p in zip(net.parameters(), params):
                q.copy_(p)
        net(batch(t)).sum().backward()
        for name, p, q, st in zip(names, params, net.parameters(), states):
            if name == "experts":
                pieces = [((e,), False) for e in range(EXPERTS)]
                muon_reference_pieces(p, q.grad, st, pieces, **MUON_KW)
            elif name in maps:  # heads of 4 rows
                pieces = [((slice(a, a + 4),), False) for a in range(0, p.shape[0], 4)]
                muon_reference_pieces(p, q.grad, st, pieces, **MUON_KW)
            elif p.ndim >= 2:
                muon_reference_step(p, q.grad, st, **MUON_KW)
            else:
                adamw_reference_step(p, q.grad, st, lr=ADAMW_LR, weight_decay=MUON_KW["weight_decay"])
    return params


def check_layout(layout: str, mesh_shape, opt_name: str) -> None:
    model_cls, shard, maps = LAYOUTS[layout]
    torch.manual_seed(0)
    twin = model_cls()
    torch.manual_seed(0)
    net = shard(model_cls(), mesh_shape)
    twin_opt, opt = make_opt(twin, opt_name, maps), make_opt(net, opt_name, maps)
    run(twin, twin_opt, range(3))
    run(net, opt, range(3))
    got, want = [full(p) for p in net.parameters()], [p.detach() for p in twin.parameters()]
    names = [n for n, _ in twin.named_parameters()]
    for name, g, w in zip(names, got, want):
        err = rel_err(g, w)
        assert err <= 1e-6, f"{layout} {opt_name}: {name} differs from one process by {err:.2e}"
    if opt_name == "muon":
        for name, g, r in zip(names, got, reference_muon(model_cls, maps)):
            err = rel_err(g, r)
            assert err <= 1e-5, f"{layout} Muon: {name} differs from the reference by {err:.2e}"
    engine = opt.orthogonalizers()[-1]
    exchanged = getattr(engine, "exchanged", engine)
    routes = exchanged.routes
    apart = sum(held[routes.owner.get(i, 0)] is None for i, held in enumerate(routes.held))
    count, total = expected_bytes(layout, dist.get_world_size(), mesh_shape[0], apart)
    assert exchanged.plan.num_matrices == count, (layout, exchanged.plan.describe())
    sent = torch.tensor([exchanged.stats.bytes_sent, exchanged.stats.bytes_received], dtype=torch.int64)
    dist.all_reduce(sent)
    if any(u.group for u in routes.units):  # owner groups move other bytes than the hand count's
        assert opt_name != "muon", "Muon runs with whole-matrix owners here"
        routed = sum(exchange_bytes(routes, r)[0] for r in range(dist.get_world_size()))
        assert sent.tolist() == [routed, routed], (layout, opt_name, sent.tolist(), routed)
    else:
        assert sent.tolist() == [total, total], (layout, opt_name, sent.tolist(), total)
    if layout == "hsdp":  # one rank forgets its programs alone: it rebuilds them, no one waits
        if dist.get_rank() == 0:
            opt.invalidate()
        run(twin, twin_opt, range(3, 4))
        run(net, opt, range(3, 4))
        for name, p, w in zip(names, net.parameters(), twin.parameters()):
            assert rel_err(full(p), w.detach()) <= 1e-6, (
                f"{layout} {opt_name}: {name} after one rank's invalidate"
            )
    meshes = ("hsdp", "fsdp+tp", "hsdp+ep", "ep+fsdp-experts-dim1")
    mesh = tuple(mesh_shape) if layout in meshes else (dist.get_world_size(),)
    log(f"{layout} {mesh} {opt_name}: equal to one process; {count} exchanged matrices, {total} bytes sent")


def check_checkpoint_across_layouts(workdir: str, mesh_shape) -> None:
    """Saved under HSDP, loaded under FSDP + TP, under 1-D FSDP2 and in one process: the next
    steps equal an uninterrupted run's."""
    torch.manual_seed(0)
    straight = hsdp(Dense(), mesh_shape)
    straight_opt = make_opt(straight, "muon")
    run(straight, straight_opt, range(2))
    model_sd, optim_sd = get_state_dict(straight, straight_opt)
    path = os.path.join(workdir, "hsdp-ckpt")
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    run(straight, straight_opt, range(2, 4))
    want = [full(p) for p in straight.parameters()]

    for label, layout in (("FSDP + TP", fsdp_tp), ("1-D FSDP2", fsdp_1d)):
        torch.manual_seed(1)  # other weights: the checkpoint must replace them
        other = layout(Dense(), mesh_shape)
        other_opt = make_opt(other, "muon")
        other_opt.init_state()
        model_sd, optim_sd = get_state_dict(other, other_opt)
        dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
        set_state_dict(other, other_opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
        run(other, other_opt, range(2, 4))
        for k, (g, w) in enumerate(zip([full(p) for p in other.parameters()], want)):
            err = rel_err(g, w)
            assert err <= 1e-6, f"HSDP → {label} resume: parameter {k} off by {err:.2e}"
        log(f"checkpoint saved under HSDP, resumed under {label}: the same updates")
    dist.barrier()
    if dist.get_rank() == 0:  # one process reads the same checkpoint without a process group
        check_single_process_resume(path, want)
    dist.barrier()


def check_single_process_resume(path: str, want: list[torch.Tensor]) -> None:
    torch.manual_seed(2)
    net = Dense()
    opt = make_opt(net, "muon")
    opt.init_state()
    model_sd, optim_sd = get_state_dict(net, opt)
    with warnings.catch_warnings():  # torch's note that no_dist=True loads in one process
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=path, no_dist=True)
    set_state_dict(net, opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
    run(net, opt, range(2, 4))
    for k, (g, w) in enumerate(zip(net.parameters(), want)):
        assert rel_err(g.detach(), w) <= 1e-6, (
            f"HSDP → one process resume: parameter {k} off by {rel_err(g.detach(), w):.2e}"
        )
    print("checkpoint saved under HSDP, resumed in one process: the same updates", flush=True)


def check_refusals() -> None:
    """A layout the step cannot take is refused, on every rank, naming the parameter and what
    to do: when the group is added, and at the first step for a parameter swapped in later (as
    accelerate swaps them), leaving the optimizer as it was."""
    from torch.distributed.tensor import Partial

    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
    sharded = nn.Parameter(distribute_tensor(torch.randn(8, 4), mesh, [Shard(0)]))
    partial = nn.Parameter(DTensor.from_local(torch.randn(4, 4), mesh, [Partial()]))
    try:
        fastmuon.Muon([{"params": [sharded, partial], "use_muon": True}], ns_dtype=F32)
    except ValueError as e:
        assert "parameter 1 of param group 0" in str(e) and "Replicate" in str(e), str(e)
    else:
        raise AssertionError("a Partial parameter was taken")
    opt = fastmuon.Muon([{"params": [sharded, sharded.detach().clone()], "use_muon": True}], ns_dtype=F32)
    opt.param_groups[0]["params"][1] = partial  # swapped in after construction
    for p in (sharded, partial):
        p.grad = torch.zeros_like(p)
    try:
        opt.step()
    except ValueError as e:
        assert "parameter 1 of param group 0" in str(e) and "Replicate" in str(e), str(e)
    else:
        raise AssertionError("a Partial parameter was stepped")
    assert not opt.state, "a refused step left state"
    log("a partial placement: refused when added and at the first step, naming the parameter; no state left")


def check_accelerate_fsdp2() -> None:
    """accelerate's FSDP2 preparation swaps the optimizer's parameters for DTensors after it was
    built (its own code path; accelerate prepares FSDP only on accelerators, so the state is
    set to FSDP by hand): the run equals one process."""
    from accelerate import Accelerator
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    torch.manual_seed(0)
    twin = Dense()
    twin_opt = fastmuon.Muon(fastmuon.param_groups(twin), ns_dtype=F32, **MUON_KW)
    torch.manual_seed(0)
    net = Dense()
    opt = fastmuon.Muon(fastmuon.param_groups(net), ns_dtype=F32, **MUON_KW)
    accelerator = Accelerator(cpu=True)
    accelerator.state.distributed_type = DistributedType.FSDP
    accelerator.state.fsdp_plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2, cpu_ram_efficient_loading=False
    )
    net, opt = accelerator.prepare(net, opt)
    assert all(isinstance(p, DTensor) for g in opt.param_groups for p in g["params"])
    run(twin, twin_opt, range(3))
    for t in range(3):
        accelerator.backward(net(batch(t)).sum())
        opt.step()
        opt.zero_grad()
    for (name, p), w in zip(net.named_parameters(), twin.parameters()):
        assert rel_err(full(p), w.detach()) <= 1e-6, (
            f"accelerate FSDP2: {name} off by {rel_err(full(p), w.detach()):.2e}"
        )
    log("accelerate's FSDP2 preparation (parameters swapped after construction): equal to one process")


def check_trainer_mesh_groups(workdir: str) -> None:
    """Transformers' Trainer gives each device mesh its own param group (experts on one, the
    dense layers on another): the optimizer it builds from fastmuon.Muon, and the one the
    factory builds from the model, both step the expert-parallel model as one process does."""
    from transformers import Trainer, TrainingArguments

    import fastmuon.integrations.transformers as fmt

    args = TrainingArguments(
        output_dir=os.path.join(workdir, "trainer"), use_cpu=True, report_to=[], weight_decay=0.1
    )
    for label, cls_and_kwargs in (
        ("fastmuon.Muon", (fastmuon.Muon, dict(ns_dtype=F32, adamw_lr=ADAMW_LR, **MUON_KW))),
        # the MoE has no output layer (head=None), and its expert stack stays with AdamW
        (
            "MuonFactory",
            (fmt.MuonFactory, dict(head=None, exclude="experts", ns_dtype=F32, adamw_lr=ADAMW_LR, **MUON_KW)),
        ),
    ):
        torch.manual_seed(0)
        twin = MoE()
        torch.manual_seed(0)
        net = expert_parallel(MoE(), None)
        trainer = Trainer(model=net, args=args, optimizer_cls_and_kwargs=cls_and_kwargs)
        opt = trainer.create_optimizer()
        meshes = {
            p.device_mesh.mesh_dim_names
            for g in opt.param_groups
            for p in g["params"]
            if isinstance(p, DTensor)
        }
        assert meshes == {("dp",), ("ep",)}, meshes
        twin_trainer = Trainer(model=twin, args=args, optimizer_cls_and_kwargs=cls_and_kwargs)
        twin_opt = twin_trainer.create_optimizer()
        run(twin, twin_opt, range(3))
        run(net, opt, range(3))
        for (name, p), w in zip(net.named_parameters(), twin.parameters()):
            err = rel_err(full(p), w.detach())
            assert err <= 1e-6, f"Trainer with {label}: {name} off from one process by {err:.2e}"
    log("Transformers' Trainer, groups per device mesh (fastmuon.Muon and MuonFactory): equal to one process")


def checks(args) -> None:
    mesh_shape = (2, args.world // 2) if args.world >= 4 else (args.world, 1)
    for layout in LAYOUTS:
        shape = (1, args.world) if layout == "fsdp+tp" and args.world < 4 else mesh_shape
        for opt_name in ("muon", "musgd"):
            check_layout(layout, shape, opt_name)
    check_checkpoint_across_layouts(args.dir, mesh_shape)
    check_refusals()
    check_accelerate_fsdp2()
    check_trainer_mesh_groups(args.dir)


if __name__ == "__main__":
    run_rank(checks, launcher_env=True)
