"""What the README and the docstrings say holds: pointers lead to sections that exist, and
printed figures that depend on the machine are not given as fixed numbers."""

from __future__ import annotations

import re
from pathlib import Path

import fastmuon

ROOT = Path(__file__).resolve().parents[2]
SOURCES = sorted((ROOT / "src" / "fastmuon").rglob("*.py"))


def headings(doc: Path) -> list[str]:
    return [line.lstrip("#").strip() for line in doc.read_text().splitlines() if line.startswith("#")]


def test_section_pointers_in_the_source_name_sections_that_exist():
    pointers = []
    for path in SOURCES:
        text = " ".join(path.read_text().split())
        for section, doc in re.findall(r'"([^"]+)" in (docs/[\w.-]+\.md)', text):
            pointers.append(section)
            assert any(h.startswith(section) for h in headings(ROOT / doc)), (path.name, section, doc)
        # the README has no such sections: its pointers go to docs/
        assert not re.search(r"README's (\"|table|[\w-]+ section)", text), path.name
    assert "Update rules" in pointers
    for cls in (fastmuon.MuSGD, fastmuon.Muon):
        assert '"Update rules" in docs/optimizers.md' in " ".join(cls.__doc__.split())


def test_readme_llm_example_does_not_promise_a_bucket_count():
    """How many buckets the planner makes depends on the machine's cost model (2 on an AVX2-only
    CPU, 3 with bf16 matmul units): the comment gives the matrix count only."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## LLM layers") :]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    (comment,) = [line for line in code.splitlines() if "describe()" in line]
    assert "plan: 38 matrices" in comment
    assert not re.search(r"\d+ buckets", comment), comment


def test_readme_says_when_ultralytics_auto_picks_musgd():
    text = " ".join((ROOT / "README.md").read_text().split())
    assert '# or optimizer="auto"' not in text
    assert "picks MuSGD only for runs of more than 10,000 iterations" in text
