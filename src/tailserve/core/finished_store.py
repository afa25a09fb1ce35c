"""Finished requests' timestamps in compact arrays, their ``Request`` objects dropped.

A simulation keeps every finished ``Request`` by default (``RunResult.requests``: explain, the
run file and the report read them), ~10 KB each with its token times as Python floats. For a
million requests that is the whole memory budget, so ``EngineOptions(stream_finished=True)``
moves each finished request here instead: the per-request numbers the summary reads, as 8-byte
array entries, and the request's inter-token gaps, as float64 chunks (the pooled ITL's
percentiles and mean need every gap, so ~8 bytes per output token stays). ``metrics.summary``
computes the same numbers from this as from the requests (``tests/test_finished_store.py``):
same values, same order, so the same floats.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field

import numpy as np

from tailserve.core.request import Request, RequestStatus
from tailserve.core.stream_interval import StreamInterval

_DONE = (RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_STOPPED)
# Token times buffered before they become gap arrays: 64 MiB, above glibc's largest mmap
# threshold (32 MiB), so every chunk is its own mapping and freeing one returns it to the OS
# (smaller chunks land in the heap, whose freed pages the process keeps: the summary's one
# contiguous copy would then double the peak).
FLUSH_TOKENS = 1 << 23


@dataclass(slots=True)
class GapPool:
    """Inter-token gaps of many requests, pooled in request order: token times buffered, then
    turned into float64 gap chunks as ``RequestLatencies.of`` takes them (consecutive
    differences, the ones across two requests dropped, and the zero ones between tokens of one
    step: speculative decoding's one streamed chunk)."""

    _chunks: list[np.ndarray] = field(default_factory=list)
    _buf: np.ndarray | None = None  # token times not yet turned into gaps (FLUSH_TOKENS)
    _fill: int = 0  # entries of ``_buf`` in use
    _counts: list[int] = field(default_factory=list)  # tokens per request in ``_buf``

    def add(self, times: list[float]) -> None:
        n = len(times)
        if self._buf is None:
            self._buf = np.empty(FLUSH_TOKENS, dtype=np.float64)
        if self._fill + n > self._buf.size:
            self._flush()
            if n > self._buf.size:  # one request longer than the buffer: a buffer of its own
                self._buf = np.empty(n, dtype=np.float64)
        self._buf[self._fill : self._fill + n] = times
        self._fill += n
        self._counts.append(n)

    def _flush(self) -> None:
        if not self._fill:
            return
        assert self._buf is not None
        gaps = np.diff(self._buf[: self._fill])
        if gaps.size:
            keep = np.ones(gaps.size, dtype=bool)
            keep[np.cumsum(self._counts)[:-1] - 1] = False
            keep &= gaps != 0.0
            self._chunks.append(gaps[keep])
        self._fill = 0
        self._counts = []

    @property
    def num_chunks(self) -> int:
        return len(self._chunks)

    def take(self) -> np.ndarray:
        """Every gap as one contiguous float64 array, handed over (the pool keeps none): built
        chunk by chunk, each chunk dropped once copied, so the peak is one array."""
        self._flush()
        self._buf = None
        chunks = self._chunks
        out = np.empty(sum(c.size for c in chunks), dtype=np.float64)
        i = 0
        while chunks:
            c = chunks.pop(0)
            out[i : i + c.size] = c
            i += c.size
        return out


@dataclass(slots=True)
class FinishedStore:
    """What ``metrics.summary`` needs of every request that left, in the order they left."""

    # How the API server chunked streamed responses: the ITL is the client's gaps between chunks
    # (with an interval, the engine's own gaps are pooled beside them, ``engine_gaps``).
    stream: StreamInterval = field(default_factory=StreamInterval)
    num_requests: int = 0
    num_rejected: int = 0
    num_aborted: int = 0
    num_preemptions: int = 0
    first_arrival: float | None = None  # seconds; min over every request, rejected ones too
    last_finish: float | None = None  # seconds; max finish time
    # Requests that finished normally (the latency statistics), one entry each:
    arrival_time: array = field(default_factory=lambda: array("d"))
    first_token_time: array = field(default_factory=lambda: array("d"))
    last_token_time: array = field(default_factory=lambda: array("d"))
    first_scheduled_time: array = field(default_factory=lambda: array("d"))
    num_output_tokens: array = field(default_factory=lambda: array("q"))
    prompt_len: array = field(default_factory=lambda: array("q"))
    num_cached_tokens: array = field(default_factory=lambda: array("q"))
    gaps: GapPool = field(default_factory=GapPool)
    engine_gaps: GapPool | None = None  # with a stream interval: the engine's own gaps
    # The pooled ITL's statistics (and the engine's, with a stream interval), set by
    # ``metrics.summary`` when it takes the gaps.
    itl_stats: dict[str, float | None] | None = None
    engine_itl_stats: dict[str, float | None] | None = None

    def __post_init__(self) -> None:
        if self.stream.is_set:
            self.engine_gaps = GapPool()

    def add(self, requests: list[Request]) -> None:
        """Take the numbers of requests that left (in the order they left)."""
        for r in requests:
            self.num_requests += 1
            status = r.status
            if status is RequestStatus.FINISHED_REJECTED:
                self.num_rejected += 1
            elif status is RequestStatus.FINISHED_ABORTED:
                self.num_aborted += 1
            self.num_preemptions += r.num_preemptions
            if self.first_arrival is None or r.arrival_time < self.first_arrival:
                self.first_arrival = r.arrival_time
            end = r.finish_time
            if end is not None and (self.last_finish is None or end > self.last_finish):
                self.last_finish = end
            if status not in _DONE:
                continue
            times = r.token_times
            self.arrival_time.append(r.arrival_time)
            self.first_token_time.append(times[0])
            self.last_token_time.append(times[-1])
            self.first_scheduled_time.append(r.first_scheduled_time)
            self.num_output_tokens.append(len(times))
            self.prompt_len.append(r.prompt_len)
            self.num_cached_tokens.append(r.num_cached_tokens)
            if self.engine_gaps is None:
                self.gaps.add(times)
            else:
                self.gaps.add(self.stream.chunk_times(times))
                self.engine_gaps.add(times)

    def take_itl(self) -> np.ndarray:
        """Every client-observed inter-token gap, pooled in request order (``GapPool.take``)."""
        return self.gaps.take()

    @property
    def num_finished(self) -> int:
        return len(self.arrival_time)
