"""The README's examples run from a clone: the files they name are shipped, and the priority
example is at a rate where its two rows differ."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

from tailserve.cli import main
from tailserve.cli.run import load_prompts

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def test_prompt_files_the_docs_use_are_shipped():
    used = {m for doc in DOCS for m in re.findall(r"--prompts (examples/\S+)", doc.read_text())}
    assert used, "the README's run example names a prompts file"
    for path in used:
        assert len(load_prompts(REPO / path)) >= 1


def test_readme_priority_example_shows_a_difference(tmp_path, capsys):
    readme = (REPO / "README.md").read_text().replace("\\\n", " ")
    (line,) = [x for x in readme.splitlines() if "scheduling_policy=priority" in x and "compare" in x]
    argv = shlex.split(line.split("#")[0])[1:]  # without "tailserve" and the comment
    out = tmp_path / "p.json"
    assert main([*argv, "--workers", "1", "--json", str(out)]) == 0
    fifo, priority = json.loads(out.read_text())["runs"]
    assert fifo["metrics"]["ttft_s"] != priority["metrics"]["ttft_s"]
