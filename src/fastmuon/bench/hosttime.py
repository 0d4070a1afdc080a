"""Host time of a step: the Python (and other non-operator) time a step spends around its ops.

Measured with ``torch.profiler`` (CPU activity only): each step runs inside a named region;
its host time is the region's span minus the spans of its outermost operator calls (events
named ``namespace::op``, e.g. ``aten::bmm``; annotation regions such as torch's own
``Optimizer.step#…`` are looked through, not subtracted). On a GPU it is the time the CPU
spends deciding and dispatching, which the kernels cannot hide when it exceeds theirs. The
profiler adds a little to each op call, so the figure is slightly above the unprofiled time.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import sys
from collections.abc import Callable, Iterator

from torch.profiler import ProfilerActivity, profile, record_function

REGION = "fastmuon.bench.step"

#: how host time is measured, in one line (for the report)
HOW = (
    "host ms/step: torch.profiler span of the step minus its outermost operator calls "
    "(aten:: and other registered ops), i.e. the Python around the ops; median of {n} profiled steps"
)


def host_ms(step: Callable[[], None], steps: int = 3) -> float:
    """Median host time of ``steps`` profiled steps, in ms (one extra step first, not counted:
    the profiler's own start-up lands in it)."""
    prof = profile(activities=[ProfilerActivity.CPU])
    with _native_stderr_silenced():  # the profiler's back end logs its start and stop there
        prof.start()
    try:
        for _ in range(steps + 1):
            with record_function(REGION):
                step()
    finally:
        with _native_stderr_silenced():
            prof.stop()
    regions = [e for e in prof.events() if e.name == REGION and e.cpu_parent is None]
    per_step = [_outside_ops_us(e) / 1e3 for e in regions[1:]]
    return statistics.median(per_step)


@contextlib.contextmanager
def _native_stderr_silenced() -> Iterator[None]:
    """File descriptor 2 to /dev/null for the duration (C++ logging bypasses ``sys.stderr``)."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _outside_ops_us(region) -> float:
    """The region's span less the spans of its outermost operator calls, in µs."""
    return region.cpu_time_total - sum(op.cpu_time_total for op in _outermost_ops(region))


def _outermost_ops(event):
    for child in event.cpu_children:
        if "::" in child.name:
            yield child
        else:  # an annotation region (e.g. torch's "Optimizer.step#SGD.step"): look inside
            yield from _outermost_ops(child)
