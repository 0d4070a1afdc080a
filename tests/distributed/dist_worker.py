"""One rank of the distributed tests (gloo on CPU); ``test_distributed.py`` launches a world of them.

One world runs every check of :data:`CHECKS` in turn, so the seconds a torch process takes to
start are paid once per rank, and writes each one's outcome for its own test (``--only NAME``
runs one alone): DDP equivalence (MuSGD and Muon), a parameter some ranks have no gradient for,
FSDP2 equivalence (uneven and empty shards), a torch.distributed.checkpoint round trip, and
step programs kept across steps. Distributed results are compared with fastmuon run on one
process (exact or within fp32 rounding) and with the plain per-parameter references in
``reference_impl.py`` (rel. 1e-5); kept programs bitwise with programs built afresh.
"""

from __future__ import annotations

import argparse
import copy
import gc
import os
import weakref
from collections.abc import Callable

import torch
import torch.distributed as dist
from gloo_rank import run_checks
from reference_impl import (
    adamw_reference_step,
    muon_reference_pieces,
    muon_reference_step,
    musgd_reference_step,
)
from torch import nn

import fastmuon
from fastmuon.distributed.dtensor import local_shard
from fastmuon.ns.device import cpu_low_precision

F32 = torch.float32
MUSGD_KW = dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-2, muon=0.3, sgd=0.7)
MUON_KW = dict(lr=0.02, momentum=0.95, nesterov=True, weight_decay=0.1)


def log(msg: str) -> None:
    print(f"[rank {dist.get_rank()}] {msg}", flush=True)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def check_close(name: str, got, want) -> bool:
    """fp32 agreement with the single-process result; returns whether it is bitwise.

    A bucket split between ranks runs as smaller batches whose matrices sit at other memory
    offsets, and the CPU GEMM may round those differently by an ulp, which NS amplifies a
    little: hence relative error 1e-6, far below the 1e-5 the batched engine meets against the
    per-parameter reference.
    """
    got, want = list(got), list(want)
    bitwise = all(torch.equal(g, w) for g, w in zip(got, want))
    for k, (g, w) in enumerate(zip(got, want)):
        assert g.shape == w.shape, f"{name}: parameter {k} has shape {tuple(g.shape)}, want {tuple(w.shape)}"
        err = rel_err(g, w)
        assert err <= 1e-6, f"{name}: parameter {k} differs from one process by {err:.2e}"
    return bitwise


def check_reference(name: str, got, want) -> None:
    for k, (g, w) in enumerate(zip(got, want)):
        err = rel_err(g, w)
        assert err <= 1e-5, f"{name}: parameter {k} differs from the per-parameter reference by {err:.2e}"


# ----- replicated parameters (DDP) ------------------------------------------------------------
def ddp_shapes() -> list[tuple]:
    """Many equal shapes (big buckets that get split across ranks), tall, wide, convs, vectors."""
    return (
        [(16, 16, 3, 3)] * 5
        + [(32, 16, 1, 1)] * 3
        + [(8, 24), (40, 12), (1, 9), (12, 1, 3, 3), (24, 8, 3, 3)]
        + [(16,), (32,), (5,)]
    )


def make_params(shapes, seed: int, channels_last_index: int | None = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    params = []
    for k, s in enumerate(shapes):
        p = torch.randn(s, generator=g) * 0.1
        if k == channels_last_index and p.ndim == 4:
            p = p.contiguous(memory_format=torch.channels_last)
        params.append(p.requires_grad_())
    return params


def set_grads(params, seed: int) -> None:
    """Fresh gradients, in each parameter's memory format, the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.empty_like(p).copy_(torch.randn(p.shape, generator=g))


def run_steps(opt_cls, params, kwargs, steps: int, group, grads_seed: int):
    groups = params
    if opt_cls is fastmuon.MuSGD:  # matrices to Muon, the rest to SGD, as the reference routes them
        groups = [
            {"params": [p for p in params if p.ndim >= 2], "use_muon": True},
            {"params": [p for p in params if p.ndim < 2], "use_muon": False},
        ]
    opt = opt_cls(groups, ns_dtype=F32, process_group=group, **kwargs)
    for t in range(steps):
        set_grads(params, grads_seed + t)
        opt.step()
    return opt


def check_ddp(group) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    shapes = ddp_shapes()
    for opt_cls, kwargs, ref in ((fastmuon.MuSGD, MUSGD_KW, "musgd"), (fastmuon.Muon, MUON_KW, "muon")):
        dist_params = make_params(shapes, 1)
        local_params = make_params(shapes, 1)
        opt = run_steps(opt_cls, dist_params, kwargs, 3, group, 100)
        run_steps(opt_cls, local_params, kwargs, 3, None, 100)
        bitwise = check_close(f"DDP {opt_cls.__name__}", dist_params, local_params)
        # against the plain per-parameter formulas
        ref_params = [p.detach().clone() for p in make_params(shapes, 1)]
        states = [{} for _ in ref_params]
        for t in range(3):
            set_grads(ref_params, 100 + t)
            for p, st in zip(ref_params, states):
                with torch.no_grad():
                    if ref == "musgd":
                        musgd_reference_step(p, p.grad, st, use_muon=None, **kwargs)
                    elif p.ndim >= 2:
                        muon_reference_step(p, p.grad, st, **kwargs)
                    else:
                        adamw_reference_step(
                            p, p.grad, st, lr=kwargs["lr"], weight_decay=kwargs["weight_decay"]
                        )
        check_reference(f"DDP {opt_cls.__name__}", [p.detach() for p in dist_params], ref_params)
        # every rank ran a share of the NS FLOPs, and the shares add up to the whole plan
        engine = opt.orthogonalizers()[0]
        owned = torch.tensor([engine.stats.owned_flops], dtype=torch.float64)
        shares = [torch.zeros(1, dtype=torch.float64) for _ in range(world)]
        dist.all_gather(shares, owned, group=group)
        total = sum(s.item() for s in shares)
        assert total == engine.stats.total_flops, (total, engine.stats.total_flops)
        assert min(s.item() for s in shares) > 0, f"a rank got no NS work: {shares}"
        if rank == 0:
            log(
                f"DDP {opt_cls.__name__}: equal to one process (bitwise={bitwise}); NS FLOP shares "
                f"{[round(s.item() / total, 3) for s in shares]}"
            )


def check_missing_grads(group) -> None:
    """Rank 0 has gradients some ranks lack; every rank must step the same set of parameters."""
    rank = dist.get_rank()
    shapes = [(6, 4), (6, 4), (4, 6), (7,)]
    params = make_params(shapes, 3, None)
    groups = [dict(params=params[:3], use_muon=True), dict(params=params[3:], use_muon=False)]
    # a cost model calibrated per rank could differ between ranks: the plan must still agree
    opt = fastmuon.MuSGD(groups, ns_dtype=F32, process_group=group, cost_model="calibrate", **MUSGD_KW)
    local = make_params(shapes, 3, None)
    lgroups = [dict(params=local[:3], use_muon=True), dict(params=local[3:], use_muon=False)]
    local_opt = fastmuon.MuSGD(lgroups, ns_dtype=F32, **MUSGD_KW)
    for t in range(2):
        set_grads(params, 7 + t)
        set_grads(local, 7 + t)
        # params[1]: no rank has a gradient; params[2]: only rank 0 has one, and it is zero;
        # params[3] (SGD): only rank 0 has its gradient, the other ranks step it as zero.
        params[1].grad = local[1].grad = None
        params[2].grad = torch.zeros_like(params[2]) if rank == 0 else None
        local[2].grad = torch.zeros_like(local[2])
        if rank != 0:
            params[3].grad = None
            local[3].grad = torch.zeros_like(local[3])
        opt.step()
        local_opt.step()
    check_close("missing gradients", params, local)
    assert torch.equal(params[1], make_params(shapes, 3, None)[1]), "a parameter without gradients moved"
    assert all(len(opt.state[p]) > 0 for p in params), "state missing for a parameter (eager init)"
    if rank == 0:
        log("missing gradients: same plan on every rank, zeros where a rank has no gradient")


def check_thread_counts_differ(group) -> None:
    """Ranks with different thread counts (which price eigendecompositions differently) must
    still build one plan: rank 0's count decides (at 1 thread a 256×384 bf16-asked matrix takes
    the eigh route on a CPU, at 8 threads standard NS)."""
    rank = dist.get_rank()
    params = make_params([(256, 384), (256, 384), (16, 24)], 5, None)
    opt = fastmuon.Muon(params, ns_dtype=torch.bfloat16, process_group=group, lr=0.02, momentum=0.95)
    torch.set_num_threads(1 if rank == 0 else 8)
    try:
        with cpu_low_precision("fp32"):
            set_grads(params, 11)
            opt.step()
    finally:
        torch.set_num_threads(1)
    methods = [b.method for b in opt.plan().buckets]
    gathered = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, methods, group=group)
    assert all(m == gathered[0] for m in gathered), f"plans differ across ranks: {gathered}"
    assert "eigh" in gathered[0], gathered[0]
    if rank == 0:
        log(f"thread counts differing by rank: one plan, rank 0's ({gathered[0]})")


# ----- FSDP2 ------------------------------------------------------------------------------------
class TinyNet(nn.Module):
    """Convs and linears with row counts that do not divide by 2 or 3, and a 1-row head."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 5, 3, padding=1)
        self.conv2 = nn.Conv2d(5, 7, 3, padding=1)
        self.conv3 = nn.Conv2d(7, 7, 3, padding=1)
        self.fc1 = nn.Linear(7, 11)
        self.fc2 = nn.Linear(11, 11)
        self.head = nn.Linear(11, 1)
        self.unused = nn.Linear(4, 5)  # never called: no rank ever has its gradient

    def forward(self, x):
        x = torch.relu(self.conv1(x))
        x = torch.relu(self.conv2(x))
        x = torch.relu(self.conv3(x)).mean(dim=(2, 3))
        return self.head(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


def batch(step: int) -> torch.Tensor:
    return torch.randn(4, 3, 6, 6, generator=torch.Generator().manual_seed(1000 + step))


def sharded_net(seed: int):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    net = TinyNet()
    twin = copy.deepcopy(net)
    for m in (net.conv1, net.conv2, net.fc1):
        fully_shard(m)
    fully_shard(net)
    return net, twin


def fsdp_step(net, opt, step: int) -> list[torch.Tensor]:
    """One training step; returns the full gradients it used (for the one-process twin)."""
    opt.zero_grad()
    net(batch(step)).square().mean().backward()
    grads = [None if p.grad is None else p.grad.full_tensor() for p in net.parameters()]
    opt.step()
    return grads


def check_fsdp(workdir: str) -> None:
    import torch.distributed.checkpoint as dcp

    rank = dist.get_rank()
    for opt_cls, kwargs in ((fastmuon.MuSGD, MUSGD_KW), (fastmuon.Muon, MUON_KW)):
        net, twin = sharded_net(5)
        opt = opt_cls(fastmuon.param_groups(net), ns_dtype=F32, **kwargs)
        twin_opt = opt_cls(fastmuon.param_groups(twin), ns_dtype=F32, **kwargs)
        for t in range(3):
            grads = fsdp_step(net, opt, t)
            for p, g in zip(twin.parameters(), grads):
                p.grad = g
            twin_opt.step()
        full = [p.full_tensor() for p in net.parameters()]
        bitwise = check_close(f"FSDP2 {opt_cls.__name__}", full, [p.detach() for p in twin.parameters()])
        assert torch.equal(full[-2], TinyNet_init(5).unused.weight), "unused parameter moved"
        # state dicts are rank-symmetric and hold every parameter (the unused one too)
        sd = opt.state_dict()
        keys = sorted((k, tuple(sorted(v))) for k, v in sd["state"].items())
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, keys)
        assert all(k == keys for k in every), "optimizer state differs in structure between ranks"
        assert len(keys) == len(list(net.parameters())), "state missing for some parameters"
        if rank == 0:
            log(f"FSDP2 {opt_cls.__name__}: equal to one process (bitwise={bitwise}); state symmetric")

        # checkpoint after 3 steps, run 2 more; a fresh run resumed from the checkpoint must match
        path = os.path.join(workdir, f"ckpt_{opt_cls.__name__}")
        dcp.save({"model": net.state_dict(), "optim": opt.state_dict()}, checkpoint_id=path)
        for t in range(3, 5):
            fsdp_step(net, opt, t)
        expected = [p.full_tensor() for p in net.parameters()]
        net2, _ = sharded_net(99)  # different weights: all must come from the checkpoint
        opt2 = opt_cls(fastmuon.param_groups(net2), ns_dtype=F32, **kwargs)
        opt2.init_state()
        state = {"model": net2.state_dict(), "optim": opt2.state_dict()}
        dcp.load(state, checkpoint_id=path)
        net2.load_state_dict(state["model"])
        opt2.load_state_dict(state["optim"])
        for t in range(3, 5):
            fsdp_step(net2, opt2, t)
        resumed = [p.full_tensor() for p in net2.parameters()]
        assert all(torch.equal(a, b) for a, b in zip(resumed, expected)), "resume differs"
        if rank == 0:
            log(f"FSDP2 {opt_cls.__name__}: checkpoint save/load/resume identical")


def check_state_dict_api(workdir: str) -> None:
    """torch's get/set_optimizer_state_dict (FQN keys) with dcp: a fresh optimizer resumes exactly."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    path = os.path.join(workdir, "ckpt_fqn")
    net, _ = sharded_net(5)
    opt = fastmuon.MuSGD(fastmuon.param_groups(net), ns_dtype=F32, **MUSGD_KW)
    twin, _ = sharded_net(5)
    twin_opt = fastmuon.MuSGD(fastmuon.param_groups(twin), ns_dtype=F32, **MUSGD_KW)
    for t in range(2):
        fsdp_step(net, opt, t)
        fsdp_step(twin, twin_opt, t)
    dcp.save({"optim": get_optimizer_state_dict(net, opt)}, checkpoint_id=path)
    for t in range(2, 4):
        fsdp_step(net, opt, t)
    # a fresh optimizer on the twin (same weights): torch initialises its state with a zero step
    twin.zero_grad(set_to_none=True)
    fresh = fastmuon.MuSGD(fastmuon.param_groups(twin), ns_dtype=F32, **MUSGD_KW)
    state = {"optim": get_optimizer_state_dict(twin, fresh)}
    dcp.load(state, checkpoint_id=path)
    set_optimizer_state_dict(twin, fresh, state["optim"])
    for t in range(2, 4):
        fsdp_step(twin, fresh, t)
    same = all(
        torch.equal(a.full_tensor(), b.full_tensor()) for a, b in zip(net.parameters(), twin.parameters())
    )
    assert same, "resume through get/set_optimizer_state_dict differs"
    if dist.get_rank() == 0:
        log("FSDP2 MuSGD: get/set_optimizer_state_dict + dcp resume identical")


def TinyNet_init(seed: int) -> TinyNet:  # noqa: N802 - the initial weights of sharded_net(seed)
    torch.manual_seed(seed)
    return TinyNet()


def split_by_ns_dtype(groups):
    """Linear weights orthogonalised in float64, convs in float32: two NS dtypes, two exchanges."""
    out = []
    for g in groups:
        g = {k: v for k, v in g.items() if k != "param_names"}
        if not g["use_muon"]:
            out.append(g)
            continue
        convs = [p for p in g["params"] if p.ndim == 4]
        out.append(dict(params=convs, use_muon=True, ns_dtype=F32))
        out.append(
            dict(params=[p for p in g["params"] if p.ndim != 4], use_muon=True, ns_dtype=torch.float64)
        )
    return out


def check_fsdp_reference() -> None:
    """FSDP2 MuSGD against the per-parameter formulas, driven by the gathered gradients."""
    net, twin = sharded_net(11)
    opt = fastmuon.MuSGD(split_by_ns_dtype(fastmuon.param_groups(net)), ns_dtype=F32, **MUSGD_KW)
    groups = fastmuon.param_groups(twin)
    group_of = {id(p): g for g in groups for p in g["params"]}
    ref = [p.detach().clone() for p in twin.parameters()]
    states = [{} for _ in ref]
    for t in range(2):
        grads = fsdp_step(net, opt, t)
        for p, q, g, st in zip(twin.parameters(), ref, grads, states):
            if g is not None:
                group = group_of[id(p)]  # its use_muon, and weight decay 0 for norms and biases
                hyper = {**MUSGD_KW, "weight_decay": group.get("weight_decay", MUSGD_KW["weight_decay"])}
                musgd_reference_step(q, g, st, use_muon=group["use_muon"], **hyper)
    check_reference("FSDP2 MuSGD", [p.full_tensor() for p in net.parameters()], ref)
    assert len({b.dtype for b in opt.last_plan.buckets}) == 2, opt.last_plan.describe()
    if dist.get_rank() == 0:
        log("FSDP2 MuSGD with two NS dtypes: equal to the per-parameter reference")


# ----- matrices cut out of tensors (matrix maps) -----------------------------------------------
class MappedNet(nn.Module):
    """Tensors holding several matrices, with row counts that put some matrices inside one
    rank's shard and spread others over ranks (2 and 3 ranks)."""

    def __init__(self):
        super().__init__()
        self.experts = nn.Parameter(torch.randn(4, 6, 5) * 0.3)  # 4 experts of (out 6, in 5)
        self.qkv = nn.Parameter(torch.randn(15, 5) * 0.3)  # Q, K, V rows
        self.c_attn = nn.Parameter(torch.randn(5, 15) * 0.3)  # Q, K, V stored (in, out)
        self.parts = nn.Parameter(torch.randn(7, 5) * 0.3)  # rows 0:3 and 3:7

    def forward(self, x):
        h = torch.einsum("eoi,bi->beo", self.experts, x).tanh().sum(1)
        return (
            h.square().sum()
            + ((x @ self.qkv.T) * (x @ self.c_attn)).sum()
            + (x @ self.parts.T).square().sum()
        )


MAPS = ["experts", {"split": [5, 5, 5]}, {"split": [5, 5, 5], "transposed": True}, {"split": [3, 4]}]
ALL = slice(None)
PIECES = [  # the same matrices, by hand: (index, stored (in, out)?)
    [((e,), False) for e in range(4)],
    [((slice(a, a + 5),), False) for a in (0, 5, 10)],
    [((ALL, slice(a, a + 5)), True) for a in (0, 5, 10)],
    [((slice(0, 3),), False), ((slice(3, 7),), False)],
]
# matrices spread over ranks (exchanged); the rest lie in one rank's shard (2 ranks: chunks of
# 2 experts, 8|7 qkv rows, 3|2 c_attn rows, 4|3 parts rows; 3 ranks: 2|2|0, 5|5|5, 2|2|1, 3|3|1)
SPREAD = {2: 5, 3: 4}


def mapped_batch(step: int) -> torch.Tensor:
    return torch.randn(3, 5, generator=torch.Generator().manual_seed(2000 + step))


def check_matrix_maps(group) -> None:
    """DDP and FSDP2 Muon on mapped tensors: equal to one process and to the per-matrix reference."""
    from torch.distributed.fsdp import fully_shard

    world = dist.get_world_size()
    torch.manual_seed(7)
    twin = MappedNet()
    ddp_net, fsdp_net = copy.deepcopy(twin), copy.deepcopy(twin)
    fully_shard(fsdp_net)
    ref = [p.detach().clone() for p in twin.parameters()]
    states = [{} for _ in PIECES]

    def muon(params, **kw):
        return fastmuon.Muon([{"params": list(params), "matrices": MAPS}], ns_dtype=F32, **MUON_KW, **kw)

    twin_opt, ddp_opt, fsdp_opt = (
        muon(twin.parameters()),
        muon(ddp_net.parameters(), process_group=group),
        muon(fsdp_net.parameters()),
    )
    for t in range(3):
        for net, opt in ((twin, twin_opt), (ddp_net, ddp_opt), (fsdp_net, fsdp_opt)):
            opt.zero_grad()
            net(mapped_batch(t)).backward()
        grads = [p.grad.full_tensor() for p in fsdp_net.parameters()]
        for opt in (twin_opt, ddp_opt, fsdp_opt):
            opt.step()
        for q, g, pieces, st in zip(ref, grads, PIECES, states):
            muon_reference_pieces(q, g, st, pieces, **MUON_KW)
    want = [p.detach() for p in twin.parameters()]
    check_close("DDP Muon with matrix maps", [p.detach() for p in ddp_net.parameters()], want)
    full = [p.full_tensor() for p in fsdp_net.parameters()]
    check_close("FSDP2 Muon with matrix maps", full, want)
    check_reference("FSDP2 Muon with matrix maps", full, ref)
    engine = fsdp_opt.orthogonalizers()[0]
    assert engine.exchanged.plan.num_matrices == SPREAD[world], engine.exchanged.plan.describe()
    if dist.get_rank() == 0:
        log(
            f"DDP and FSDP2 Muon with matrix maps: equal to one process and the reference; {SPREAD[world]} of 13 matrices exchanged"
        )


# ----- prepared step programs reused across steps ----------------------------------------------
def count_builds(opt) -> list[int]:
    """Counts the step programs ``opt`` builds (one entry per build)."""
    driver = opt._driver
    builds, build = [], driver._make_program

    def counted(*args, **kwargs):
        builds.append(1)
        return build(*args, **kwargs)

    driver._make_program = counted  # the step looks the method up on the instance
    return builds


def local_tensors(opt, params) -> list[torch.Tensor]:
    """Every parameter and state buffer of ``opt`` (local shards where sharded)."""
    out = [local_shard(p.detach()) for p in params]
    for p in params:
        out += [local_shard(v) for _, v in sorted(opt.state[p].items()) if isinstance(v, torch.Tensor)]
    return out


# What each step does to the gradient of the parameter a check picks: "all" leaves it;
# "drop": the last rank has none (it steps there as zeros, with the program of "all");
# "none": no rank has one (another program); "nan": a NaN on the last rank only (every rank
# refuses the step, which changes nothing).
SCHEDULE = ["all", "drop", "none", "all", "nan", "drop", "all"]


def check_cached_against_fresh(name: str, make, grads_at) -> None:
    """Two models from ``make()`` (same weights): one optimizer keeps its step programs, the
    other forgets them before every step (``invalidate``). After every step both hold bitwise
    the same parameters and state, and the first has built one program per set of gradients
    (two: "all" and "drop" share one)."""
    rank, last = dist.get_rank(), dist.get_world_size() - 1
    (kept_net, kept), (fresh_net, fresh) = make(), make()
    builds, fresh_builds = count_builds(kept), count_builds(fresh)
    grads = []  # weak references to the gradients of the steps that build a program
    for t, what in enumerate(SCHEDULE):
        for net, opt in ((kept_net, kept), (fresh_net, fresh)):
            params = list(net.parameters())
            for p in params:
                p.grad = None
            picked = grads_at(t, net)
            if (what == "drop" and rank == last) or what == "none":
                picked.grad = None
            if opt is fresh:
                opt.invalidate()
            if what != "nan":
                opt.step()
                if t in (0, 2) and opt is kept:  # the steps that build its two programs
                    grads += [weakref.ref(local_shard(p.grad)) for p in params if p.grad is not None]
                continue
            if rank == last:
                local_shard(picked.grad).view(-1)[0] = float("nan")
            programs, before = (
                list(opt._driver.cache.programs),
                [x.clone() for x in local_tensors(opt, params)],
            )
            try:
                opt.step()
            except FloatingPointError:
                pass
            else:
                raise AssertionError(f"{name}: a NaN on rank {last} was not refused on rank {rank}")
            assert list(opt._driver.cache.programs) == programs, (
                f"{name}: a refused step changed the programs"
            )
            after = local_tensors(opt, params)
            assert all(torch.equal(a, b) for a, b in zip(after, before)), f"{name}: a refused step wrote"
        pairs = zip(local_tensors(kept, kept_net.parameters()), local_tensors(fresh, fresh_net.parameters()))
        assert all(torch.equal(a, b) for a, b in pairs), f"{name}: step {t} ({what}) differs from fresh"
    assert len(builds) == 2, f"{name}: {len(builds)} programs built over {len(SCHEDULE)} steps"
    assert len(fresh_builds) == len(SCHEDULE), fresh_builds
    # the programs hold no gradient of the steps that built them
    kept_net.zero_grad(set_to_none=True)
    gc.collect()
    assert not any(g() is not None for g in grads), f"{name}: a kept program holds a gradient"


def check_cached_programs(group) -> None:
    """Distributed steps reuse their prepared program, bitwise as a fresh one steps: DDP and
    FSDP2, MuSGD and Muon, whole tensors and matrix maps."""
    from torch.distributed.fsdp import fully_shard

    shapes = [(16, 16, 3, 3), (16, 16, 3, 3), (8, 24), (40, 12), (24, 8, 3, 3), (16,), (5,)]

    def replicated(opt_cls, kwargs):
        def make():
            net = nn.ParameterList(make_params(shapes, 21))
            groups = [
                {"params": [p for p in net if p.ndim >= 2], "use_muon": True},
                {"params": [p for p in net if p.ndim < 2], "use_muon": False},
            ]
            return net, opt_cls(groups, ns_dtype=F32, process_group=group, **kwargs)

        def grads_at(t, net):
            set_grads(list(net), 300 + t)
            return net[2 + t % 2]

        return make, grads_at

    def sharded(opt_cls, kwargs):
        def make():
            net, _ = sharded_net(13)
            return net, opt_cls(fastmuon.param_groups(net), ns_dtype=F32, **kwargs)

        def grads_at(t, net):
            net(batch(t)).square().mean().backward()
            return net.fc2.weight if t % 2 else net.conv2.weight  # conv2: a module sharded on its own

        return make, grads_at

    def mapped(process_group):
        def make():
            torch.manual_seed(7)
            net = MappedNet()
            if process_group is None:
                fully_shard(net)
            params = [{"params": list(net.parameters()), "matrices": MAPS}]
            return net, fastmuon.Muon(params, ns_dtype=F32, process_group=process_group, **MUON_KW)

        def grads_at(t, net):
            net(mapped_batch(t)).backward()
            return net.qkv  # matrices inside one rank's rows and spread ones

        return make, grads_at

    for opt_cls, kwargs in ((fastmuon.MuSGD, MUSGD_KW), (fastmuon.Muon, MUON_KW)):
        check_cached_against_fresh(f"DDP {opt_cls.__name__}", *replicated(opt_cls, kwargs))
        check_cached_against_fresh(f"FSDP2 {opt_cls.__name__}", *sharded(opt_cls, kwargs))
    check_cached_against_fresh("DDP Muon with matrix maps", *mapped(group))
    check_cached_against_fresh("FSDP2 Muon with matrix maps", *mapped(None))
    if dist.get_rank() == 0:
        log("step programs kept across distributed steps: bitwise as fresh ones, one per gradient set")


def check_new_local_shard() -> None:
    """A DTensor parameter given a new local tensor between steps (as FSDP2 re-pads one after
    ``nn.Module._apply``) is updated in that tensor: the step program is rebuilt over it."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))

    def shard(t: torch.Tensor) -> torch.Tensor:
        return distribute_tensor(t, mesh, [Shard(0)])

    def make() -> list[torch.Tensor]:
        g = torch.Generator().manual_seed(5)
        return [nn.Parameter(shard(torch.randn(s, generator=g))) for s in [(9, 4), (6, 6), (7,)]]

    moved, twin = make(), make()
    opts = [fastmuon.Muon(ps, ns_dtype=F32, **MUON_KW) for ps in (moved, twin)]
    builds = count_builds(opts[0])
    for t in range(3):
        for ps, opt in zip((moved, twin), opts):
            g = torch.Generator().manual_seed(40 + t)
            for p in ps:
                p.grad = shard(torch.randn(p.shape, generator=g))
            if t == 2 and ps is moved:
                for p in ps:
                    p._local_tensor = p._local_tensor.clone()
            opt.step()
    same = all(torch.equal(a.to_local(), b.to_local()) for a, b in zip(moved, twin))
    assert same, "a parameter's new local tensor missed the update"
    assert len(builds) == 2, f"{len(builds)} programs built (one, then one over the new local tensors)"
    if dist.get_rank() == 0:
        log("a parameter's new local tensor: the program is rebuilt over it")


def check_one_ranks_misfit(group) -> None:
    """A gradient in another layout on one rank only (a contiguous gradient of a channels_last
    weight, which torch's fused CPU kernel would misread) refits that rank's program alone: it
    rebuilds over the engine it had, the other ranks keep theirs, no rank waits on a collective
    the others skip, and every rank steps bitwise as with fresh programs."""
    rank, last = dist.get_rank(), dist.get_world_size() - 1
    shapes = [(16, 16, 3, 3), (8, 24), (24, 8, 3, 3), (16,)]

    def make():
        params = make_params(shapes, 23)  # the first weight channels_last
        groups = [
            {"params": [p for p in params if p.ndim >= 2], "use_muon": True},
            {"params": [p for p in params if p.ndim < 2], "use_muon": False},
        ]
        return params, fastmuon.MuSGD(groups, ns_dtype=F32, process_group=group, **MUSGD_KW)

    (kept_params, kept), (fresh_params, fresh) = make(), make()
    builds = count_builds(kept)
    engines = []
    for t in range(4):
        for params, opt in ((kept_params, kept), (fresh_params, fresh)):
            set_grads(params, 500 + t)
            if t == 2 and rank == last:
                params[0].grad = params[0].grad.contiguous()
            if opt is fresh:
                opt.invalidate()
            opt.step()
        engines.append(next(iter(kept._driver.cache.programs.values())).matrices.engine)
        pairs = zip(local_tensors(kept, kept_params), local_tensors(fresh, fresh_params))
        assert all(torch.equal(a, b) for a, b in pairs), f"step {t} differs from fresh on rank {rank}"
    # the refit program takes the foreach path for that weight, which fits either layout after
    assert len(builds) == (2 if rank == last else 1), f"{len(builds)} programs built on rank {rank}"
    assert all(e is engines[0] for e in engines), "a refit program changed its engine"
    assert len(kept._driver.cache.programs) == 1
    if rank == 0:
        log("a gradient layout on one rank only: that rank refits its program alone, bitwise")


def check_errors() -> None:
    """Unsupported set-ups fail on every rank with a message that says what to do: the
    per-parameter path over DTensors; a plain tensor beside them whose gradient differs by rank
    (a module left out of fully_shard)."""
    net, _ = sharded_net(3)
    plain = nn.Parameter(torch.randn(4, 4))
    cases = [
        (fastmuon.MuSGD(net.parameters(), use_muon=True, foreach=False, ns_dtype=F32), "foreach=True"),
        (fastmuon.MuSGD([net.fc2.weight, plain], use_muon=True, ns_dtype=F32), "fully_shard"),
    ]
    for opt, hint in cases:
        net(batch(0)).sum().backward()
        plain.grad = torch.full_like(plain, dist.get_rank() + 1.0)
        try:
            opt.step()
        except ValueError as e:
            assert hint in str(e), str(e)
        else:
            raise AssertionError(f"expected a ValueError mentioning {hint!r}")
        opt.zero_grad()
        net.zero_grad()


def check_variants_ddp(group) -> None:
    """DDP NorMuon, AdaMuon and cautious Muon (matrix maps included): equal to one process, and
    to the per-matrix references written from the papers."""
    from reference_impl import variant_reference_step

    cases = (
        (fastmuon.NorMuon, {}, dict(variant="normuon", nesterov=True)),
        (fastmuon.AdaMuon, {}, dict(variant="adamuon", nesterov=False, sign_momentum=True)),
        (
            fastmuon.Muon,
            {"cautious_weight_decay": True},
            dict(variant="muon", nesterov=True, cautious=True),
        ),
    )
    for opt_cls, extra, ref_kw in cases:
        torch.manual_seed(7)
        twin = MappedNet()
        ddp_net = copy.deepcopy(twin)
        ref = [p.detach().clone() for p in twin.parameters()]
        states = [{} for _ in PIECES]
        kw = {k: v for k, v in MUON_KW.items() if k != "nesterov"}

        def make(net, opt_cls=opt_cls, kw=kw, extra=extra, **more):
            groups = [{"params": list(net.parameters()), "matrices": MAPS}]
            return opt_cls(groups, ns_dtype=F32, **kw, **extra, **more)

        twin_opt, ddp_opt = make(twin), make(ddp_net, process_group=group)
        for t in range(3):
            for net, opt in ((twin, twin_opt), (ddp_net, ddp_opt)):
                opt.zero_grad()
                net(mapped_batch(t)).backward()
            grads = [p.grad.clone() for p in twin.parameters()]
            for opt in (twin_opt, ddp_opt):
                opt.step()
            for q, g, pieces, st in zip(ref, grads, PIECES, states):
                with torch.no_grad():
                    variant_reference_step(q, g, st, pieces=pieces, **kw, **ref_kw)
        want = [p.detach() for p in twin.parameters()]
        check_close(
            f"DDP {opt_cls.__name__} with matrix maps", [p.detach() for p in ddp_net.parameters()], want
        )
        check_reference(f"DDP {opt_cls.__name__} with matrix maps", want, ref)
        for p, q in zip(ddp_net.parameters(), twin.parameters()):
            assert torch.equal(ddp_opt.state[p]["momentum_buffer"], twin_opt.state[q]["momentum_buffer"])
    if dist.get_rank() == 0:
        log("DDP NorMuon, AdaMuon and cautious Muon: equal to one process and the reference")


def subgroup() -> dist.ProcessGroup:
    """A group of every rank that is not the default one (made by all ranks, in step)."""
    return dist.new_group(list(range(dist.get_world_size())))


#: Every check, in the order one world runs them; ``test_distributed`` has a test for each.
CHECKS: dict[str, Callable[[argparse.Namespace], None]] = {
    "variants_ddp": lambda args: check_variants_ddp(dist.group.WORLD),
    "ddp": lambda args: check_ddp(dist.group.WORLD),
    "ddp_in_a_subgroup": lambda args: check_ddp(subgroup()),
    "missing_grads": lambda args: check_missing_grads(dist.group.WORLD),
    "thread_counts_differ": lambda args: check_thread_counts_differ(dist.group.WORLD),
    "fsdp": lambda args: check_fsdp(args.dir),
    "fsdp_reference": lambda args: check_fsdp_reference(),
    "matrix_maps": lambda args: check_matrix_maps(dist.group.WORLD),
    "cached_programs": lambda args: check_cached_programs(dist.group.WORLD),
    "new_local_shard": lambda args: check_new_local_shard(),
    "one_ranks_misfit": lambda args: check_one_ranks_misfit(dist.group.WORLD),
    "state_dict_api": lambda args: check_state_dict_api(args.dir),
    "errors": lambda args: check_errors(),
}


if __name__ == "__main__":
    run_checks(CHECKS)
