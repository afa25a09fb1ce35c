"""The server survives its clients (issue 12): every reproduction is a regression test.

Fuzzed bodies get a 400 in OpenAI's shape and the engine keeps serving; an executor fault in one
step answers that step's requests with a 500 and the engine goes on; a scheduler fault answers
every request (also those not yet accepted) and stops the server with exit status 1; API keys,
CORS, the body limit, the header timeout; a huge prompt is tokenized without stalling a stream.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from server_helpers import MICRO, NAME, assert_openai_error, running_server, wait_idle, wait_until
from tailserve.bench.predict import PredictSpec, server_deployment, spec_for_server
from tailserve.cli.listen import api_keys_from_env
from tailserve.executors.pytorch.init_model import init_model


@pytest.fixture(scope="module")
def micro_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model(tmp_path_factory.mktemp("models") / "micro", preset="tiny", dtype="float32", **MICRO)


@pytest.fixture(scope="module")
def torch_server(micro_model: Path) -> Iterator[Any]:
    with running_server(micro_model, "torch") as running:
        yield running


def _post(base_url: str, body: dict | str, path: str = "/v1/completions", **kw: Any) -> httpx.Response:
    content = body if isinstance(body, str) else json.dumps(body)
    headers = {"content-type": "application/json", **kw.pop("headers", {})}
    return httpx.post(f"{base_url}{path}", content=content, headers=headers, timeout=60, **kw)


# ---- validation: the reproductions and more, as raw JSON text ---------------------------
# Raw text, because Python's json (and FastAPI's parser) accept NaN/Infinity literals and numbers
# beyond int64 that a dict could not show.
REFUSED = {
    "seed above uint64": '{"prompt": "hi", "max_tokens": 2, "seed": 18446744073709551616}',
    "seed below int64": '{"prompt": "hi", "max_tokens": 2, "seed": -9223372036854775809}',
    "seed above int64": '{"prompt": "hi", "max_tokens": 2, "seed": 9223372036854775808}',
    "stop token id out of vocabulary": '{"prompt": "hi", "max_tokens": 2, "min_tokens": 1, "stop_token_ids": [1000000]}',
    "negative stop token id": '{"prompt": "hi", "max_tokens": 2, "stop_token_ids": [-1]}',
    "temperature Infinity": '{"prompt": "hi", "max_tokens": 2, "temperature": Infinity}',
    "temperature NaN": '{"prompt": "hi", "max_tokens": 2, "temperature": NaN}',
    "top_p -Infinity": '{"prompt": "hi", "max_tokens": 2, "top_p": -Infinity}',
    "top_p NaN": '{"prompt": "hi", "max_tokens": 2, "top_p": NaN}',
    "top_p zero": '{"prompt": "hi", "top_p": 0}',
    "top_p above 1": '{"prompt": "hi", "top_p": 1.5}',
    "negative temperature": '{"prompt": "hi", "temperature": -0.5}',
    "top_k -2": '{"prompt": "hi", "top_k": -2}',
    "top_k fractional": '{"prompt": "hi", "top_k": 1.5}',
    "min_p above 1": '{"prompt": "hi", "min_p": 1.5}',
    "min_p negative": '{"prompt": "hi", "min_p": -0.1}',
    "min_p NaN": '{"prompt": "hi", "min_p": NaN}',
    "stream as a string": '{"prompt": "hi", "max_tokens": 2, "stream": "yes"}',
    "ignore_eos as a number": '{"prompt": "hi", "ignore_eos": 1}',
    "booleans as token ids": '{"prompt": [true, false]}',
    "a boolean among token ids": '{"prompt": [5, true]}',
    "a float among token ids": '{"prompt": [5, 6.0]}',
    "nested prompt of booleans": '{"prompt": [[true]]}',
    "max_tokens as a string": '{"prompt": "hi", "max_tokens": "5"}',
    "max_tokens fractional": '{"prompt": "hi", "max_tokens": 2.5}',
    "max_tokens boolean": '{"prompt": "hi", "max_tokens": true}',
    "max_tokens zero": '{"prompt": "hi", "max_tokens": 0}',
    "min_tokens negative": '{"prompt": "hi", "min_tokens": -1}',
    "min_tokens above max_tokens": '{"prompt": "hi", "max_tokens": 2, "min_tokens": 3}',
    "min_tokens above the rest of the context": '{"prompt": "hi", "min_tokens": 100000}',
    "n as a boolean": '{"prompt": "hi", "n": true}',
    "best_of 2": '{"prompt": "hi", "best_of": 2}',
    "logit_bias": '{"prompt": "hi", "logit_bias": {"5": 10}}',
    "priority as a string": '{"prompt": "hi", "priority": "high"}',
    "stop of numbers": '{"prompt": "hi", "stop": [1]}',
    "model as a number": '{"prompt": "hi", "model": 5}',
    "prompt an object": '{"prompt": {"text": "hi"}}',
    "prompt null": '{"prompt": null}',
    "lone surrogate in the prompt": '{"prompt": "\\ud800", "max_tokens": 2}',
    "stream_options of the wrong type": '{"prompt": "hi", "stream": true, "stream_options": {"include_usage": "yes"}}',
    "body a string": '"hi"',
    "body null": "null",
}
REFUSED_CHAT = {
    "content a number": {"messages": [{"role": "user", "content": 5}]},
    "role missing": {"messages": [{"content": "hi"}]},
    "temperature a string": {"messages": [{"role": "user", "content": "hi"}], "temperature": "1"},
    "max_completion_tokens zero": {
        "messages": [{"role": "user", "content": "hi"}],
        "max_completion_tokens": 0,
    },
    "seed above int64": {"messages": [{"role": "user", "content": "hi"}], "seed": 2**63},
}
# Valid by vLLM's rules: served, and the engine lives on.
SERVED = {
    "top_p 1e-50 (0 in float32)": '{"prompt": "hi", "max_tokens": 2, "top_p": 1e-50}',
    "top_p 1e-50 with top_k": '{"prompt": "hi", "max_tokens": 2, "top_p": 1e-50, "top_k": 5}',
    "largest int64 seed": '{"prompt": "hi", "max_tokens": 2, "seed": 9223372036854775807}',
    "smallest int64 seed": '{"prompt": "hi", "max_tokens": 2, "seed": -9223372036854775808}',
    "huge temperature": '{"prompt": "hi", "max_tokens": 2, "temperature": 1e308}',
    "temperature just above greedy": '{"prompt": "hi", "max_tokens": 2, "temperature": 1.1e-5}',
    "min_p 1": '{"prompt": "hi", "max_tokens": 2, "min_p": 1.0}',
    "top_k -1 disables": '{"prompt": "hi", "max_tokens": 2, "top_k": -1}',
    "min_tokens with a stop id": '{"prompt": "hi", "max_tokens": 3, "min_tokens": 2, "stop_token_ids": [5]}',
    "integer temperature": '{"prompt": "hi", "max_tokens": 2, "temperature": 1}',
    "token ids": '{"prompt": [5, 6, 7], "max_tokens": 2}',
    "nulls for unset fields": '{"prompt": "hi", "max_tokens": 2, "stream": null, "n": null, "min_tokens": null, '
    '"ignore_eos": null, "priority": null, "seed": null, "stop": null, "echo": null, "temperature": null}',
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_bad_values_are_400_and_the_engine_lives(torch_server: Any, case: str) -> None:
    error = assert_openai_error(_post(torch_server.base_url, REFUSED[case]), 400)
    assert error["type"] == "BadRequestError"
    assert torch_server.async_engine.is_healthy


@pytest.mark.parametrize("case", list(REFUSED_CHAT))
def test_bad_chat_values_are_400(torch_server: Any, case: str) -> None:
    assert_openai_error(_post(torch_server.base_url, REFUSED_CHAT[case], "/v1/chat/completions"), 400)


@pytest.mark.parametrize("case", list(SERVED))
def test_edge_values_are_served_and_the_engine_lives(torch_server: Any, case: str) -> None:
    response = _post(torch_server.base_url, SERVED[case])
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] >= 1
    assert torch_server.async_engine.is_healthy


def test_messages_name_the_parameter_as_vllm(torch_server: Any) -> None:
    error = assert_openai_error(_post(torch_server.base_url, REFUSED["top_p zero"]), 400)
    assert error["message"] == "top_p must be in (0, 1], got 0.0." and error["param"] == "top_p"
    error = assert_openai_error(_post(torch_server.base_url, REFUSED["temperature Infinity"]), 400)
    assert error["message"].startswith("temperature:") and "finite" in error["message"]
    error = assert_openai_error(_post(torch_server.base_url, REFUSED["stop token id out of vocabulary"]), 400)
    assert "1000000 is out of vocabulary" in error["message"]


def test_max_tokens_default_is_the_rest_of_the_context(torch_server: Any) -> None:
    max_len = torch_server.engine.max_model_len
    body = {"prompt": [5, 6, 7], "ignore_eos": True}
    done = _post(torch_server.base_url, body).json()
    assert done["usage"]["completion_tokens"] == max_len - 3
    assert done["choices"][0]["finish_reason"] == "length"
    null = _post(torch_server.base_url, {**body, "max_tokens": None}).json()
    assert null["usage"]["completion_tokens"] == max_len - 3


def test_405_is_a_client_error_and_unknown_routes_404(torch_server: Any) -> None:
    error = assert_openai_error(httpx.get(f"{torch_server.base_url}/v1/completions"), 405)
    assert error["type"] == "MethodNotAllowedError"
    assert_openai_error(httpx.delete(f"{torch_server.base_url}/health"), 405)


# ---- engine faults ------------------------------------------------------------------------------
class FaultOnce:
    """Wraps an executor: its ``at``-th ``execute`` raises once (after scheduling, before update:
    mid-step), or raises every time after ``at`` if ``forever``."""

    def __init__(self, inner: Any, at: int) -> None:
        self.inner = inner
        self.at = at
        self.calls = 0

    def execute(self, out: Any) -> Any:
        self.calls += 1
        if self.calls == self.at:
            raise RuntimeError("injected executor fault")
        return self.inner.execute(out)


def _stream(base_url: str, body: dict) -> list[dict]:
    """Every SSE event of one streamed completion (``[DONE]`` as the string)."""
    with httpx.stream("POST", f"{base_url}/v1/completions", json={**body, "stream": True}, timeout=30) as r:
        assert r.status_code == 200
        return [
            json.loads(line[6:]) if line != "data: [DONE]" else "[DONE]" for line in r.iter_lines() if line
        ]


@pytest.mark.parametrize("executor", ["torch", "sim"])
def test_executor_fault_fails_that_step_and_the_engine_goes_on(
    micro_model: Path, executor: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR, logger="tailserve.server")
    with running_server(micro_model, executor) as running:
        checker = running.engine.stop_checker
        checker.inner = FaultOnce(checker.inner, at=4)  # the 4th step from now raises
        body = {"prompt": [5, 6, 7, 8], "max_tokens": 40, "ignore_eos": True}
        results: list[Any] = [None] * 3
        started = time.monotonic()

        def client(i: int) -> None:
            if i == 2:  # a plain (non-streaming) request
                results[i] = _post(running.base_url, body)
            else:
                results[i] = _stream(running.base_url, body)

        threads = [threading.Thread(target=client, args=(i,)) for i in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        assert time.monotonic() - started < 30 and all(r is not None for r in results)

        failed = 0
        for events in results[:2]:
            assert events[-1] == "[DONE]"
            last = events[-2]
            if "error" in last:
                failed += 1
                assert last["error"]["code"] == 500 and "RuntimeError" in last["error"]["message"]
                assert "injected" not in last["error"]["message"]  # no exception text to clients
        plain = results[2]
        if plain.status_code != 200:
            failed += 1
            error = assert_openai_error(plain, 500)
            assert error["type"] == "InternalServerError" and "RuntimeError" in error["message"]
        assert failed >= 1  # the requests of the failed step
        assert running.async_engine.num_failed_steps == 1
        logged = [r for r in caplog.records if "engine step failed" in r.getMessage()]
        assert logged and logged[0].exc_info is not None  # with its traceback

        # Recovered: consistent, blocks freed, and it serves again.
        wait_idle(running)
        assert running.async_engine.is_healthy
        assert running.engine.stats().kv_cache_usage == 0.0
        running.engine.check_integrity()
        again = _post(running.base_url, {**body, "max_tokens": 3})
        assert again.status_code == 200 and again.json()["usage"]["completion_tokens"] == 3


@pytest.mark.parametrize("executor", ["torch", "sim"])
def test_scheduler_fault_answers_everyone_and_stops_the_server(
    micro_model: Path, executor: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR, logger="tailserve.server")
    with running_server(micro_model, executor) as running:
        scheduler = running.engine.scheduler
        entered, release = threading.Event(), threading.Event()
        real = scheduler.schedule

        def schedule(now: float) -> Any:
            if scheduler.waiting or scheduler.running:
                entered.set()
                release.wait(10)
                raise RuntimeError("injected scheduler fault")
            return real(now)

        scheduler.schedule = schedule
        # Hold the server's own reaction (stop, exit 1) until /health has been read.
        stop_server = running.async_engine.on_fatal
        deaths: list[BaseException] = []
        running.async_engine.on_fatal = deaths.append
        body = {"prompt": [5, 6, 7], "max_tokens": 20, "ignore_eos": True}
        answers: dict[int, Any] = {}

        def client(i: int) -> None:
            answers[i] = _stream(running.base_url, body) if i == 0 else _post(running.base_url, body)

        first = threading.Thread(target=client, args=(0,))
        first.start()
        assert entered.wait(10)
        # These reach the engine's inbox while it is stuck in the failing step: never accepted.
        waiting = [threading.Thread(target=client, args=(i,)) for i in (1, 2, 3)]
        for thread in waiting:
            thread.start()
        wait_until(lambda: running.async_engine._inbox.qsize() == 3, timeout=10)
        release.set()
        for thread in [first, *waiting]:
            thread.join(20)
        assert sorted(answers) == [0, 1, 2, 3]  # no one hangs
        assert answers[0][-1] == "[DONE]" and answers[0][-2]["error"]["code"] == 503
        for i in (1, 2, 3):
            error = assert_openai_error(answers[i], 503)
            assert "engine stopped" in error["message"] and "RuntimeError" in error["message"]
        health = httpx.get(f"{running.base_url}/health")
        assert_openai_error(health, 503)
        assert "RuntimeError" in health.json()["error"]["message"]
        assert len(deaths) == 1
        stop_server(deaths[0])
        assert running.server.exit_code == 1 and running.server.should_exit
        logged = [r for r in caplog.records if "engine thread died" in r.getMessage()]
        assert logged and logged[0].exc_info is not None


FATAL_SERVE = """
import sys
from tailserve.core.scheduler import Scheduler
real = Scheduler.schedule
def schedule(self, now):
    if self.waiting or self.running:
        raise RuntimeError("injected scheduler fault")
    return real(self, now)
Scheduler.schedule = schedule
from tailserve.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_serve_exits_1_when_the_engine_dies_and_reads_the_key_from_the_environment(micro_model: Path) -> None:
    cmd = [sys.executable, "-c", FATAL_SERVE, "serve", "--model", str(micro_model), "--executor", "sim"]
    cmd += ["--port", "0", "--log-level", "warning"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TAILSERVE_API_KEY": "s3cret"}
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=env)
    try:
        url = None
        assert proc.stderr is not None
        for line in proc.stderr:
            if "listening on " in line:
                url = line.split("listening on ")[1].split()[0]
                break
        assert url is not None
        wait_until(lambda: httpx.get(f"{url}/health").status_code == 200, timeout=30)
        body = {"prompt": "hi", "max_tokens": 3}
        assert_openai_error(httpx.post(f"{url}/v1/completions", json=body), 401)
        auth = {"Authorization": "Bearer s3cret"}
        reply = httpx.post(f"{url}/v1/completions", json=body, headers=auth, timeout=30)
        assert_openai_error(reply, 503)
        assert proc.wait(timeout=30) == 1
        rest = proc.stderr.read()
        assert "engine thread died" in rest and "RuntimeError: injected scheduler fault" in rest
        assert "exiting with status 1" in rest
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# ---- access --------------------------------------------------------------------------------------
def test_api_key_guards_all_but_health_metrics_version(micro_model: Path) -> None:
    with running_server(micro_model, "sim", app_options={"api_keys": ["k1", "k2"]}) as running:
        url = running.base_url
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "k1"}):
            error = assert_openai_error(httpx.get(f"{url}/v1/models", headers=headers), 401)
            assert error["type"] == "AuthenticationError"
        assert_openai_error(httpx.post(f"{url}/tokenize", json={"prompt": "x"}), 401)
        for key in ("k1", "k2"):
            assert (
                httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {key}"}).status_code == 200
            )
        for path in ("/health", "/metrics", "/version"):
            assert httpx.get(f"{url}{path}").status_code == 200
        import openai

        client = openai.OpenAI(base_url=f"{url}/v1", api_key="k1", max_retries=0)
        assert client.completions.create(model=NAME, prompt="hi", max_tokens=2).usage.completion_tokens == 2
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{url}/v1", api_key="nope", max_retries=0).models.list()


def test_api_keys_come_from_the_flag_then_the_environment() -> None:
    assert api_keys_from_env(["a"], {"TAILSERVE_API_KEY": "b"}) == ["a"]
    assert api_keys_from_env(None, {"TAILSERVE_API_KEY": "b", "VLLM_API_KEY": "c"}) == ["b"]
    assert api_keys_from_env(None, {"VLLM_API_KEY": "c"}) == ["c"]
    assert api_keys_from_env(None, {}) == []
    with pytest.raises(ValueError, match="--api-key must not be empty"):
        api_keys_from_env([" "], {})


def test_cors_is_off_by_default_and_on_for_allowed_origins(torch_server: Any, micro_model: Path) -> None:
    origin = {"Origin": "http://ui.example"}
    assert (
        "access-control-allow-origin"
        not in httpx.get(f"{torch_server.base_url}/v1/models", headers=origin).headers
    )
    with running_server(
        micro_model, "sim", app_options={"allowed_origins": ["http://ui.example"]}
    ) as running:
        got = httpx.get(f"{running.base_url}/v1/models", headers=origin)
        assert got.headers["access-control-allow-origin"] == "http://ui.example"
        other = httpx.get(f"{running.base_url}/v1/models", headers={"Origin": "http://evil.example"})
        assert "access-control-allow-origin" not in other.headers


# ---- bounded inputs ------------------------------------------------------------------------------
def test_body_limit_refuses_declared_and_chunked_bodies(micro_model: Path) -> None:
    with running_server(micro_model, "sim", app_options={"max_request_bytes": 1000}) as running:
        big = json.dumps({"prompt": "x" * 2000, "max_tokens": 1})
        error = assert_openai_error(_post(running.base_url, big), 413)
        assert error["type"] == "RequestEntityTooLargeError" and "1000 bytes" in error["message"]

        def chunks() -> Iterator[bytes]:
            for _ in range(10):
                yield b" " * 200
            yield b'{"prompt": "hi"}'

        chunked = httpx.post(f"{running.base_url}/v1/completions", content=chunks(), timeout=30)
        assert_openai_error(chunked, 413)
        small = _post(running.base_url, {"prompt": "hi", "max_tokens": 2})
        assert small.status_code == 200


def test_slow_header_connections_are_closed(micro_model: Path) -> None:
    with running_server(micro_model, "sim", server_options={"header_timeout": 0.3}) as running:
        host, port = running.base_url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=5) as slow:
            slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # never finishes the head
            started = time.monotonic()
            assert slow.recv(100) == b""  # closed by the server
            assert time.monotonic() - started < 4
        # A client that keeps its connection between requests is unaffected while it is quick.
        with httpx.Client(base_url=running.base_url) as client:
            for _ in range(3):
                assert client.get("/health").status_code == 200


def test_huge_prompt_is_refused_by_size_before_tokenizing(micro_model: Path) -> None:
    with running_server(micro_model, "sim", app_options={"max_request_bytes": 16 * 2**20}) as running:
        huge = "hello world " * (10 * 2**20 // 12)  # 10 MiB
        started = time.monotonic()
        error = assert_openai_error(_post(running.base_url, {"prompt": huge, "max_tokens": 1}), 400)
        assert "maximum context length" in error["message"] and "bytes" in error["message"]
        chat = {"messages": [{"role": "user", "content": huge}], "max_tokens": 1}
        assert_openai_error(_post(running.base_url, chat, "/v1/chat/completions"), 400)
        assert time.monotonic() - started < 10  # ~10 s each if it were tokenized
    with running_server(micro_model, "sim") as running:  # the default limit: 4 MiB
        assert_openai_error(_post(running.base_url, {"prompt": huge}), 413)


def test_tokenizing_a_huge_text_does_not_stall_a_stream(micro_model: Path) -> None:
    with running_server(micro_model, "sim", app_options={"max_request_bytes": 16 * 2**20}) as running:
        text = "the quick brown fox jumps over the lazy dog, " * (2 * 2**20 // 45)  # 2 MiB
        arrivals: list[float] = []
        body = {"prompt": [5, 6], "max_tokens": 4000, "ignore_eos": True, "stream": True}

        def stream() -> None:
            with httpx.stream("POST", f"{running.base_url}/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line:
                        arrivals.append(time.monotonic())
                    if len(arrivals) and done.is_set():
                        break

        done = threading.Event()
        reader = threading.Thread(target=stream)
        reader.start()
        wait_until(lambda: len(arrivals) > 5)
        t0 = time.monotonic()
        tokens = httpx.post(f"{running.base_url}/tokenize", json={"prompt": text}, timeout=120).json()
        t1 = time.monotonic()
        done.set()
        reader.join(30)
        assert tokens["count"] == len(tokens["tokens"]) > len(text) // 10
        during = [b - a for a, b in itertools.pairwise(arrivals) if t0 <= b <= t1]
        assert during, "no token arrived while the text was tokenized"
        # Tokenized inline, the stream would stop for the whole call; in the worker it flows on.
        assert max(during) < (t1 - t0) / 3, (max(during), t1 - t0)


# ---- bench --predict reads the server's deployment ----------------------------------------------
def test_predict_uses_the_sim_servers_own_deployment(torch_server: Any, micro_model: Path) -> None:
    with running_server(micro_model, "sim", policy_flags={"max_num_seqs": "4"}) as running:
        info = server_deployment(running.base_url)
    assert info is not None and info["executor"] == "sim"
    spec, warnings = spec_for_server({}, info)
    # The real-time sim executor steps synchronously: the server says so, and the prediction follows.
    policy = "vllm:max_num_seqs=4,async_scheduling=False"
    assert spec == PredictSpec("Llama-3-8B", "H100-SXM", 1, "auto", policy) and not warnings
    changed, warnings = spec_for_server({"hardware": "A100-80GB"}, info)
    assert changed.hardware == "A100-80GB" and changed.policy == policy
    assert "not the server's own deployment" in warnings[0]
    torch_info = server_deployment(torch_server.base_url)
    assert torch_info == {"executor": "torch"}
    same, warnings = spec_for_server({}, torch_info)
    assert same == PredictSpec() and "a torch executor" in warnings[0]
    _, warnings = spec_for_server({}, None)
    assert "no simulated deployment" in warnings[0]
