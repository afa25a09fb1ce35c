"""Per-iteration record of a run, kept column-wise so a long simulation stays cheap."""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any


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

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.start: list[float] = []
        self.duration: list[float] = []
        self.num_prefill_tokens: list[int] = []
        self.num_decode_tokens: list[int] = []
        self.batch_size: list[int] = []
        self.num_used_blocks: list[int] = []
        self.num_preemptions: list[int] = []

    def __len__(self) -> int:
        return len(self.start)

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
