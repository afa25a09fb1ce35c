"""Recorded traffic: the requests a client or a router saw, as a tailserve JSONL trace that
``simulate --trace`` replays, each line carrying what was measured.

One line per request, the tailserve trace format (``traces.py``) with two optional keys:

    {"arrival_time": 0.512, "prompt_len": 812, "max_tokens": 64,
     "prompt_token_ids": [...],                      # where the prompt was sent as token ids
     "measured": {"ttft_s": 0.031, "itl_s": [0.011, ...], "output_tokens": 64, "latency_s": 0.74}}

``arrival_time`` is seconds after the recording's first request was sent (the client's send
time, or the router's receipt). ``prompt_token_ids`` let a replay see exactly the prefix sharing
the traffic had (the simulator keys its prefix cache on them); ``measured`` holds the latencies
as that recorder saw them (``error`` instead for a request that failed). ``load_trace`` reads the
requests and ignores ``measured``; ``load_measured`` reads both, in the same order.

A recorder writes each request as it finishes, so a file is usable while traffic still flows
and lines are in finishing order; readers sort by arrival time.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from os import PathLike
from pathlib import Path
from typing import IO, Any

from tailserve.core.request import Request
from tailserve.workloads.errors import TraceError
from tailserve.workloads.traces import load_trace


@dataclass(slots=True)
class Measured:
    """What was seen of one request: TTFT and every gap after it (seconds), tokens received,
    send -> last token; or the error it failed with."""

    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    output_tokens: int = 0
    latency_s: float | None = None
    error: str = ""

    @property
    def success(self) -> bool:
        return not self.error  # a plain (non-streamed) request has no TTFT, yet it succeeded

    def to_json(self) -> dict[str, Any]:
        if self.error:
            return {"error": self.error}
        body: dict[str, Any] = {
            "ttft_s": self.ttft_s,
            "itl_s": self.itl_s,
            "output_tokens": self.output_tokens,
        }
        if self.latency_s is not None:
            body["latency_s"] = self.latency_s
        return body

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> Measured:
        if body.get("error"):
            return cls(error=str(body["error"]))
        return cls(
            _opt_float(body.get("ttft_s")),
            [float(x) for x in body.get("itl_s") or ()],
            int(body.get("output_tokens") or 0),
            _opt_float(body.get("latency_s")),
        )


def _opt_float(value: Any) -> float | None:
    return None if value is None else float(value)


def trace_line(
    arrival_time: float,
    prompt_len: int,
    max_tokens: int,
    measured: Measured,
    prompt_token_ids: list[int] | None = None,
) -> dict[str, Any]:
    line: dict[str, Any] = {
        "arrival_time": round(max(arrival_time, 0.0), 6),
        "prompt_len": prompt_len,
        "max_tokens": max_tokens,
    }
    if prompt_token_ids is not None and len(prompt_token_ids) == prompt_len:
        line["prompt_token_ids"] = list(prompt_token_ids)
    line["measured"] = measured.to_json()
    return line


class TraceRecorder:
    """Appends one line per finished request to a file, thread-safe; arrival times are counted
    from the first request that ``arrived`` (``time.monotonic`` by default, the router's clock)."""

    def __init__(self, path: str | PathLike[str], clock: Any = time.monotonic) -> None:
        self.path = Path(path)
        self._file: IO[str] = self.path.open("w")
        self._lock = threading.Lock()
        self._clock = clock
        self._t0: float | None = None
        self.num_written = 0

    def arrived(self) -> float:
        """Now, as an arrival time in the recording (0 for the first request)."""
        now = self._clock()
        with self._lock:
            if self._t0 is None:
                self._t0 = now
            return now - self._t0

    def write(self, line: dict[str, Any]) -> None:
        text = json.dumps(line, separators=(",", ":")) + "\n"
        with self._lock:
            self._file.write(text)
            self._file.flush()
            self.num_written += 1

    def close(self) -> None:
        with self._lock:
            self._file.close()


def write_trace(path: str | PathLike[str], lines: list[dict[str, Any]]) -> None:
    """A whole recording at once, in arrival order (the bench client writes it after its run)."""
    with Path(path).open("w") as f:
        for line in sorted(lines, key=lambda x: x["arrival_time"]):
            f.write(json.dumps(line, separators=(",", ":")) + "\n")


def load_measured(path: str | PathLike[str]) -> list[tuple[Request, Measured]]:
    """Each request of a recorded trace with what was measured, in ``load_trace``'s order
    (arrival time, ties in file order); a line without ``measured`` is an error here."""
    requests = load_trace(path, format="tailserve")
    by_row: dict[int, Measured] = {}
    with Path(path).open() as f:
        row = 0
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            body = json.loads(line).get("measured")
            if not isinstance(body, dict):
                raise TraceError(f"{path}:{number}: no measured figures (not a recorded trace)")
            try:
                by_row[row] = Measured.from_json(body)
            except (TypeError, ValueError) as error:
                raise TraceError(f"{path}:{number}: measured: {error}") from None
            row += 1
    return [(r, by_row[int(r.request_id.removeprefix("trace-"))]) for r in requests]


def has_measured(path: str | PathLike[str]) -> bool:
    """Whether a trace's first line carries ``measured`` figures (a recording)."""
    try:
        with Path(path).open() as f:
            for line in f:
                if line.strip():
                    body = json.loads(line)
                    return isinstance(body, dict) and isinstance(body.get("measured"), dict)
    except (OSError, ValueError):
        return False
    return False
