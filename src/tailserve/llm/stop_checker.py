"""Stop conditions and incremental text, checked on each sampled token before the scheduler
applies the iteration (so a stopped request frees its blocks in the same step).

As vLLM: EOS ends a request unless ``ignore_eos``; a ``stop_token_ids`` hit ends it; a stop
string ends it once ``min_tokens`` exist, and the text is cut where the stop string starts.
``max_tokens`` is the scheduler's own rule (``FINISHED_LENGTH``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tailserve.core.executor import Executor, StepResult
from tailserve.core.request import Request
from tailserve.core.sampling_params import SamplingParams
from tailserve.core.scheduler_output import SchedulerOutput


@dataclass(slots=True)
class TextState:
    """Per request: the detokeniser, the visible text and where the last output left off."""

    detokenizer: Any  # tokenizer.IncrementalDetokenizer
    params: SamplingParams
    text: str = ""
    stop_reason: str | int | None = None
    num_reported_tokens: int = 0
    num_reported_chars: int = 0
    pending: list[int] = field(default_factory=list)  # tokens sampled since the last output


class StopChecker:
    """Wraps an executor: records sampled tokens and marks requests that hit a stop condition."""

    def __init__(self, inner: Executor, eos_token_ids: tuple[int, ...]) -> None:
        self.inner = inner
        self.eos_token_ids = frozenset(eos_token_ids)
        self.states: dict[str, TextState] = {}
        self.requests: dict[str, Request] = {}

    @property
    def needs_block_ids(self) -> bool:
        return self.inner.needs_block_ids

    def execute(self, out: SchedulerOutput) -> StepResult:
        result = self.inner.execute(out)
        if not result.token_ids:
            return result
        for request_id, token in result.token_ids.items():
            state = self.states[request_id]
            request = self.requests[request_id]
            state.pending.append(token)
            if state.stop_reason is not None:
                continue
            p = state.params
            num_outputs = request.num_output_tokens + 1  # counting this token
            state.text += state.detokenizer.push(token)
            if not p.ignore_eos and token in self.eos_token_ids and num_outputs > p.min_tokens:
                result.stopped.add(request_id)
            elif token in p.stop_token_ids and num_outputs > p.min_tokens:
                state.stop_reason = token
                result.stopped.add(request_id)
            elif p.stop and num_outputs >= p.min_tokens:
                cut = _find_stop(state.text, p.stop, state.num_reported_chars)
                if cut is not None:
                    state.text, state.stop_reason = state.text[: cut[0]], cut[1]
                    result.stopped.add(request_id)
        return result


def _find_stop(text: str, stops: tuple[str, ...], reported: int) -> tuple[int, str] | None:
    """Earliest stop string in the text not yet reported (plus enough overlap to catch a stop
    string that straddles the boundary)."""
    best: tuple[int, str] | None = None
    for stop in stops:
        i = text.find(stop, max(0, reported - len(stop) + 1))
        if i >= 0 and (best is None or i < best[0]):
            best = (i, stop)
    return best
