"""What every gloo worker script does first: read its rank, the world size, the rendezvous port
and a working directory from the command line (as ``test_distributed.launch`` passes them), join
a gloo process group with one thread, run its checks, and leave the group."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable

import torch
import torch.distributed as dist


def run_rank(body: Callable[[argparse.Namespace], None]) -> int:
    """Run ``body(args)`` as one rank of a gloo group; the process's exit status."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--dir", required=True)
    args = parser.parse_args()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=args.rank, world_size=args.world)
    try:
        body(args)
    finally:
        dist.destroy_process_group()
    return 0
