"""Where the benchmarks read peer engines from and write their results (standard library only:
vLLM's driver imports this from vLLM's venv).

- Peer engines live in venvs under ``${TAILSERVE_PEERS:-<repo>/.peers}/<name>``, made by
  ``scripts/setup-peers.sh``; nothing defaults to a path of one machine.
- Results go to ``benchmarks/out/`` (git-ignored) unless ``--out`` names a file; the figures the
  docs quote were written with ``--out benchmarks/results/NAME.json`` and are committed.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
OUT_DIR = HERE / "out"


def peers_dir() -> Path:
    base = os.environ.get("TAILSERVE_PEERS")
    return Path(base).expanduser() if base else REPO / ".peers"


def peer_venv(name: str) -> Path:
    return peers_dir() / name


def missing_peer(name: str, venv: Path | str) -> str:
    """The message when a peer engine's venv is absent: where it was looked for, how to make it."""
    return (
        f"{name}'s venv is not at {venv} (no {Path(venv) / 'bin' / 'python'}). Create it with "
        f"`scripts/setup-peers.sh {name}` (venvs go under $TAILSERVE_PEERS, default <repo>/.peers), "
        f"or pass --{name}-venv DIR."
    )


def default_out(filename: str) -> Path:
    """``benchmarks/out/FILENAME`` (created), the git-ignored default for a results file."""
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    return OUT_DIR / filename


def save_results(results: dict, out: str | Path | None, filename: str) -> Path:
    """Write a benchmark's results as JSON to ``out`` (default ``benchmarks/out/FILENAME``), say
    where, and return the path."""
    path = Path(out) if out else default_out(filename)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=1))
    print(f"results: {path}")
    return path


# The public traces the benchmarks replay by default, and where each comes from.
TRACE_SOURCES = {
    "azure_llm_2023_conv.csv": "Azure LLM inference trace 2023 (github.com/Azure/AzurePublicDataset, "
    "data/AzureLLMInferenceTrace_conv.csv; CC-BY 4.0)",
    "mooncake_conversation.jsonl": "Mooncake conversation trace (github.com/kvcache-ai/Mooncake, "
    "FAST25-release/traces/conversation_trace.jsonl; Apache-2.0)",
}
TRACES_DIR = REPO.parent / "shared" / "traces"  # beside the clone, as docs/cli.md says


def default_trace(filename: str) -> Path:
    return TRACES_DIR / filename


def check_trace(path: str | Path) -> str | None:
    """None when the trace exists, else one line saying where to get it."""
    p = Path(path)
    if p.is_file():
        return None
    source = TRACE_SOURCES.get(p.name)
    where = f"; it is the {source}" if source else ""
    return f"no trace at {p}{where}. Download it there or pass --trace PATH."
