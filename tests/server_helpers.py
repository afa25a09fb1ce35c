"""A live ``tailserve serve`` app on 127.0.0.1 in a thread, for the server tests."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import openai

from tailserve.llm import LLMEngine
from tailserve.server.app import build_app
from tailserve.server.async_engine import AsyncEngine
from tailserve.server.launch import ServerThread, make_server
from tailserve.server.prometheus import ServerMetrics

MICRO = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 1024,
    "max_position_embeddings": 512,
}
NAME = "micro"


@contextmanager
def running_server(
    model: Path,
    executor: str = "torch",
    *,
    policy: str = "vllm",
    policy_flags: dict[str, str] | None = None,
    max_queued_requests: int | None = None,
    drain_timeout: float = 5.0,
    app_options: dict[str, Any] | None = None,
    server_options: dict[str, Any] | None = None,
) -> Iterator[Any]:
    """A server on a free port; ``.base_url``, ``.engine``, ``.async_engine``, ``.client``, ``.server``."""
    engine = LLMEngine.from_args(
        str(model),
        executor=executor,
        policy=policy,
        dtype="float32",
        policy_flags=policy_flags,
        kv_cache_memory_gib=0.01,
        served_model_name=NAME,
    )
    metrics = ServerMetrics(NAME)
    async_engine = AsyncEngine(engine, max_queued_requests=max_queued_requests, metrics=metrics)
    app = build_app(
        async_engine, served_model_name=NAME, model_root=str(model), metrics=metrics, **(app_options or {})
    )
    server = make_server(
        app,
        async_engine,
        host="127.0.0.1",
        port=0,
        drain_timeout=drain_timeout,
        log_level="warning",
        **(server_options or {}),
    )
    with ServerThread(server) as running:
        running.engine = engine
        running.async_engine = async_engine
        running.client = openai.OpenAI(
            base_url=f"{running.base_url}/v1", api_key="none", timeout=60.0, max_retries=0
        )
        yield running


def wait_until(condition: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.01)


def wait_idle(running: Any) -> None:
    """Until the engine thread holds no request and has published that."""
    wait_until(
        lambda: not running.async_engine.snapshot.has_unfinished and not running.async_engine.num_in_flight
    )


def assert_openai_error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status and isinstance(error["message"], str) and error["message"]
    return error
