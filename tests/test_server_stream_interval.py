"""``tailserve serve --policy P:stream_interval=N``: the SSE stream sends chunks by the engine's rule
(``core/stream_interval.py``), and a request's own ``stream_interval`` changes it as that engine
does. The sim executor samples one token per step, so the split below follows from the rule:
vLLM and SGLang send the first token, then a chunk once N tokens are unsent, then the rest at
finish; TensorRT-LLM sends on the first iteration, every N-th and the last."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from server_helpers import MICRO, NAME, assert_openai_error, running_server, wait_idle
from tailserve.executors.pytorch.init_model import init_model

TOKENS = 10


@pytest.fixture(scope="module")
def micro_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model(tmp_path_factory.mktemp("models") / "micro", preset="tiny", dtype="float32", **MICRO)


@pytest.fixture(scope="module")
def default_server(micro_model: Path) -> Iterator[Any]:
    with running_server(micro_model, "sim") as running:
        yield running


def _server(micro_model: Path, policy: str) -> Any:
    return running_server(micro_model, "sim", policy=policy, policy_flags={"stream_interval": "4"})


@pytest.fixture(scope="module")
def vllm_4(micro_model: Path) -> Iterator[Any]:
    with _server(micro_model, "vllm") as running:
        yield running


@pytest.fixture(scope="module")
def sglang_4(micro_model: Path) -> Iterator[Any]:
    with _server(micro_model, "sglang") as running:
        yield running


@pytest.fixture(scope="module")
def trtllm_4(micro_model: Path) -> Iterator[Any]:
    with _server(micro_model, "trtllm") as running:
        yield running


def stream(running: Any, path: str = "/v1/completions", **fields: Any) -> list[dict[str, Any]]:
    """The events of one streamed request of ``TOKENS`` tokens, each with its running usage."""
    body = {
        "model": NAME,
        "max_tokens": TOKENS,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        **fields,
    }
    if path == "/v1/completions":
        body.setdefault("prompt", [5, 6, 7, 8])
    else:
        body.setdefault("messages", [{"role": "user", "content": "hi"}])
    with httpx.stream("POST", f"{running.base_url}{path}", json=body, timeout=60) as response:
        assert response.status_code == 200
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    wait_idle(running)
    return [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]


def split(events: list[dict[str, Any]]) -> list[int]:
    """Tokens per event that carries choices, from the running usage's completion tokens."""
    counts = [e["usage"]["completion_tokens"] for e in events if e["choices"]]
    return [b - a for a, b in zip([0, *counts], counts, strict=False)]


def text_of(events: list[dict[str, Any]]) -> str:
    choices = [e["choices"][0] for e in events if e["choices"]]
    return "".join(c["text"] if "text" in c else c["delta"].get("content", "") for c in choices)


def test_default_interval_sends_one_event_per_token_unless_the_request_asks(default_server: Any) -> None:
    assert split(stream(default_server)) == [1] * TOKENS
    # vLLM raises the server's interval (1) to the request's.
    assert split(stream(default_server, stream_interval=4)) == [1, 4, 4, 1]


def test_vllm_interval_4_sends_1_4_4_1_tokens_then_usage(vllm_4: Any) -> None:
    for path in ("/v1/completions", "/v1/chat/completions"):
        events = stream(vllm_4, path)
        token_events = [e for e in events if e["choices"]]
        assert split(events) == [1, 4, 4, 1]
        reasons = [e["choices"][0]["finish_reason"] for e in token_events]
        assert reasons == [None, None, None, "length"]
        assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == TOKENS
        assert len(events) == len(token_events) + 1
    deltas = [e["choices"][0]["delta"] for e in token_events]  # the chat stream's
    assert deltas[0]["role"] == "assistant" and all("role" not in d for d in deltas[1:])
    assert all(d["content"] for d in deltas)


def test_chunked_text_is_the_unchunked_text(micro_model: Path) -> None:
    # The sim executor's tokens come from a seeded generator: each fresh server's first request
    # samples the same tokens, so the two streams must spell the same text.
    texts = {}
    for flags in ({}, {"stream_interval": "4"}):
        with running_server(micro_model, "sim", policy_flags=flags) as running:
            events = stream(running)
        texts[bool(flags)] = (text_of(events), len(split(events)))
    (plain, plain_events), (chunked, chunked_events) = texts[False], texts[True]
    assert plain and chunked == plain
    assert (plain_events, chunked_events) == (TOKENS, 4)


def test_request_interval_raises_vllm_replaces_sglang_and_is_ignored_by_trtllm(
    vllm_4: Any, sglang_4: Any, trtllm_4: Any
) -> None:
    # vLLM: max(request, server); 6 -> first token, then 6 unsent, then the last 3.
    assert split(stream(vllm_4, stream_interval=2)) == [1, 4, 4, 1]
    assert split(stream(vllm_4, stream_interval=6)) == [1, 6, 3]
    # SGLang: the request's own.
    assert split(stream(sglang_4)) == [1, 4, 4, 1]
    assert split(stream(sglang_4, stream_interval=2)) == [1, 2, 2, 2, 2, 1]
    assert split(stream(sglang_4, "/v1/chat/completions", stream_interval=6)) == [1, 6, 3]
    # TensorRT-LLM counts iterations (the 1st, 4th, 8th and the last) and takes no request value.
    assert split(stream(trtllm_4)) == [1, 3, 4, 2]
    assert split(stream(trtllm_4, stream_interval=2)) == [1, 3, 4, 2]


@pytest.mark.parametrize("value", [0, -3, "x", "4", 2.5, True])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_bad_stream_interval_is_a_400_naming_it(default_server: Any, path: str, value: Any) -> None:
    body = {"model": NAME, "max_tokens": 2, "stream": True, "stream_interval": value}
    body.update(
        {"prompt": "x"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "x"}]}
    )
    error = assert_openai_error(httpx.post(f"{default_server.base_url}{path}", json=body), 400)
    assert error["param"] == "stream_interval"
    assert error["message"].startswith("stream_interval: ")


def test_plain_request_checks_stream_interval_and_otherwise_ignores_it(vllm_4: Any) -> None:
    body = {"model": NAME, "prompt": "x", "max_tokens": 5, "ignore_eos": True}
    refused = httpx.post(f"{vllm_4.base_url}/v1/completions", json={**body, "stream_interval": 0})
    assert assert_openai_error(refused, 400)["param"] == "stream_interval"
    done = httpx.post(f"{vllm_4.base_url}/v1/completions", json={**body, "stream_interval": 3}, timeout=60)
    assert done.status_code == 200
    choice = done.json()["choices"][0]
    assert choice["finish_reason"] == "length" and choice["text"]
    assert done.json()["usage"]["completion_tokens"] == 5
    wait_idle(vllm_4)


def test_abort_ends_a_chunked_stream_at_once(micro_model: Path) -> None:
    # A request holding back all but its first token: at shutdown its stream is the error event
    # and [DONE], with nothing of the held-back text.
    with running_server(micro_model, "sim", drain_timeout=0.2) as running:
        body = {"model": NAME, "prompt": "x", "max_tokens": 5000, "ignore_eos": True, "stream": True}
        body["stream_interval"] = 4000
        with httpx.stream("POST", f"{running.base_url}/v1/completions", json=body, timeout=60) as response:
            lines = response.iter_lines()
            first = json.loads(next(lines).removeprefix("data: "))
            running.server.should_exit = True  # what SIGINT does
            rest = [line for line in lines if line]
    assert first["choices"][0]["text"] and first["choices"][0]["finish_reason"] is None
    assert rest[-1] == "data: [DONE]" and len(rest) == 2
    error = json.loads(rest[0].removeprefix("data: "))["error"]
    assert error["message"] == "request aborted: server shutting down" and error["code"] == 503
