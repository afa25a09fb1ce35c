"""``X-Request-Id``: a forwarded id (the router sends one) is the request's id in the engine and
in the response (``cmpl-<id>``, as vLLM's ``_base_request_id``), and comes back in the header."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from server_helpers import MICRO, running_server, wait_idle
from tailserve.executors.pytorch.init_model import init_model


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    model = init_model(tmp_path_factory.mktemp("models") / "micro", preset="tiny", dtype="float32", **MICRO)
    with running_server(model, "sim") as running:
        yield running


def test_forwarded_request_id_names_the_request_and_comes_back(server: Any) -> None:
    seen: list[str] = []
    engine = server.engine
    add = engine.add_request

    def spy(request_id: str, *args: Any, **kwargs: Any) -> Any:
        seen.append(request_id)
        return add(request_id, *args, **kwargs)

    engine.add_request = spy
    try:
        body = {"prompt": [1, 2, 3], "max_tokens": 2}
        r = httpx.post(f"{server.base_url}/v1/completions", json=body, headers={"X-Request-Id": "abc-123"})
        assert r.status_code == 200 and r.headers["x-request-id"] == "abc-123"
        assert r.json()["id"] == "cmpl-abc-123"
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True}
        with httpx.stream(
            "POST", f"{server.base_url}/v1/chat/completions", json=chat, headers={"X-Request-Id": "s-1"}
        ) as s:
            assert s.headers["x-request-id"] == "s-1"
            events = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and json.loads(events[0])["id"] == "chatcmpl-s-1"
    finally:
        engine.add_request = add
    assert seen == ["cmpl-abc-123", "chatcmpl-s-1"]
    wait_idle(server)


def test_without_the_header_the_server_makes_one_and_says_it(server: Any) -> None:
    r = httpx.post(f"{server.base_url}/v1/completions", json={"prompt": [1, 2], "max_tokens": 1})
    assert r.status_code == 200
    assert r.json()["id"] == f"cmpl-{r.headers['x-request-id']}" and len(r.headers["x-request-id"]) == 32


def test_errors_carry_the_id_and_a_bad_id_is_a_400(server: Any) -> None:
    r = httpx.post(f"{server.base_url}/v1/completions", json={"prompt": []}, headers={"X-Request-Id": "e-9"})
    assert r.status_code == 400 and r.headers["x-request-id"] == "e-9"
    long = httpx.post(
        f"{server.base_url}/v1/completions", json={"prompt": [1]}, headers={"X-Request-Id": "x" * 300}
    )
    assert long.status_code == 400 and "X-Request-Id" in long.json()["error"]["message"]
