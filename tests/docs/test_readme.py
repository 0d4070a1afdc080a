"""The README's quick start runs as printed, and trains."""

from __future__ import annotations

import contextlib
import io
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _quick_start_code() -> str:
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Quick start") :]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_quick_start_runs_and_the_loss_falls():
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(_quick_start_code(), "README.md quick start", "exec"), {"__name__": "__quickstart__"})
    losses = [float(x) for x in re.findall(r"loss (\d+\.\d+)", out.getvalue())]
    assert len(losses) == 3 and losses[-1] < losses[0] - 0.1
    assert "bucket 0" in out.getvalue()
    # the expected output the README shows under it: the same losses, the same matrices
    text = (ROOT / "README.md").read_text()
    shown = re.search(r"```text\n(.*?)```", text[text.index("## Quick start") :], re.S).group(1)
    shown_losses = [float(x) for x in re.findall(r"loss (\d+\.\d+)", shown)]
    assert shown_losses == pytest.approx(losses, abs=0.01)
    assert re.search(r"^plan: 2 matrices", shown, re.M) and re.search(
        r"^plan: 2 matrices", out.getvalue(), re.M
    )


def test_llm_layers_example_runs_and_plans_every_matrix():
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## LLM layers") :]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "README.md LLM layers", "exec"), {"__name__": "__llm__"})
    # 2 layers x 4 experts x (gate, up, down) + 2 x 4 query heads + k, v, o per layer (the
    # routers are AdamW's)
    assert out.getvalue().startswith("plan: 38 matrices")
