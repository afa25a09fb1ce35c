"""Per-iteration record of a run.

``IterationLog`` keeps counts column-wise (always on, cheap even for a long simulation);
``BatchRecord`` keeps, when asked for, which requests ran in each iteration with how many tokens,
the preemptions and the waiting queue's head — what the TTFT/TBT attribution needs.
"""

from __future__ import annotations

import json
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tailserve.core.request import Request
    from tailserve.core.scheduler import Scheduler
    from tailserve.core.scheduler_output import SchedulerOutput


class IterationLog:
    FIELDS = (
        "start",  # seconds
        "duration",  # seconds
        "num_prefill_tokens",
        "num_decode_tokens",
        "batch_size",
        "num_used_blocks",  # KV blocks in use after scheduling
        "num_preemptions",
    )

    def __init__(self, num_blocks: int, *, compact: bool = False) -> None:
        """``compact``: columns as typed arrays (8-byte times, 4-byte counts: 36 bytes an
        iteration instead of ~150 as Python lists) for a run of millions of iterations; they
        read like lists but are not JSON (a streaming run keeps no run file)."""
        self.num_blocks = num_blocks
        self.compact = compact
        floats = (lambda: array("d")) if compact else list
        ints = (lambda: array("i")) if compact else list
        self.start: list[float] = floats()
        self.duration: list[float] = floats()
        self.num_prefill_tokens: list[int] = ints()
        self.num_decode_tokens: list[int] = ints()
        self.batch_size: list[int] = ints()
        self.num_used_blocks: list[int] = ints()
        self.num_preemptions: list[int] = ints()

    def __len__(self) -> int:
        return len(self.start)

    def busy_seconds(self) -> float:
        """Seconds some iteration ran: the union of their spans. Under pipeline parallelism the
        micro-batches in flight overlap (each spans its trip through the stages); elsewhere the
        spans are disjoint and this is the sum of the durations."""
        total, end = 0.0, float("-inf")
        for start, duration in zip(self.start, self.duration):
            if start >= end:
                total += duration
                end = start + duration
            elif start + duration > end:
                total += start + duration - end
                end = start + duration
        return total

    def record(
        self,
        start: float,
        duration: float,
        num_prefill_tokens: int,
        num_decode_tokens: int,
        batch_size: int,
        num_used_blocks: int,
        num_preemptions: int,
    ) -> None:
        self.start.append(start)
        self.duration.append(duration)
        self.num_prefill_tokens.append(num_prefill_tokens)
        self.num_decode_tokens.append(num_decode_tokens)
        self.batch_size.append(batch_size)
        self.num_used_blocks.append(num_used_blocks)
        self.num_preemptions.append(num_preemptions)

    def extend_decode_run(
        self,
        starts: Sequence[float],
        durations: Sequence[float],
        num_decodes: int,
        num_used_blocks: Sequence[int],
    ) -> None:
        k = len(starts)
        self.start.extend(starts)
        self.duration.extend(durations)
        self.num_prefill_tokens.extend([0] * k)
        self.num_decode_tokens.extend([num_decodes] * k)
        self.batch_size.extend([num_decodes] * k)
        self.num_used_blocks.extend(num_used_blocks)
        self.num_preemptions.extend([0] * k)

    def rows(self) -> Iterator[dict[str, Any]]:
        columns = [getattr(self, name) for name in self.FIELDS]
        for values in zip(*columns):
            row = dict(zip(self.FIELDS, values))
            row["kv_usage"] = row["num_used_blocks"] / self.num_blocks
            yield row

    def write_jsonl(self, path: str | Path) -> None:
        with open(path, "w") as f:
            for row in self.rows():
                f.write(json.dumps(row) + "\n")


@dataclass(slots=True)
class BatchEntry:
    """One iteration, or a run of identical decode iterations from the decode fast path.

    Iteration ``j`` of the entry grants every listed request ``num_new_tokens`` tokens on top of
    ``num_context_tokens + j`` cached ones (``j`` is 0 for a single iteration; in a decode run
    every grant is 1 and each context grows by one per iteration).
    """

    starts: list[float]  # seconds, one per iteration
    durations: list[float]  # seconds, one per iteration
    request_ids: list[str]  # the scheduled requests, in batch order
    num_new_tokens: list[int]  # per request: a prefill chunk, or 1 for a decode
    num_context_tokens: list[int]  # per request, cached before the entry's first iteration
    num_used_blocks: list[int]  # per iteration: KV blocks in use after scheduling
    preempted: list[str] = field(default_factory=list)  # by recompute in this iteration
    swapped_out: list[str] = field(default_factory=list)
    swapped_in: list[str] = field(default_factory=list)
    waiting_head: str | None = None  # the first waiting request after scheduling
    num_waiting: int = 0  # requests waiting after scheduling
    num_swapped: int = 0  # requests whose KV sits in the CPU pool after scheduling

    @property
    def num_iterations(self) -> int:
        return len(self.starts)

    def to_json(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__slots__}  # type: ignore[attr-defined]


class BatchRecord:
    """Which requests ran in each iteration with how many tokens: what ``metrics.attribution``
    needs to say why a request waited. Opt-in (``EngineOptions(record_batches=True)``): it holds
    one entry per iteration outside decode runs, and one per decode run."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size  # tokens per KV block
        self.entries: list[BatchEntry] = []

    def record(
        self, start: float, duration: float, out: SchedulerOutput, num_used_blocks: int, sched: Scheduler
    ) -> None:
        scheduled = out.scheduled
        self.entries.append(
            BatchEntry(
                [start],
                [duration],
                [s.request.request_id for s in scheduled],
                [s.num_new_tokens for s in scheduled],
                [s.num_context_tokens for s in scheduled],
                [num_used_blocks],
                [r.request_id for r in out.preempted],
                [r.request_id for r in out.swapped_out],
                [r.request_id for r in out.swapped_in],
                sched.waiting.peek_request().request_id if sched.waiting else None,
                len(sched.waiting),
                len(sched.swapped),
            )
        )

    def record_decode_run(
        self,
        starts: list[float],
        durations: list[float],
        running: list[Request],
        num_context_tokens: list[int],
        num_used_blocks: list[int],
        sched: Scheduler,
    ) -> None:
        """A decode run: ``running`` decoded one token in each iteration, from the given contexts
        (taken before the run). Nobody is admitted during a run, so the queue stays as it is."""
        self.entries.append(
            BatchEntry(
                starts,
                durations,
                [r.request_id for r in running],
                [1] * len(running),
                num_context_tokens,
                num_used_blocks,
                waiting_head=sched.waiting.peek_request().request_id if sched.waiting else None,
                num_waiting=len(sched.waiting),
                num_swapped=len(sched.swapped),
            )
        )

    @property
    def num_iterations(self) -> int:
        return sum(len(e.starts) for e in self.entries)

    def iteration_log(self) -> IterationLog:
        """The counts ``Engine`` logs, rebuilt (a saved run keeps only this record)."""
        log = IterationLog(self.num_blocks)
        for e in self.entries:
            prefill = sum(n for n in e.num_new_tokens if n > 1)
            decode = sum(1 for n in e.num_new_tokens if n == 1)
            preemptions = len(e.preempted) + len(e.swapped_out)
            for start, duration, used in zip(e.starts, e.durations, e.num_used_blocks):
                log.record(start, duration, prefill, decode, len(e.request_ids), used, preemptions)
        return log

    def to_json(self) -> dict[str, Any]:
        return {
            "num_blocks": self.num_blocks,
            "block_size": self.block_size,
            "entries": [e.to_json() for e in self.entries],
        }

    @staticmethod
    def from_json(data: dict[str, Any]) -> BatchRecord:
        try:
            record = BatchRecord(int(data["num_blocks"]), int(data["block_size"]))
            record.entries = [BatchEntry(**e) for e in data["entries"]]
        except (KeyError, TypeError) as e:
            raise ValueError(f"malformed batch record: {e}") from None
        for i, e in enumerate(record.entries):
            k = len(e.starts)
            n = len(e.request_ids)
            if not k or len(e.durations) != k or len(e.num_used_blocks) != k:
                raise ValueError(
                    f"batch record entry {i}: starts, durations and num_used_blocks differ in length"
                )
            if len(e.num_new_tokens) != n or len(e.num_context_tokens) != n:
                raise ValueError(f"batch record entry {i}: one token count per request expected")
        return record
