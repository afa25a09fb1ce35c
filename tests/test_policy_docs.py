"""Policy docstrings cite sections of docs/policies.md that exist."""

from __future__ import annotations

import re
from pathlib import Path

import tailserve.policies

ROOT = Path(__file__).resolve().parents[1]


def test_every_cited_policies_md_section_exists() -> None:
    headings = [line[3:] for line in (ROOT / "docs" / "policies.md").read_text().splitlines() if line.startswith("## ")]
    cited = []
    for path in sorted(Path(tailserve.policies.__file__).parent.glob("*.py")):
        text = path.read_text()
        assert "shared/reference" not in text, f"{path.name} cites a reference file outside the repo"
        for title in re.findall(r'``docs/policies\.md``, "([^"]+)"', text):
            cited.append(title)
            assert any(h.startswith(title) for h in headings), f"{path.name} cites a missing section {title!r}"
    assert len(cited) >= 6  # vllm, vllm-v0, sarathi, orca, sglang, tgi
