"""What the router reads from a request body to route it: ``RouteRequest`` (prompt keys, length,
session) — the same object the cluster simulator routes.

A proxy sees the request before any tokenizer does, so prefix matching works on what is in the
body, as the real routers do:

- a ``/v1/completions`` prompt of **token ids** is keyed by its tokens, in blocks of 16 (Dynamo's
  KV router hashes token blocks the same way; exact);
- a **text** prompt, and a chat's messages, are keyed by their UTF-8 bytes in blocks of 64 (about
  16 tokens of English at ~4 bytes a token). SGLang's router matches its approximate radix tree
  on the request text for the same reason: no tokenizer in the router, and equal text means
  equal tokens for the same model. The prompt length in tokens is estimated as bytes / 4.
  A chat is rendered as ``role\\ncontent\\n`` per message, so conversations that share their first
  turns share a prefix.

The session (for ``session`` affinity) is the body's ``session_id`` (vLLM's chat field), else
its ``user``, else an ``X-Session-Id`` header. A body whose prompt cannot be read is still routed
(prompt_len 1, no keys): the backend answers it with its own 400.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tailserve.cluster.routing import DEFAULT_ROUTER_BLOCK_SIZE, RouteRequest, block_keys_from_tokens

BYTES_PER_TOKEN = 4  # estimate for text prompts
TEXT_BLOCK_BYTES = DEFAULT_ROUTER_BLOCK_SIZE * BYTES_PER_TOKEN


def route_request(
    path: str, body: Mapping[str, Any], request_id: str, headers: Mapping[str, str] | None = None
) -> RouteRequest:
    session = body.get("session_id") or body.get("user") or (headers or {}).get("x-session-id")
    session_id = str(session) if session is not None else None
    if path.endswith("/chat/completions"):
        return _from_text(request_id, _chat_text(body.get("messages")), session_id)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of prompts: route on the first (tailserve refuses batches)
    if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return RouteRequest.from_tokens(request_id, prompt, session_id=session_id)
    return _from_text(request_id, prompt if isinstance(prompt, str) else "", session_id)


def _from_text(request_id: str, text: str, session_id: str | None) -> RouteRequest:
    data = text.encode("utf-8", "surrogatepass")
    return RouteRequest(
        request_id,
        prompt_len=max(1, -(-len(data) // BYTES_PER_TOKEN)),
        block_keys=block_keys_from_tokens(data, TEXT_BLOCK_BYTES),
        block_size=DEFAULT_ROUTER_BLOCK_SIZE,
        session_id=session_id,
    )


def _chat_text(messages: Any) -> str:
    if not isinstance(messages, list):
        return ""
    parts = []
    for message in messages:
        if not isinstance(message, dict):
            continue
        content = message.get("content")
        if isinstance(content, list):  # OpenAI content parts: keep the text ones
            content = "".join(
                str(p.get("text", "")) for p in content if isinstance(p, dict) and p.get("type") == "text"
            )
        parts.append(f"{message.get('role', '')}\n{content if isinstance(content, str) else ''}\n")
    return "".join(parts)
