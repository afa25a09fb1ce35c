"""The OpenAI-compatible HTTP API (FastAPI) over an ``AsyncEngine``.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (streaming and not),
``GET /v1/models``, ``GET /health`` (200, or 503 with the reason once the engine died),
``GET /metrics`` (Prometheus text), and vLLM's ``POST /tokenize`` / ``POST /detokenize`` that
benchmark clients use to align prompt lengths, plus ``GET /version``.

Every error is an OpenAI error object (``protocol.error_body``). Bad input is a 400 — including
FastAPI's own validation errors, which would otherwise be 422 in FastAPI's shape — a missing API
key a 401, a body over the limit a 413, a full waiting queue, a request over vLLM's admission
limits (``max_num_queued_reqs`` / ``max_num_queued_tokens``, vLLM's own message) or a draining
server a 503 with the reason. A 500 is an engine step that failed or a bug in the server: its body says so without the
exception's text, which goes to the log with the traceback.

Prompts are tokenized here, before the engine sees them (``tokenize_pool``): off the event loop
and off the engine thread, after a size check that needs no tokenizing. Bodies are parsed by
``request_body.BodyParser``: within ``RequestLimits``, and a big one off the event loop.

``/metrics`` counts every generation request received and each one refused before the engine
took it, by reason (``prometheus.RequestCounter``); the routes mark which is which.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from tailserve import __version__
from tailserve.core.gc_pause import freeze_heap
from tailserve.llm import SamplingParams
from tailserve.llm.llm_engine import RequestRefusedError
from tailserve.server.async_engine import AsyncEngine
from tailserve.server.guards import (
    DEFAULT_LIMIT_CONCURRENCY,
    DEFAULT_MAX_REQUEST_BYTES,
    ApiKeyGuard,
    BodyLimit,
    ConcurrencyLimit,
    RequestIdHeader,
    cors_options,
)
from tailserve.server.prometheus import RequestCounter, ServerMetrics, mark_accepted, mark_rejected
from tailserve.server.protocol import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    RequestLimits,
    SamplingFields,
    TokenizeRequest,
    error_body,
    model_card,
    new_id,
    now_s,
)
from tailserve.server.request_body import BodyParser, openapi_body
from tailserve.server.request_stream import EngineDeadError, QueueFullError, ShuttingDownError
from tailserve.server.serving import (
    ResponseMeta,
    cancel_on_disconnect,
    full_response,
    stream_response,
)
from tailserve.server.tokenize_pool import PromptTokenizer

logger = logging.getLogger("tailserve.server")


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
    api_keys: list[str] | None = None,
    allowed_origins: list[str] | None = None,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    limit_concurrency: int | None = DEFAULT_LIMIT_CONCURRENCY,
) -> FastAPI:
    """The app; ``api_keys`` turn on Bearer auth, ``allowed_origins`` CORS (off without them),
    ``limit_concurrency`` sheds requests beyond it with 503s (None: no limit)."""
    llm = engine.engine
    created = now_s()
    prompts = PromptTokenizer(llm.tokenizer, model_root, llm.max_model_len)
    bodies = BodyParser(RequestLimits.for_model(llm.max_model_len))
    deployment = {"executor": "sim" if llm.deployment else "torch", **(llm.deployment or {})}
    stream_rule = llm.scheduler.policy.stream_interval()  # the policy's stream_interval

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        freeze_heap()  # full GC passes then skip the start-up heap (slow-client stalls, issue 30)
        try:
            yield
        finally:
            await engine.shutdown()
            prompts.close()

    app = FastAPI(title="tailserve", version=__version__, lifespan=lifespan)
    # Added innermost first: CORS sees every response (a 401 too), auth runs before any body is read.
    app.add_middleware(BodyLimit, max_bytes=max_request_bytes)
    if api_keys:
        app.add_middleware(ApiKeyGuard, api_keys=list(api_keys))
    if limit_concurrency is not None:  # a request without the key is answered at once, never held
        app.add_middleware(ConcurrencyLimit, limit=limit_concurrency)
    if allowed_origins:
        app.add_middleware(CORSMiddleware, **cors_options(list(allowed_origins)))
    app.add_middleware(RequestIdHeader)  # a 401, 413 or 503 carries the id too
    if metrics is not None:
        app.add_middleware(RequestCounter, metrics=metrics)  # outermost: it sees every refusal

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
        logger.error("%s %s failed", request.method, request.url.path, exc_info=error)
        return _error("internal server error (the server logged the details)", 500)

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
            message = str(error)
            name = message.split(" ", 1)[0]  # vLLM's messages start with the parameter's name
            raise ApiError(message, param=name if name in type(body).model_fields else None) from None

    async def serve(
        request: Request,
        body: SamplingFields,
        prompt: list[int],
        params: SamplingParams,
        meta: ResponseMeta,
    ) -> Any:
        try:
            stream = await engine.generate(
                prompt,
                params,
                priority=body.priority,
                request_id=meta.response_id,
                # The tenant (fairness, SLO class): the X-Tenant-Id header, else OpenAI's ``user``.
                tenant_id=request.headers.get("x-tenant-id") or body.user,
            )
        except ValueError as error:  # the engine's own check: prompt too long, empty, ...
            raise ApiError(str(error)) from None
        except QueueFullError as error:
            mark_rejected(request, "queue_full")
            raise ApiError(str(error), status=503) from None
        except RequestRefusedError as error:  # vLLM's admission limits, TGI's backpressure (429)
            mark_rejected(request, "queue_full" if error.status == 503 else "overloaded")
            raise ApiError(str(error), status=error.status) from None
        except ShuttingDownError as error:
            mark_rejected(request, "shutting_down")
            raise ApiError(str(error), status=503) from None
        except EngineDeadError as error:
            mark_rejected(request, "engine_dead")
            raise ApiError(str(error), status=503) from None
        mark_accepted(request)  # from here on the engine counts it: finished, aborted or failed
        if body.stream:
            events = stream_response(engine, stream, meta, stream_rule.for_request(body.stream_interval))
            return StreamingResponse(events, media_type="text/event-stream")
        return await cancel_on_disconnect(request, lambda: full_response(engine, stream, meta))

    @app.post("/v1/completions", openapi_extra=openapi_body(CompletionRequest))
    async def completions(request: Request) -> Any:
        body = await bodies.parse(request, CompletionRequest)
        check_model(body.model)
        params = sampling(body, body.max_tokens)
        if isinstance(body.prompt, str):
            prompts.check_prompt_size(body.prompt, "prompt")
            prompt = await prompts.encode(body.prompt)
        else:
            prompt = body.prompt
        meta = ResponseMeta(
            "completion",
            new_id("cmpl", request.state.request_id),
            served_model_name,
            body.include_usage,
            body.continuous_usage,
        )
        return await serve(request, body, prompt, params, meta)

    @app.post("/v1/chat/completions", openapi_extra=openapi_body(ChatCompletionRequest))
    async def chat_completions(request: Request) -> Any:
        body = await bodies.parse(request, ChatCompletionRequest)
        check_model(body.model)
        params = sampling(body, body.requested_max_tokens)
        messages = body.chat_messages()
        prompts.check_prompt_size("".join(m["content"] for m in messages), "messages")
        prompt = await prompts.encode_chat(messages, body.add_generation_prompt is not False)
        meta = ResponseMeta(
            "chat",
            new_id("chatcmpl", request.state.request_id),
            served_model_name,
            body.include_usage,
            body.continuous_usage,
        )
        return await serve(request, body, prompt, params, meta)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [model_card(served_model_name, model_root, llm.max_model_len, created, deployment)],
        }

    @app.get("/health")
    async def health() -> Response:
        if engine.is_healthy:
            return Response(status_code=200)
        reason = engine.dead_message if engine.dead is not None else "the engine is not running"
        return _error(reason, 503)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        body = metrics.render() if metrics is not None else b""
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    @app.post("/tokenize", openapi_extra=openapi_body(TokenizeRequest))
    async def tokenize(request: Request) -> Any:
        body = await bodies.parse(request, TokenizeRequest)
        check_model(body.model)
        whole = await prompts.tokenize_json(body.prompt, body.add_special_tokens)
        if whole is not None:  # a long text: tokenized and serialized in the worker process
            return Response(whole, media_type="application/json")
        tokens = await prompts.encode(body.prompt, body.add_special_tokens)
        return {"tokens": tokens, "count": len(tokens), "max_model_len": llm.max_model_len}

    @app.post("/detokenize", openapi_extra=openapi_body(DetokenizeRequest))
    async def detokenize(request: Request) -> dict[str, Any]:
        body = await bodies.parse(request, DetokenizeRequest)  # at most max_model_len tokens
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
