"""The closed loop's three workloads, as the requests ``tailserve bench`` sends and the simulator
replays: token-id prompts (exact lengths on every server; the prefix cache sees real sharing)
and a fixed send schedule, from a seed. Sized for the ``tiny`` model (2,048-token context) on a
CPU so one run takes ~10-30 s.

- **hol**: the essay's head-of-line mix. Short chats arrive as a Poisson stream (prompts 32-256
  tokens, 48 outputs) while a long prompt (1,800 tokens, 8 outputs) arrives every 2 s: each long
  prefill stalls the decodes running beside it unless the budget chunks it.
- **conversation**: the first requests of the Azure LLM inference conversation trace
  (``azure_llm_2023_conv.csv``, beside the clone), at their recorded times, prompt and
  output lengths halved (prompts capped at 1,800 tokens, outputs at 64) so the trace's
  shape fits the tiny model and this CPU.
- **shared-prefix**: 4 system prompts of 512 tokens, each request one of them plus a 32-96-token
  question, 32 outputs, Poisson: what prefix caching saves.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from benchmarks._common import check_trace, default_trace
from tailserve.bench.datasets import BenchRequest
from tailserve.workloads.traces import load_trace

CONVERSATION_TRACE = "azure_llm_2023_conv.csv"
LONG_PROMPT = 1800
LENGTH_DIVISOR = 2
TRACE_SLOWDOWN = 1.0


@dataclass(frozen=True, slots=True)
class Workload:
    name: str
    requests: list[BenchRequest]
    times: np.ndarray  # send times, seconds from the start
    note: str

    @property
    def summary(self) -> dict:
        prompts = [r.prompt_len for r in self.requests]
        return {
            "name": self.name,
            "note": self.note,
            "requests": len(self.requests),
            "span_s": float(self.times[-1]) if len(self.times) else 0.0,
            "prompt_tokens": int(sum(prompts)),
            "output_tokens": int(sum(r.output_len for r in self.requests)),
        }


def _ids(rng: np.random.Generator, n: int, vocab: int) -> list[int]:
    return rng.integers(10, vocab, size=n).tolist()


def hol(vocab: int, seed: int, quick: bool) -> Workload:
    rng = np.random.default_rng([seed, 1])
    span = 4.0 if quick else 9.0
    rate = 3.0
    times, t = [], 0.0
    while (t := t + rng.exponential(1 / rate)) < span:
        times.append(t)
    shorts = [
        (t, BenchRequest(_ids(rng, int(n), vocab), int(n), 48))
        for t, n in zip(times, rng.integers(32, 257, len(times)))
    ]
    longs = [
        (at, BenchRequest(_ids(rng, LONG_PROMPT, vocab), LONG_PROMPT, 8)) for at in np.arange(1.0, span, 2.0)
    ]
    both = sorted([*shorts, *longs], key=lambda x: x[0])
    return Workload(
        "hol",
        [r for _, r in both],
        np.array([t for t, _ in both]),
        f"short chats (32-256-token prompts, 48 outputs) Poisson at {rate:g}/s for {span:g} s, a "
        f"{LONG_PROMPT}-token prompt (8 outputs) every 2 s from t=1 s",
    )


def conversation(vocab: int, seed: int, quick: bool, trace: Path | None = None) -> Workload:
    path = trace or default_trace(CONVERSATION_TRACE)
    if (missing := check_trace(path)) is not None:
        raise SystemExit(f"closed_loop: {missing}")
    count = 16 if quick else 40
    rows = load_trace(path, max_requests=count)
    rng = np.random.default_rng([seed, 2])
    requests, times = [], []
    for r in rows:
        prompt = min(math.ceil(r.prompt_len / LENGTH_DIVISOR), LONG_PROMPT)
        output = max(1, min(math.ceil(r.max_tokens / LENGTH_DIVISOR), 64))
        requests.append(BenchRequest(_ids(rng, prompt, vocab), prompt, output))
        times.append((r.arrival_time - rows[0].arrival_time) * TRACE_SLOWDOWN)
    return Workload(
        "conversation",
        requests,
        np.array(times),
        f"the first {count} requests of {path.name} at their times x{TRACE_SLOWDOWN:g}, lengths / "
        f"{LENGTH_DIVISOR} (prompts <= {LONG_PROMPT}, outputs <= 64)",
    )


def shared_prefix(vocab: int, seed: int, quick: bool) -> Workload:
    rng = np.random.default_rng([seed, 3])
    count, rate = (16, 3.0) if quick else (36, 3.0)
    prefixes = [_ids(rng, 512, vocab) for _ in range(4)]
    requests = []
    for _ in range(count):
        prefix = prefixes[int(rng.integers(0, 4))]
        suffix = _ids(rng, int(rng.integers(32, 97)), vocab)
        requests.append(BenchRequest(prefix + suffix, len(prefix) + len(suffix), 32))
    times = np.cumsum(rng.exponential(1 / rate, count))
    return Workload(
        "shared-prefix",
        requests,
        times - times[0],
        f"{count} requests Poisson at {rate:g}/s, each one of 4 512-token system prompts + a 32-96-token "
        "question, 32 outputs",
    )


def build(names: list[str], vocab: int, seed: int, quick: bool, trace: Path | None = None) -> list[Workload]:
    makers = {
        "hol": lambda: hol(vocab, seed, quick),
        "conversation": lambda: conversation(vocab, seed, quick, trace),
        "shared-prefix": lambda: shared_prefix(vocab, seed, quick),
    }
    unknown = [n for n in names if n not in makers]
    if unknown:
        raise SystemExit(f"closed_loop: unknown workload(s) {unknown}; known: {', '.join(makers)}")
    return [makers[n]() for n in names]
