"""One request's state: what it asks for, how far it has got, and when each thing happened.

Token accounting (the one rule, as in vLLM V1): a request has ``num_tokens`` = prompt tokens +
output tokens generated so far, and ``num_computed_tokens`` = tokens whose KV is in the cache.
Every iteration the scheduler grants a request some new tokens so that the second catches up
with the first. A prefill is a large grant, a chunk a smaller one, a decode a grant of 1, a
prefix-cache hit raises ``num_computed_tokens`` without a grant, a recompute preemption resets
it to 0. When a grant makes ``num_computed_tokens == num_tokens`` the model samples one output
token, which raises ``num_tokens`` by one; nothing else produces tokens.

The timestamps here are the only per-request timing anywhere; every metric derives from them.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from tailserve.core.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    SWAPPED = "swapped"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"
    FINISHED_REJECTED = "finished_rejected"

    _finished: bool  # set for each member below

    @property
    def is_finished(self) -> bool:
        # An attribute, not ``self in _FINISHED``: that hashes the member through Enum's
        # Python-level ``__hash__``, and schedulers ask this of every running request each step.
        return self._finished


_FINISHED = frozenset(
    {
        RequestStatus.FINISHED_STOPPED,
        RequestStatus.FINISHED_LENGTH,
        RequestStatus.FINISHED_ABORTED,
        RequestStatus.FINISHED_REJECTED,
    }
)
for _status in RequestStatus:
    _status._finished = _status in _FINISHED

# OpenAI ``finish_reason`` for each terminal status (vLLM maps rejected prompts to "length").
FINISH_REASONS: dict[RequestStatus, str] = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_REJECTED: "abort",
}


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    prompt_len: int  # tokens
    max_tokens: int  # output tokens; in simulation exactly this many are generated
    arrival_time: float  # seconds, on the engine's clock
    priority: int = 0  # lower is more urgent (vLLM's convention)
    tenant_id: str | None = None
    prompt_token_ids: list[int] | None = None
    # Hashes of the prompt's prefix blocks (e.g. Mooncake ``hash_ids``), for prefix caching.
    prefix_block_hashes: list[int] | None = None
    # Simulation only: the token ids this request will generate (a multi-turn workload knows its
    # replies), so prefix caching can key the blocks that hold outputs too.
    planned_output_token_ids: list[int] | None = None
    # Real executors: how to sample and when to stop; None in simulation.
    sampling_params: SamplingParams | None = None

    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_output_tokens: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    num_preemptions: int = 0
    status_reason: str | None = None  # why it was aborted or rejected
    enqueue_time: float | None = None  # seconds; when it last entered the waiting queue
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first admission
    # A load of its prefix from a CPU offloading tier (policies/vllm_offload.py): (admitted to
    # load, put back to waiting with the KV in) in seconds, and the tokens loaded (of
    # ``num_cached_tokens``: vLLM's external hits); None without one
    kv_load: tuple[float, float, int] | None = None
    # vLLM V1's in-flight accounting, kept only for a policy that advances a request's computed
    # tokens when it schedules them (``vllm`` with async scheduling or speculative decoding:
    # ``Scheduler.advance_scheduled``, ``Scheduler.update_advanced``); 0 / False for every other.
    num_output_placeholders: int = 0  # tokens that steps in flight will sample (async scheduling)
    num_in_flight_tokens: int = 0  # tokens scheduled in steps whose outputs are not applied yet
    num_stale_output_tokens: int = 0  # in-flight tokens of steps scheduled before a preemption
    num_draft_tokens: int = 0  # draft tokens proposed for its next step (vLLM's spec_token_ids)
    is_prefill_chunk: bool = False  # its last scheduled step left part of its tokens uncomputed
    # The plain ``vllm`` pass's counterpart, read only with KV loads (``vllm_offload.py``): its
    # ``num_output_tokens`` when it was last admitted or scheduled a chunk leaving part of its
    # tokens uncomputed (-1: its last chunk did not). vLLM keeps such a request in its in-flight
    # prefills until a step computes all its tokens, which then samples: so it is one while its
    # output count still reads the same, and decodes never touch this.
    prefill_outputs: int = -1

    first_scheduled_time: float | None = None  # seconds; first admission to the running set
    token_times: list[float] = field(default_factory=list)  # seconds; one per output token
    finish_time: float | None = None  # seconds

    def __post_init__(self) -> None:
        if self.prompt_len < 1:
            raise ValueError(f"request {self.request_id}: prompt_len must be >= 1, got {self.prompt_len}")
        if self.max_tokens < 1:
            raise ValueError(f"request {self.request_id}: max_tokens must be >= 1, got {self.max_tokens}")

    @property
    def num_tokens(self) -> int:
        return self.prompt_len + self.num_output_tokens

    @property
    def num_remaining_tokens(self) -> int:
        """Tokens still to compute before the next output token is sampled."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_prefilling(self) -> bool:
        """True while more than one token is missing from the cache (prompt or recompute)."""
        return self.num_tokens - self.num_computed_tokens > 1

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> str | None:
        return FINISH_REASONS.get(self.status)
