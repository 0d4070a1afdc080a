"""InFlight keeps a collective's tensors until no other thread holds them (no process group needed:
a stand-in work object holds a view, which torch counts as a reference to the tensor)."""

from __future__ import annotations

import copy
import threading

import pytest
import torch

from fastmuon.distributed.inflight import InFlight


class StandInWork:
    """Holds a reference to the tensor, as a process group's work object does."""

    def __init__(self, t: torch.Tensor, done: bool = True):
        self.view, self.done = t.view(-1), done

    def wait(self) -> bool:
        return True

    def is_completed(self) -> bool:
        return self.done


def stand_in_collective(t: torch.Tensor, async_op: bool, done: bool = True) -> StandInWork:
    assert async_op
    return StandInWork(t, done)


def never_sleep(_: float) -> None:
    raise AssertionError("settle waited although nothing else held the tensor")


def test_settle_waits_until_the_thread_still_holding_the_work_lets_go():
    t = torch.zeros(6)
    before = t._use_count()
    inflight = InFlight()
    inflight.issue(stand_in_collective, t)
    inflight.wait()
    holder = list(inflight._works)  # handed to the helper thread, which keeps its own reference
    go, released = threading.Event(), []

    def helper():
        work = holder.pop()
        go.wait()
        released.append(True)
        del work

    thread = threading.Thread(target=helper)
    thread.start()
    sleeps = []

    def sleep(_: float) -> None:
        sleeps.append(True)
        go.set()
        thread.join()

    inflight.settle(_sleep=sleep)
    assert sleeps and released == [True]
    assert t._use_count() == before


class StandInGatherWork:
    """Holds every output of an ``all_gather``-style collective, as gloo's work object does."""

    def __init__(self, outputs: list[torch.Tensor]):
        self.views = [t.view(-1) for t in outputs]

    def wait(self) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def stand_in_gather(outputs: list[torch.Tensor], send: torch.Tensor, async_op: bool) -> StandInGatherWork:
    assert async_op
    for t in outputs:
        t.copy_(send)
    return StandInGatherWork(outputs)


def test_the_tensors_of_a_list_argument_are_held_until_the_thread_lets_go():
    outputs = [torch.zeros(3) for _ in range(2)]
    inflight = InFlight()
    inflight.issue(stand_in_gather, outputs, torch.ones(3))
    inflight.wait()
    assert all(torch.equal(t, torch.ones(3)) for t in outputs)
    ids = {id(t) for t in outputs}
    held = [t for t, _ in inflight._held.values()]
    assert ids <= {id(t) for t in held}  # the caller may drop its list: InFlight keeps them
    del outputs
    holder = list(inflight._works)  # the helper thread's reference to the work
    sleeps = []

    def sleep(_: float) -> None:
        sleeps.append(True)
        holder.clear()  # the thread lets go

    inflight.settle(_sleep=sleep)
    assert sleeps  # settle waited for the work's views of the outputs to go


def test_views_the_caller_keeps_do_not_make_settle_wait():
    t = torch.zeros(6)
    inflight = InFlight()
    inflight.issue(stand_in_collective, t)
    inflight.wait()
    kept = [t[:3], t[3:]]  # results handed out as views, still alive
    inflight.settle(_sleep=never_sleep)
    assert all(k._base is t for k in kept)


def test_an_unfinished_collective_is_not_waited_for():
    t = torch.zeros(6)
    before = t._use_count()
    inflight = InFlight()
    inflight.issue(stand_in_collective, t, done=False)
    inflight.wait()
    lost = list(inflight._works)  # a thread that never lets go, as a lost peer's would
    inflight.settle(_sleep=never_sleep)  # returns at once, although the tensor is still held
    assert t._use_count() > before
    assert not inflight._works and not inflight._held and not inflight._pending
    del lost
    assert t._use_count() == before


@pytest.mark.parametrize("clone", [copy.copy, copy.deepcopy])
def test_a_copy_holds_nothing(clone):
    inflight = InFlight()
    inflight.issue(stand_in_collective, torch.zeros(3))
    twin = clone(inflight)
    assert twin is not inflight and not twin._works and not twin._held and not twin._pending
