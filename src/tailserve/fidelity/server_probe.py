"""Timed requests to a running OpenAI-compatible server: what ``calibrate --from-server`` sends.

- ``served_models`` / ``choose_model``: the server's ``/v1/models``, and the one to probe; every
  way it can go wrong is one line (``ProbeError``): the server unreachable, not OpenAI-compatible,
  or not serving the model asked for (the served models listed).
- ``Prompts``: a fresh prompt of a given length for each probe (random, so nothing of it is in a
  prefix cache). As token ids when the server takes token-id prompts on ``/v1/completions``
  (vLLM, SGLang and tailserve do: then the server computes exactly that many tokens), else as
  text whose length the server reports back in ``usage.prompt_tokens`` (the probe's measured
  length is that count, not the target).
- ``ServerProbe.stream`` / ``streams``: one streamed completion, or several at once, each timed
  at the client as ``vllm bench serve`` times them: TTFT to the first chunk with a choice, then
  the gap before every later one.
- ``ServerProbe.beside``: one request sent while other streams are decoding (each has had a few
  tokens), for a step that mixes a prefill with running decodes; hooks run just before it is
  sent and just after it ends, while the decodes still run.
- ``ServerProbe.histograms``: the server's ``/metrics`` histograms and counters
  (``server_metrics``), or None when it publishes none.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import json
import random
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from tailserve.fidelity.server_metrics import HistogramTotals, parse_histograms


class ProbeError(ValueError):
    """A probe that cannot go on; the message is one line for the user."""


@dataclass(frozen=True, slots=True)
class ServedModel:
    id: str
    root: str | None
    max_model_len: int | None


@dataclass(frozen=True, slots=True)
class StreamTiming:
    """One streamed completion as the client saw it."""

    ttft_s: float  # send -> first chunk with a choice
    gaps_s: tuple[float, ...]  # between consecutive chunks with a choice
    prompt_tokens: int  # usage.prompt_tokens (the prompt's length when the server sent none)
    completion_tokens: int  # usage.completion_tokens (chunks when the server sent none)
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, where sent


@dataclass(frozen=True, slots=True)
class BesideTiming:
    """A request sent beside running decode streams (``ServerProbe.beside``)."""

    probe: StreamTiming
    decodes: tuple[StreamTiming, ...]
    chunks_at_send: tuple[int, ...]  # tokens each decode stream had received when it was sent
    chunks_at_end: tuple[int, ...]  # ... and when it ended (the decodes still running)
    before: Any  # what the ``before`` hook returned
    after: Any  # what the ``after`` hook returned


@functools.cache
def ssl_context() -> ssl.SSLContext:
    """One TLS context for every client a probe opens. httpx builds a new one per client, loading
    the CA bundle (~30 ms of CPU here); a probe opens a client per stream and per metrics scrape,
    and on a small host that CPU lands beside the engine being timed: it made tailserve's adaptive
    thread count drop to one thread before probes (see docs/fidelity.md, "The probe's own CPU")."""
    return httpx.create_ssl_context()


def served_models(base_url: str, headers: dict[str, str], timeout: float = 30.0) -> list[ServedModel]:
    url = f"{base_url}/v1/models"
    try:
        response = httpx.get(url, headers=headers, timeout=timeout, verify=ssl_context())
    except httpx.HTTPError as error:
        raise ProbeError(f"cannot reach the server at {base_url}: {_reason(error)}") from None
    if response.status_code == 401:
        raise ProbeError(f"{url} answered 401 Unauthorized: pass the server's key with --api-key")
    try:
        response.raise_for_status()
        cards = response.json()["data"]
        models = [
            ServedModel(str(c["id"]), c.get("root"), _int_or_none(c.get("max_model_len"))) for c in cards
        ]
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        raise ProbeError(
            f"{base_url} is not an OpenAI-compatible server: GET /v1/models answered "
            f"{response.status_code} without a model list"
        ) from None
    if not models:
        raise ProbeError(f"{url} lists no model")
    return models


def choose_model(models: list[ServedModel], served_name: str | None, model: str) -> ServedModel:
    """``served_name`` when given, else the served model that ``model`` (a directory or a name)
    is: its id or root, the same path, or the same last path component."""
    listed = ", ".join(m.id + (f" ({m.root})" if m.root and m.root != m.id else "") for m in models)
    if served_name is not None:
        for m in models:
            if m.id == served_name:
                return m
        raise ProbeError(f"the server serves {listed}, not {served_name!r}")
    wanted = {model, Path(model).name}
    if Path(model).exists():
        wanted.add(str(Path(model).resolve()))
    found = [
        m
        for m in models
        for name in (m.id, m.root)
        if name and (name in wanted or Path(name).name in wanted or _resolved(name) in wanted)
    ]
    found = list(dict.fromkeys(found))
    if len(found) == 1:
        return found[0]
    raise ProbeError(
        f"--model {model} does not name one model the server serves; it serves {listed} "
        "(pass --served-model NAME to probe one of them)"
    )


def _resolved(name: str) -> str:
    return str(Path(name).resolve()) if Path(name).exists() else name


def _int_or_none(value: object) -> int | None:
    try:
        return int(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None


def _reason(error: Exception) -> str:
    text = str(error) or type(error).__name__
    return text.splitlines()[0]


# Common English words, for servers that take only text prompts: most tokenizers give each one
# token after a space, so a prompt's length in words is close to its length in tokens.
WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "was",
    "that",
    "for",
    "it",
    "with",
    "as",
    "on",
    "be",
    "at",
    "by",
    "this",
    "had",
    "not",
    "are",
    "but",
    "from",
    "or",
    "have",
    "an",
    "they",
    "which",
    "one",
    "you",
    "were",
    "all",
    "her",
    "she",
    "there",
    "would",
    "their",
    "we",
    "him",
    "been",
    "has",
    "when",
    "who",
    "will",
    "no",
    "more",
    "if",
    "out",
    "so",
    "said",
    "what",
    "up",
    "its",
    "about",
    "than",
    "into",
    "them",
    "can",
    "only",
    "other",
    "new",
    "some",
    "could",
    "time",
    "these",
    "two",
    "may",
    "then",
    "do",
    "first",
    "any",
    "my",
    "now",
    "such",
    "like",
    "our",
    "over",
    "man",
    "me",
    "even",
    "most",
    "made",
    "after",
    "also",
    "did",
    "many",
    "before",
    "must",
    "through",
    "back",
    "years",
    "where",
    "much",
    "your",
    "way",
    "well",
    "down",
    "should",
    "because",
    "each",
    "just",
    "those",
    "people",
    "how",
    "too",
    "little",
    "state",
    "good",
    "very",
    "make",
    "world",
    "still",
    "own",
    "see",
    "men",
    "work",
    "long",
    "get",
    "here",
    "between",
    "both",
    "life",
    "being",
    "under",
    "never",
    "day",
    "same",
    "another",
    "know",
    "while",
    "last",
    "might",
    "us",
    "great",
    "old",
    "year",
    "off",
    "come",
    "since",
    "against",
    "go",
    "came",
    "right",
    "used",
    "take",
    "three",
]


class Prompts:
    """Fresh prompts of a target length: token ids in ``[low, high)``, or text of common words.
    ``seed`` None (the default) draws from the system's entropy: a prompt a run before this one
    sent may still sit in the server's prefix cache, and a cached prefill costs next to nothing."""

    def __init__(
        self, token_ids: bool, vocab_size: int, seed: int | None = None, words_per_token: float = 1.0
    ) -> None:
        self.token_ids = token_ids
        self.low = min(10, vocab_size - 1)  # below it: special tokens in most vocabularies
        self.high = vocab_size
        self.words_per_token = words_per_token
        self._rng = random.Random(seed)

    def make(self, num_tokens: int) -> str | list[int]:
        if self.token_ids:
            return [self._rng.randrange(self.low, self.high) for _ in range(num_tokens)]
        num_words = max(1, round(num_tokens * self.words_per_token))
        return " ".join(self._rng.choice(WORDS) for _ in range(num_words))


class ServerProbe:
    """Streamed completions to one model of one server (``ignore_eos``: every probe generates
    exactly ``max_tokens``; temperature 0)."""

    def __init__(self, base_url: str, model: str, headers: dict[str, str], timeout: float = 600.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.headers = headers
        self.timeout = timeout

    def body(self, prompt: str | list[int], max_tokens: int, stream: bool = True) -> dict:
        body = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": stream,
        }
        if stream:
            body["stream_options"] = {"include_usage": True}
        return body

    def accepts_token_ids(self, vocab_size: int) -> bool:
        """Whether ``/v1/completions`` takes a token-id prompt as exactly those tokens."""
        ids = Prompts(True, vocab_size, seed=12345).make(8)
        try:
            response = httpx.post(
                f"{self.base_url}/v1/completions",
                json=self.body(ids, 1, stream=False),
                headers=self.headers,
                timeout=self.timeout,
                verify=ssl_context(),
            )
        except httpx.HTTPError as error:
            raise ProbeError(f"cannot reach the server at {self.base_url}: {_reason(error)}") from None
        if response.status_code != 200:
            return False
        try:
            return int(response.json()["usage"]["prompt_tokens"]) == len(ids)
        except (ValueError, KeyError, TypeError):
            return False

    def stream(self, prompt: str | list[int], max_tokens: int) -> StreamTiming:
        return self.streams([prompt], max_tokens)[0]

    def streams(self, prompts: list[str | list[int]], max_tokens: int) -> list[StreamTiming]:
        """All prompts sent at once, each streamed; their timings in order."""
        return asyncio.run(self._streams(prompts, max_tokens))

    async def _streams(self, prompts: list[str | list[int]], max_tokens: int) -> list[StreamTiming]:
        limits = httpx.Limits(max_connections=len(prompts), max_keepalive_connections=len(prompts))
        async with httpx.AsyncClient(
            timeout=self.timeout, limits=limits, headers=self.headers, verify=ssl_context()
        ) as client:
            return list(await asyncio.gather(*(self._one(client, p, max_tokens) for p in prompts)))

    def beside(
        self,
        decode_prompts: list[str | list[int]],
        decode_tokens: int,
        prompt: str | list[int],
        warm_chunks: int = 4,
        before: Callable[[], Any] | None = None,
        after: Callable[[Any], Any] | None = None,
    ) -> BesideTiming:
        """``prompt`` (one token) sent once every decode stream has received ``warm_chunks``
        tokens; ``before`` runs just before it is sent, ``after`` (given what ``before``
        returned) just after its last byte, while the decodes still run."""
        return asyncio.run(self._beside(decode_prompts, decode_tokens, prompt, warm_chunks, before, after))

    async def _beside(
        self, decode_prompts, decode_tokens, prompt, warm_chunks, before, after
    ) -> BesideTiming:
        n = len(decode_prompts) + 1
        counts = [0] * len(decode_prompts)

        def counter(i: int) -> Callable[[], None]:
            def bump() -> None:
                counts[i] += 1

            return bump

        limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
        async with httpx.AsyncClient(
            timeout=self.timeout, limits=limits, headers=self.headers, verify=ssl_context()
        ) as client:
            tasks = [
                asyncio.create_task(self._one(client, p, decode_tokens, counter(i)))
                for i, p in enumerate(decode_prompts)
            ]
            try:
                while min(counts) < warm_chunks:
                    done = [t for t in tasks if t.done()]
                    if done:
                        done[0].result()  # a stream that failed says why
                        raise ProbeError(
                            f"a decode stream ended after {min(counts)} tokens, before the probe was "
                            f"sent: probe with more --decode-tokens than {decode_tokens}"
                        )
                    await asyncio.sleep(0.002)
                hook_before = await asyncio.to_thread(before) if before else None
                at_send = tuple(counts)
                timing = await self._one(client, prompt, 1)
                hook_after = await asyncio.to_thread(after, hook_before) if after else None
                at_end = tuple(counts)
                decodes = await asyncio.gather(*tasks)
            finally:
                for t in tasks:
                    t.cancel()
        return BesideTiming(timing, tuple(decodes), at_send, at_end, hook_before, hook_after)

    async def _one(
        self,
        client: httpx.AsyncClient,
        prompt: str | list[int],
        max_tokens: int,
        on_chunk: Callable[[], None] | None = None,
    ) -> StreamTiming:
        url = f"{self.base_url}/v1/completions"
        times: list[float] = []
        usage: dict = {}
        start = time.perf_counter()
        try:
            async with client.stream("POST", url, json=self.body(prompt, max_tokens)) as response:
                if response.status_code != 200:
                    text = (await response.aread()).decode("utf-8", "replace")
                    raise ProbeError(f"POST {url} answered {response.status_code}: {_error_message(text)}")
                async for line in response.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        continue
                    chunk = json.loads(data)
                    if "error" in chunk:
                        raise ProbeError(f"POST {url}: the stream failed: {_error_message(data)}")
                    if chunk.get("choices"):
                        times.append(time.perf_counter())
                        if on_chunk is not None:
                            on_chunk()
                    if chunk.get("usage"):
                        usage = chunk["usage"]
        except httpx.HTTPError as error:
            raise ProbeError(f"POST {url} failed: {_reason(error)}") from None
        except json.JSONDecodeError:
            raise ProbeError(f"POST {url}: the stream is not OpenAI's server-sent events") from None
        if not times:
            raise ProbeError(f"POST {url}: the stream ended without a token")
        num_prompt = len(prompt) if isinstance(prompt, list) else 0
        details = usage.get("prompt_tokens_details") or {}
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        return StreamTiming(
            times[0] - start,
            tuple(b - a for a, b in itertools.pairwise(times)),
            int(usage.get("prompt_tokens") or num_prompt),
            int(usage.get("completion_tokens") or len(times)),
            _int_or_none(cached),
        )

    def histograms(self) -> HistogramTotals | None:
        try:
            response = httpx.get(
                f"{self.base_url}/metrics", headers=self.headers, timeout=30.0, verify=ssl_context()
            )
            response.raise_for_status()
            return parse_histograms(response.text)
        except (httpx.HTTPError, ValueError):
            return None


def _error_message(text: str) -> str:
    """An OpenAI error body's message (both shapes), else the body's first 200 characters."""
    try:
        body = json.loads(text)
        error = body.get("error", body)
        return str(error.get("message", error) if isinstance(error, dict) else error)
    except (ValueError, AttributeError):
        return text.strip().splitlines()[0][:200] if text.strip() else "(empty body)"
