from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def shared_traces() -> Path | None:
    for candidate in (REPO.parent / "shared" / "traces", Path("/work/shared/traces")):
        if (candidate / "azure_llm_2023_conv.csv").exists():
            return candidate
    return None


@pytest.fixture
def traces_dir() -> Path:
    found = shared_traces()
    if found is None:
        pytest.skip("the shared traces folder (../shared/traces) is not present")
    return found
