"""How far a newcomer walks to follow one prepared single-device step through fastmuon.

Builds a small conv + linear model, takes two steps (the first prepares the program), then
follows the third ``step()`` with ``sys.setprofile`` and prints, per optimizer, the fastmuon
files it enters, how often the walk crosses from one file to another and how many fastmuon
frames deep it nests. Run: ``.venv/bin/python scripts/step_walk.py [Muon MuSGD NorMuon AdaMuon]``.
"""

from __future__ import annotations

import sys
import warnings
from dataclasses import dataclass, field

import torch

import fastmuon

_PACKAGE = "/fastmuon/"


@dataclass
class Walk:
    """What one step entered: files (relative to the package), crossings, deepest nesting."""

    files: set[str] = field(default_factory=set)
    crossings: int = 0
    deepest: int = 0


def walk(cls: type[torch.optim.Optimizer]) -> Walk:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.Flatten(), torch.nn.Linear(8 * 6 * 6, 10))
    # NS in fp32: the same path on every CPU (bf16 NS takes another where the CPU has bf16 units)
    opt = cls(fastmuon.param_groups(model), lr=0.02, ns_dtype=torch.float32)
    x = torch.randn(4, 3, 8, 8)
    for k in range(3):
        opt.zero_grad()
        model(x).square().mean().backward()
        if k < 2:
            opt.step()
    seen = Walk()
    stack: list[bool] = []  # per live frame: whether it is fastmuon's
    last: list[str] = []

    def profile(frame, event, arg):  # noqa: ANN001, ARG001 (sys.setprofile's signature)
        name = frame.f_code.co_filename
        if event == "call":
            ours = _PACKAGE in name
            stack.append(ours)
            if ours:
                rel = name.rsplit(_PACKAGE, 1)[-1]
                seen.files.add(rel)
                if last and last[0] != rel:
                    seen.crossings += 1
                last[:] = [rel]
                seen.deepest = max(seen.deepest, sum(stack))
        elif event == "return" and stack:
            stack.pop()

    sys.setprofile(profile)
    try:
        opt.step()
    finally:
        sys.setprofile(None)
    return seen


def main(names: list[str]) -> None:
    warnings.simplefilter("ignore")  # the tiny model's warnings are not the point here
    for name in names or ["Muon", "MuSGD"]:
        seen = walk(getattr(fastmuon, name))
        print(f"{name}: {len(seen.files)} files, {seen.crossings} crossings, {seen.deepest} frames deep")
        print("   ", " ".join(sorted(seen.files)))


if __name__ == "__main__":
    main(sys.argv[1:])
