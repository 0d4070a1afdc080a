"""Marks of what a step added to the optimizer's state, so that a refused step takes it back."""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any


def mark_state(state: MutableMapping[Any, dict[str, Any]]) -> list[int]:
    """How many entries each parameter's state holds now (a step only adds entries, and dicts keep
    their order); an entry that is not a dict counts as -1: kept."""
    return [len(entry) if isinstance(entry, dict) else -1 for entry in state.values()]


def drop_state_after(state: MutableMapping[Any, dict[str, Any]], mark: list[int]) -> None:
    """Remove every state entry added since ``mark`` (the zero buffers of a refused step)."""
    entries = list(state.items())
    for key, _ in entries[len(mark) :]:
        del state[key]
    for (_, entry), size in zip(entries, mark):
        if size < 0 or not isinstance(entry, dict):
            continue
        for name in list(entry)[size:]:
            del entry[name]
