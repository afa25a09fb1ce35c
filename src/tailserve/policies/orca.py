"""Orca (OSDI'22) iteration-level scheduling, as Sarathi-Serve's ``orca_scheduler.py`` re-implements it.

The rules (``docs/policies.md``, "`orca` — iteration-level scheduling"):
1. Every running request decodes one token each iteration.
2. Waiting requests join in FCFS order *in the same iteration*, each with its whole prompt (no
   chunking), while fewer than ``max_num_seqs`` run and the KV cache can reserve the request's
   maximum total length (prompt + ``max_tokens``) up front.
3. The first request whose reservation does not fit stops admission.
4. No preemption: the worst-case reservation guarantees every admitted request completes.

So one long prompt makes its iteration long for every co-batched decode — the generation stall
that chunked prefill removes.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any

from tailserve.core.device import DeviceInfo
from tailserve.core.policy import Policy
from tailserve.core.scheduler import Scheduler
from tailserve.core.scheduler_output import ScheduledRequest, SchedulerOutput
from tailserve.executors.simulated.fast_paths import FastPaths
from tailserve.policies.sarathi_pipeline import PausedPipeline


@dataclass(frozen=True, slots=True)
class OrcaConfig:
    max_num_seqs: int = 256  # Orca's max_bs
    # 0: reserve each request's own prompt + max_tokens. N > 0: reserve at least N tokens per
    # request, as continuous-batching servers before paged KV did (one contiguous buffer of the
    # maximum sequence length per slot; docs/experiments.md, the Anyscale benchmark).
    reserve_tokens: int = 0
    # Set from the deployment's pipeline stages: Sarathi-Serve's pipelined engine (sarathi_pipeline.py)
    pipeline_parallel_size: int = field(default=1, metadata={"recorded_when_set": True})

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.reserve_tokens < 0:
            raise ValueError(f"reserve_tokens must be >= 0, got {self.reserve_tokens}")
        if self.pipeline_parallel_size < 1:
            raise ValueError(f"pipeline_parallel_size must be >= 1, got {self.pipeline_parallel_size}")


class OrcaPolicy(PausedPipeline, Policy, FastPaths):
    name = "orca"
    summary = (
        "Orca: iteration-level batching, whole prompts join running decodes, KV reserved for the max length"
    )
    config_cls = OrcaConfig
    default_block_size = 16
    default_gpu_memory_utilization = 0.9

    @classmethod
    def default_config(cls, device: DeviceInfo, max_model_len: int, **overrides: Any) -> OrcaConfig:
        known = {f.name for f in fields(OrcaConfig)}
        return replace(OrcaConfig(), **{k: v for k, v in overrides.items() if k in known})

    def schedule(self, sched: Scheduler, now: float) -> SchedulerOutput:
        out = SchedulerOutput()
        busy = sched.batch_of  # under pipeline stages: requests whose batch is in flight
        for request in sched.running:
            if busy and request in busy:
                continue  # not PAUSED (orca_scheduler.py)
            # Blocks were reserved for the whole sequence at admission; this never fails.
            sched.allocate(request, request.num_computed_tokens + 1)
            out.scheduled.append(ScheduledRequest(request, 1, request.num_computed_tokens))
        while sched.waiting and len(sched.running) < self.config.max_num_seqs:
            request = sched.waiting.peek_request()
            total = max(request.prompt_len + request.max_tokens, self.config.reserve_tokens)
            if not sched.allocate(request, total):
                break
            sched.waiting.pop_request()
            sched.admit(request, now)
            out.num_admitted += 1
            out.scheduled.append(ScheduledRequest(request, request.num_tokens, 0))
        return out
