"""What a step does with NaN/Inf gradients: raise, skip the affected parameters, or ignore.

``"skip"`` must not synchronise with the host, so nothing here asks *whether* a gradient is
bad: every decision is a device-side mask. The step runs as usual (a matrix with a bad
gradient has its Newton–Schulz input zeroed in its bucket, so the NaN cannot reach the other
matrices there), and afterwards each parameter and every one of its state tensors is put back
to its pre-step value wherever its gradient was not finite. The snapshot and the restore are a
handful of fused calls per (device, dtype), whatever the number of parameters.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from ..distributed.inflight import InFlight
from ..ns import device as compute
from ..ns.layout import memory_order
from .program import Gather

NONFINITE_MODES = ("raise", "skip", "ignore")

#: Refuse loudly by default: a NaN gradient usually means a diverging run or a bug, and naming
#: the parameter is the fastest way to find it. It costs one read of the gradients and one
#: host sync per step; a step under ``torch.amp.GradScaler`` never gets there (the scaler skips
#: steps with infs itself). ``"skip"`` rides over sporadic bad batches; ``"ignore"`` costs nothing.
DEFAULT_NONFINITE = "raise"


def check_mode(mode: Any) -> str:
    if mode not in NONFINITE_MODES:
        raise ValueError(f"invalid nonfinite={mode!r}; choose one of {NONFINITE_MODES}")
    return mode


def _finite_by_group(grads: Sequence[Tensor]) -> list[tuple[list[int], Tensor]]:
    """``(indices, ok)`` per (device, dtype) of the non-empty gradients: ``ok[k]`` is True when
    every entry of ``grads[indices[k]]`` is finite.

    The max-abs norm is inf or NaN exactly when some entry is, and unlike a sum of squares it
    cannot overflow on huge but finite gradients. One fused norm call per (device, dtype).
    """
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, g in enumerate(grads):
        if g.numel() > 0:  # nothing to be non-finite (and the inf-norm of nothing is undefined)
            groups.setdefault((g.device, g.dtype), []).append(i)
    return [(indices, _max_abs([grads[i] for i in indices]).isfinite()) for indices in groups.values()]


def _max_abs(tensors: list[Tensor]) -> Tensor:
    """Each tensor's largest |entry|, stacked. On a CPU the fused inf-norm runs one slow kernel
    per tensor, slower than abs + max there."""
    if compute.is_host(tensors[0].device):
        return torch.stack(torch._foreach_max(torch._foreach_abs(tensors)))
    return torch.stack(torch._foreach_norm(tensors, ord=float("inf")))


def finite_flags(grads: Sequence[Tensor]) -> list[Tensor]:
    """One 0-d bool tensor per gradient, on its device: True when every entry is finite."""
    flags: list[Tensor | None] = [None] * len(grads)
    for indices, ok in _finite_by_group(grads):
        for k, i in enumerate(indices):
            flags[i] = ok[k]
    for i, g in enumerate(grads):
        if flags[i] is None:
            flags[i] = torch.ones((), dtype=torch.bool, device=g.device)
    return flags  # type: ignore[return-value]


def agree_across_ranks(flags: Sequence[Tensor], group: Any, inflight: InFlight) -> Tensor:
    """All ranks' flags combined (finite only where finite on every rank), one all-reduce
    (held by ``inflight``, see inflight.py)."""
    import torch.distributed as dist

    ok = torch.stack([f.to(flags[0].device) for f in flags]).float()
    inflight.issue(dist.all_reduce, ok, op=dist.ReduceOp.MIN, group=group)
    inflight.wait()
    return ok > 0.5


def raise_if_nonfinite(
    grads: Sequence[Tensor], name: Callable[[int], str], *, flags_given: bool = False
) -> None:
    """Raise naming the first parameter whose gradient holds NaN/Inf (one host sync per device).

    With ``flags_given`` the first argument holds finished 0-d flags instead of gradients."""
    if flags_given:
        groups = [(list(range(len(grads))), torch.stack(list(grads)))] if grads else []
    else:
        # Fast screen first: an L2 norm is finite whenever every entry is (it only errs the
        # other way, when squares of huge finite entries overflow), and it is the cheapest fused
        # reduction on both CPU and GPU. Only a failed screen pays for the exact max-abs check.
        by_device: dict[torch.device, list[Tensor]] = {}
        for g in grads:
            if g.numel() > 0:
                by_device.setdefault(g.device, []).append(g)
        if all(bool(torch.stack(torch._foreach_norm(gs)).isfinite().all()) for gs in by_device.values()):
            return
        groups = _finite_by_group(grads)
    by_device: dict[torch.device, list[Tensor]] = {}
    for _, ok in groups:
        by_device.setdefault(ok.device, []).append(ok)
    if all(bool(torch.cat(oks).all()) for oks in by_device.values()):
        return
    for indices, ok in groups:
        if bool(ok.all()):
            continue
        bad = [indices[k] for k in (~ok).nonzero().flatten().tolist()]
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        raise FloatingPointError(
            f"{name(bad[0])} has a non-finite gradient (NaN or Inf){more}; the step was not applied. "
            "Find the cause (learning rate, loss scale, data), use torch.amp.GradScaler for fp16 "
            "training, or pass nonfinite='skip' to leave such parameters untouched for the step"
        )


def zero_rejected_(batch: Tensor, keep: Tensor | Sequence[Tensor]) -> None:
    """Zero the slots of a ``(B, R, C)`` bucket whose matrix is not kept (in place, one call).

    ``keep``: one bool per slot (a vector, or 0-d tensors). A zero matrix orthogonalises to
    zero, so a NaN never enters the batched Newton–Schulz.
    """
    keep = keep if isinstance(keep, Tensor) else torch.stack(list(keep))
    rejected = ~keep.view(-1, 1, 1)
    batch.masked_fill_(rejected, 0)


def _memory_view(t: Tensor) -> Tensor | None:
    """``t``'s elements as a 1-D view in memory order, or None if its memory has gaps/overlaps."""
    if memory_order(t) is None:
        return None
    return t.as_strided((t.numel(),), (1,), t.storage_offset())


class _Group:
    """Tensors of one (device, dtype): snapshotted into one flat copy and restored with one ``where``.

    The flat views are views of detached tensors: a view of a parameter that requires grad,
    taken before the step modifies the parameter in place, would be one that autograd (and
    ``torch.compile``, which inspects every tensor it is handed) refuses to read afterwards.
    """

    def __init__(self, views: list[Tensor], flags: list[Tensor]):
        self.views = views
        self.flags = flags
        self.sizes = [v.numel() for v in views]
        self.snapshot = torch.cat(views)
        # An asynchronous host-to-device copy: the host does not wait for the device.
        self.repeats = torch.tensor(self.sizes).to(self.snapshot.device, non_blocking=True)

    def restore(self) -> None:
        keep = _flags_on(self.flags, self.snapshot.device)
        mask = torch.repeat_interleave(keep, self.repeats, output_size=self.snapshot.numel())
        merged = torch.where(mask, torch.cat(self.views), self.snapshot, out=self.snapshot)
        torch._foreach_copy_(self.views, list(merged.split(self.sizes)))


def _flags_on(flags: list[Tensor], device: torch.device) -> Tensor:
    """Stack flags (ordered so that each source device's flags are adjacent) onto ``device``.

    Moving flags between devices (an AdamW step count lives on the CPU while its parameter is
    on a GPU) is a copy the host waits for: the one synchronisation "skip" may cost.
    """
    parts: list[Tensor] = []
    start = 0
    while start < len(flags):
        stop = start
        while stop < len(flags) and flags[stop].device == flags[start].device:
            stop += 1
        parts.append(torch.stack(flags[start:stop]).to(device))
        start = stop
    return torch.cat(parts) if len(parts) > 1 else parts[0]


class SkipGuard:
    """Snapshot of every tensor a step may write, put back where the gradient was not finite.

    ``params[i]`` owns ``params[i]`` itself and every tensor in ``states[i]``; ``flags[i]`` says
    whether its gradient was finite. Built after the state buffers exist, restored after the step.
    """

    def __init__(self, params: Sequence[Tensor], flags: Sequence[Tensor], states: Sequence[dict]):
        grouped: dict[tuple[torch.device, torch.dtype], list[tuple[Tensor, Tensor]]] = {}
        self._loose: list[tuple[Tensor, Tensor, Tensor]] = []  # non-dense tensors, copied one by one
        for p, flag, state in zip(params, flags, states):
            for t in [p, *(v for v in state.values() if isinstance(v, Tensor))]:
                view = _memory_view(t.detach())
                if view is None:
                    self._loose.append((t, t.clone(), flag))
                else:
                    grouped.setdefault((t.device, t.dtype), []).append((view, flag))
        self._groups = []
        for entries in grouped.values():
            entries.sort(key=lambda e: str(e[1].device))  # adjacent by flag device (stable)
            self._groups.append(_Group([v for v, _ in entries], [f for _, f in entries]))

    def restore(self) -> None:
        for group in self._groups:
            group.restore()
        for t, saved, flag in self._loose:
            t.copy_(torch.where(flag.to(t.device), t, saved))


# ----- prepared once per step program ---------------------------------------------------------
class FiniteCheck:
    """Which of a fixed list of gradients are finite, as one bool vector on the first one's
    device: one fused max-abs per (device, dtype), no host read (the lists are made once)."""

    def __init__(self, grads: Sequence[Tensor]):
        self.size = len(grads)
        self.device = grads[0].device if grads else torch.device("cpu")
        groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
        for i, g in enumerate(grads):
            if g.numel() > 0:
                groups.setdefault((g.device, g.dtype), []).append(i)
        self._groups = [(Gather(idx), torch.tensor(idx, device=self.device)) for idx in groups.values()]
        by_device: dict[torch.device, list[int]] = {}
        for (device, _), idx in groups.items():
            by_device.setdefault(device, []).extend(idx)
        self._by_device = [Gather(idx) for idx in by_device.values()]

    def __call__(self, grads: Sequence[Tensor]) -> Tensor:
        if len(self._groups) == 1 and len(self._groups[0][0]) == self.size:  # all in one, in order
            return _max_abs(self._groups[0][0](grads)).isfinite()
        keep = torch.ones(self.size, dtype=torch.bool, device=self.device)
        for pick, positions in self._groups:
            ok = _max_abs(pick(grads)).isfinite()
            keep.index_copy_(0, positions, ok.to(self.device))
        return keep

    def screen(self, grads: Sequence[Tensor]) -> bool:
        """Whether every gradient is finite (one host read per device): the cheap test of "raise"."""
        return all(
            bool(torch.stack(torch._foreach_norm(pick(grads))).isfinite().all()) for pick in self._by_device
        )


class SkipPlan:
    """:class:`SkipGuard` prepared once: which tensors to snapshot, grouped by (device, dtype).

    ``owners[i]`` is the position (in the step's keep vector) of the parameter that owns
    ``params[i]`` and its ``states[i]``. Per step: :meth:`snapshot` before the update, and
    :meth:`restore` after it with the keep vector.
    """

    def __init__(self, params: Sequence[Tensor], states: Sequence[dict], owners: Sequence[int]):
        grouped: dict[tuple[torch.device, torch.dtype], list[tuple[Tensor, int]]] = {}
        self._loose: list[tuple[Tensor, int]] = []
        for p, state, owner in zip(params, states, owners):
            for t in [p, *(v for v in state.values() if isinstance(v, Tensor))]:
                view = _memory_view(t.detach())  # see _Group: views of detached tensors
                if view is None:
                    self._loose.append((t, owner))
                else:
                    grouped.setdefault((t.device, t.dtype), []).append((view, owner))
        self._groups = []
        for (device, _), entries in grouped.items():
            views = [v for v, _ in entries]
            sizes = [v.numel() for v in views]
            owner_index = torch.tensor([o for _, o in entries], device=device)
            repeats = torch.tensor(sizes, device=device)
            self._groups.append((views, sizes, owner_index, repeats, sum(sizes)))

    def snapshot(self) -> list[Tensor]:
        return [torch.cat(views) for views, *_ in self._groups] + [t.clone() for t, _ in self._loose]

    def restore(self, saved: list[Tensor], keep: Tensor) -> None:
        for (views, sizes, owner_index, repeats, total), snap in zip(self._groups, saved):
            k = keep.to(snap.device).index_select(0, owner_index)
            mask = torch.repeat_interleave(k, repeats, output_size=total)
            merged = torch.where(mask, torch.cat(views), snap, out=snap)
            torch._foreach_copy_(views, list(merged.split(sizes)))
        for (t, owner), snap in zip(self._loose, saved[len(self._groups) :]):
            t.copy_(torch.where(keep[owner].to(t.device), t, snap))
