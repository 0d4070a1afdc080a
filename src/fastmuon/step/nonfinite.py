"""What a step does with NaN/Inf gradients: raise, skip the affected parameters, or ignore.

One mechanism serves the batched and the per-parameter path: a :class:`NonFiniteGuard` over a
step's gradients (prepared once per step program, or per step for the reference loop).

``"skip"`` must not synchronise with the host, so nothing here asks *whether* a gradient is
bad: every decision is a device-side mask. The step runs as usual (a matrix with a bad
gradient has its Newton–Schulz input zeroed in its bucket, so the NaN cannot reach the other
matrices there), and afterwards each parameter and every one of its state tensors is put back
to its pre-step value wherever its gradient was not finite. The snapshot and the restore are a
handful of fused calls per (device, dtype), whatever the number of parameters.

``"raise"`` on the host's CPU asks before the update (a read there makes nothing wait) and
refuses the step. On an accelerator it runs the step as ``"skip"`` does and leaves the verdict
for the next call to read (see :mod:`fastmuon.step.deferred`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor

from ..ns import device
from ..ns.engine import Gather
from ..ns.layout import memory_order
from .deferred import PendingFlags, host_buffer, nothing_to_finish

NONFINITE_MODES = ("raise", "skip", "ignore")

#: Refuse loudly by default: a NaN gradient usually means a diverging run or a bug, and naming
#: the parameter is the fastest way to find it. On the host's CPU it costs one read of the
#: gradients per step; on an accelerator the masked step of ``"skip"`` and an error one call
#: later, with no host sync. A step under ``torch.amp.GradScaler`` never gets there (the scaler
#: skips steps with infs itself). ``"skip"`` rides over sporadic bad batches; ``"ignore"`` costs
#: nothing.
DEFAULT_NONFINITE = "raise"


def check_mode(mode: Any) -> str:
    if not isinstance(mode, str) or mode not in NONFINITE_MODES:
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
        (indices, _finite([grads[i] for i in indices], device.is_host(where)))
        for (where, _), indices in groups.items()
    ]


def _finite(tensors: list[Tensor], host: bool) -> Tensor:
    """Whether each tensor's entries are all finite, as a bool vector: a max-abs norm is below
    inf exactly when no entry is NaN or ±inf (NaN compares False), one comparison kernel."""
    return _max_abs(tensors, host) < math.inf


def _max_abs(tensors: list[Tensor], host: bool) -> Tensor:
    """Each tensor's largest |entry|, stacked. On the host's CPU (``host``) the fused inf-norm
    runs one slow kernel per tensor, slower than abs + max there; a compiler's trace takes the
    inf-norm everywhere (it cannot trace ``_foreach_max`` and would break the graph there)."""
    if host and not torch.compiler.is_compiling():
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
        if all(bool((torch.stack(torch._foreach_norm(gs)) < math.inf).all()) for gs in by_device.values()):
            return
        groups = _finite_by_group(grads)
    flags_by_device: dict[torch.device, list[Tensor]] = {}
    for _, ok in groups:
        flags_by_device.setdefault(ok.device, []).append(ok)
    if all(bool(torch.cat(oks).all()) for oks in flags_by_device.values()):
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
    """``t``'s elements as a 1-D view in memory order, or None if its memory has gaps/overlaps:
    the flat view of ``t`` with its dims in memory order (no storage offset is read, which a
    compiler's trace cannot)."""
    order = memory_order(t)
    if order is None:
        return None
    return t.permute(order).view(-1)


# ----- prepared once per step program ---------------------------------------------------------
class _Loose(NamedTuple):
    """A tensor a restore may put back that is no 1-D view of its memory (gaps or overlaps)."""

    tensor: Tensor
    owner: int  # its parameter's place in the keep vector
    host: bool  # on the host's CPU


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
        # (pick, positions, whether on the host's CPU): decided here, once per program. A plain
        # tuple: the per-parameter path builds a check every step, and a record's constructor
        # would be one more Python call there
        self._groups = [
            (Gather(idx), torch.tensor(idx, device=self.device), device.is_host(where))
            for (where, _), idx in groups.items()
        ]
        by_device: dict[torch.device, list[int]] = {}
        for (where, _), idx in groups.items():
            by_device.setdefault(where, []).extend(idx)
        self._by_device = [Gather(idx) for idx in by_device.values()]

    def __call__(self, grads: Sequence[Tensor]) -> Tensor:
        if len(self._groups) == 1 and len(self._groups[0][0]) == self.size:  # all in one, in order
            pick, _, host = self._groups[0]
            return _finite(pick(grads), host)
        keep = torch.ones(self.size, dtype=torch.bool, device=self.device)
        for pick, positions, host in self._groups:
            ok = _finite(pick(grads), host)
            keep.index_copy_(0, positions, ok.to(self.device))
        return keep

    def screen(self, grads: Sequence[Tensor]) -> bool:
        """Whether every gradient is finite (one host read per device): the cheap test of "raise"."""
        return all(
            bool((torch.stack(torch._foreach_norm(pick(grads))) < math.inf).all()) for pick in self._by_device
        )


#: A group's elements are laid out owner by owner, each owner's run padded to whole blocks, so
#: that the restore's mask is one flag per block (one small gather of the owners' flags) rather
#: than one per element (a repeat through an int64 index: 17 bytes an element moved, 8 held).
#: Blocks are a power of two between these sizes, as large as keeps the padding (below one
#: block per owner) within 1/:data:`PAD_SHARE` of the group; where the owners' runs are shorter
#: than that allows (hundreds of tiny tensors), the smallest, whose index is still an int32 per
#: 8 elements.
BLOCK_RANGE = (8, 4096)
PAD_SHARE = 32


def block_size(total: int, owners: int) -> int:
    """The block of a group of ``total`` elements held by ``owners`` parameters."""
    low, high = BLOCK_RANGE
    fits = total // (PAD_SHARE * max(owners, 1))
    return min(high, max(low, 1 << max(fits.bit_length() - 1, 0)))


class _Group:
    """The tensors of one (device, dtype) that a restore may put back, as 1-D views in one
    order: by owner, each owner's run padded to whole blocks of ``block`` elements.

    ``pieces``: the split of a flat copy into the views, each followed by its padding (0 but
    after an owner's last view), so ``flat.split(pieces)[::2]`` are the views' places;
    ``block_owner``: each block's owner, the gather that turns the keep vector into the mask;
    ``pads``: views of one spare tensor that the host's ``torch.cat`` puts between owners.
    """

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
        """:attr:`views`; in a compiler's trace made afresh from :attr:`tensors`, so that the
        graph's inputs are the tensors themselves (views kept from outside it would be inputs
        aliasing them, which AOT autograd refuses)."""
        if torch.compiler.is_compiling():
            return [_memory_view(t) for t in self.tensors]  # type: ignore[misc]
        return self.views

    def places(self, flat: Tensor) -> list[Tensor]:
        """The views' places in a flat copy laid out as this group."""
        return list(flat.split(self.pieces)[::2])


def _joined(group: _Group) -> Tensor:
    """The group's tensors in one new tensor laid out as the group (padding unset). Off the
    host by one foreach copy: torch's CUDA cat takes a launch per 128 inputs, the foreach copy
    a launch per batch of tensors or blocks, far fewer for the hundreds of small tensors of a
    conv net."""
    views = group.current_views()
    if group.host:
        return torch.cat([t for pair in zip(views, group.pads) for t in pair])
    flat = torch.empty(group.total, dtype=views[0].dtype, device=views[0].device)
    torch._foreach_copy_(group.places(flat), views)
    return flat


class SkipPlan:
    """What a step may have to put back, prepared once: every parameter and state tensor,
    grouped by (device, dtype).

    ``owners[i]`` is the position (in the step's keep vector) of the parameter that owns
    ``params[i]`` and its ``states[i]``. Per step: :meth:`snapshot` before the update, and
    :meth:`restore` after it with the keep vector. ``counts_only``: the owners whose update masks its own tensors (see
    ``UpdateProgram.self_masked``): of theirs only the 0-d state (AdamW's step count, which the
    update counts on the host) is taken.
    """

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
                # grouped detached (the restore writes a leaf parameter in place through its view)
                if memory_order(t) is None:
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


class NonFiniteGuard:
    """A step's handling of NaN/Inf gradients over a fixed list of gradients.

    ``mode`` "raise" refuses the step naming the first bad parameter; "skip" puts each
    parameter with a bad gradient and all of ``states[i]`` back after the update (``params[i]``
    owns ``grads[i]``); "ignore" does nothing. In a distributed run the ranks must decide alike
    (a NaN may sit in one rank's shard only): :meth:`keep` then takes ``agree``, which combines
    every rank's flags.

    With ``defer`` (the prepared step), "raise" over gradients not all on the host's CPU is
    ``deferred``: the step runs masked as "skip" runs, and :meth:`settle` sends its flags to
    the host for the next call to read, so no step waits for the device.
    """

    def __init__(
        self,
        mode: str,
        grads: Sequence[Tensor],
        params: Sequence[Tensor] = (),
        states: Sequence[dict[str, Any]] = (),
        *,
        defer: bool = False,
        self_masked: frozenset[int] = frozenset(),
    ):
        self.mode = mode
        self.check = FiniteCheck(grads)
        self.deferred = (
            mode == "raise" and defer and bool(params) and not all(device.is_host(g.device) for g in grads)
        )
        masking = mode == "skip" or self.deferred
        # what the update leaves as it was by itself (see UpdateProgram.self_masked) is never
        # copied: of such a parameter only a step count may be
        rest = [
            i
            for i in range(len(params))
            if i not in self_masked or any(isinstance(t, Tensor) and t.dim() == 0 for t in states[i].values())
        ]
        self.skip = (
            SkipPlan([params[i] for i in rest], [states[i] for i in rest], rest, self_masked)
            if masking and rest
            else None
        )
        # everything, for a step that does not take the self-masking path (see :meth:`snapshot`)
        self.skip_all = (
            SkipPlan(params, states, range(len(params))) if masking and params and self_masked else self.skip
        )
        self.masking = masking and bool(params)
        # a "skip" over accelerator gradients whose state lies partly on the host (AdamW's step
        # counts) puts that part back when the flags reach the host, as a deferred "raise" does:
        # reading them at once would make the host wait for the device every step
        self.host_later = (
            mode == "skip"
            and self.skip_all is not None
            and self.skip_all.holds_host()
            and not all(device.is_host(g.device) for g in grads)
        )
        self._flags = host_buffer(len(grads)) if self.deferred or self.host_later else None

    def keep(
        self,
        grads: Sequence[Tensor],
        name: Callable[[int], str],
        agree: Callable[[Tensor], Tensor] | None = None,
    ) -> Tensor | None:
        """Call after the state buffers exist and before anything is written: raises (a
        "raise" that is not deferred), or returns the keep vector (one bool per gradient, on the
        device) whose ``False`` entries :meth:`settle` puts back; ``None``: nothing to put back."""
        if self.mode == "ignore" or not grads:
            return None
        # a traced step decides on the host as the CPU does: nothing of it outlives the trace
        if self.mode == "raise" and (not self.deferred or torch.compiler.is_compiling()):
            if agree is None:
                if not self.check.screen(grads):
                    raise_if_nonfinite(grads, name)
                return None
            keep = agree(self.check(grads))
            raise_if_nonfinite(list(keep.unbind(0)), name, flags_given=True)
            return None
        keep = self.check(grads)
        return agree(keep) if agree is not None else keep

    def snapshot(self, keep: Tensor | None, whole: bool = False) -> list[Tensor] | None:
        """What the update may overwrite, saved (only where something may have to go back and
        the update does not keep it as it was by itself). ``whole``: this step's update does
        not take its self-masking path (an orthogonalize hook or a compiler's trace makes the
        matrix half run all buckets at once, unmasked): everything is saved. :meth:`restore`
        and :meth:`settle` are given the same ``whole``."""
        plan = self.skip_all if whole else self.skip
        return plan.snapshot() if keep is not None and plan is not None else None

    def restore(self, saved: list[Tensor] | None, keep: Tensor | None, whole: bool = False) -> None:
        """Put back every tensor of a parameter whose gradient was not finite."""
        plan = self.skip_all if whole else self.skip
        if saved is not None and keep is not None and plan is not None:
            plan.restore(saved, keep)

    def settle(
        self,
        saved: list[Tensor] | None,
        keep: Tensor,
        name: Callable[[int], str],
        step: int,
        whole: bool = False,
    ) -> PendingFlags | None:
        """After a completed update: "skip" puts everything copied back now (None). A deferred
        "raise" puts back what lives on the device, starts the flags' copy to the host and
        returns them, pending: read, they raise and put back the host's tensors too."""
        if not self.masking:
            return None
        plan = self.skip_all if whole else self.skip
        if not (self.deferred or self.host_later) or torch.compiler.is_compiling():
            if plan is not None and saved is not None:
                plan.restore(saved, keep)
            return None
        finish: Callable[[Tensor], None] = nothing_to_finish
        if plan is not None and saved is not None:
            plan.restore(saved, keep, on_host=False)
            finish = functools.partial(_restore_on_host, plan, plan.on_host(saved))
        return PendingFlags.start(
            keep,
            self._flags,  # type: ignore[arg-type]
            step,
            name,
            finish,
            raises=self.deferred,
        )


def _restore_on_host(plan: SkipPlan, held: list[Tensor | None], flags: Tensor) -> None:
    plan.restore(held, flags, on_host=True)
