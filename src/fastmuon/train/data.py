"""Training data that every machine already has: scikit-learn's digits and Python's own source.

Nothing is downloaded. Splits are fixed (they do not depend on the run's seed) so that every
contender and every seed is judged on the same held-out examples.
"""

from __future__ import annotations

import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

#: Split seed: fixed so the held-out set never changes between runs.
SPLIT_SEED = 0

#: Standard-library modules whose source is the character corpus, in this order. They exist
#: as single files in every CPython >= 3.10; a missing one (an unusual build) is skipped.
STDLIB_MODULES: tuple[str, ...] = (
    "argparse.py",
    "dataclasses.py",
    "functools.py",
    "textwrap.py",
    "string.py",
    "shutil.py",
    "tempfile.py",
    "typing.py",
    "inspect.py",
    "fractions.py",
    "statistics.py",
    "heapq.py",
    "bisect.py",
    "difflib.py",
    "calendar.py",
    "configparser.py",
)


@dataclass(frozen=True)
class DigitsData:
    """8×8 grey digit images as ``(N, 1, 8, 8)`` floats in [0, 1] with integer labels."""

    train_x: Tensor
    train_y: Tensor
    val_x: Tensor
    val_y: Tensor


def load_digits_data(val_fraction: float = 0.2) -> DigitsData:
    """scikit-learn's 1,797 handwritten digits (shipped with the package), split 80/20."""
    try:
        from sklearn.datasets import load_digits
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            "the digits task needs scikit-learn: pip install 'fastmuon[train]' (or scikit-learn)"
        ) from e
    bunch = load_digits()
    x = torch.tensor(bunch.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(bunch.target, dtype=torch.long)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(SPLIT_SEED))
    n_val = int(round(val_fraction * len(y)))
    val, train = order[:n_val], order[n_val:]
    return DigitsData(x[train], y[train], x[val], y[val])


def stdlib_source_files(modules: tuple[str, ...] = STDLIB_MODULES) -> list[Path]:
    """The corpus files in a fixed order, found via ``sysconfig`` (no download, no network)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [root / name for name in modules if (root / name).is_file()]
    if not files:
        raise FileNotFoundError(
            f"none of {modules} found under the standard library at {root}; the chars task needs "
            "the Python source files (some minimal installs ship only .pyc: install the full Python)"
        )
    return files


@dataclass(frozen=True)
class CharCorpus:
    """A character-level corpus encoded as token ids, split contiguously into train and val."""

    vocab: tuple[str, ...]
    train: Tensor
    val: Tensor

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def decode(self, ids: Tensor) -> str:
        return "".join(self.vocab[i] for i in ids.tolist())


def load_char_corpus(max_chars: int | None = None, val_fraction: float = 0.1) -> CharCorpus:
    """Concatenated stdlib source; the last ``val_fraction`` of each file is held out.

    Splitting every file (rather than the concatenation) keeps the held-out text a mix of all
    modules instead of the tail of the last one. ``max_chars`` caps the corpus (tests).
    """
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    texts = [f.read_text(encoding="utf-8") for f in stdlib_source_files()]
    if max_chars is not None:
        per_file = max(1, max_chars // len(texts))
        texts = [t[:per_file] for t in texts]
    vocab = tuple(sorted(set("".join(texts))))
    index = {c: i for i, c in enumerate(vocab)}
    train_parts, val_parts = [], []
    for t in texts:
        cut = int(len(t) * (1 - val_fraction))
        train_parts.append(t[:cut])
        val_parts.append(t[cut:])

    def encode(parts: list[str]) -> Tensor:
        return torch.tensor([index[c] for c in "".join(parts)], dtype=torch.long)

    return CharCorpus(vocab, encode(train_parts), encode(val_parts))


def char_windows(
    tokens: Tensor, batch_size: int, block: int, generator: torch.Generator
) -> tuple[Tensor, Tensor]:
    """``batch_size`` random windows of ``block`` characters and their next-character targets."""
    if len(tokens) <= block + 1:
        raise ValueError(f"corpus split of {len(tokens)} characters is too short for block={block}")
    # The generator lives on the CPU (same draws on every device); the windows on tokens' device.
    starts = torch.randint(0, len(tokens) - block - 1, (batch_size,), generator=generator)
    idx = starts.to(tokens.device)[:, None] + torch.arange(block, device=tokens.device)
    return tokens[idx], tokens[idx + 1]
