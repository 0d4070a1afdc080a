"""One training run: same seed, same batches, same schedule for every contender; timed honestly.

Wall time counts only training (batch, forward, backward, optimizer step), not evaluation. The
optimizer-step share is the part of that time spent inside ``optimizer.step()``. On CUDA the
device is synchronised around the step so the split is real, not launch time.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch.optim.lr_scheduler import LambdaLR

from ..ns.timing import synchronize
from .contenders import Contender, lr_multiplier
from .tasks import CharsTask, DigitsTask

Task = DigitsTask | CharsTask


@dataclass
class RunResult:
    """What one (task, contender, seed) run measured; ``evals`` are the curve points."""

    task: str
    optimizer: str
    label: str
    hparams: str
    seed: int
    steps: int
    wall_s: float
    optimizer_s: float
    final: dict[str, float]
    # per training step: cumulative training seconds and the batch loss
    step_time_s: list[float] = field(default_factory=list)
    step_loss: list[float] = field(default_factory=list)
    # periodic evaluations: {"step", "time_s", "train_loss", "val_loss"[, "val_acc"]}
    evals: list[dict[str, float]] = field(default_factory=list)
    diverged: bool = False

    @property
    def step_share(self) -> float:
        return self.optimizer_s / self.wall_s if self.wall_s > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["step_share"] = self.step_share
        d["ms_per_step"] = 1e3 * self.wall_s / max(1, len(self.step_loss))
        return d


def eval_steps(steps: int, evals: int) -> set[int]:
    """Steps after which to evaluate: step 0 (the initial model), ``evals`` evenly spaced, the last."""
    points = {0, steps}
    points.update(round(i * steps / evals) for i in range(1, evals))
    return points


def train_run(
    task: Task,
    contender: Contender,
    *,
    steps: int,
    seed: int,
    device: torch.device,
    ns_dtype: torch.dtype,
    on_step: Callable[[int, float], None] | None = None,
) -> RunResult:
    """Train a fresh model from ``seed`` for ``steps`` steps; ``on_step(step, loss)`` drives a progress bar.

    ``task.setup(device)`` must have been called. The model's initial weights and the batch
    sequence depend only on ``seed``, so every contender starts from the same point and sees
    the same data.
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    torch.manual_seed(seed)
    model = task.build_model().to(device)
    optimizer = contender.build(model, task.name, ns_dtype)
    scheduler = LambdaLR(optimizer, lambda s: lr_multiplier(s, steps))
    batches = torch.Generator().manual_seed(seed)
    checkpoints = eval_steps(steps, task.evals)

    result = RunResult(
        task.name, contender.name, contender.label, contender.describe(task.name), seed, steps, 0.0, 0.0, {}
    )

    def evaluate(step: int) -> None:
        model.eval()
        metrics = task.evaluate(model)
        model.train()
        result.evals.append({"step": step, "time_s": result.wall_s, **metrics})

    evaluate(0)
    model.train()
    for step in range(1, steps + 1):
        synchronize(device)
        t0 = time.perf_counter()
        x, y = task.batch(batches)
        loss = task.loss(model, x, y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        synchronize(device)
        t1 = time.perf_counter()
        optimizer.step()
        scheduler.step()
        synchronize(device)
        t2 = time.perf_counter()
        result.wall_s += t2 - t0
        result.optimizer_s += t2 - t1
        value = loss.item()
        result.step_time_s.append(result.wall_s)
        result.step_loss.append(value)
        if on_step is not None:
            on_step(step, value)
        if not math.isfinite(value):
            result.diverged = True
            evaluate(step)  # the final figures show the divergence rather than an older point
            break
        if step in checkpoints:
            evaluate(step)
    result.final = {k: v for k, v in result.evals[-1].items() if k not in ("step", "time_s")}
    return result
