"""The OpenAI-compatible HTTP API (FastAPI) over an ``AsyncEngine``.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (streaming and not),
``GET /v1/models``, ``GET /health`` (200, or 503 once the engine died), ``GET /metrics``
(Prometheus text), and vLLM's ``POST /tokenize`` / ``POST /detokenize`` that benchmark clients
use to align prompt lengths, plus ``GET /version``.

Every error is an OpenAI error object (``protocol.error_body``). Bad input is a 400 — including
FastAPI's own validation errors, which would otherwise be 422 in FastAPI's shape — a full
waiting queue or a draining server a 503 with the reason; a 500 means a bug in the server.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from tailserve import __version__
from tailserve.llm import SamplingParams
from tailserve.server.async_engine import AsyncEngine
from tailserve.server.prometheus import ServerMetrics
from tailserve.server.protocol import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    SamplingFields,
    TokenizeRequest,
    error_body,
    model_card,
    new_id,
    now_s,
)
from tailserve.server.request_stream import EngineDeadError, QueueFullError, ShuttingDownError
from tailserve.server.serving import (
    ResponseMeta,
    cancel_on_disconnect,
    full_response,
    stream_response,
)


def _error(message: str, status: int, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, status, param), status_code=status)


def _validation_message(error: RequestValidationError) -> tuple[str, str | None]:
    """The first validation error as ``field: reason``, and the field as ``param``."""
    errors = error.errors()
    if not errors:
        return "invalid request body", None
    first = errors[0]
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    msg = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error")
        return f"request body is not valid JSON{f' ({detail})' if detail else ''}", None
    field = ".".join(loc)
    return (f"{field}: {msg}" if field else msg), (loc[0] if loc else None)


def build_app(
    engine: AsyncEngine,
    *,
    served_model_name: str,
    model_root: str,
    metrics: ServerMetrics | None = None,
) -> FastAPI:
    llm = engine.engine
    created = now_s()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        yield
        await engine.shutdown()

    app = FastAPI(title="tailserve", version=__version__, lifespan=lifespan)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(error)
        return _error(message, 400, param)

    @app.exception_handler(ApiError)
    async def on_api_error(request: Request, error: ApiError) -> JSONResponse:
        return _error(error.message, error.status, error.param)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        return _error(str(error.detail), error.status_code)

    @app.exception_handler(Exception)
    async def on_bug(request: Request, error: Exception) -> JSONResponse:
        return _error(f"internal server error: {error!r}", 500)

    def check_model(name: str | None) -> None:
        if name is not None and name != served_model_name:
            raise ApiError(
                f"The model `{name}` does not exist; this server serves `{served_model_name}`.",
                param="model",
            )

    def sampling(body: SamplingFields, max_tokens: int | None) -> SamplingParams:
        try:
            return body.to_sampling_params(max_tokens)
        except ValueError as error:
            raise ApiError(str(error)) from None

    async def serve(
        request: Request,
        body: SamplingFields,
        prompt: str | list[int],
        params: SamplingParams,
        meta: ResponseMeta,
    ) -> Any:
        try:
            stream = await engine.generate(
                prompt, params, priority=body.priority, request_id=meta.response_id
            )
        except ValueError as error:  # the engine's own check: prompt too long, empty, ...
            raise ApiError(str(error)) from None
        except (QueueFullError, ShuttingDownError, EngineDeadError) as error:
            raise ApiError(str(error), status=503) from None
        if body.stream:
            return StreamingResponse(stream_response(engine, stream, meta), media_type="text/event-stream")
        return await cancel_on_disconnect(request, lambda: full_response(engine, stream, meta))

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Any:
        check_model(body.model)
        params = sampling(body, body.max_tokens)
        prompt: Any = body.prompt
        meta = ResponseMeta(
            "completion", new_id("cmpl"), served_model_name, body.include_usage, body.continuous_usage
        )
        return await serve(request, body, prompt, params, meta)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
        check_model(body.model)
        params = sampling(body, body.requested_max_tokens)
        try:
            prompt = llm.tokenizer.apply_chat_template(
                body.chat_messages(), add_generation_prompt=body.add_generation_prompt
            )
        except Exception as error:  # a template may refuse a conversation (roles, order)
            raise ApiError(f"messages: the chat template failed: {error}", param="messages") from None
        meta = ResponseMeta(
            "chat", new_id("chatcmpl"), served_model_name, body.include_usage, body.continuous_usage
        )
        return await serve(request, body, prompt, params, meta)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [model_card(served_model_name, model_root, llm.max_model_len, created)],
        }

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if engine.is_healthy else 503)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        body = metrics.render() if metrics is not None else b""
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        check_model(body.model)
        tokens = list(llm.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens))
        return {"tokens": tokens, "count": len(tokens), "max_model_len": llm.max_model_len}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        check_model(body.model)
        vocab = llm.tokenizer.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise ApiError(f"tokens: id {bad[0]} is out of vocabulary ({vocab} tokens)", param="tokens")
        return {"prompt": llm.tokenizer.decode(body.tokens)}

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    return app
