"""Distributed steps on CPU with gloo: DDP and FSDP2 equivalence, missing gradients, checkpoints.

Each test launches one world of ``dist_worker.py`` processes (2 ranks, then 3: uneven shares
and uneven, even empty, FSDP2 shards) that runs all the checks; see that file for what they
compare against. The launch costs a few seconds per rank, so the checks share one world.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

HERE = Path(__file__).resolve().parent

pytestmark = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed with gloo"
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(world: int, workdir: Path, timeout: float = 600, script: str = "dist_worker.py") -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(HERE.parent / "src"), str(HERE), env.get("PYTHONPATH", "")])
    port = free_port()
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(HERE / script),
                "--rank",
                str(r),
                "--world",
                str(world),
                "--port",
                str(port),
                "--dir",
                str(workdir),
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(world)
    ]
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    report = "\n".join(
        f"--- rank {r} (exit {p.returncode}) ---\n{out}" for r, (p, out) in enumerate(zip(procs, outputs))
    )
    assert all(p.returncode == 0 for p in procs), report
    return report


@pytest.mark.parametrize("world", [2, 3])
def test_distributed_world(world, tmp_path):
    report = launch(world, tmp_path)
    assert "checkpoint save/load/resume identical" in report
    assert "DDP NorMuon, AdaMuon and cautious Muon: equal to one process and the reference" in report
    assert "thread counts differing by rank: one plan" in report
    assert "with matrix maps: equal to one process and the reference" in report
    assert "step programs kept across distributed steps: bitwise as fresh ones" in report
    assert "new local tensor: the program is rebuilt over it" in report
    assert "a gradient layout on one rank only: that rank refits its program alone, bitwise" in report
    print(report)
