"""Policy docstrings cite sections of docs/policies.md that exist; the docs' lists of policies
name every registered one."""

from __future__ import annotations

import re
from pathlib import Path

import tailserve.policies

ROOT = Path(__file__).resolve().parents[1]


def test_every_cited_policies_md_section_exists() -> None:
    headings = [
        line[3:]
        for line in (ROOT / "docs" / "policies.md").read_text().splitlines()
        if line.startswith("## ")
    ]
    cited = []
    for path in sorted(Path(tailserve.policies.__file__).parent.glob("*.py")):
        text = path.read_text()
        assert "shared/reference" not in text, f"{path.name} cites a reference file outside the repo"
        for title in re.findall(r'``docs/policies\.md``, "([^"]+)"', text):
            cited.append(title)
            assert any(h.startswith(title) for h in headings), (
                f"{path.name} cites a missing section {title!r}"
            )
    assert len(cited) >= 6  # vllm, vllm-v0, sarathi, orca, sglang, tgi


def test_the_docs_lists_of_policies_name_every_registered_one() -> None:
    from tailserve.policies.registry import POLICIES

    lists = {
        "README.md": r"Policies: (.*?) \(any case\)",
        "docs/cli.md": r"`--policy P` \(default `vllm`; one of (.*?)\) followed",
    }
    for doc, pattern in lists.items():
        found = re.search(pattern, " ".join((ROOT / doc).read_text().split()))
        assert found is not None, f"{doc}: the list of policies moved"
        assert re.findall(r"`([^`]+)`", found.group(1)) == list(POLICIES), doc
