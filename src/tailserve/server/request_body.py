"""Request bodies read into the protocol's models with bounded work on the event loop.

FastAPI parses a body on the event loop: ``json.loads``, then pydantic, both holding the GIL for
their whole run. A legal 4 MB body of 2M prompt token ids held the loop (and ``/health``) 0.4 to
0.9 s, 140,000 chat messages 2.5 s; 400,000 ``stop`` strings passed validation and then were
searched for after every token of every engine step.

Here a body is parsed by ``BodyParser.parse`` with the same results and the same errors as
FastAPI's (400s in OpenAI's shape; a body that is not ``application/json`` is not parsed), and:

- **limits** (``RequestLimits``): at most ``max_stop_strings`` stop strings (4, vLLM's
  ``VLLM_MAX_STOP_STRINGS`` default and OpenAI's documented "up to 4") of ``max_stop_chars``
  characters in all, ``max_stop_token_ids`` stop token ids, and ``max_items`` (the context
  length) prompt token ids, ``/detokenize`` tokens, or chat messages plus content parts (each
  costs at least a token: more cannot fit). Each is a 400 naming the field.
- **small bodies** (up to ``INLINE_BODY_BYTES``) are parsed on the loop, as before: a few
  milliseconds at most.
- **big bodies** go to a worker thread, one at a time. A thread alone would not do: the GIL is
  held through any single C call (``json.loads`` of 2M ints is 0.2 s; pydantic validating 140k
  messages 0.9 s), and the loop waits for it. So the work is cut into short calls: msgspec splits
  the top-level object into raw fields without building them (about 5 ns a byte); each field's
  size is checked against the limits before it is built (a token-id list is counted by its
  commas, a message list by a fail-fast msgspec pass that skips the text); unknown fields (which
  nothing reads) are never built; and a long message list is decoded and validated one message
  at a time. Big bodies must be strict JSON (RFC 8259: no ``NaN``, no lone surrogates).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, TypeVar

import msgspec
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from tailserve.server.protocol import ApiError, ChatMessage, RequestLimits

INLINE_BODY_BYTES = 64 * 1024  # parsed on the event loop: ~2 ms of JSON at worst
PER_ITEM_MESSAGES = 256  # a longer message list is validated one message at a time
_UTF8_BOM = b"\xef\xbb\xbf"
_NOT_AN_OBJECT = "Input should be a valid dictionary or object to extract fields from"

M = TypeVar("M", bound=BaseModel)


# gc=False: the shapes of 100,000s of messages must not set off a collection of the whole heap.
class _Part(msgspec.Struct, gc=False):
    text: str = ""


class _MessageShape(msgspec.Struct, gc=False):
    """Just enough of a chat message to count messages and parts; unknown keys are skipped."""

    role: str
    content: str | list[_Part] | None = None


_FIELDS = msgspec.json.Decoder(dict[str, msgspec.Raw])
_ITEMS = msgspec.json.Decoder(list[msgspec.Raw])
_SHAPES = msgspec.json.Decoder(list[_MessageShape])
_ONE_TEXT = msgspec.json.Decoder(tuple[str])


class BodyParser:
    """Parses request bodies for one app (``limits`` from its model's context length)."""

    def __init__(self, limits: RequestLimits) -> None:
        self.limits = limits
        self._worker = asyncio.Semaphore(1)  # big bodies are parsed one at a time

    async def parse(self, request: Request, model: type[M]) -> M:
        """The request's body as ``model``; raises ``RequestValidationError`` or ``ApiError`` (400)."""
        raw = await request.body()
        if not raw:
            raise RequestValidationError([_error("missing", (), "Field required", None)])
        if not _is_json(request.headers.get("content-type")):
            raise RequestValidationError([_error("model_attributes_type", (), _NOT_AN_OBJECT, raw[:64])])
        if len(raw) <= INLINE_BODY_BYTES:
            return self.parse_small(raw, model)
        async with self._worker:
            return await asyncio.to_thread(self.parse_big, raw, model)

    def parse_small(self, raw: bytes, model: type[M]) -> M:
        try:
            data = json.loads(raw)
        except json.JSONDecodeError as error:
            raise _invalid_json(error.msg, error.pos) from None
        except (ValueError, RecursionError) as error:  # bad UTF-8, an over-long integer, deep nesting
            raise _invalid_json(_reason(error)) from None
        if not isinstance(data, dict):
            raise RequestValidationError([_error("model_attributes_type", (), _NOT_AN_OBJECT, data)])
        check_limits(data, model, self.limits)
        return _validate(model, data)

    def parse_big(self, raw: bytes, model: type[M]) -> M:
        """``parse_small`` cut into short GIL-holding calls (see the module docstring)."""
        try:
            fields = _FIELDS.decode(raw.removeprefix(_UTF8_BOM))
        except msgspec.ValidationError:  # valid JSON, not an object
            raise RequestValidationError(
                [_error("model_attributes_type", (), _NOT_AN_OBJECT, None)]
            ) from None
        except (msgspec.DecodeError, RecursionError) as error:
            raise _invalid_json(_reason(error)) from None
        known = model.model_fields
        data: dict[str, Any] = {}
        messages: list[Any] | None = None
        for name, value in fields.items():
            if name not in known:
                continue  # accepted and ignored, as the models' ``extra="allow"``: never built
            text = bytes(value)
            self._precheck(name, text)
            if name == "messages":
                messages = self._messages(text)
            else:
                data[name] = _loads(text)
        check_limits(data, model, self.limits)
        if messages is not None:
            data["messages"] = messages
        return _validate(model, data)

    def _precheck(self, name: str, text: bytes) -> None:
        """Refuse a raw field that is over its limit before building it."""
        limits = self.limits
        if name in ("prompt", "tokens", "stop_token_ids"):
            if not text.startswith(b"["):
                return
            limit = limits.max_stop_token_ids if name == "stop_token_ids" else limits.max_items
            if b'"' in text:
                if name == "prompt":  # the one valid form with text: a list of one string
                    try:
                        _ONE_TEXT.decode(text)
                    except (msgspec.DecodeError, msgspec.ValidationError):
                        raise ApiError(
                            "prompt: must be a string, a list of token ids (integers), or a list of one of those",
                            param="prompt",
                        ) from None
                    return
                raise ApiError(f"{name}: must be a list of integers", param=name)
            count = text.count(b",") + 1  # exact for a flat list of numbers
            if count > limit:
                raise ApiError(_too_many(name, count, limits), param=name)
        elif name == "stop":
            # A character is at most 12 bytes of JSON (a surrogate pair of \u escapes), a string's
            # quotes and comma 3 more: a bigger field holds too many characters or strings.
            most = 12 * limits.max_stop_chars + 3 * limits.max_stop_strings + 64
            if len(text) > most:
                raise ApiError(
                    f"stop: {len(text):,} bytes of stop strings; at most {limits.max_stop_strings} "
                    f"strings of {limits.max_stop_chars:,} characters in all are accepted",
                    param="stop",
                )
        elif name != "messages" and len(text) > INLINE_BODY_BYTES:
            # Every other field is a scalar, a small object or a list a request never needs long.
            raise ApiError(f"{name}: {len(text):,} bytes is too large for this field", param=name)

    def _messages(self, text: bytes) -> list[Any]:
        """Counted before they are built, then decoded and validated a message at a time."""
        limit = self.limits.max_items
        if text.count(b",") + 1 > limit:  # commas bound the count; text may hold commas
            try:
                shapes = _SHAPES.decode(text)  # stops at the first element that is not a message
            except msgspec.ValidationError as error:
                raise ApiError(f"messages: {_msgspec_where(error)}", param="messages") from None
            except (msgspec.DecodeError, RecursionError) as error:
                raise _invalid_json(_reason(error)) from None
            count = sum(1 + (len(m.content) if isinstance(m.content, list) else 0) for m in shapes)
            if count > limit:
                raise ApiError(_too_many("messages", count, self.limits), param="messages")
        try:
            items = _ITEMS.decode(text)
        except msgspec.ValidationError:
            raise RequestValidationError(
                [_error("list_type", ("messages",), "Input should be a valid list", None)]
            ) from None
        decoded = [_loads(bytes(item)) for item in items]  # one short call each
        count = sum(1 + _num_parts(m) for m in decoded)
        if count > limit:
            raise ApiError(_too_many("messages", count, self.limits), param="messages")
        if len(decoded) <= PER_ITEM_MESSAGES:
            return decoded  # validated with the rest of the body
        messages = []
        for i, message in enumerate(decoded):  # the loop gets the GIL between two messages
            try:
                messages.append(ChatMessage.model_validate(message))
            except ValidationError as error:
                raise _located(error, ("messages", i)) from None
        return messages


def check_limits(data: dict[str, Any], model: type[BaseModel], limits: RequestLimits) -> None:
    """The limits on a decoded body (before the model is built: each check is a ``len``)."""
    fields = model.model_fields
    for name in ("prompt", "tokens"):
        value = data.get(name) if name in fields else None
        if isinstance(value, list):
            # A token-id list, or a list of one (longer lists are refused by the model).
            inner = value[0] if len(value) == 1 and isinstance(value[0], list) else value
            if len(inner) > limits.max_items:
                raise ApiError(_too_many(name, len(inner), limits), param=name)
    stop = data.get("stop") if "stop" in fields else None
    if isinstance(stop, list):
        if len(stop) > limits.max_stop_strings:
            raise ApiError(
                f"stop: at most {limits.max_stop_strings} stop strings are accepted, got {len(stop):,}",
                param="stop",
            )
        stop_chars = sum(len(s) for s in stop if isinstance(s, str))
    else:
        stop_chars = len(stop) if isinstance(stop, str) else 0
    if stop_chars > limits.max_stop_chars:
        raise ApiError(
            f"stop: the stop strings are {stop_chars:,} characters in all; at most "
            f"{limits.max_stop_chars:,} are accepted",
            param="stop",
        )
    stop_ids = data.get("stop_token_ids") if "stop_token_ids" in fields else None
    if isinstance(stop_ids, list) and len(stop_ids) > limits.max_stop_token_ids:
        raise ApiError(_too_many("stop_token_ids", len(stop_ids), limits), param="stop_token_ids")
    messages = data.get("messages") if "messages" in fields else None
    if isinstance(messages, list):
        count = sum(1 + _num_parts(m) for m in messages)
        if count > limits.max_items:
            raise ApiError(_too_many("messages", count, limits), param="messages")


def _too_many(name: str, count: int, limits: RequestLimits) -> str:
    """The message for a list over its limit; the context's in vLLM's words, as the engine's own."""
    if name == "stop_token_ids":
        return f"stop_token_ids: at most {limits.max_stop_token_ids:,} ids are accepted, got {count:,}"
    context = f"This model's maximum context length is {limits.max_items} tokens. However, "
    if name == "prompt":
        return f"{context}your prompt has {count} token ids. Please reduce the length of the prompt."
    if name == "messages":
        return (
            f"{context}your messages hold {count} messages and content parts, each at least a token. "
            "Please reduce the length of the messages."
        )
    return f"{name}: {count:,} token ids, more than the model's context length ({limits.max_items} tokens)"


def _num_parts(message: Any) -> int:
    content = message.get("content") if isinstance(message, dict) else None
    return len(content) if isinstance(content, list) else 0


def _is_json(content_type: str | None) -> bool:
    """FastAPI's rule: ``application/json`` or ``application/*+json``, parameters aside."""
    if not content_type:
        return False
    media = content_type.split(";", 1)[0].strip().lower()
    main, _, sub = media.partition("/")
    return main == "application" and (sub == "json" or sub.endswith("+json"))


def _loads(text: bytes) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise _invalid_json(error.msg) from None
    except (ValueError, RecursionError) as error:
        raise _invalid_json(_reason(error)) from None


def _validate(model: type[M], data: dict[str, Any]) -> M:
    try:
        return model.model_validate(data)
    except ValidationError as error:
        raise _located(error, ()) from None


def _located(error: ValidationError, where: tuple[Any, ...]) -> RequestValidationError:
    """FastAPI's shape: every location under ``body`` (and under ``where``)."""
    return RequestValidationError(
        [{**e, "loc": ("body", *where, *e["loc"])} for e in error.errors(include_url=False)]
    )


def _error(kind: str, loc: tuple[Any, ...], msg: str, value: Any) -> dict[str, Any]:
    return {"type": kind, "loc": ("body", *loc), "msg": msg, "input": value}


def _invalid_json(reason: str, pos: int = 0) -> RequestValidationError:
    return RequestValidationError(
        [
            {
                "type": "json_invalid",
                "loc": ("body", pos),
                "msg": "JSON decode error",
                "input": {},
                "ctx": {"error": reason},
            }
        ]
    )


def _reason(error: BaseException) -> str:
    if isinstance(error, RecursionError):
        return "nested too deeply"
    if isinstance(error, UnicodeDecodeError):
        return f"not UTF-8: {error.reason}"
    return str(error).split(" - at ")[0]


def _msgspec_where(error: msgspec.ValidationError) -> str:
    """msgspec's ``... - at `$[3].content``` as ``... (messages.3.content)``."""
    message, _, where = str(error).partition(" - at ")
    path = where.strip("`").removeprefix("$").replace("[", ".").replace("]", "")
    return f"{message} (messages{path})" if where else message


def openapi_body(model: type[BaseModel]) -> dict[str, Any]:
    """The ``openapi_extra`` of a route that parses ``model`` itself: the JSON body FastAPI would
    have documented (nested models inlined, so the schema stands alone)."""
    schema = model.model_json_schema()
    defs = schema.pop("$defs", {})

    def inline(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#/$defs/"):
                return inline(defs[ref.removeprefix("#/$defs/")])
            return {key: inline(value) for key, value in node.items()}
        if isinstance(node, list):
            return [inline(value) for value in node]
        return node

    content = {"application/json": {"schema": inline(schema)}}
    return {"requestBody": {"required": True, "content": content}}
