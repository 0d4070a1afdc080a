"""How far a design's optimizer step sits from the balanced ideal, and whether its exchange
buffers stay within bound: the measures ``fastmuon plan`` prints and its targets judge.

- A rank's **optimizer time**: its NS seconds plus its exchange seconds; the busiest rank's is
  the step's, since every rank waits for the last result.
- The **balanced ideal**: the mean rank's NS seconds (its FLOPs at the device's rate for the NS
  dtype, plus its kernel launches, as the figures price them) plus the largest shard (in the
  dtype the design moves) once over the link: the step with its NS work spread evenly and the
  largest shard crossing the link once. A design that orthogonalises whole matrices cannot reach
  its NS term where one matrix outweighs the mean share; a rank that orthogonalises its shard
  where it lies moves less than the shard, so a step may come in under the ideal.
- The **buffer bound**: twice the rank's own shard, or :data:`BUFFER_FLOOR_BYTES`, whichever is
  larger; a floor, since an exchange needs room for its largest message however small the shard.

The link comes with the figures (:func:`priced`): the one the world's exchange crosses (NVLink
inside a node, InfiniBand beyond).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from .figures import Figures

#: the buffer bound's floor: 2 GiB
BUFFER_FLOOR_BYTES = 2 * 2**30
#: the buffer bound's multiple of the rank's shard
BUFFER_SHARDS = 2


def priced(fig: Figures, link_bytes_per_s: float) -> Figures:
    """``fig`` with the link its ideal is priced at (bytes/s each way)."""
    fig.link_bytes_per_s = link_bytes_per_s
    return fig


def optimizer_seconds(fig: Figures) -> np.ndarray:
    """Each rank's optimizer time: NS seconds plus exchange seconds."""
    return fig.ns_seconds + fig.comm_seconds


def busiest_seconds(fig: Figures) -> float:
    """The busiest rank's optimizer time: the step's."""
    return float(optimizer_seconds(fig).max())


def shard_bytes(fig: Figures) -> np.ndarray:
    """Each rank's shard of the orthogonalised matrices, in the dtype the design moves."""
    return fig.held * fig.itemsize


def ideal_seconds(fig: Figures) -> float:
    """The balanced ideal: the mean rank's NS seconds plus the largest shard once over the link."""
    if not fig.link_bytes_per_s > 0:
        raise ValueError(
            f"{fig.design}'s figures carry no link; make them with figures() or give it with "
            "priced(fig, link_bytes_per_s)"
        )
    return float(fig.ns_seconds.mean()) + float(shard_bytes(fig).max()) / fig.link_bytes_per_s


def ideal_ratio(fig: Figures) -> float:
    """The busiest rank's optimizer time over the balanced ideal (1: balanced)."""
    ideal, busiest = ideal_seconds(fig), busiest_seconds(fig)
    return busiest / ideal if ideal else (1.0 if not busiest else float("inf"))


def buffer_bounds(fig: Figures) -> np.ndarray:
    """Each rank's buffer bound: twice its own shard, at least :data:`BUFFER_FLOOR_BYTES`."""
    return np.maximum(BUFFER_SHARDS * shard_bytes(fig), BUFFER_FLOOR_BYTES)


def tightest_rank(fig: Figures) -> int:
    """The rank whose buffers come closest to (or furthest past) its bound."""
    return int(np.argmax(fig.buffers / buffer_bounds(fig)))


def buffers_fit(fig: Figures) -> bool:
    """Whether every rank's buffers stay within its own bound."""
    return bool(np.all(fig.buffers <= buffer_bounds(fig)))


def balance_summary(fig: Figures) -> dict[str, Any]:
    """The measures for :meth:`Figures.summary` (the ideal's None where the figures carry no link)."""
    r = tightest_rank(fig)
    out: dict[str, Any] = {
        "optimizer_seconds_max": busiest_seconds(fig),
        "ideal_seconds": None,
        "ideal_ratio": None,
        "buffer_bytes_tightest": int(fig.buffers[r]),
        "buffer_bound_bytes_tightest": int(buffer_bounds(fig)[r]),
        "buffers_fit": buffers_fit(fig),
    }
    if fig.link_bytes_per_s > 0:
        out["ideal_seconds"], out["ideal_ratio"] = ideal_seconds(fig), ideal_ratio(fig)
    return out
