"""The token-id workloads, arrival-timed runs and their metrics, the same for every engine
(standard library only: the vLLM driver imports this from vLLM's venv).

``drive`` submits each request at its arrival time to an engine with a step loop (tailserve's and
vLLM's ``LLMEngine``: ``add_request`` / ``step`` / ``has_unfinished_requests``) and stamps, on
one clock, when the driver first sees a token of each request and when it finishes. Both engines
are observed the same way — the time a ``step`` returns — so their TTFTs compare; they are
measured from the scheduled arrival, so time a request spent waiting for a busy ``step`` to
return before it could even be submitted counts against the engine, as it would for a client.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

# One step's news about a request: (request id, output tokens so far, finished).
StepNews = tuple[str, int, bool]
BOS_ID = 1
P_PROMPT_LEN = (32, 512)  # tokens, uniform, inclusive
P_OUTPUT_LEN = (16, 128)
P_LEN_SEED, P_ARRIVAL_SEED = 2024, 2025


@dataclass(frozen=True, slots=True)
class TimedRequest:
    request_id: str
    arrival_s: float  # seconds after the run starts
    prompt_token_ids: list[int]
    max_tokens: int

    @staticmethod
    def from_json(item: dict[str, Any]) -> TimedRequest:
        return TimedRequest(
            item["request_id"], item["arrival_s"], item["prompt_token_ids"], item["max_tokens"]
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "request_id": self.request_id,
            "arrival_s": self.arrival_s,
            "prompt_token_ids": self.prompt_token_ids,
            "max_tokens": self.max_tokens,
        }


@dataclass(slots=True)
class RequestTiming:
    request_id: str
    arrival_s: float
    first_token_s: float | None = None
    finish_s: float | None = None
    num_output_tokens: int = 0

    def to_json(self) -> dict[str, Any]:
        return {
            "request_id": self.request_id,
            "arrival_s": self.arrival_s,
            "first_token_s": self.first_token_s,
            "finish_s": self.finish_s,
            "num_output_tokens": self.num_output_tokens,
        }


def drive(
    requests: list[TimedRequest],
    add: Callable[[TimedRequest], None],
    step: Callable[[], Iterable[StepNews]],
    has_unfinished: Callable[[], bool],
) -> list[RequestTiming]:
    """Submit ``requests`` (sorted by arrival) on time and step the engine until all finish."""
    timings = {r.request_id: RequestTiming(r.request_id, r.arrival_s) for r in requests}
    t0 = time.perf_counter()
    i = 0
    while i < len(requests) or has_unfinished():
        now = time.perf_counter() - t0
        while i < len(requests) and requests[i].arrival_s <= now:
            add(requests[i])
            i += 1
        if has_unfinished():
            news = list(step())
            t = time.perf_counter() - t0
            for request_id, num_tokens, finished in news:
                timing = timings[request_id]
                if num_tokens and timing.first_token_s is None:
                    timing.first_token_s = t
                if finished:
                    timing.finish_s = t
                    timing.num_output_tokens = num_tokens
        elif i < len(requests):
            time.sleep(max(0.0, requests[i].arrival_s - (time.perf_counter() - t0)))
    return [timings[r.request_id] for r in requests]


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks, as ``numpy.percentile`` (vLLM's benchmark)."""
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(timings: list[RequestTiming]) -> dict[str, Any]:
    """Output tokens/s over the run (first arrival to last finish), TTFT and E2E percentiles."""
    unfinished = [t.request_id for t in timings if t.finish_s is None or t.first_token_s is None]
    if unfinished:
        raise RuntimeError(f"{len(unfinished)} requests never finished: {unfinished[:5]}")
    start = min(t.arrival_s for t in timings)
    duration = max(t.finish_s for t in timings) - start  # type: ignore[type-var]
    ttft = [t.first_token_s - t.arrival_s for t in timings]  # type: ignore[operator]
    e2e = [t.finish_s - t.arrival_s for t in timings]  # type: ignore[operator]
    num_out = sum(t.num_output_tokens for t in timings)
    return {
        "num_requests": len(timings),
        "duration_s": duration,
        "output_tokens": num_out,
        "output_tok_s": num_out / duration,
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p99_s": percentile(ttft, 99),
        "ttft_max_s": max(ttft),
        "e2e_p50_s": percentile(e2e, 50),
        "e2e_p99_s": percentile(e2e, 99),
    }


def median(values: list[float]) -> float:
    return percentile(values, 50)


# ---- workloads (token ids, so no tokenizer matters) --------------------------------------
def random_prompts(num: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """BOS, then ``length - 1`` ids uniform in [3, vocab) (0-2 are unk/bos/eos)."""
    rng = random.Random(seed)
    return [[BOS_ID] + [rng.randrange(3, vocab) for _ in range(length - 1)] for _ in range(num)]


def poisson_requests(num: int, vocab: int) -> list[TimedRequest]:
    """Mixed lengths, Poisson arrivals at 1 request/s (``at_rate`` rescales). Lengths and gaps
    come from their own seeded generators, so every rate sees the same requests in the same
    pattern, stretched."""
    lengths = random.Random(P_LEN_SEED)
    arrivals = random.Random(P_ARRIVAL_SEED)
    requests, t = [], 0.0
    for i in range(num):
        prompt_len = lengths.randint(*P_PROMPT_LEN)
        max_tokens = lengths.randint(*P_OUTPUT_LEN)
        prompt = [BOS_ID] + [lengths.randrange(3, vocab) for _ in range(prompt_len - 1)]
        requests.append(TimedRequest(f"p{i}", t, prompt, max_tokens))
        t += arrivals.expovariate(1.0)
    return requests


def at_rate(requests: list[TimedRequest], rate: float) -> list[TimedRequest]:
    return [
        TimedRequest(r.request_id, r.arrival_s / rate, r.prompt_token_ids, r.max_tokens) for r in requests
    ]
