"""``fastmuon yolo``'s options (no torch imported: ``--help`` answers at once); the command
itself is :func:`fastmuon.integrations.ultralytics.run`."""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "yolo_args",
        nargs=argparse.REMAINDER,
        metavar="ARGS",
        help="what you would pass to `yolo`, e.g. train model=yolo26n.yaml data=coco8.yaml optimizer=MuSGD",
    )
