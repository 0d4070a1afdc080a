"""What a step does with NaN/Inf gradients: raise, skip the affected parameters, or ignore.

One :class:`NonFiniteGuard` over a step's gradients serves the batched and the per-parameter path.
``"skip"`` never synchronises with the host: every decision is a device-side mask. The step runs
as usual (a bad matrix's NS input is zeroed in its bucket, so its NaN cannot reach the others),
then each parameter and every one of its state tensors is put back to its pre-step value wherever
its gradient was not finite, in a handful of fused calls per (device, dtype). ``"raise"`` on the
host's CPU refuses the step before the update; on an accelerator it runs as ``"skip"`` does and
leaves the verdict for the next call (see :mod:`fastmuon.step.deferred`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor

from ..ns import device
from ..ns.layout import memory_order

NONFINITE_MODES = ("raise", "skip", "ignore")

#: Refuse loudly by default: a NaN gradient usually means a diverging run or a bug, found fastest by
#: the parameter's name. ``torch.amp.GradScaler`` skips steps with infs itself, before they get here.
DEFAULT_NONFINITE = "raise"


def check_mode(mode: Any) -> str:
    if not isinstance(mode, str) or mode not in NONFINITE_MODES:
        raise ValueError(f"invalid nonfinite={mode!r}; choose one of {NONFINITE_MODES}")
    return mode


def _memory_view(t: Tensor) -> Tensor | None:
    """``t``'s elements as a 1-D view in memory order (no storage offset read, which a trace
    cannot), or None if its memory has gaps or overlaps."""
    order = memory_order(t)
    if order is None:
        return None
    return t.permute(order).view(-1)


class _Loose(NamedTuple):
    """A tensor a restore may put back that is no 1-D view of its memory (gaps or overlaps)."""

    tensor: Tensor
    owner: int  # its parameter's place in the keep vector
    host: bool  # on the host's CPU


#: A group's elements are laid out owner by owner, each owner's run padded to whole blocks, so the
#: restore's mask is one flag per block rather than per element. Blocks are a power of two in this
#: range, as large as keeps the padding within 1/:data:`PAD_SHARE` of the group.
BLOCK_RANGE = (8, 4096)
PAD_SHARE = 32


def block_size(total: int, owners: int) -> int:
    """The block of a group of ``total`` elements held by ``owners`` parameters."""
    low, high = BLOCK_RANGE
    fits = total // (PAD_SHARE * max(owners, 1))
    return min(high, max(low, 1 << max(fits.bit_length() - 1, 0)))


class _Group:
    """The tensors of one (device, dtype) that a restore may put back, as 1-D views laid out by
    owner, each owner's run padded to whole blocks. ``pieces``: the split of a flat copy into the
    views, each followed by its padding, so ``flat.split(pieces)[::2]`` are the views' places;
    ``block_owner``: each block's owner; ``pads``: views of a spare tensor for the host's cat."""

    __slots__ = ("views", "tensors", "pieces", "block", "block_owner", "total", "host", "pads")

    def __init__(self, where: torch.device, entries: list[tuple[Tensor, int]]):
        self.tensors = [t for t, _ in entries]  # whose memory the views are (none has gaps)
        self.views: list[Tensor] = [_memory_view(t) for t in self.tensors]  # type: ignore[misc]
        held = sum(v.numel() for v in self.views)
        self.block = block_size(held, len({owner for _, owner in entries}))
        self.pieces: list[int] = []
        block_owner: list[int] = []
        run = 0
        for k, (t, owner) in enumerate(entries):
            run += t.numel()
            last = k + 1 == len(entries) or entries[k + 1][1] != owner
            pad = -run % self.block if last else 0
            self.pieces += [t.numel(), pad]
            if last:
                block_owner += [owner] * ((run + pad) // self.block)
                run = 0
        self.total = sum(self.pieces)
        self.block_owner = torch.tensor(block_owner, dtype=torch.int32, device=where)
        self.host = device.is_host(where)
        spare = torch.empty(self.block, dtype=self.views[0].dtype, device=where)
        self.pads = [spare[:n] for n in self.pieces[1::2]]

    def mask(self, keep: Tensor) -> Tensor:
        """Each block's owner's flag in ``keep`` (on this group's device), ``(blocks, 1)``."""
        return keep.index_select(0, self.block_owner).view(-1, 1)

    def current_views(self) -> list[Tensor]:
        """:attr:`views`; in a compiler's trace made afresh, since views kept from outside would be
        graph inputs aliasing the tensors, which AOT autograd refuses."""
        if torch.compiler.is_compiling():
            return [_memory_view(t) for t in self.tensors]  # type: ignore[misc]
        return self.views

    def places(self, flat: Tensor) -> list[Tensor]:
        """The views' places in a flat copy laid out as this group."""
        return list(flat.split(self.pieces)[::2])


def _joined(group: _Group) -> Tensor:
    """The group's tensors in one new tensor laid out as the group (padding unset); off the host by
    one foreach copy, which takes far fewer launches than a CUDA cat of many small tensors."""
    views = group.current_views()
    if group.host:
        return torch.cat([t for pair in zip(views, group.pads) for t in pair])
    flat = torch.empty(group.total, dtype=views[0].dtype, device=views[0].device)
    torch._foreach_copy_(group.places(flat), views)
    return flat


class SkipPlan:
    """What a step may have to put back, prepared once: every parameter and state tensor, grouped
    by (device, dtype). ``owners[i]``: the place in the keep vector of the parameter owning
    ``params[i]`` and ``states[i]``; ``counts_only``: owners whose update masks itself, of whose
    tensors only the 0-d state (AdamW's step count, counted on the host) is taken."""

    def __init__(
        self,
        params: Sequence[Tensor],
        states: Sequence[dict[str, Any]],
        owners: Sequence[int],
        counts_only: frozenset[int] = frozenset(),
    ):
        owners = list(owners)
        grouped: dict[tuple[torch.device, torch.dtype], list[tuple[Tensor, int]]] = {}
        self._loose: list[_Loose] = []
        for i in sorted(range(len(owners)), key=owners.__getitem__):
            p, state, owner = params[i], states[i], owners[i]
            tensors = [p, *(v for v in state.values() if isinstance(v, Tensor))]
            if owner in counts_only:
                tensors = [t for t in tensors[1:] if t.dim() == 0]
            for t in tensors:
                if memory_order(t) is None:  # grouped detached: the restore writes leaves through views
                    self._loose.append(_Loose(t, owner, device.is_host(t.device)))
                else:
                    grouped.setdefault((t.device, t.dtype), []).append((t.detach(), owner))
        self._groups = [_Group(where, entries) for (where, _), entries in grouped.items()]

    def held(self) -> int:
        """The elements a snapshot copies (its padding aside)."""
        return sum(v.numel() for g in self._groups for v in g.views) + sum(
            t.numel() for t, _, _ in self._loose
        )

    def snapshot(self) -> list[Tensor]:
        """One copy per (device, dtype) of everything :meth:`restore` may put back."""
        return [_joined(g) for g in self._groups] + [t.clone() for t, _, _ in self._loose]

    def restore(self, saved: Sequence[Tensor | None], keep: Tensor, on_host: bool | None = None) -> None:
        """Put back ``saved`` wherever ``keep`` is False: the tensors on the host's CPU
        (``on_host`` True), those elsewhere (False) or all (None)."""
        for group, snap in zip(self._groups, saved):
            if snap is None or (on_host is not None and group.host != on_host):
                continue  # None: a copy :meth:`on_host` left out
            blocks = snap.view(-1, group.block)
            torch.where(group.mask(keep.to(snap.device)), _joined(group).view_as(blocks), blocks, out=blocks)
            torch._foreach_copy_(group.current_views(), group.places(snap))
        for (t, owner, host), snap in zip(self._loose, saved[len(self._groups) :]):
            if snap is not None and (on_host is None or host == on_host):
                t.copy_(torch.where(keep[owner].to(t.device), t, snap))

    def holds_host(self) -> bool:
        """Whether some tensor it may put back lives on the host's CPU."""
        return any(g.host for g in self._groups) or any(host for _, _, host in self._loose)

    def on_host(self, saved: Sequence[Tensor]) -> list[Tensor | None]:
        """``saved`` with only the host's CPU tensors' copies kept (None elsewhere)."""
        hosts = [g.host for g in self._groups] + [host for _, _, host in self._loose]
        return [s if host else None for s, host in zip(saved, hosts)]
