"""A tiny, fully deterministic training job for the exact-resume tests.

Importable by the tests, and runnable as a script so that the second half of a run happens
in a fresh Python process: ``python resume_job.py CHECKPOINT STEPS OUTPUT`` loads the model,
optimizer and LR scheduler from CHECKPOINT, trains STEPS more steps and saves the state to OUTPUT.
"""

from __future__ import annotations

import sys

import torch
from torch import nn

import fastmuon

KINDS = ("musgd", "muon")


def build(kind: str, channels_last: bool = False):
    """Model, optimizer and scheduler, identical in every process (fixed seed)."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, bias=False),
        nn.Flatten(),
        nn.Linear(32, 5),
    )
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    groups = fastmuon.param_groups(model)
    if kind == "musgd":
        opt = fastmuon.MuSGD(
            groups, lr=0.05, momentum=0.9, nesterov=True, weight_decay=5e-4, muon=0.5, sgd=1.0
        )
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    elif kind == "muon":
        opt = fastmuon.Muon(groups, lr=0.02, weight_decay=0.1)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10)
    else:
        raise ValueError(kind)
    return model, opt, sched


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randn(4, 3, 6, 6, generator=gen), torch.randn(4, 5, generator=gen)


def train(model, opt, sched, start: int, stop: int) -> None:
    for step in range(start, stop):
        x, y = batch(step)
        opt.zero_grad(set_to_none=True)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        sched.step()


def save(path, model, opt, sched, step: int, **meta) -> None:
    state = {"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()}
    torch.save({**state, "step": step, **meta}, path)


def load(path, kind: str, channels_last: bool = False):
    model, opt, sched = build(kind, channels_last)
    ckpt = torch.load(path, weights_only=True)
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["opt"])
    sched.load_state_dict(ckpt["sched"])
    return model, opt, sched, ckpt["step"]


def main(argv: list[str]) -> None:
    checkpoint, steps, output = argv
    ckpt = torch.load(checkpoint, weights_only=True)
    model, opt, sched, start = load(checkpoint, ckpt["kind"], ckpt["channels_last"])
    train(model, opt, sched, start, start + int(steps))
    save(
        output, model, opt, sched, start + int(steps), kind=ckpt["kind"], channels_last=ckpt["channels_last"]
    )


if __name__ == "__main__":
    main(sys.argv[1:])
