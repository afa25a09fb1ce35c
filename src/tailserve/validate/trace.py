"""A step-by-step record of one scheduler's decisions, and the first step where two differ."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class StepRecord:
    step: int
    # (request id, new tokens granted, tokens already computed) in the scheduler's order; for an
    # admitted request the computed count is its prefix-cache hit.
    scheduled: list[tuple[str, int, int]] = field(default_factory=list)
    admitted: list[str] = field(default_factory=list)  # entered the running set this step
    preempted: list[str] = field(default_factory=list)  # sorted
    finished: list[str] = field(default_factory=list)  # sorted; by length or stop token
    aborted: list[str] = field(default_factory=list)  # sorted; before the scheduler ran
    num_used_blocks: int = 0  # KV blocks held by requests after the step

    def to_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "scheduled": [list(s) for s in self.scheduled],
            "admitted": list(self.admitted),
            "preempted": list(self.preempted),
            "finished": list(self.finished),
            "aborted": list(self.aborted),
            "num_used_blocks": self.num_used_blocks,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> StepRecord:
        return cls(
            step=d["step"],
            scheduled=[(s[0], s[1], s[2]) for s in d["scheduled"]],
            admitted=list(d["admitted"]),
            preempted=list(d["preempted"]),
            finished=list(d["finished"]),
            aborted=list(d["aborted"]),
            num_used_blocks=d["num_used_blocks"],
        )


_FIELDS = ("scheduled", "admitted", "preempted", "finished", "aborted", "num_used_blocks")


@dataclass(frozen=True, slots=True)
class Divergence:
    step: int
    fields: tuple[str, ...]  # which parts of the step differ
    ours: StepRecord | None  # None: tailserve ran out of steps first
    theirs: StepRecord | None

    def describe(self) -> str:
        def view(rec: StepRecord | None) -> str:
            if rec is None:
                return "(no such step: the run had ended)"
            return ", ".join(f"{f}={getattr(rec, f)}" for f in _FIELDS)

        return (
            f"step {self.step} differs in {', '.join(self.fields)}\n"
            f"  tailserve: {view(self.ours)}\n"
            f"  engine:    {view(self.theirs)}"
        )


def first_divergence(ours: list[StepRecord], theirs: list[StepRecord]) -> Divergence | None:
    """The first step whose decisions differ, or None when the traces are identical."""
    for i in range(max(len(ours), len(theirs))):
        a = ours[i] if i < len(ours) else None
        b = theirs[i] if i < len(theirs) else None
        if a is None or b is None:
            return Divergence(i, ("length",), a, b)
        diff = tuple(f for f in _FIELDS if getattr(a, f) != getattr(b, f))
        if diff:
            return Divergence(i, diff, a, b)
    return None
