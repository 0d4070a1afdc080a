"""Distributed steps on CPU with gloo: DDP and FSDP2 equivalence, missing gradients, checkpoints.

One world of ``dist_worker.py`` processes per size (2 ranks, then 3: uneven shares and uneven,
even empty, FSDP2 shards) runs every check of ``dist_worker.CHECKS`` (see that file for what
they compare against): the launch costs a few seconds per rank, so the checks share it. Each
check is its own test, which reads that check's outcome on every rank; a check the shared world
did not reach (it stops at the first failure) runs alone in a world of its own.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch.distributed as dist

HERE = Path(__file__).resolve().parent

pytestmark = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed with gloo"
)

#: Warnings are errors in the workers too (pytest's filters do not reach a subprocess); the
#: third-party ones a gloo world raises are ignored by name.
WORKER_WARNINGS = [
    "-W",
    "error",
    # FSDP2's note on a wrapped module returning a view (an nn.Linear on a batch of sequences);
    # no test model writes into one in place
    "-W",
    "ignore:FSDP2-wrapped module:UserWarning",
]

#: How long the other ranks get to finish once one has failed (they may wait in its collective).
GRACE_S = 10.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_world(
    world: int, workdir: Path, timeout: float, script: str, extra: list[str]
) -> list[tuple[int | None, str]]:
    """Each rank's exit status (None: killed) and output; once a rank fails, the others are
    given :data:`GRACE_S` and then stopped."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    # the package, the workers beside this file and the suite's shared helpers (tests/)
    paths = [str(HERE.parents[1] / "src"), str(HERE), str(HERE.parent), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    port = free_port()
    logs = [(workdir / f"rank{r}.log").open("w+") for r in range(world)]
    command = [sys.executable, *WORKER_WARNINGS, str(HERE / script)]
    procs = [
        subprocess.Popen(
            [
                *command,
                "--rank",
                str(r),
                "--world",
                str(world),
                "--port",
                str(port),
                "--dir",
                str(workdir),
                *extra,
            ],
            env=env,
            stdout=logs[r],
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(world)
    ]
    deadline = time.monotonic() + timeout
    try:
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            if any(p.returncode not in (None, 0) for p in procs):
                deadline = min(deadline, time.monotonic() + GRACE_S)
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    outputs = []
    for log in logs:
        log.seek(0)
        outputs.append(log.read())
        log.close()
    return [(None if p.returncode < 0 else p.returncode, out) for p, out in zip(procs, outputs)]


def world_report(ranks: list[tuple[int | None, str]]) -> str:
    return "\n".join(f"--- rank {r} (exit {code}) ---\n{out}" for r, (code, out) in enumerate(ranks))


def launch(world: int, workdir: Path, timeout: float = 600, script: str = "dist_worker.py") -> str:
    """Run a world of ``script``; every rank's output, after asserting that each rank passed."""
    ranks = run_world(world, workdir, timeout, script, [])
    report = world_report(ranks)
    assert all(code == 0 for code, _ in ranks), report
    return report


def read_outcomes(workdir: Path, world: int) -> list[dict[str, str | None]]:
    """Per rank, each check it ended: None where it passed, else its traceback."""
    outcomes = []
    for r in range(world):
        path = workdir / "checks" / f"rank{r}.jsonl"
        lines = path.read_text().splitlines() if path.exists() else []
        outcomes.append({row["check"]: row["error"] for row in map(json.loads, lines)})
    return outcomes


class SharedWorlds:
    """One run of every check per world size, launched when a test first asks for it."""

    def __init__(self, make_dir: Callable[[str], Path]):
        self.make_dir = make_dir
        self.runs: dict[int, tuple[list[dict[str, str | None]], str]] = {}

    def outcome(self, world: int, check: str) -> tuple[list[str | None] | None, str]:
        """Each rank's outcome of ``check`` in the shared world (None where a rank did not reach
        it), and the world's output."""
        if world not in self.runs:
            workdir = self.make_dir(f"world{world}")
            ranks = run_world(world, workdir, 900, "dist_worker.py", [])
            self.runs[world] = (read_outcomes(workdir, world), world_report(ranks))
        outcomes, report = self.runs[world]
        if not all(check in o for o in outcomes):
            return None, report
        return [o[check] for o in outcomes], report


@pytest.fixture(scope="module")
def shared_worlds(tmp_path_factory) -> SharedWorlds:
    return SharedWorlds(lambda name: tmp_path_factory.mktemp(name))


def check_names() -> list[str]:
    sys.path.insert(0, str(HERE))
    from dist_worker import CHECKS

    return list(CHECKS)


@pytest.mark.parametrize("check", check_names())
@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_distributed_check(world, check, shared_worlds, tmp_path):
    errors, report = shared_worlds.outcome(world, check)
    if errors is None:  # the shared world stopped before it: the check runs alone
        ranks = run_world(world, tmp_path, 600, "dist_worker.py", ["--only", check])
        report = world_report(ranks)
        errors = [o.get(check, "ended without an outcome") for o in read_outcomes(tmp_path, world)]
        failed = {r: e for r, e in enumerate(errors) if e is not None}
        assert not failed, (
            f"check {check!r} (run alone, {world} ranks) failed:\n"
            + "\n".join(f"rank {r}: {e}" for r, e in failed.items())
            + f"\n{report}"
        )
    failed = {r: e for r, e in enumerate(errors) if e is not None}
    assert not failed, f"check {check!r} ({world} ranks) failed:\n" + "\n".join(
        f"rank {r}: {e}" for r, e in failed.items()
    )
