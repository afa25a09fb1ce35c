"""What the engine reports about a request after a step, shaped like vLLM's ``RequestOutput``.

A script written for vLLM reads ``out.prompt``, ``out.prompt_token_ids``,
``out.outputs[0].text`` / ``.token_ids`` / ``.finish_reason`` / ``.stop_reason`` and
``out.metrics`` (``RequestMetrics``); tailserve's own code reads the same facts flat
(``out.text``, ``out.token_ids``, ...), which stay as the stored fields. One completion per
request (``n = 1``), so ``outputs`` always has one element. Times are the engine's clock:
seconds since the engine started (vLLM's are Unix times), so differences mean the same.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class CompletionOutput:
    """vLLM's ``CompletionOutput``: one generated sequence."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: None  # not computed
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: str | int | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True, slots=True)
class RequestMetrics:
    """vLLM's ``RequestMetrics`` (engine-clock seconds)."""

    arrival_time: float
    last_token_time: float | None
    first_scheduled_time: float | None
    first_token_time: float | None
    time_in_queue: float | None
    finished_time: float | None


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
    prompt: str | None = None  # the text prompt, as vLLM; None for a prompt given as token ids

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def outputs(self) -> list[CompletionOutput]:
        return [
            CompletionOutput(0, self.text, self.token_ids, None, None, self.finish_reason, self.stop_reason)
        ]

    @property
    def metrics(self) -> RequestMetrics:
        queued = (
            self.first_scheduled_time - self.arrival_time if self.first_scheduled_time is not None else None
        )
        return RequestMetrics(
            arrival_time=self.arrival_time,
            last_token_time=self.token_times[-1] if self.token_times else None,
            first_scheduled_time=self.first_scheduled_time,
            first_token_time=self.first_token_time,
            time_in_queue=queued,
            finished_time=self.finish_time,
        )
