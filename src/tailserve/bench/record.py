"""``tailserve bench --record-trace FILE``: the run as a recorded trace (``workloads/recorded.py``).

Each request's line: its send time (seconds after the run's first send), the prompt's length
(``usage.prompt_tokens`` where the server sent it) and token ids (the benchmark's prompts are
token ids but for ShareGPT's text), the tokens generated as ``max_tokens`` (a replay generates
what was generated), and TTFT, each inter-token gap and the latency as the client timed them.
"""

from __future__ import annotations

from collections.abc import Sequence
from os import PathLike

from tailserve.bench.client import RequestResult
from tailserve.bench.datasets import BenchRequest
from tailserve.workloads.recorded import Measured, trace_line, write_trace


def record_trace(
    path: str | PathLike[str], requests: Sequence[BenchRequest], results: Sequence[RequestResult]
) -> None:
    t0 = min((r.start_time for r in results if r.start_time), default=0.0)
    lines = []
    for request, result in zip(requests, results):
        if result.success:
            measured = Measured(result.ttft, list(result.itl), result.output_tokens, result.latency)
        else:
            measured = Measured(error=result.error or "failed")
        ids = request.prompt if isinstance(request.prompt, list) else None
        max_tokens = result.output_tokens if result.success and result.output_tokens else request.output_len
        lines.append(trace_line(result.start_time - t0, result.prompt_len, max_tokens, measured, ids))
    write_trace(path, lines)
