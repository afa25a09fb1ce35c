"""``tailserve router --record-trace FILE``: every completion request that passes through, as a
line of a recorded trace (``workloads/recorded.py``) that ``simulate --trace`` replays.

The router sees each request from its arrival to its last byte, as a client would without the
client's own network: arrival when the router received it; TTFT to the first SSE event with a
choice; each gap between such events; the token counts from the final ``usage`` event (``stream_
options.include_usage``, which ``vllm bench`` and ``tailserve bench`` ask for) or, for a plain
request, the body's ``usage``. The prompt's token ids are kept when the client sent token ids
(the replay's prefix cache then sees the traffic's sharing). A request whose prompt length is
known from neither (a text prompt, no usage) cannot be replayed and is not written.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from tailserve.workloads.recorded import Measured, TraceRecorder, trace_line


@dataclass(slots=True)
class RequestWatch:
    """One request's timing as its response passes through."""

    arrival: float  # in the recording's time (``TraceRecorder.arrived``)
    start: float  # the router's clock at arrival
    max_tokens: int
    token_ids: list[int] | None
    events: list[float] = field(default_factory=list)  # clock at each event with a choice
    usage: dict[str, Any] = field(default_factory=dict)
    error: str = ""
    _buffer: bytes = b""

    @classmethod
    def of(cls, body: dict[str, Any], arrival: float, start: float) -> RequestWatch:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], list):
            prompt = prompt[0]
        ids = list(prompt) if isinstance(prompt, list) and all(type(t) is int for t in prompt) else None
        asked = body.get("max_tokens") or body.get("max_completion_tokens") or 0
        return cls(arrival, start, int(asked) if isinstance(asked, int) else 0, ids or None)

    def feed(self, chunk: bytes, now: float) -> None:
        """SSE bytes as they pass; events may span chunks."""
        self._buffer += chunk
        *events, self._buffer = self._buffer.split(b"\n\n")
        for event in events:
            for line in event.decode("utf-8", "replace").splitlines():
                if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                    continue
                try:
                    obj = json.loads(line[5:])
                except ValueError:
                    continue
                if not isinstance(obj, dict):
                    continue
                if "error" in obj:
                    self.error = str((obj["error"] or {}).get("message", obj["error"]))
                if obj.get("choices"):
                    self.events.append(now)
                if isinstance(obj.get("usage"), dict):
                    self.usage = obj["usage"]

    def line(self, status: int, end: float) -> dict[str, Any] | None:
        """The trace line, or None when the prompt's length is unknown."""
        prompt_len = int(self.usage.get("prompt_tokens") or (len(self.token_ids) if self.token_ids else 0))
        if prompt_len < 1:
            return None
        if status >= 400 or self.error:
            measured = Measured(error=self.error or f"HTTP {status}")
        elif self.events:
            gaps = [b - a for a, b in zip(self.events, self.events[1:])]
            tokens = int(self.usage.get("completion_tokens") or len(self.events))
            measured = Measured(self.events[0] - self.start, gaps, tokens, self.events[-1] - self.start)
        else:  # a plain response: its latency and token count only
            tokens = int(self.usage.get("completion_tokens") or 0)
            measured = Measured(None, [], tokens, end - self.start)
        # The replay generates what was generated (a stop string or EOS may have ended it early).
        max_tokens = measured.output_tokens or self.max_tokens
        if max_tokens < 1:
            return None
        return trace_line(self.arrival, prompt_len, max_tokens, measured, self.token_ids)


async def watched(
    chunks: AsyncIterator[bytes],
    watch: RequestWatch,
    recorder: TraceRecorder,
    status: int,
    clock: Callable[[], float],
) -> AsyncIterator[bytes]:
    """``chunks`` passed through unchanged, timed; the line written when the stream ends."""
    try:
        async for chunk in chunks:
            watch.feed(chunk, clock())
            yield chunk
    finally:
        if (line := watch.line(status, clock())) is not None:
            recorder.write(line)


def record_plain(
    watch: RequestWatch, content: bytes, status: int, recorder: TraceRecorder, end: float
) -> None:
    try:
        body = json.loads(content)
        watch.usage = (body.get("usage") or {}) if isinstance(body, dict) else {}
    except ValueError:
        pass
    if (line := watch.line(status, end)) is not None:
        recorder.write(line)
