"""What the engine reports about a request after a step (vLLM's ``RequestOutput``, flattened)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    new_token_ids: list[int]  # since this request's previous output
    new_text: str
    token_ids: list[int]  # every output token so far
    text: str  # detokenised output so far (a matched stop string and what follows are cut)
    finished: bool
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    status_reason: str | None = None  # why it was aborted or rejected
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    # Engine clock, seconds since the engine started.
    arrival_time: float = 0.0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    token_times: list[float] = field(default_factory=list)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)
