"""How an engine's API server batches a request's tokens into streamed chunks (``stream_interval``).

The engine's steps do not change; what a streaming client sees does. Each engine sends the first
token at once and the last one at finish, and in between:

- vLLM (``--stream-interval``, ``vllm/v1/engine/output_processor.py:324-345@v0.32.0``) and SGLang
  (``--stream-interval``, ``managers/scheduler_components/output_streamer.py:454-470@0.5.23``)
  count tokens: a chunk leaves once at least N tokens are unsent (a speculative step can carry
  several tokens past a multiple of N, so it is "at least", not "every N-th").
- TensorRT-LLM (``stream_interval`` in the LLM API options, ``PyExecutor._handle_responses``)
  counts iterations: a response on the request's first decoding iteration, on every N-th, and
  on the last.

So TTFT, TPOT and E2E are unchanged, and the client's inter-token latency (``vllm bench serve``
times one gap per chunk) becomes the gap between chunks, about N decode steps: ITL p50 moves
from one step to N, while the engine's own ITL (Prometheus ``inter_token_latency_seconds``,
recorded per step before the output processor holds anything back) stays.

A request may ask for its own interval (vLLM's and SGLang's ``stream_interval`` sampling
parameter): vLLM raises it to the server's ("values below the server setting are clamped up to
it"), SGLang takes the request's; TensorRT-LLM's OpenAI server has no such field.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

UNITS = ("tokens", "iterations")
# What a request's own ``stream_interval`` does to the server's: "max" (vLLM), "replace"
# (SGLang), "ignore" (TensorRT-LLM: the request cannot carry one).
PER_REQUEST = ("max", "replace", "ignore")


@dataclass(frozen=True, slots=True)
class StreamInterval:
    """One engine's streaming rule: a chunk every ``every`` tokens or iterations."""

    every: int = 1
    unit: str = "tokens"
    per_request: str = "max"

    def __post_init__(self) -> None:
        if isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 1:
            raise ValueError(f"stream_interval must be an integer >= 1, got {self.every!r}")
        if self.unit not in UNITS:
            raise ValueError(f"stream interval unit must be one of {UNITS}, got {self.unit!r}")
        if self.per_request not in PER_REQUEST:
            raise ValueError(f"per_request must be one of {PER_REQUEST}, got {self.per_request!r}")

    @property
    def is_set(self) -> bool:
        """Whether chunks hold back tokens at all (1: every step's tokens go out at once)."""
        return self.every > 1

    def for_request(self, asked: int | None) -> StreamInterval:
        """The rule for a request that asked for ``asked`` tokens per chunk (None: the server's)."""
        if asked is None or self.per_request == "ignore":
            return self
        if self.per_request == "max":
            return replace(self, every=max(self.every, asked))
        return replace(self, every=asked)

    def chunk_times(self, token_times: Sequence[float]) -> list[float]:
        """When a streaming client receives each chunk of a request whose tokens came at
        ``token_times`` (tokens of one step share its time: one iteration)."""
        n = len(token_times)
        if not self.is_set:  # every step's tokens at once: each distinct time is a chunk
            return [t for i, t in enumerate(token_times) if i == 0 or t != token_times[i - 1]]
        out: list[float] = []
        chunker = Chunker(self)
        i = 0
        while i < n:
            t = token_times[i]
            j = i + 1
            while j < n and token_times[j] == t:
                j += 1
            if chunker.take(j - i, finished=j == n):
                out.append(t)
            i = j
        return out

    def describe(self) -> str:
        return f"stream_interval={self.every} ({self.unit})"

    def to_json(self) -> dict[str, Any]:
        return {"every": self.every, "unit": self.unit}

    @classmethod
    def from_json(cls, data: dict[str, Any] | None) -> StreamInterval:
        return cls() if not data else cls(int(data["every"]), str(data["unit"]))


class Chunker:
    """One request's stream: told each step's new tokens, says whether a chunk leaves now (the
    server's and the simulator's one rule)."""

    __slots__ = ("rule", "sent_any", "steps", "unsent")

    def __init__(self, rule: StreamInterval) -> None:
        self.rule = rule
        self.unsent = 0  # tokens produced and not yet sent
        self.steps = 0  # steps that produced tokens (TensorRT-LLM's decoding iterations)
        self.sent_any = False

    def take(self, new_tokens: int, *, finished: bool) -> bool:
        """A step produced ``new_tokens`` (0 at an abort or a finish without a token); True when
        the chunk of every unsent token goes out now."""
        if new_tokens:
            self.unsent += new_tokens
            self.steps += 1
        every = self.rule.every
        if finished:
            send = True
        elif not new_tokens:
            send = False
        elif not self.sent_any or every == 1:
            send = True
        elif self.rule.unit == "tokens":
            send = self.unsent >= every
        else:
            send = self.steps % every == 0
        if send:
            self.unsent = 0
            self.sent_any = True
        return send
