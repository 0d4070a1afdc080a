"""What every gloo worker script does first: read its rank, the world size, the rendezvous port
and a working directory from the command line (as ``test_distributed.launch`` passes them), join
a gloo process group with one thread, run its checks, leave the group and end the process.

:func:`run_checks` runs named checks in one world and writes each one's outcome on this rank to
``<dir>/checks/rank<r>.jsonl`` as it ends, so a test per check can read its own (see
``test_distributed.check_outcome``). A failed check stops the rank: the other ranks may be
waiting in one of its collectives, and a world out of step says nothing about the checks after.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import NoReturn

import torch
import torch.distributed as dist


def rank_args(only: bool = False) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--dir", required=True)
    if only:
        parser.add_argument("--only", default=None, help="run this check alone (a name of the checks)")
    return parser.parse_args()


def run_rank(
    body: Callable[[argparse.Namespace], None],
    args: argparse.Namespace | None = None,
    launcher_env: bool = False,
) -> NoReturn:
    """Run ``body(args)`` as one rank of a gloo group, then end the process: status 0 when it
    passed, 1 (with its traceback) when it raised. ``launcher_env`` also sets the variables a
    launcher such as torchrun sets, which accelerate and Transformers read."""
    args = rank_args() if args is None else args
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
    if launcher_env:
        rank, world = str(args.rank), str(args.world)
        os.environ.update(RANK=rank, WORLD_SIZE=world, LOCAL_RANK=rank, LOCAL_WORLD_SIZE=world)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=args.rank, world_size=args.world)
    status = 0
    try:
        body(args)
        dist.barrier()  # no rank takes its end of the store and the pairs away while others use them
    except BaseException:
        traceback.print_exc()
        status = 1
    finally:
        dist.destroy_process_group()
    leave(status)


def leave(status: int) -> NoReturn:
    """End the process with its output flushed but without the interpreter's teardown. The
    workers compare results with ``DTensor.full_tensor``, whose functional collectives leave
    their work objects to gloo's threads, and those threads can still be running after
    ``destroy_process_group``; one that frees such a work object while the interpreter tears
    down aborts the process ("terminate called without an active exception") after every check
    has passed.
    Whether fastmuon's own collectives let a rank exit cleanly is tested on its own, in
    ``test_reliability.py``."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def results_path(workdir: str | Path, rank: int) -> Path:
    return Path(workdir) / "checks" / f"rank{rank}.jsonl"


def run_checks(checks: Mapping[str, Callable[[argparse.Namespace], None]]) -> NoReturn:
    """Run ``checks`` in order (or the one ``--only`` names) as one rank, each outcome written as
    it ends; exit status 1 at the first that fails."""
    args = rank_args(only=True)
    names = list(checks) if args.only is None else [args.only]
    path = results_path(args.dir, args.rank)
    path.parent.mkdir(parents=True, exist_ok=True)

    def body(args: argparse.Namespace) -> None:
        with path.open("a") as out:
            for name in names:
                try:
                    checks[name](args)
                    dist.barrier()
                except BaseException:
                    out.write(json.dumps({"check": name, "error": traceback.format_exc()}) + "\n")
                    out.flush()
                    raise
                out.write(json.dumps({"check": name, "error": None}) + "\n")
                out.flush()

    run_rank(body, args)
