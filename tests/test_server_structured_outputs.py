"""Structured outputs (vLLM's response_format json_object / json_schema, its guided_* fields and
structured_outputs) are refused with a 400: the server samples freely, and ignoring them as
unknown fields returned text the client's JSON parser then failed on."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from server_helpers import MICRO, assert_openai_error, running_server
from tailserve.executors.pytorch.init_model import init_model
from tailserve.server.protocol import ChatCompletionRequest, CompletionRequest

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
REFUSED = {
    "json_object": (
        {"response_format": {"type": "json_object"}},
        "response_format 'json_object' is not supported",
    ),
    "json_schema": (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}},
        "response_format 'json_schema' is not supported",
    ),
    "guided_json": ({"guided_json": {"type": "object"}}, "guided_json is not supported"),
    "guided_choice": ({"guided_choice": ["a", "b"]}, "guided_choice is not supported"),
    "guided_regex": ({"guided_regex": "[0-9]+"}, "guided_regex is not supported"),
    "structured_outputs": ({"structured_outputs": {"choice": ["a"]}}, "structured_outputs is not supported"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_structured_outputs_are_refused(case):
    fields, message = REFUSED[case]
    with pytest.raises(ValueError, match=message):
        ChatCompletionRequest.model_validate({**CHAT, **fields})
    with pytest.raises(ValueError, match=message):
        CompletionRequest.model_validate({"prompt": "hi", **fields})


def test_plain_text_and_unset_fields_are_served():
    text = ChatCompletionRequest.model_validate({**CHAT, "response_format": {"type": "text"}})
    assert text.response_format == {"type": "text"}
    unset = ChatCompletionRequest.model_validate({**CHAT, "response_format": None, "guided_json": None})
    assert unset.response_format is None
    other = ChatCompletionRequest.model_validate({**CHAT, "some_unknown_field": 1})  # ignored, as vLLM does
    assert other.response_format is None and other.messages


@pytest.fixture(scope="module")
def sim_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    model = init_model(tmp_path_factory.mktemp("models") / "micro", preset="tiny", dtype="float32", **MICRO)
    with running_server(model, "sim") as running:
        yield running


def test_the_server_answers_400(sim_server):
    response = httpx.post(
        f"{sim_server.base_url}/v1/chat/completions",
        content=json.dumps({**CHAT, "response_format": {"type": "json_object"}}),
        headers={"content-type": "application/json"},
        timeout=60,
    )
    error = assert_openai_error(response, 400)
    assert "response_format 'json_object' is not supported" in error["message"]
    ok = httpx.post(f"{sim_server.base_url}/v1/chat/completions", json=CHAT, timeout=60)
    assert ok.status_code == 200, ok.text
