"""What a policy decides for one iteration; the only thing an executor ever sees."""

from __future__ import annotations

from dataclasses import dataclass, field

from tailserve.core.request import Request


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # tokens computed this iteration: a prefill chunk, or 1 for a decode
    num_context_tokens: int  # tokens already in the KV cache before this iteration


@dataclass(frozen=True, slots=True)
class PaddingSlot:
    """Work a padded batch does for nobody (static batching): costs time, produces no token."""

    num_new_tokens: int
    num_context_tokens: int


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)  # by recompute this iteration
    swapped_out: list[Request] = field(default_factory=list)
    swapped_in: list[Request] = field(default_factory=list)
    padding: list[PaddingSlot] = field(default_factory=list)
    num_admitted: int = 0  # waiting requests that entered the running set this iteration
    num_swap_out_blocks: int = 0  # KV blocks copied GPU -> CPU before this iteration runs
    num_swap_in_blocks: int = 0  # KV blocks copied CPU -> GPU before this iteration runs

    @property
    def is_empty(self) -> bool:
        return not self.scheduled and not self.swapped_out and not self.swapped_in

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled if s.num_new_tokens > 1)

    @property
    def num_decode_tokens(self) -> int:
        return sum(1 for s in self.scheduled if s.num_new_tokens == 1)
