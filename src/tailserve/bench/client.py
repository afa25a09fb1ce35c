"""The load generator: send requests on a schedule to an OpenAI-compatible server, time every chunk.

Timing is ``vllm bench serve``'s, client side, with ``time.perf_counter``:

- a request starts just before its POST (after any wait for a ``--max-concurrency`` slot,
  which is recorded apart as ``client_queue_time``);
- TTFT ends at the first SSE event whose ``choices`` list is non-empty, even if its text is
  empty; every later such event appends its gap to ``itl``;
- latency (E2EL) ends at the last such event, not at ``[DONE]``;
- the output token count is ``usage.completion_tokens`` from the final usage event, or — for a
  server that sends none — the generated text re-tokenized, or the number of token events.

The schedule is precomputed (``send_times``): gamma gaps with shape ``burstiness`` and mean
``1/rate``, rescaled so the last send is at exactly N / rate (``tailserve.workloads.arrivals``,
vLLM's ``get_request``), all at t = 0 for an infinite rate, or a trace's own timestamps.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import numpy as np

from tailserve.bench.datasets import BenchRequest
from tailserve.bench.tokenizer import BenchTokenizer
from tailserve.workloads.arrivals import gamma_arrivals


@dataclass(slots=True)
class RequestResult:
    prompt_len: int  # tokens, as the dataset built it (or usage.prompt_tokens)
    success: bool = False
    output_tokens: int = 0
    ttft: float = 0.0  # seconds
    itl: list[float] = field(default_factory=list)  # seconds
    latency: float = 0.0  # seconds, send -> last token event
    start_time: float = 0.0  # perf_counter at send
    client_queue_time: float = 0.0  # seconds waited for a --max-concurrency slot
    generated_text: str = ""
    error: str = ""


@dataclass(frozen=True, slots=True)
class BenchConfig:
    api_url: str  # full URL of the endpoint, e.g. http://127.0.0.1:8000/v1/completions
    model: str
    chat: bool = False  # /v1/chat/completions: prompts are sent as one user message
    ignore_eos: bool = True
    extra_body: dict[str, Any] = field(default_factory=dict)  # temperature, top_p, ...
    max_concurrency: int | None = None
    timeout_s: float = 6 * 3600.0  # per request, as vLLM's client


def send_times(requests: list[BenchRequest], request_rate: float, burstiness: float, seed: int) -> np.ndarray:
    """Seconds after the start at which each request is sent."""
    if all(r.arrival_time is not None for r in requests) and math.isinf(request_rate):
        return np.asarray([r.arrival_time for r in requests], dtype=np.float64)
    return gamma_arrivals(len(requests), request_rate, burstiness, np.random.default_rng(seed))


def _payload(request: BenchRequest, config: BenchConfig, tokenizer: BenchTokenizer | None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": config.model,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if config.chat:
        prompt = request.prompt
        if not isinstance(prompt, str):
            if tokenizer is None:
                raise ValueError("chat needs text prompts; pass --tokenizer to decode token-id prompts")
            prompt = tokenizer.decode(prompt)
        body["messages"] = [{"role": "user", "content": prompt}]
        body["max_completion_tokens"] = request.output_len
    else:
        body["prompt"] = request.prompt
        body["max_tokens"] = request.output_len
    if config.ignore_eos:
        body["ignore_eos"] = True
    body.update(config.extra_body)
    return body


async def send_request(
    session: aiohttp.ClientSession,
    request: BenchRequest,
    config: BenchConfig,
    tokenizer: BenchTokenizer | None = None,
) -> RequestResult:
    """One streamed request, timed as the module docstring says; never raises for server errors."""
    result = RequestResult(prompt_len=request.prompt_len)
    payload = _payload(request, config, tokenizer)
    text_parts: list[str] = []
    num_events = 0
    start = time.perf_counter()
    result.start_time = start
    last = start
    try:
        async with session.post(config.api_url, json=payload) as response:
            if response.status != 200:
                body = await response.text()
                result.error = f"HTTP {response.status} {response.reason}: {body[:300]}"
                return result
            buffer = b""
            async for data in response.content.iter_any():
                buffer += data
                *events, buffer = buffer.split(b"\n\n")
                for event in events:
                    for line in event.decode("utf-8").splitlines():
                        if not line.startswith("data:"):
                            continue  # ":" comments, pings, event names
                        chunk = line[5:].strip()
                        if chunk == "[DONE]":
                            continue
                        obj = json.loads(chunk)
                        if "error" in obj:
                            result.error = str(obj["error"].get("message", obj["error"]))
                            continue
                        if obj.get("choices"):
                            now = time.perf_counter()
                            if num_events == 0:
                                result.ttft = now - start
                            else:
                                result.itl.append(now - last)
                            last = now
                            num_events += 1
                            choice = obj["choices"][0]
                            delta = choice.get("delta") if config.chat else None
                            piece = (delta or {}).get("content") if config.chat else choice.get("text")
                            text_parts.append(piece or "")
                        elif obj.get("usage"):
                            result.output_tokens = int(obj["usage"].get("completion_tokens") or 0)
                            result.prompt_len = int(obj["usage"].get("prompt_tokens") or result.prompt_len)
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError, UnicodeDecodeError) as error:
        result.error = f"{type(error).__name__}: {error}"
    result.generated_text = "".join(text_parts)
    result.latency = last - start
    if num_events and not result.error:
        result.success = True
        if not result.output_tokens:
            result.output_tokens = (
                len(tokenizer.encode(result.generated_text)) if tokenizer is not None else num_events
            )
    elif not result.error:
        result.error = "Never received a valid chunk to calculate TTFT."
    return result


async def run_benchmark(
    requests: list[BenchRequest],
    times: np.ndarray,
    config: BenchConfig,
    tokenizer: BenchTokenizer | None = None,
    on_done: Callable[[RequestResult], None] | None = None,
) -> tuple[list[RequestResult], float]:
    """Send every request at its time; return the results in request order and the duration
    (seconds from the start until the last response ended)."""
    limit = config.max_concurrency
    connector = aiohttp.TCPConnector(limit=limit or 0, limit_per_host=limit or 0, keepalive_timeout=60)
    timeout = aiohttp.ClientTimeout(total=config.timeout_s)
    semaphore: Any = asyncio.Semaphore(limit) if limit else contextlib.nullcontext()

    async def limited(session: aiohttp.ClientSession, request: BenchRequest) -> RequestResult:
        arrived = time.perf_counter()
        async with semaphore:
            result = await send_request(session, request, config, tokenizer)
        result.client_queue_time = result.start_time - arrived if result.start_time else 0.0
        if on_done is not None:
            on_done(result)
        return result

    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        start = time.perf_counter()
        tasks = []
        for request, at in zip(requests, times):
            delay = start + float(at) - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(limited(session, request)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    return list(results), duration
