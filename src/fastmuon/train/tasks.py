"""A task = data + model + loss + evaluation, with its default budget.

The training loop only sees this interface, so adding a task does not touch the loop.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cache

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .data import SPLIT_SEED, CharCorpus, DigitsData, char_windows, load_char_corpus, load_digits_data
from .models import CharTransformer, DigitsCNN


@cache
def _digits() -> DigitsData:
    return load_digits_data()


@cache
def _corpus(max_chars: int | None) -> CharCorpus:
    return load_char_corpus(max_chars)


@dataclass
class DigitsTask:
    """Classify scikit-learn's 8×8 digits with :class:`DigitsCNN`; cross-entropy loss."""

    width: int = 16
    hidden: int = 64
    batch_size: int = 64
    default_steps: int = 120
    evals: int = 10
    eval_train_examples: int = 512
    name: str = "digits"
    _data: dict[str, Tensor] = field(default_factory=dict, repr=False)

    def setup(self, device: torch.device) -> None:
        d = _digits()
        self._data = {k: getattr(d, k).to(device) for k in ("train_x", "train_y", "val_x", "val_y")}
        # the training loss is measured on a fixed subset: the curve, not an exact figure, is the point
        self._data["eval_x"] = self._data["train_x"][: self.eval_train_examples]
        self._data["eval_y"] = self._data["train_y"][: self.eval_train_examples]

    def build_model(self) -> nn.Module:
        return DigitsCNN(self.width, self.hidden)

    def batch(self, generator: torch.Generator) -> tuple[Tensor, Tensor]:
        n = len(self._data["train_y"])
        idx = torch.randint(0, n, (self.batch_size,), generator=generator).to(self._data["train_y"].device)
        return self._data["train_x"][idx], self._data["train_y"][idx]

    def loss(self, model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
        return F.cross_entropy(model(x), y)

    @torch.no_grad()
    def evaluate(self, model: nn.Module) -> dict[str, float]:
        """Loss on the val set and the fixed train subset, and val accuracy (BatchNorm in eval mode)."""
        out: dict[str, float] = {}
        for split, key in (("train", "eval"), ("val", "val")):
            logits = model(self._data[f"{key}_x"])
            y = self._data[f"{key}_y"]
            out[f"{split}_loss"] = F.cross_entropy(logits, y).item()
            if split == "val":
                out["val_acc"] = (logits.argmax(1) == y).float().mean().item()
        return out


@dataclass
class CharsTask:
    """Next-character prediction on stdlib source with :class:`CharTransformer`.

    Train and val losses are measured on fixed windows (the same for every run) so that curves
    from different contenders are comparable point by point.
    """

    dim: int = 64
    layers: int = 2
    heads: int = 4
    block: int = 64
    batch_size: int = 24
    max_chars: int | None = None
    eval_windows: int = 128
    default_steps: int = 120
    evals: int = 8
    name: str = "chars"
    _data: dict[str, Tensor] = field(default_factory=dict, repr=False)
    _vocab_size: int = 0

    def setup(self, device: torch.device) -> None:
        corpus = _corpus(self.max_chars)
        self._vocab_size = corpus.vocab_size
        gen = torch.Generator().manual_seed(SPLIT_SEED + 1)
        self._data = {"train_tokens": corpus.train.to(device)}
        for split, tokens in (("train", corpus.train), ("val", corpus.val)):
            x, y = char_windows(tokens, self.eval_windows, self.block, gen)
            self._data[f"{split}_x"], self._data[f"{split}_y"] = x.to(device), y.to(device)

    def build_model(self) -> nn.Module:
        if not self._vocab_size:
            raise RuntimeError("call setup(device) before build_model(): the vocabulary comes from the data")
        return CharTransformer(self._vocab_size, self.block, self.dim, self.layers, self.heads)

    def batch(self, generator: torch.Generator) -> tuple[Tensor, Tensor]:
        return char_windows(self._data["train_tokens"], self.batch_size, self.block, generator)

    def loss(self, model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
        logits = model(x)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

    @torch.no_grad()
    def evaluate(self, model: nn.Module) -> dict[str, float]:
        out: dict[str, float] = {}
        for split in ("train", "val"):
            x, y = self._data[f"{split}_x"], self._data[f"{split}_y"]
            total = 0.0
            for i in range(0, len(x), 64):
                total += self.loss(model, x[i : i + 64], y[i : i + 64]).item() * len(x[i : i + 64])
            out[f"{split}_loss"] = total / len(x)
        return out


TASKS = ("digits", "chars")


def make_task(name: str) -> DigitsTask | CharsTask:
    """The task with its default (README) size."""
    if name == "digits":
        return DigitsTask()
    if name == "chars":
        return CharsTask()
    raise ValueError(f"unknown model {name!r}; choose one of {TASKS} (or 'all')")
