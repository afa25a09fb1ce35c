"""``tailserve serve`` over HTTP: the official openai client against a live server on loopback, with
the real PyTorch executor on a micro model and with the simulated executor paced in real time."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from server_helpers import MICRO, NAME, assert_openai_error, running_server, wait_idle, wait_until
from tailserve.cli import main
from tailserve.executors.pytorch.init_model import init_model


@pytest.fixture(scope="session")
def micro_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model(tmp_path_factory.mktemp("models") / "micro", preset="tiny", dtype="float32", **MICRO)


@pytest.fixture(scope="module", params=["torch", "sim"])
def server(request: pytest.FixtureRequest, micro_model: Path) -> Iterator[Any]:
    with running_server(micro_model, request.param) as running:
        yield running


@pytest.fixture(scope="module")
def torch_server(micro_model: Path) -> Iterator[Any]:
    with running_server(micro_model, "torch") as running:
        yield running


def scrape(base_url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = httpx.get(f"{base_url}/metrics").text
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def sample(samples: dict, name: str, **labels: str) -> float:
    key = (name, tuple(sorted({"model_name": NAME, "engine": "0", **labels}.items())))
    return samples[key]


# ---- the API -----------------------------------------------------------------------------------
def test_completion_chat_and_usage(server: Any) -> None:
    client = server.client
    done = client.completions.create(
        model=NAME, prompt="The weather today", max_tokens=7, extra_body={"ignore_eos": True}
    )
    assert done.object == "text_completion"
    assert done.choices[0].finish_reason == "length"
    assert isinstance(done.choices[0].text, str) and done.choices[0].text
    assert done.usage.completion_tokens == 7
    assert done.usage.prompt_tokens == len(server.engine.tokenizer.encode("The weather today"))
    assert done.usage.total_tokens == done.usage.prompt_tokens + 7

    chat = client.chat.completions.create(
        model=NAME,
        messages=[{"role": "user", "content": "Say something."}],
        max_tokens=5,
        extra_body={"ignore_eos": True},
    )
    assert chat.object == "chat.completion"
    assert chat.choices[0].message.role == "assistant"
    assert chat.usage.completion_tokens == 5
    templated = server.engine.tokenizer.apply_chat_template([{"role": "user", "content": "Say something."}])
    # The template writes BOS itself: encoded without special tokens (one BOS, as vLLM).
    assert chat.usage.prompt_tokens == len(
        server.engine.tokenizer.encode(templated, add_special_tokens=False)
    )
    wait_idle(server)


def test_streaming_sends_one_chunk_per_token_then_usage_then_done(server: Any) -> None:
    stream = server.client.completions.create(
        model=NAME,
        prompt=[5, 6, 7, 8, 9],
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    token_chunks = [c for c in chunks if c.choices]
    assert len(token_chunks) == 6
    assert [c.choices[0].finish_reason for c in token_chunks] == [None] * 5 + ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    assert chunks[-1].usage.prompt_tokens == 5
    assert all(c.usage is None for c in token_chunks)

    chat = server.client.chat.completions.create(
        model=NAME,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    deltas = [c.choices[0].delta for c in chat]
    assert deltas[0].role == "assistant" and len(deltas) == 4  # role rides on the first token chunk
    # The raw stream ends with [DONE] (the SDK hides it).
    body = {"model": NAME, "prompt": "x", "max_tokens": 2, "stream": True}
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body) as response:
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]" and all(line.startswith("data: ") for line in lines)
    wait_idle(server)


def test_greedy_is_deterministic_and_stop_strings_cut(torch_server: Any) -> None:
    client = torch_server.client
    first = client.completions.create(
        model=NAME, prompt="one two three", max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    again = client.completions.create(
        model=NAME, prompt="one two three", max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    text = first.choices[0].text
    assert again.choices[0].text == text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    cut = client.completions.create(
        model=NAME, prompt="one two three", max_tokens=12, temperature=0, stop=[stop]
    )
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == text[: text.index(stop)]
    seeded = [
        client.completions.create(model=NAME, prompt="seed", max_tokens=8, temperature=1.0, seed=11)
        .choices[0]
        .text
        for _ in range(2)
    ]
    assert seeded[0] == seeded[1]


def test_models_health_tokenize(server: Any) -> None:
    models = httpx.get(f"{server.base_url}/v1/models").json()
    card = models["data"][0]
    assert models["object"] == "list" and card["id"] == NAME and card["object"] == "model"
    assert card["max_model_len"] == server.engine.max_model_len and Path(card["root"]).is_dir()
    assert httpx.get(f"{server.base_url}/health").status_code == 200
    ids = httpx.post(f"{server.base_url}/tokenize", json={"model": NAME, "prompt": "hello there"}).json()
    assert ids["tokens"] == server.engine.tokenizer.encode("hello there") and ids["count"] == len(
        ids["tokens"]
    )
    text = httpx.post(f"{server.base_url}/detokenize", json={"model": NAME, "tokens": ids["tokens"]}).json()
    assert text["prompt"] == server.engine.tokenizer.decode(ids["tokens"])
    bad = httpx.post(f"{server.base_url}/detokenize", json={"model": NAME, "tokens": [5, 10**6]})
    assert bad.status_code == 400 and "out of vocabulary" in bad.json()["error"]["message"]


# ---- bad input -------------------------------------------------------------------------------
BAD_COMPLETIONS = {
    "invalid JSON": "{not json",
    "not an object": "[1, 2]",
    "missing prompt": {"model": NAME, "max_tokens": 4},
    "prompt of the wrong type": {"prompt": 12},
    "max_tokens not a number": {"prompt": "hi", "max_tokens": "many"},
    "negative max_tokens": {"prompt": "hi", "max_tokens": -3},
    "max_tokens beyond the context": {"prompt": "hi", "max_tokens": 100_000},
    "prompt longer than the context": {"prompt": list(range(3, 800)), "max_tokens": 1},
    "empty prompt": {"prompt": ""},
    "token id out of vocabulary": {"prompt": [1, 99_999]},
    "unknown model": {"model": "gpt-4", "prompt": "hi"},
    "n above 1": {"prompt": "hi", "n": 3},
    "stream_options without stream": {"prompt": "hi", "stream_options": {"include_usage": True}},
    "min_tokens above max_tokens": {"prompt": "hi", "max_tokens": 2, "min_tokens": 5},
    "negative temperature": {"prompt": "hi", "temperature": -1},
    "top_p of zero": {"prompt": "hi", "top_p": 0},
    "logprobs": {"prompt": "hi", "logprobs": 2},
    "several prompts": {"prompt": ["a", "b"]},
}
BAD_CHATS = {
    "no messages": {"model": NAME, "messages": []},
    "unknown role": {"messages": [{"role": "wizard", "content": "hi"}]},
    "tools": {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]},
    "negative max_completion_tokens": {
        "messages": [{"role": "user", "content": "hi"}],
        "max_completion_tokens": -1,
    },
}


@pytest.mark.parametrize("case", list(BAD_COMPLETIONS))
def test_bad_completion_bodies_get_400_in_openai_shape(torch_server: Any, case: str) -> None:
    body = BAD_COMPLETIONS[case]
    content = body if isinstance(body, str) else json.dumps(body)
    response = httpx.post(
        f"{torch_server.base_url}/v1/completions",
        content=content,
        headers={"content-type": "application/json"},
    )
    error = assert_openai_error(response, 400)
    assert error["type"] == "BadRequestError"
    assert torch_server.async_engine.is_healthy


@pytest.mark.parametrize("case", list(BAD_CHATS))
def test_bad_chat_bodies_get_400(torch_server: Any, case: str) -> None:
    response = httpx.post(f"{torch_server.base_url}/v1/chat/completions", json=BAD_CHATS[case])
    assert_openai_error(response, 400)


def test_openai_client_sees_bad_request_and_unknown_routes_keep_the_shape(torch_server: Any) -> None:
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        torch_server.client.completions.create(model=NAME, prompt="hi", max_tokens=10_000)
    assert_openai_error(httpx.get(f"{torch_server.base_url}/v1/nothing"), 404)
    # The server still serves after all of that.
    assert (
        torch_server.client.completions.create(model=NAME, prompt="ok", max_tokens=1).usage.completion_tokens
        == 1
    )


# ---- lifecycle -----------------------------------------------------------------------------
def test_disconnect_mid_stream_aborts_and_frees_blocks(torch_server: Any) -> None:
    before = scrape(torch_server.base_url)
    body = {"model": NAME, "prompt": "a long story", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{torch_server.base_url}/v1/completions", json=body) as response:
        lines = response.iter_lines()
        received = [next(lines) for _ in range(6)]  # a few tokens in, then hang up
    assert all(line.startswith("data: ") or not line for line in received)
    wait_idle(torch_server)
    engine = torch_server.engine
    assert not engine.has_unfinished_requests()
    assert engine.stats().kv_cache_usage == 0.0
    engine.check_integrity()
    after = scrape(torch_server.base_url)
    aborted = sample(after, "vllm:request_success_total", finished_reason="abort")
    assert aborted == sample(before, "vllm:request_success_total", finished_reason="abort") + 1


def test_full_queue_answers_503_with_the_reason(micro_model: Path) -> None:
    # One sequence at a time (max_num_seqs=1) and room for one waiting request.
    with running_server(
        micro_model, "sim", policy_flags={"max_num_seqs": "1"}, max_queued_requests=1
    ) as running:
        body = {"model": NAME, "prompt": "x", "max_tokens": 2000, "ignore_eos": True, "stream": True}
        with (
            httpx.stream("POST", f"{running.base_url}/v1/completions", json=body) as first,
            httpx.stream("POST", f"{running.base_url}/v1/completions", json=body) as second,
        ):
            first_lines = first.iter_lines()  # kept: a dropped iterator closes the stream
            next(first_lines)
            wait_until(lambda: running.async_engine.snapshot.num_waiting == 1)
            third = httpx.post(f"{running.base_url}/v1/completions", json={**body, "stream": False})
            error = assert_openai_error(third, 503)
            assert "queue is full" in error["message"] and "--max-queued-requests 1" in error["message"]
            assert second.status_code == 200
        wait_idle(running)
        assert running.engine.stats().kv_cache_usage == 0.0


def test_shutdown_aborts_in_flight_requests_with_a_reason(micro_model: Path) -> None:
    with running_server(micro_model, "sim", drain_timeout=0.2) as running:
        body = {"model": NAME, "prompt": "x", "max_tokens": 5000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{running.base_url}/v1/completions", json=body) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data: ")
            running.server.should_exit = True  # what SIGINT does
            rest = [line for line in lines if line]
        events = [json.loads(line[6:]) for line in rest if line != "data: [DONE]"]
        assert rest[-1] == "data: [DONE]"
        assert events[-1]["error"]["message"] == "request aborted: server shutting down"
        assert events[-1]["error"]["code"] == 503
        # The abort reaches the stream at once; the engine hands its output over at its next
        # step, which a loaded machine can delay past this line (it failed so once).
        wait_until(lambda: not running.engine.has_unfinished_requests())


def test_metrics_speak_vllm_names_and_counters_move(server: Any) -> None:
    before = scrape(server.base_url)
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:time_to_first_token_seconds_count",
        "vllm:inter_token_latency_seconds_count",
        "vllm:e2e_request_latency_seconds_count",
        "vllm:request_queue_time_seconds_count",
    ):
        sample(before, name)
    prompt = [11, 12, 13, 14, 15, 16, 17]
    server.client.completions.create(model=NAME, prompt=prompt, max_tokens=5, extra_body={"ignore_eos": True})
    wait_idle(server)
    after = scrape(server.base_url)

    def moved(name: str, **labels: str) -> float:
        return sample(after, name, **labels) - sample(before, name, **labels)

    assert moved("vllm:prompt_tokens_total") == len(prompt)
    assert moved("vllm:generation_tokens_total") == 5
    assert moved("vllm:prefix_cache_queries_total") == len(prompt)
    assert moved("vllm:request_success_total", finished_reason="length") == 1
    assert moved("vllm:time_to_first_token_seconds_count") == 1
    assert moved("vllm:inter_token_latency_seconds_count") == 4
    assert moved("vllm:e2e_request_latency_seconds_count") == 1
    assert moved("vllm:request_queue_time_seconds_count") == 1
    assert moved("vllm:e2e_request_latency_seconds_sum") > 0
    assert sample(after, "vllm:num_requests_running") == 0


# ---- the command ---------------------------------------------------------------------------
def test_serve_command_starts_and_exits_0_on_sigterm(micro_model: Path) -> None:
    cmd = [
        sys.executable,
        "-m",
        "tailserve.cli",
        "serve",
        "--model",
        str(micro_model),
        "--executor",
        "sim",
        "--port",
        "0",
    ]
    cmd += ["--max-num-seqs", "8", "--log-level", "warning"]
    proc = subprocess.Popen(
        cmd, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"}
    )
    try:
        url = None
        for line in proc.stderr:
            if "listening on " in line:
                url = line.split("listening on ")[1].split()[0]
                break
        assert url is not None, "the server printed no address"
        wait_until(lambda: _healthy(url), timeout=30)
        reply = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 3}).json()
        assert reply["usage"]["completion_tokens"] == 3
        # A stand-in server is named after the model it simulates and says what it runs.
        card = httpx.get(f"{url}/v1/models").json()["data"][0]
        assert card["id"] == reply["model"] == "Llama-3-8B"
        assert card["tailserve"] == {
            "executor": "sim",
            "model": "Llama-3-8B",
            "hardware": "H100-SXM",
            "tp": 1,
            "calibration": "auto",
            # as it runs: the real-time executor steps synchronously, so bench --predict does too
            "policy": "vllm:max_num_seqs=8,async_scheduling=False",
        }
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health").status_code == 200
    except httpx.HTTPError:
        return False


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--port", "70000"], "--port must be in 0..65535"),
        (["--max-queued-requests", "-1"], "--max-queued-requests must be >= 0"),
        (["--such-flag", "3"], "unrecognized argument --such-flag"),
    ],
)
def test_serve_bad_arguments_are_one_line(micro_model: Path, argv: list[str], message: str, capsys) -> None:
    assert main(["serve", "--model", str(micro_model), "--executor", "sim", "--port", "0", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tailserve: error:") and message in err


def test_serve_port_in_use_is_one_line(micro_model: Path, capsys) -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "--model", str(micro_model), "--port", str(port)]) == 2
    assert f"cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err


def test_priority_reaches_the_scheduler(micro_model: Path) -> None:
    # vLLM's priority scheduling, one sequence at a time: of two waiting requests the one with
    # the lower priority value runs first, whatever the arrival order.
    flags = {"max_num_seqs": "1", "scheduling_policy": "priority"}
    with running_server(micro_model, "sim", policy_flags=flags) as running:
        url = f"{running.base_url}/v1/completions"
        body = {"model": NAME, "prompt": "x", "max_tokens": 40, "ignore_eos": True, "stream": True}
        done: list[int] = []

        def post(priority: int) -> None:
            httpx.post(url, json={**body, "stream": False, "max_tokens": 2, "priority": priority}, timeout=60)
            done.append(priority)

        with httpx.stream("POST", url, json=body) as first:
            lines = first.iter_lines()
            next(lines)
            late = [threading.Thread(target=post, args=(p,)) for p in (5, 0)]
            for i, thread in enumerate(late, start=1):  # priority 5 waits before priority 0 arrives
                thread.start()
                wait_until(lambda i=i: running.async_engine.snapshot.num_waiting == i)
            rest = [line for line in lines if line]
        for thread in late:
            thread.join(30)
        assert rest[-1] == "data: [DONE]"
        assert done == [0, 5]
