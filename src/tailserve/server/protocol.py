"""OpenAI request bodies, response objects and the error shape, as vLLM's server speaks them.

Request models accept unknown fields (OpenAI clients send more than we read; vLLM logs and
ignores them too) but reject, with a 400, every field we would otherwise silently get wrong:
``n`` other than 1, several prompts, log-probabilities, penalties, tools. Types are strict — no
string booleans, no booleans as token ids or numbers — and floats must be finite (Python's JSON
parser accepts ``NaN`` and ``Infinity``). ``to_sampling_params`` is the one place a body becomes
the engine's ``SamplingParams``, whose checks give vLLM's messages (``top_p must be in (0, 1],
got 0.0.``); only the seed's int64 range is a field constraint, as in vLLM's protocol.

Errors are ``{"error": {"message", "type", "param", "code"}}`` with ``code`` the HTTP status, the
shape of current vLLM (``ErrorResponse``); in a stream the same object is one ``data:`` event.

``RequestLimits`` bound what one body may ask for (``request_body`` enforces them before the
models are built): vLLM's cap of 4 stop strings (``VLLM_MAX_STOP_STRINGS``, also OpenAI's "up to
4 sequences"; ``TAILSERVE_MAX_STOP_STRINGS`` or vLLM's variable raises it), their total size, the
stop token ids, and as many token ids, messages or content parts as the context has tokens.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from tailserve.core.sampling_params import SEED_MAX, SEED_MIN
from tailserve.llm import SamplingParams

# Every request model: unknown fields pass (and are ignored), known ones are typed strictly.
STRICT = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)


class ApiError(Exception):
    """A request the server refuses; becomes an OpenAI error response with ``status``."""

    def __init__(self, message: str, *, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param

    @property
    def type(self) -> str:
        return error_type(self.status)


ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    408: "RequestTimeoutError",
    413: "RequestEntityTooLargeError",
    429: "RateLimitError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


def error_type(status: int) -> str:
    """OpenAI-style error type; a status we do not name is a client or a server error by class."""
    return ERROR_TYPES.get(status, "BadRequestError" if status < 500 else "InternalServerError")


def error_body(message: str, status: int, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type(status), "param": param, "code": status}}


# ---- limits ---------------------------------------------------------------------------------
MAX_STOP_STRINGS = 4  # vLLM's VLLM_MAX_STOP_STRINGS default; OpenAI documents "up to 4 sequences"
MAX_STOP_CHARS = 4096  # all stop strings together: each is searched for after every token
MAX_STOP_TOKEN_IDS = 1024  # each token is looked up in them; vLLM bounds bad-word tokens at 1024
STOP_STRINGS_ENV = ("TAILSERVE_MAX_STOP_STRINGS", "VLLM_MAX_STOP_STRINGS")


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """What one request body may hold (a larger one is a 400 naming the field)."""

    max_items: int  # prompt token ids, /detokenize tokens, messages + content parts: the context length
    max_stop_strings: int = MAX_STOP_STRINGS
    max_stop_chars: int = MAX_STOP_CHARS
    max_stop_token_ids: int = MAX_STOP_TOKEN_IDS

    @classmethod
    def for_model(cls, max_model_len: int, environ: Mapping[str, str] = os.environ) -> RequestLimits:
        """The limits of a server whose context is ``max_model_len`` tokens; the stop-string count
        from ``TAILSERVE_MAX_STOP_STRINGS``, else ``VLLM_MAX_STOP_STRINGS``, else 4."""
        count = MAX_STOP_STRINGS
        for name in STOP_STRINGS_ENV:
            value = environ.get(name, "").strip()
            if value:
                try:
                    count = int(value)
                except ValueError:
                    count = -1
                if count < 0:
                    raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
                break
        return cls(max_items=max_model_len, max_stop_strings=count)


# vLLM's request fields for structured outputs (0.8's guided_*, 0.11's structured_outputs).
STRUCTURED_OUTPUT_FIELDS = (
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "structured_outputs",
)


class StreamOptions(BaseModel):
    model_config = STRICT
    # vLLM's default: asking for stream_options at all means usage is wanted.
    include_usage: bool = True
    continuous_usage_stats: bool = False


class SamplingFields(BaseModel):
    """Fields shared by completions and chat completions (OpenAI's plus vLLM's extensions)."""

    model_config = STRICT

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # vLLM: 0 or -1 disables
    min_p: float | None = None
    seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)  # int64, as vLLM
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM's extra parameter: tokens per streamed chunk, applied to the server's stream_interval
    # by the policy's rule (vLLM takes the larger); a plain response ignores it.
    stream_interval: int | None = Field(default=None, ge=1)
    n: int = 1
    min_tokens: int = 0
    ignore_eos: bool = False
    priority: int = 0  # vLLM: lower is served first (with a priority scheduling policy)
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    repetition_penalty: float | None = 1.0
    logit_bias: dict[str, float] | None = None
    response_format: dict[str, Any] | None = None  # {"type": "text"} only
    user: str | None = None

    @field_validator("stream", "n", "min_tokens", "ignore_eos", "priority", mode="before")
    @classmethod
    def _null_is_default(cls, value: Any, info: Any) -> Any:
        # OpenAI clients send null for "not set"; vLLM types these Optional with the same default.
        return cls.model_fields[info.field_name].default if value is None else value

    @model_validator(mode="after")
    def _check_supported(self) -> SamplingFields:
        if self.n != 1:
            raise ValueError(f"n must be 1 (one choice per request), got {self.n}")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options can only be set when stream is true")
        for name, neutral in (
            ("presence_penalty", 0.0),
            ("frequency_penalty", 0.0),
            ("repetition_penalty", 1.0),
        ):
            value = getattr(self, name)
            if value is not None and value != neutral:
                raise ValueError(f"{name} is not supported (got {value}; only {neutral} is accepted)")
        if self.logit_bias:
            raise ValueError("logit_bias is not supported")
        # Structured outputs constrain what may be sampled: sampling freely instead returns text
        # the client then fails to parse, so they are refused, not ignored as unknown fields are.
        kind = (self.response_format or {}).get("type", "text")
        if kind != "text":
            raise ValueError(
                f"response_format {kind!r} is not supported (structured outputs); only 'text' is"
            )
        for name in STRUCTURED_OUTPUT_FIELDS:
            if (self.model_extra or {}).get(name) is not None:
                raise ValueError(f"{name} is not supported (structured outputs)")
        return self

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.continuous_usage_stats

    def to_sampling_params(self, max_tokens: int | None) -> SamplingParams:
        """The engine's parameters; ``max_tokens`` None means the rest of the context (vLLM's
        server default). Raises ``ValueError`` with vLLM's message for a value out of range."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        kwargs: dict[str, Any] = {
            "max_tokens": max_tokens,
            "stop": stop,
            "stop_token_ids": list(self.stop_token_ids or []),
            "min_tokens": self.min_tokens,
            "ignore_eos": self.ignore_eos,
            "seed": self.seed,
        }
        for name in ("temperature", "top_p", "top_k", "min_p"):
            value = getattr(self, name)
            if value is not None:
                kwargs[name] = value
        return SamplingParams(**kwargs)


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class CompletionRequest(SamplingFields):
    # One prompt: text or token ids (``vllm bench`` sends both); a list of one is unwrapped.
    prompt: Any
    max_tokens: int | None = None  # None: the rest of the context, as vLLM's server
    echo: bool | None = False
    logprobs: int | None = None
    suffix: str | None = None
    best_of: int | None = None

    @model_validator(mode="after")
    def _check_prompt(self) -> CompletionRequest:
        if self.echo:
            raise ValueError("echo is not supported")
        if self.logprobs is not None:
            raise ValueError("logprobs are not supported")
        if self.suffix:
            raise ValueError("suffix is not supported")
        if self.best_of not in (None, 1):
            raise ValueError(f"best_of must be 1, got {self.best_of}")
        return self

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, prompt: Any) -> str | list[int]:
        """A string or a list of token ids, or a list of exactly one of those."""
        if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
            if len(prompt) != 1:
                raise ValueError(f"one prompt per request is supported, got {len(prompt)}")
            prompt = prompt[0]
        if isinstance(prompt, list) and all(_is_token_id(t) for t in prompt):
            prompt = list(prompt)
        elif not isinstance(prompt, str):
            raise ValueError("must be a string, a list of token ids (integers), or a list of one of those")
        if not prompt:
            raise ValueError("must not be empty")
        return prompt


class TextPart(BaseModel):
    model_config = STRICT
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = STRICT
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None  # deprecated by OpenAI, still sent
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    add_generation_prompt: bool | None = True

    @model_validator(mode="after")
    def _check_chat(self) -> ChatCompletionRequest:
        if self.logprobs or self.top_logprobs:
            raise ValueError("logprobs are not supported")
        if self.tools:
            raise ValueError("tools are not supported")
        return self

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def chat_messages(self) -> list[dict[str, str]]:
        return [{"role": m.role, "content": m.text()} for m in self.messages]


class TokenizeRequest(BaseModel):
    model_config = STRICT
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True


class DetokenizeRequest(BaseModel):
    model_config = STRICT
    model: str | None = None
    tokens: list[int]


# ---- responses ------------------------------------------------------------------------------
def new_id(prefix: str, base: str | None = None) -> str:
    """``prefix-base``: the request's own id (X-Request-Id) when it has one, else a fresh uuid."""
    return f"{prefix}-{base or uuid.uuid4().hex}"


def now_s() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def model_card(
    name: str, root: str, max_model_len: int, created: int, deployment: dict[str, Any] | None = None
) -> dict[str, Any]:
    """vLLM's model card; ``tailserve`` (our extension) says what the server runs: the executor
    and, for ``--executor sim``, the simulated deployment ``bench --predict`` should predict."""
    return {
        "id": name,
        "object": "model",
        "created": created,
        "owned_by": "tailserve",
        "root": root,
        "parent": None,
        "max_model_len": max_model_len,
        "permission": [],
        "tailserve": deployment or {},
    }
