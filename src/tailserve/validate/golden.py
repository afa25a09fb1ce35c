"""Golden fixtures: an engine's recorded decisions, checked against tailserve without the engine.

A fixture file holds, per workload, the workload (compact form) and the engine's trace as one
short digest per step (``step_digest``), plus the full trace for the first few workloads so a
failure can show the engine's view. ``check_fixture`` replays each workload through tailserve
and reports the first step whose digest differs.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tailserve.validate.trace import StepRecord
from tailserve.validate.workload import Workload, from_compact, to_compact

NUM_FULL_TRACES = 12  # workloads stored with every step spelled out


def step_digest(step: StepRecord) -> str:
    blob = json.dumps(step.to_dict(), separators=(",", ":"), sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:8]


def record_entry(workload: Workload, steps: list[StepRecord], full: bool) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "workload": to_compact(workload),
        "num_steps": len(steps),
        "digests": " ".join(step_digest(s) for s in steps),
    }
    if full:
        entry["steps"] = [s.to_dict() for s in steps]
    return entry


@dataclass(frozen=True, slots=True)
class GoldenMismatch:
    index: int  # position in the fixture file
    seed: int | None
    step: int
    ours: StepRecord | None
    theirs: dict[str, Any] | None  # the engine's step, when the fixture spells it out

    def describe(self) -> str:
        ours = self.ours.to_dict() if self.ours is not None else "(run had ended)"
        theirs = self.theirs if self.theirs is not None else "(digest only: rerun live to see it)"
        return (
            f"workload #{self.index} (seed {self.seed}) differs from the engine at step {self.step}\n"
            f"  tailserve: {ours}\n  engine:    {theirs}"
        )


def check_entry(
    index: int, entry: dict[str, Any], run: Callable[[Workload], list[StepRecord]]
) -> GoldenMismatch | None:
    workload = from_compact(entry["workload"])
    ours = run(workload)
    digests = entry["digests"].split()
    full = entry.get("steps")
    for i in range(max(len(ours), len(digests))):
        mine = step_digest(ours[i]) if i < len(ours) else None
        if i >= len(digests) or mine != digests[i]:
            theirs = full[i] if full is not None and i < len(full) else None
            return GoldenMismatch(index, workload.seed, i, ours[i] if i < len(ours) else None, theirs)
    return None


def load_fixture(path: Path) -> dict[str, Any]:
    with open(path) as f:
        return json.load(f)


def write_fixture(path: Path, engine: str, version: str, entries: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"engine": engine, "version": version, "workloads": entries}
    with open(path, "w") as f:
        json.dump(doc, f, separators=(",", ":"))
        f.write("\n")
