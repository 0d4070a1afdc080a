"""One rank of the QK-clip DDP test (gloo on CPU); ``test_qk_clip_distributed.py`` launches two.

Each rank holds the same replicated weights and gradients but saw other batches, so other logit
maxima: the clip must use every rank's largest, and the replicas must stay equal.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from gloo_rank import run_rank
from reference_impl import qk_clip_reference
from torch import nn

import fastmuon

H, K, D, IN, TAU = 4, 2, 3, 10, 1.0
PARTS = [{"layer": "attn", "part": "query", "heads": H}, {"layer": "attn", "part": "key", "heads": K}]


def replicated_params() -> list[nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    return [nn.Parameter(torch.randn(s, generator=g)) for s in ((H * D, IN), (K * D, IN))]


def rank_maxima(rank: int) -> torch.Tensor:
    return torch.tensor([[0.5, 3.0, 0.8, 1.5], [2.0, 0.7, 4.0, 0.9]][rank])


def checks(args) -> None:
    params = replicated_params()
    opt = fastmuon.Muon(
        [{"params": params, "attention": PARTS}],
        lr=0.0,
        weight_decay=0.0,
        qk_clip_tau=TAU,
        process_group=dist.group.WORLD,
    )
    for p in params:
        p.grad = torch.zeros_like(p)  # lr 0: the clip alone changes the weights
    opt.step(logit_maxima={"attn": rank_maxima(args.rank)})
    largest = torch.maximum(rank_maxima(0), rank_maxima(1))
    want_q, want_k = qk_clip_reference(*replicated_params(), largest, heads=H, kv_heads=K, tau=TAU, alpha=0.5)
    assert torch.allclose(params[0], want_q, rtol=1e-6) and torch.allclose(params[1], want_k, rtol=1e-6)
    gathered = [torch.empty_like(params[0]) for _ in range(2)]
    dist.all_gather(gathered, params[0].detach().contiguous())
    assert torch.equal(gathered[0], gathered[1])
    print(f"[rank {args.rank}] QK-clip under DDP: the ranks' largest maxima, replicas equal", flush=True)


if __name__ == "__main__":
    run_rank(checks)
