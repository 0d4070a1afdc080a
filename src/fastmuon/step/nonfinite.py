"""What a step does with NaN/Inf gradients: raise, skip the affected parameters, or ignore.

One mechanism serves the batched and the per-parameter path: a :class:`NonFiniteGuard` over a
step's gradients (prepared once per step program, or per step for the reference loop).

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

from ..ns import device as compute
from ..ns.gather import Gather
from ..ns.layout import memory_order

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
    return [
        (indices, _max_abs([grads[i] for i in indices], compute.is_host(device)).isfinite())
        for (device, _), indices in groups.items()
    ]


def _max_abs(tensors: list[Tensor], host: bool) -> Tensor:
    """Each tensor's largest |entry|, stacked. On the host's CPU (``host``) the fused inf-norm
    runs one slow kernel per tensor, slower than abs + max there."""
    if host:
        return torch.stack(torch._foreach_max(torch._foreach_abs(tensors)))
    return torch.stack(torch._foreach_norm(tensors, ord=float("inf")))


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


def _memory_view(t: Tensor) -> Tensor | None:
    """``t``'s elements as a 1-D view in memory order, or None if its memory has gaps/overlaps."""
    if memory_order(t) is None:
        return None
    return t.as_strided((t.numel(),), (1,), t.storage_offset())


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
        # (pick, positions, whether on the host's CPU): decided here, once per program
        self._groups = [
            (Gather(idx), torch.tensor(idx, device=self.device), compute.is_host(device))
            for (device, _), idx in groups.items()
        ]
        by_device: dict[torch.device, list[int]] = {}
        for (device, _), idx in groups.items():
            by_device.setdefault(device, []).extend(idx)
        self._by_device = [Gather(idx) for idx in by_device.values()]

    def __call__(self, grads: Sequence[Tensor]) -> Tensor:
        if len(self._groups) == 1 and len(self._groups[0][0]) == self.size:  # all in one, in order
            pick, _, host = self._groups[0]
            return _max_abs(pick(grads), host).isfinite()
        keep = torch.ones(self.size, dtype=torch.bool, device=self.device)
        for pick, positions, host in self._groups:
            ok = _max_abs(pick(grads), host).isfinite()
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


class NonFiniteGuard:
    """A step's handling of NaN/Inf gradients over a fixed list of gradients.

    ``mode`` "raise" refuses the step naming the first bad parameter; "skip" puts each
    parameter with a bad gradient and all of ``states[i]`` back after the update (``params[i]``
    owns ``grads[i]``); "ignore" does nothing. In a distributed run the ranks must decide alike
    (a NaN may sit in one rank's shard only): :meth:`keep` then takes ``agree``, which combines
    every rank's flags.
    """

    def __init__(
        self, mode: str, grads: Sequence[Tensor], params: Sequence[Tensor] = (), states: Sequence[dict] = ()
    ):
        self.mode = mode
        self.check = FiniteCheck(grads)
        self.skip = SkipPlan(params, states, range(len(params))) if mode == "skip" and params else None

    def keep(
        self,
        grads: Sequence[Tensor],
        name: Callable[[int], str],
        agree: Callable[[Tensor], Tensor] | None = None,
    ) -> Tensor | None:
        """Call after the state buffers exist and before anything is written: raises ("raise"),
        or returns the keep vector (one bool per gradient, on the device) whose ``False``
        entries :meth:`restore` puts back ("skip"); ``None``: nothing to put back."""
        if self.mode == "ignore" or not grads:
            return None
        if self.mode == "raise" and agree is None:
            if not self.check.screen(grads):
                raise_if_nonfinite(grads, name)
            return None
        keep = self.check(grads)
        if agree is not None:
            keep = agree(keep)
        if self.mode == "raise":
            raise_if_nonfinite(list(keep.unbind(0)), name, flags_given=True)
            return None
        return keep

    def snapshot(self, keep: Tensor | None) -> list[Tensor] | None:
        """What the update may overwrite, saved (only where something may have to go back)."""
        return self.skip.snapshot() if keep is not None and self.skip is not None else None

    def restore(self, saved: list[Tensor] | None, keep: Tensor | None) -> None:
        """Put back every tensor of a parameter whose gradient was not finite."""
        if saved is not None:
            self.skip.restore(saved, keep)  # type: ignore[union-attr]
