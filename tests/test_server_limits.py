"""Legal but huge bodies cannot stall the server, and it accounts for every request (issue 30,
items 5 and 7).

Limits like vLLM's (4 stop strings, their total size, stop token ids, token ids / messages no
more than the context holds) refuse a body before it is built; a big body is parsed off the event
loop in short GIL-holding calls, so ``/health`` and other streams go on; ``/metrics`` counts
requests received and rejected by reason; API keys from the environment lose stray whitespace,
and a blank key variable is said out loud.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from server_helpers import MICRO, assert_openai_error, running_server, wait_idle
from tailserve.cli.listen import api_keys_from_env
from tailserve.executors.pytorch.init_model import init_model
from tailserve.server import request_body
from tailserve.server.protocol import ChatCompletionRequest, CompletionRequest, RequestLimits
from tailserve.server.request_body import BodyParser

MAX_MODEL_LEN = MICRO["max_position_embeddings"]  # 512; a sim server's is its simulated model's
COMPACT = (",", ":")


@pytest.fixture(scope="module")
def micro_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model(tmp_path_factory.mktemp("models") / "micro", preset="tiny", dtype="float32", **MICRO)


@pytest.fixture(scope="module")
def sim_server(micro_model: Path) -> Iterator[Any]:
    with running_server(micro_model, "sim") as running:
        yield running


def _post(base_url: str, body: dict | bytes, path: str = "/v1/completions", **kw: Any) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body, separators=COMPACT).encode()
    headers = {"content-type": "application/json", **kw.pop("headers", {})}
    return httpx.post(f"{base_url}{path}", content=content, headers=headers, timeout=60, **kw)


# ---- limits ---------------------------------------------------------------------------------
def test_stop_strings_are_capped_at_vllms_four(sim_server: Any) -> None:
    url = sim_server.base_url
    ok = _post(url, {"prompt": "hi", "max_tokens": 2, "stop": ["zq1", "zq2", "zq3", "zq4"]})
    assert ok.status_code == 200, ok.text
    error = assert_openai_error(_post(url, {"prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}), 400)
    assert error["param"] == "stop" and "at most 4 stop strings are accepted, got 5" in error["message"]
    error = assert_openai_error(_post(url, {"prompt": "hi", "stop": "x" * 5000}), 400)
    assert "5,000 characters in all; at most 4,096" in error["message"]
    chat = {"messages": [{"role": "user", "content": "hi"}], "stop": [str(i) for i in range(9)]}
    assert assert_openai_error(_post(url, chat, "/v1/chat/completions"), 400)["param"] == "stop"


def test_400000_stop_strings_are_refused_before_they_are_built(sim_server: Any) -> None:
    # The body: 3.9 MB; it used to be served, 64 tokens in 15 s, slowing every stream.
    body = {
        "prompt": "hi",
        "max_tokens": 64,
        "ignore_eos": True,
        "stop": [f"q{i:05d}" for i in range(400_000)],
    }
    started = time.monotonic()
    error = assert_openai_error(_post(sim_server.base_url, body), 400)
    assert error["param"] == "stop" and "at most 4 strings" in error["message"]
    assert time.monotonic() - started < 10


def test_stop_token_ids_are_capped(sim_server: Any) -> None:
    url = sim_server.base_url
    assert _post(url, {"prompt": "hi", "max_tokens": 2, "stop_token_ids": [3] * 1024}).status_code == 200
    error = assert_openai_error(_post(url, {"prompt": "hi", "stop_token_ids": [3] * 1025}), 400)
    assert error["param"] == "stop_token_ids" and "at most 1,024 ids" in error["message"]


@pytest.mark.parametrize("size", [0, 2_000_000])  # 0: just over the context (a small body); the 4 MB
def test_more_prompt_token_ids_than_the_context_are_refused_at_once(sim_server: Any, size: int) -> None:
    context = sim_server.engine.max_model_len  # the simulated model's
    size = size or context + 1
    for prompt in ([5] * size, [[5] * size]):
        error = assert_openai_error(_post(sim_server.base_url, {"prompt": prompt, "max_tokens": 1}), 400)
        assert error["param"] == "prompt"
        assert error["message"] == (
            f"This model's maximum context length is {context} tokens. However, your prompt has {size} "
            "token ids. Please reduce the length of the prompt."
        )


def test_detokenize_and_messages_are_bounded_by_the_context(sim_server: Any) -> None:
    url = sim_server.base_url
    error = assert_openai_error(_post(url, {"tokens": [5] * 2_000_000}, "/detokenize"), 400)
    assert error["param"] == "tokens" and "2,000,000 token ids" in error["message"]
    for count in (sim_server.engine.max_model_len + 1, 140_000):  # just over, then 4 MB of tiny ones
        chat = {"messages": [{"role": "user", "content": ""}] * count}
        error = assert_openai_error(_post(url, chat, "/v1/chat/completions"), 400)
        assert error["param"] == "messages" and f"hold {count} messages and content parts" in error["message"]
    junk = b'{"messages":[' + b",".join([b"{}"] * 1_000_000) + b',{"role":"user"}]}'
    error = assert_openai_error(_post(url, junk, "/v1/chat/completions"), 400)
    assert "missing required field `role` (messages.0)" in error["message"]


def test_big_bodies_within_the_limits_are_served_as_small_ones(sim_server: Any) -> None:
    url = sim_server.base_url
    pad = {"unread": [1] * 100_000}  # an unknown field (ignored) makes the body big
    body = {"prompt": [5] * 100, "max_tokens": 3, "stop": ["zq"], "stop_token_ids": [3, 4]}
    assert len(json.dumps({**body, **pad})) > request_body.INLINE_BODY_BYTES
    reply = _post(url, {**body, **pad})
    counts = ("prompt_tokens", "completion_tokens")
    assert reply.status_code == 200, reply.text
    assert [reply.json()["usage"][k] for k in counts] == [_post(url, body).json()["usage"][k] for k in counts]
    messages = [{"role": "user", "content": [{"type": "text", "text": "hi "}]}] * 300  # one by one
    chat = {"messages": messages, "max_tokens": 2, **pad}
    reply = _post(url, chat, "/v1/chat/completions")
    assert reply.status_code == 200, reply.text
    small = _post(url, {"messages": messages, "max_tokens": 2}, "/v1/chat/completions")
    assert reply.json()["usage"]["prompt_tokens"] == small.json()["usage"]["prompt_tokens"]
    # Errors read the same as for a small body.
    bad = [*messages[:299], {"role": "robot", "content": "hi"}]
    error = assert_openai_error(_post(url, {"messages": bad, **pad}, "/v1/chat/completions"), 400)
    assert error["message"].startswith("messages.299.role: Input should be")
    error = assert_openai_error(_post(url, {"prompt": "hi", "temperature": -1, **pad}), 400)
    assert error["param"] == "temperature"
    error = assert_openai_error(_post(url, b'{"prompt": "hi", "unread": [' + b"1," * 40_000 + b"]"), 400)
    assert "not valid JSON" in error["message"]


def test_stop_string_limit_follows_the_environment() -> None:
    assert RequestLimits.for_model(512, {}).max_stop_strings == 4
    assert RequestLimits.for_model(512, {"VLLM_MAX_STOP_STRINGS": "8"}).max_stop_strings == 8
    env = {"TAILSERVE_MAX_STOP_STRINGS": "16", "VLLM_MAX_STOP_STRINGS": "8"}
    assert RequestLimits.for_model(512, env).max_stop_strings == 16
    with pytest.raises(ValueError, match="TAILSERVE_MAX_STOP_STRINGS must be an integer >= 0, got 'many'"):
        RequestLimits.for_model(512, {"TAILSERVE_MAX_STOP_STRINGS": "many"})


# ---- off the event loop -------------------------------------------------------------------
class _Request:
    """What ``BodyParser.parse`` reads of a Starlette request."""

    def __init__(self, body: bytes) -> None:
        self._body = body
        self.headers = {"content-type": "application/json"}

    async def body(self) -> bytes:
        return self._body


def test_big_bodies_never_hold_the_event_loop() -> None:
    """While 8 bodies of 2M token ids (the issue: /health 4.2 s) and 8 of 140,000 messages are
    parsed, each is refused and the event loop keeps turning (the parse runs off the loop). How
    long its gaps are is a speed figure: ``python -m benchmarks.server_stress --checks huge`` measures it."""
    parser = BodyParser(RequestLimits(max_items=MAX_MODEL_LEN))
    ids = json.dumps({"prompt": [5] * 2_000_000}, separators=COMPACT).encode()
    chat = json.dumps({"messages": [{"role": "user", "content": ""}] * 140_000}, separators=COMPACT).encode()

    async def run() -> tuple[float, list[Any]]:
        gaps: list[float] = []
        done = asyncio.Event()

        async def ticker() -> None:
            last = time.perf_counter()
            while not done.is_set():
                await asyncio.sleep(0.001)
                now = time.perf_counter()
                gaps.append(now - last)
                last = now

        tick = asyncio.create_task(ticker())
        await asyncio.sleep(0.01)
        jobs = [parser.parse(_Request(ids), CompletionRequest) for _ in range(8)]
        jobs += [parser.parse(_Request(chat), ChatCompletionRequest) for _ in range(8)]
        results = await asyncio.gather(*jobs, return_exceptions=True)
        done.set()
        await tick
        return len(gaps), results

    ticks, results = asyncio.run(run())
    assert all(type(r).__name__ == "ApiError" for r in results), results
    assert ticks > 16  # the loop ran between (and during) the 16 parses


def test_a_big_body_is_parsed_on_a_worker_thread(sim_server: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    threads: list[str] = []
    original = BodyParser.parse_big

    def recording(self: BodyParser, raw: bytes, model: Any) -> Any:
        threads.append(threading.current_thread().name)
        return original(self, raw, model)

    monkeypatch.setattr(BodyParser, "parse_big", recording)
    body = {"prompt": "hi", "max_tokens": 1, "unread": "x" * 100_000}
    assert _post(sim_server.base_url, body).status_code == 200
    assert threads and threads[0] != "tailserve-http"  # not the server's event-loop thread


# ---- accounting on /metrics ---------------------------------------------------------------
def _counters(base_url: str) -> dict[str, float]:
    text = httpx.get(f"{base_url}/metrics").text
    found = {}
    for line in text.splitlines():
        m = re.match(r"^(tailserve_requests_\w+_total|vllm:request_success_total)\{(.*)\} (\S+)$", line)
        if m:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2)))
            key = m.group(1) + "".join(f":{labels[k]}" for k in ("reason", "finished_reason") if k in labels)
            found[key] = float(m.group(3))
    return found


def test_metrics_account_for_every_request(micro_model: Path) -> None:
    options = {"api_keys": ["k"], "max_request_bytes": 10_000}
    with running_server(micro_model, "sim", app_options=options) as running:
        url, auth = running.base_url, {"Authorization": "Bearer k"}
        zero = _counters(url)
        reasons = ["invalid", "unauthorized", "too_large", "overloaded", "queue_full", "shutting_down"]
        assert all(zero[f"tailserve_requests_rejected_total:{r}"] == 0 for r in reasons)
        assert zero["vllm:request_success_total:error"] == 0
        sent = [
            _post(url, {"prompt": "hi", "max_tokens": 2}, headers=auth),  # finished: length
            _post(url, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}, "/v1/chat/completions", headers=auth),
            _post(url, {"prompt": "hi", "top_p": 0}, headers=auth),  # invalid
            _post(url, {"prompt": "hi", "stop": list("abcde")}, headers=auth),  # invalid: a limit
            _post(url, {"prompt": [5] * 1000, "max_tokens": 8000}, headers=auth),  # invalid: the engine's check
            _post(url, b"{", headers=auth),  # invalid JSON
            _post(url, {"prompt": "hi"}),  # unauthorized
            _post(url, {"prompt": "x" * 20_000}, headers=auth),  # too large
            httpx.get(f"{url}/v1/models", headers=auth),  # not a generation request: not counted
        ]  # fmt: skip
        assert [r.status_code for r in sent] == [200, 200, 400, 400, 400, 400, 401, 413, 200]
        wait_idle(running)
        after = _counters(url)
        grew = {k: v - zero.get(k, 0) for k, v in after.items() if v != zero.get(k, 0)}
        assert grew == {
            "tailserve_requests_received_total": 8,
            "vllm:request_success_total:length": 2,
            "tailserve_requests_rejected_total:invalid": 4,
            "tailserve_requests_rejected_total:unauthorized": 1,
            "tailserve_requests_rejected_total:too_large": 1,
        }
        finished = sum(v for k, v in after.items() if k.startswith("vllm:request_success_total"))
        rejected = sum(v for k, v in after.items() if k.startswith("tailserve_requests_rejected_total"))
        assert after["tailserve_requests_received_total"] == finished + rejected


def test_a_failed_step_counts_as_finished_with_error(micro_model: Path) -> None:
    class FaultOnce:
        def __init__(self, inner: Any) -> None:
            self.inner, self.calls = inner, 0

        def execute(self, out: Any) -> Any:
            self.calls += 1
            if self.calls == 2:
                raise RuntimeError("injected executor fault")
            return self.inner.execute(out)

    with running_server(micro_model, "sim") as running:
        running.engine.stop_checker.inner = FaultOnce(running.engine.stop_checker.inner)
        reply = _post(running.base_url, {"prompt": [5, 6], "max_tokens": 20, "ignore_eos": True})
        assert_openai_error(reply, 500)
        wait_idle(running)
        counters = _counters(running.base_url)
        assert counters["vllm:request_success_total:error"] == 1
        assert counters["tailserve_requests_received_total"] == 1
        assert sum(v for k, v in counters.items() if k.startswith("tailserve_requests_rejected")) == 0


# ---- API keys from the environment --------------------------------------------------------
def test_api_key_variables_lose_surrounding_whitespace(micro_model: Path) -> None:
    assert api_keys_from_env(None, {"TAILSERVE_API_KEY": "s3cret\n"}) == ["s3cret"]
    assert api_keys_from_env(None, {"VLLM_API_KEY": "  s3cret\r\n"}) == ["s3cret"]
    assert api_keys_from_env([" a ", "b\n"], {}) == ["a", "b"]
    keys = api_keys_from_env(None, {"TAILSERVE_API_KEY": "s3cret\n"})  # `echo s3cret > key` in a secret
    with running_server(micro_model, "sim", app_options={"api_keys": keys}) as running:
        auth = {"Authorization": "Bearer s3cret"}
        assert _post(running.base_url, {"prompt": "hi", "max_tokens": 1}, headers=auth).status_code == 200


def test_a_blank_key_variable_is_said_on_stderr(capsys: pytest.CaptureFixture[str]) -> None:
    assert api_keys_from_env(None, {"TAILSERVE_API_KEY": ""}) == []
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "TAILSERVE_API_KEY is set but empty: no API key" in err
    assert api_keys_from_env(None, {"TAILSERVE_API_KEY": " \n", "VLLM_API_KEY": ""}) == []
    assert "TAILSERVE_API_KEY and VLLM_API_KEY are set but empty" in capsys.readouterr().err
    assert api_keys_from_env(None, {"TAILSERVE_API_KEY": "", "VLLM_API_KEY": "v"}) == ["v"]
    assert api_keys_from_env(None, {}) == []
    assert capsys.readouterr().err == ""  # a key found, or no variable at all: nothing to say
    with pytest.raises(ValueError, match="--api-key must not be empty"):
        api_keys_from_env([" "], {})
