"""One differential workload: a scheduler configuration and requests whose every event is a step.

Both sides (tailserve and the engine's driver) read this exact description, so the only thing
that can differ is the scheduling decision. Times are steps, not seconds: a request arrives
before the scheduler runs in its ``arrival_step``, an abort lands before the scheduler runs in
its ``abort_step``, and the fake model runner samples ``output_token_ids[k]`` as the k-th output
token (the token ``stop_token_id`` there ends the request as a stop-string would).

With speculative decoding each request also lists how many drafts a verification accepts
(``accepted[i]``: of all k, for a verification after ``len(prompt) + i`` computed tokens; with
fewer drafts scheduled, the first ones decide) — drawn by the simulated executor's own
acceptance model (``executors/simulated/spec_decode.py``), so both sides accept exactly what
tailserve's executor would.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

STOP_TOKEN_ID = 2  # never drawn for ordinary tokens


@dataclass(frozen=True, slots=True)
class SchedulerSpec:
    """The flags both schedulers get, under vLLM's names."""

    num_blocks: int  # usable KV blocks (vLLM gets one more for its null block)
    block_size: int = 16  # tokens
    max_num_batched_tokens: int = 256
    max_num_seqs: int = 8
    long_prefill_token_threshold: int = 0
    long_prefill_token_threshold_adaptive: bool = False  # vLLM V1 (0.32)
    # vLLM V1 (0.32) DP prefill balancing: steps off the cadence defer prefills (the drivers keep
    # the step counter; policies/vllm_dp_prefill.py)
    prefill_schedule_interval: int = 1
    max_num_active_seqs: int | None = None  # vLLM V1 (0.32): admission below max_num_seqs
    enable_prefix_caching: bool = True
    scheduling_policy: str = "fcfs"  # or "priority"
    max_model_len: int = 4096  # tokens
    enable_chunked_prefill: bool = True
    # vLLM V0 only: CPU swap blocks and the preemption mode ("auto" = vLLM's None).
    num_cpu_blocks: int = 0
    preemption_mode: str = "auto"
    # vLLM V1 (0.32): async scheduling (its engine core's batch queue of two) and speculative
    # decoding (``--speculative-config``'s method and num_speculative_tokens).
    async_scheduling: bool = False
    speculative_method: str | None = None
    num_speculative_tokens: int = 0
    # vLLM's synthetic rejection sampler's per-position rates, which drew ``RequestSpec.accepted``
    synthetic_acceptance_rates: list[float] | None = None
    # vLLM V1 (0.32) native KV offloading (``--kv-offloading-size``): chunks (one KV block each)
    # the CPU tier holds; 0 = no tier. Needs prefix caching (tailserve's tier sits behind it).
    num_host_blocks: int = 0
    # vLLM V1 (0.32) as one side of a P/D pair with its ``NixlConnector`` (pull mode):
    # "kv_consumer" (the decode instance: every request's prompt KV is read from a remote
    # prefill instance once admitted), "kv_producer" (the prefill instance: every finished
    # request keeps its KV until the decode side has read it); None = no connector.
    nixl_role: str | None = None
    # vLLM V1 (0.32) pipeline parallelism: the engine core's batch queue holds this many steps
    # (one more with async scheduling, whose scheduler staggers a request's decodes by it).
    pipeline_parallel_size: int = 1

    def __post_init__(self) -> None:
        if self.num_blocks < 1 or self.block_size < 1:
            raise ValueError(
                f"num_blocks and block_size must be >= 1, got {self.num_blocks}, {self.block_size}"
            )
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be fcfs or priority, got {self.scheduling_policy!r}")
        if self.pipeline_parallel_size < 1:
            raise ValueError(f"pipeline_parallel_size must be >= 1, got {self.pipeline_parallel_size}")
        if self.num_host_blocks < 0:
            raise ValueError(f"num_host_blocks must be >= 0, got {self.num_host_blocks}")
        if self.nixl_role not in (None, "kv_consumer", "kv_producer"):
            raise ValueError(f"nixl_role must be kv_consumer or kv_producer, got {self.nixl_role!r}")
        if self.nixl_role is not None and self.num_host_blocks:
            raise ValueError("nixl_role goes without num_host_blocks here")
        if self.num_host_blocks and not self.enable_prefix_caching:
            raise ValueError("num_host_blocks (a CPU offloading tier) needs enable_prefix_caching")
        given = (self.speculative_method is not None, self.synthetic_acceptance_rates is not None)
        if len({*given, self.num_speculative_tokens > 0}) > 1:
            raise ValueError(
                "speculative_method, synthetic_acceptance_rates and num_speculative_tokens >= 1 go together"
            )


@dataclass(frozen=True, slots=True)
class RequestSpec:
    request_id: str
    arrival_step: int
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # what the fake model samples, in order; len == max_tokens
    priority: int = 0  # lower is more urgent (vLLM)
    abort_step: int | None = None
    # Speculative decoding: drafts accepted by a verification after len(prompt) + i computed
    # tokens (see the module docstring); None without drafts.
    accepted: list[int] | None = None
    # With a NixlConnector (``SchedulerSpec.nixl_role``): the steps its fake worker takes to
    # report the transfer done, counted from the step that starts it (a consumer's read: the
    # step that admitted the request to load; a producer's send: the step after the request
    # finished, whose connector metadata first lists it) to the step whose output reports it.
    transfer_steps: int | None = None

    @property
    def max_tokens(self) -> int:
        return len(self.output_token_ids)

    def num_accepted(self, num_context_tokens: int, num_drafts: int) -> int:
        """Drafts accepted of ``num_drafts`` verified after ``num_context_tokens`` computed tokens."""
        assert self.accepted is not None, f"request {self.request_id}: no acceptance draws"
        i = num_context_tokens - len(self.prompt_token_ids)
        if not 0 <= i < len(self.accepted):
            raise ValueError(
                f"request {self.request_id}: no acceptance draw for a verification at {num_context_tokens}"
            )
        return min(self.accepted[i], num_drafts)

    def __post_init__(self) -> None:
        if not self.prompt_token_ids or not self.output_token_ids:
            raise ValueError(f"request {self.request_id}: prompt and outputs must be non-empty")
        if self.abort_step is not None and self.abort_step <= self.arrival_step:
            raise ValueError(f"request {self.request_id}: abort_step must come after arrival_step")
        if self.transfer_steps is not None and self.transfer_steps < 0:
            raise ValueError(f"request {self.request_id}: transfer_steps must be >= 0")


@dataclass(frozen=True, slots=True)
class Workload:
    scheduler: SchedulerSpec
    requests: list[RequestSpec] = field(default_factory=list)
    max_steps: int = 2000  # a run still unfinished by then is reported as such
    stop_token_id: int = STOP_TOKEN_ID
    seed: int | None = None  # the generator's seed, for the record

    def __post_init__(self) -> None:
        ids = [r.request_id for r in self.requests]
        if len(set(ids)) != len(ids):
            raise ValueError("request ids must be unique")
        capacity = self.scheduler.num_blocks * self.scheduler.block_size
        for r in self.requests:
            if (self.scheduler.nixl_role is None) != (r.transfer_steps is None):
                raise ValueError(
                    f"request {r.request_id}: transfer_steps goes with nixl_role, and only with it"
                )
            total = len(r.prompt_token_ids) + r.max_tokens
            if total > min(capacity, self.scheduler.max_model_len):
                # vLLM's scheduler would loop forever on it; tailserve rejects it at the door.
                raise ValueError(
                    f"request {r.request_id}: {total} tokens exceed the KV capacity ({capacity}) or "
                    f"max_model_len ({self.scheduler.max_model_len})"
                )

    def to_dict(self) -> dict[str, Any]:
        """The wire format the drivers read (``config`` holds the scheduler flags)."""
        requests = []
        for r in self.requests:
            d = asdict(r)
            d["max_tokens"] = r.max_tokens
            requests.append(d)
        return {
            "config": asdict(self.scheduler),
            "requests": requests,
            "max_steps": self.max_steps,
            "stop_token_id": self.stop_token_id,
            "seed": self.seed,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Workload:
        requests = [
            RequestSpec(
                request_id=r["request_id"],
                arrival_step=r["arrival_step"],
                prompt_token_ids=list(r["prompt_token_ids"]),
                output_token_ids=list(r["output_token_ids"]),
                priority=r.get("priority", 0),
                abort_step=r.get("abort_step"),
                accepted=r.get("accepted"),
                transfer_steps=r.get("transfer_steps"),
            )
            for r in d["requests"]
        ]
        return cls(
            scheduler=SchedulerSpec(**d["config"]),
            requests=requests,
            max_steps=d.get("max_steps", 2000),
            stop_token_id=d.get("stop_token_id", STOP_TOKEN_ID),
            seed=d.get("seed"),
        )


def encode_tokens(tokens: list[int]) -> list[list[int]]:
    """Token ids as runs ``[first, length]`` of consecutive ids (the generator's prompts are a
    few such runs, so golden fixtures stay small)."""
    runs: list[list[int]] = []
    for t in tokens:
        if runs and runs[-1][0] + runs[-1][1] == t:
            runs[-1][1] += 1
        else:
            runs.append([t, 1])
    return runs


def decode_tokens(runs: list[list[int]]) -> list[int]:
    return [t for first, n in runs for t in range(first, first + n)]


def to_compact(w: Workload) -> dict[str, Any]:
    """``Workload.to_dict`` with each request as ``[id, arrival_step, prompt runs, output runs,
    priority, abort_step]`` (and its acceptance draws, with speculative decoding, then its
    transfer steps, with a NixlConnector; null draws before those) and token
    lists as runs (``encode_tokens``): golden files stay small."""
    d = w.to_dict()
    d["requests"] = [
        [
            r["request_id"],
            r["arrival_step"],
            encode_tokens(r["prompt_token_ids"]),
            encode_tokens(r["output_token_ids"]),
            r["priority"],
            r["abort_step"],
            *([r["accepted"]] if r["accepted"] is not None or r["transfer_steps"] is not None else []),
            *([r["transfer_steps"]] if r["transfer_steps"] is not None else []),
        ]
        for r in d["requests"]
    ]
    if not w.scheduler.async_scheduling and not w.scheduler.num_speculative_tokens:
        for name in (
            "async_scheduling",
            "speculative_method",
            "num_speculative_tokens",
            "synthetic_acceptance_rates",
        ):
            d["config"].pop(name)  # fixtures recorded before these flags read the same
    if not w.scheduler.num_host_blocks:
        d["config"].pop("num_host_blocks")  # likewise without a CPU offloading tier
    if w.scheduler.nixl_role is None:
        d["config"].pop("nixl_role")  # likewise without a NixlConnector
    if w.scheduler.pipeline_parallel_size == 1:
        d["config"].pop("pipeline_parallel_size")  # likewise without pipeline parallelism
    return d


def from_compact(d: dict[str, Any]) -> Workload:
    requests = [
        {
            "request_id": r[0],
            "arrival_step": r[1],
            "prompt_token_ids": decode_tokens(r[2]),
            "output_token_ids": decode_tokens(r[3]),
            "priority": r[4],
            "abort_step": r[5],
            "accepted": r[6] if len(r) > 6 else None,
            "transfer_steps": r[7] if len(r) > 7 else None,
        }
        for r in d["requests"]
    ]
    return Workload.from_dict(dict(d, requests=requests))
