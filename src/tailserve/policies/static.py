"""Static batching, the pre-Orca baseline (FasterTransformer, plain ``generate`` servers).

The rules:
1. Wait until ``batch_size`` requests are queued, or the oldest has waited ``max_wait`` seconds.
2. Take up to ``batch_size`` of them (FCFS) whose prompt + ``max_tokens`` fit the KV cache.
3. Prefill them together, every prompt padded to the longest one in the batch.
4. Decode the whole batch until its longest output is done: a request that finished early keeps
   its slot as padding, and nothing joins until the batch is over.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

from tailserve.core.device import DeviceInfo
from tailserve.core.policy import Policy
from tailserve.core.request import Request
from tailserve.core.scheduler import Scheduler
from tailserve.core.scheduler_output import PaddingSlot, ScheduledRequest, SchedulerOutput


@dataclass(frozen=True, slots=True)
class StaticConfig:
    batch_size: int = 8
    max_wait: float = 0.5  # seconds the oldest request waits for a full batch

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.max_wait < 0:
            raise ValueError(f"max_wait must be >= 0 seconds, got {self.max_wait}")


class StaticPolicy(Policy):
    name = "static"
    summary = "static batching: wait for a full batch, pad, run it to completion"
    config_cls = StaticConfig

    def __init__(self, config: StaticConfig) -> None:
        super().__init__(config)
        self._batch: list[Request] = []
        self._padded_len = 0  # longest prompt in the batch, tokens

    @classmethod
    def default_config(cls, device: DeviceInfo, max_model_len: int, **overrides: Any) -> StaticConfig:
        known = {f.name for f in fields(StaticConfig)}
        return replace(StaticConfig(), **{k: v for k, v in overrides.items() if k in known})

    def schedule(self, sched: Scheduler, now: float) -> SchedulerOutput:
        if self._batch:
            return self._decode_batch()
        if not sched.waiting or not self._batch_ready(sched, now):
            return SchedulerOutput()
        return self._start_batch(sched, now)

    def _batch_ready(self, sched: Scheduler, now: float) -> bool:
        cfg: StaticConfig = self.config
        # The same expression next_wakeup returns, so waking at that time is always ready.
        return (
            len(sched.waiting) >= cfg.batch_size
            or now >= sched.waiting.peek_request().arrival_time + cfg.max_wait
        )

    def _start_batch(self, sched: Scheduler, now: float) -> SchedulerOutput:
        out = SchedulerOutput()
        while sched.waiting and len(self._batch) < self.config.batch_size:
            request = sched.waiting.peek_request()
            if not sched.allocate(request, request.prompt_len + request.max_tokens):
                break
            sched.waiting.pop_request()
            sched.admit(request, now)
            self._batch.append(request)
        out.num_admitted = len(self._batch)
        self._padded_len = max(r.prompt_len for r in self._batch)
        for request in self._batch:
            out.scheduled.append(ScheduledRequest(request, request.prompt_len, 0))
            if request.prompt_len < self._padded_len:
                out.padding.append(PaddingSlot(self._padded_len - request.prompt_len, request.prompt_len))
        return out

    def _decode_batch(self) -> SchedulerOutput:
        out = SchedulerOutput()
        step = max(r.num_output_tokens for r in self._batch)
        for request in self._batch:
            if request.is_finished:
                out.padding.append(PaddingSlot(1, self._padded_len + step))
            else:
                out.scheduled.append(ScheduledRequest(request, 1, request.num_computed_tokens))
        return out

    def on_finished(self, sched: Scheduler, finished: list[Request]) -> None:
        if self._batch and all(r.is_finished for r in self._batch):
            self._batch = []

    def next_wakeup(self, sched: Scheduler, now: float) -> float | None:
        if self._batch or not sched.waiting:
            return None
        return sched.waiting.peek_request().arrival_time + self.config.max_wait
