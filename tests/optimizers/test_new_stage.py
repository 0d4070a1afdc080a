"""A new stage after Newton–Schulz, written here as its author would: its stage, its rule, its
class and this test, nothing in fastmuon's core.

The stage equalises each matrix's columns: ``Ô[:, j] = O[:, j] · RMS(O) / RMS(O[:, j])`` (every
column of the update at the update's own RMS). It keeps no state, and its rule is Muon's with
the stage after NS (``StagedRule``, NorMuon's and AdaMuon's too): the batched program takes it as
a class of matrices stacked together (``classes``, ``__call__`` and ``run_class``, what
:class:`fastmuon.step.contracts.AfterNSStage` asks), the per-parameter path as one function of a
matrix's update.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pytest
import torch
from conftest import rel_err
from reference_impl import adamw_reference_step, adjust, ema_update, ns_reference
from torch import Tensor, nn

import fastmuon
from fastmuon.rules.second_moment import StagedRule
from fastmuon.step.contracts import LIKE_PARAM, Rule
from fastmuon.step.matrix_item import MatrixItem

HP = dict(lr=0.02, momentum=0.95, nesterov=True, weight_decay=0.1, ns_dtype=torch.float32)


def equalise(o: Tensor) -> Tensor:
    """``(N, m, n)`` stacked updates, each with its columns at the whole update's RMS."""
    column = o.square().mean(-2, keepdim=True).sqrt().clamp_min(1e-12)
    whole = o.square().mean((-2, -1), keepdim=True).sqrt()
    return o / column * whole


class ColumnRMSStage:
    """The batched stage over a program's matrices (in its order): one class per shape and dtype."""

    def __init__(self, items: list[MatrixItem]):
        by_kind: dict[tuple[Any, ...], list[int]] = {}
        for k, it in enumerate(items):
            by_kind.setdefault((tuple(it.param.shape), it.param.dtype), []).append(k)
        self.classes = [(idx, shape, dtype) for (shape, dtype), idx in by_kind.items()]

    def __call__(self, updates: Sequence[Tensor], scalars: Any) -> list[Tensor]:
        out = list(updates)
        for c, (idx, _, _) in enumerate(self.classes):
            for k, r in zip(idx, self.run_class(c, [updates[k] for k in idx], scalars)):
                out[k] = r
        return out

    def run_class(self, c: int, updates: Sequence[Tensor], scalars: Any) -> list[Tensor]:
        idx, shape, dtype = self.classes[c]
        o = torch.stack(list(updates)).to(torch.float32).reshape(len(idx), shape[0], -1)
        return list(equalise(o).to(dtype).reshape(len(idx), *shape).unbind(0))


def equalise_one(item: MatrixItem, o: Tensor) -> Tensor:
    """The stage on one matrix, for the per-parameter path."""
    return equalise(o.to(torch.float32).reshape(1, o.shape[0], -1)).to(o.dtype).reshape(o.shape)


class ColumnRMS:
    """The kind of stage (:class:`fastmuon.step.contracts.AfterNSKind`): no state of its own, no
    settings, Muon's lr factor."""

    key = None
    shaped = LIKE_PARAM
    role = None

    def shape(self, p: Tensor, m: Any) -> tuple[int, ...]:
        return tuple(p.shape)

    def adjust(self, group: Mapping[str, Any]) -> str:
        return group["adjust_lr_fn"] or "original"

    def attach(self, group: Any, p: Tensor, m: Any, state: Any, items: list[MatrixItem], env: Any) -> None:
        """Nothing per matrix: the stage reads only its update."""

    def pattern(self, groups: Sequence[Mapping[str, Any]]) -> tuple[Any, ...]:
        return ()

    def scalars(self, groups: Sequence[Mapping[str, Any]], s: Any) -> Any:
        return s

    def batched(self, items: list[MatrixItem]) -> ColumnRMSStage:
        return ColumnRMSStage(items)

    def reference(self, item: MatrixItem, update: Tensor) -> Tensor:
        return equalise_one(item, update)


class ColumnMuon(fastmuon.Muon):
    """Muon whose orthogonalised update has its columns equalised."""

    _rule = StagedRule("column_rms", ColumnRMS())


def reference_step(p: Tensor, g: Tensor, state: dict, *, lr, momentum, nesterov, weight_decay) -> None:
    """One step on one parameter, fp32: Muon's, the columns equalised after NS."""
    u = ema_update(p, g, state, momentum, nesterov)
    o = ns_reference(u.reshape(u.shape[0], -1))
    o = equalise(o[None])[0].reshape(p.shape) * adjust("original", p.shape)
    p.mul_(1 - lr * weight_decay).sub_(lr * o)


def test_the_rule_satisfies_the_contract():
    assert isinstance(ColumnMuon._rule, Rule)


def shapes_and_grads(seed: int):
    gen = torch.Generator().manual_seed(seed)
    # repeats of a shape (one stacked class), a conv, a wide and a tall matrix, and a vector (AdamW)
    shapes = [(24, 16), (24, 16), (24, 16), (8, 4, 3, 3), (12, 40), (40, 12), (16,)]
    params = [nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
    grads = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(3)]
    return params, grads


@pytest.mark.parametrize(
    "options",
    [{}, {"foreach": False}, {"max_bucket_bytes": 4096}, {"hooked": True}],
    ids=["bucket-by-bucket", "per-parameter", "a class across buckets", "all buckets in one call"],
)
def test_a_new_stage_steps_as_its_per_parameter_fp32_reference(options):
    params, grads = shapes_and_grads(0)
    groups = [{"params": params[:-1], "use_muon": True}, {"params": params[-1:], "use_muon": False}]
    options = dict(options)
    hooked = options.pop("hooked", False)
    opt = ColumnMuon(groups, **HP, **options)
    if hooked:  # a hook around NS runs every bucket in one engine call: the stage over all at once
        calls = []
        opt.register_orthogonalize_hook(lambda run: calls.append(1) or run())
    ref = [p.detach().clone() for p in params]
    states: list[dict] = [{} for _ in params]
    for step in grads:
        for p, g in zip(params, step):
            p.grad = g.clone()
        opt.step()
        for r, g, st in zip(ref[:-1], step[:-1], states[:-1]):
            reference_step(r, g, st, **{k: HP[k] for k in ("lr", "momentum", "nesterov", "weight_decay")})
        adamw_reference_step(ref[-1], step[-1], states[-1], lr=opt.param_groups[1]["lr"], weight_decay=0.1)
        if options.get("max_bucket_bytes"):  # the small cap puts the repeated shape in several buckets
            plan = opt.plan()
            holding = {
                b
                for b, bucket in enumerate(plan.buckets)
                for m in bucket.members
                if (m.rows, m.cols) == (24, 16)
            }
            assert len(holding) > 1, plan.describe()
    for p, r in zip(params, ref):
        assert rel_err(p.detach(), r) < 1e-5
    if hooked:
        assert len(calls) == len(grads)
    assert set(opt.state[params[0]]) == {"momentum_buffer"}  # Muon's state, nothing of its own
