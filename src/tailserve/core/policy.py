"""A policy is one engine's ordering and budget rules, nothing else.

Shared mechanics (allocation, admission, recompute preemption, token accounting) live in
``Scheduler`` (core/scheduler.py); a policy calls them from ``schedule``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

from tailserve.core.device import DeviceInfo
from tailserve.core.request import Request
from tailserve.core.scheduler import Scheduler
from tailserve.core.scheduler_output import SchedulerOutput


class Policy(ABC):
    name: ClassVar[str]
    summary: ClassVar[str]
    config_cls: ClassVar[type]
    # Engine-wide defaults of the engine this policy models.
    default_block_size: ClassVar[int] = 16
    default_gpu_memory_utilization: ClassVar[float] = 0.9
    # Free blocks a decode iteration must leave untouched or it preempts (Sarathi: 1).
    decode_reserve_blocks: ClassVar[int] = 0

    def __init__(self, config: Any) -> None:
        self.config = config

    @classmethod
    @abstractmethod
    def default_config(cls, device: DeviceInfo, max_model_len: int, **overrides: Any) -> Any:
        """The engine's defaults for this device, with the user's overrides applied."""

    @classmethod
    def profile_tokens(cls, config: Any, max_model_len: int) -> int:
        """Tokens of the largest forward pass the engine sizes its activation memory for (vLLM
        profiles ``max_num_batched_tokens``)."""
        return getattr(config, "max_num_batched_tokens", None) or max_model_len

    def add_request(self, sched: Scheduler, request: Request) -> None:
        sched.waiting.append(request)

    @abstractmethod
    def schedule(self, sched: Scheduler, now: float) -> SchedulerOutput: ...

    def on_finished(self, sched: Scheduler, finished: list[Request]) -> None:
        """Hook for policies that track batches (static batching)."""
        return None

    def can_fast_forward(self, sched: Scheduler) -> bool:
        """True when, with every running request one token behind, this policy would schedule
        one decode for each of them, in running order, and admit nobody, for as long as no
        request arrives or finishes and the free KV blocks suffice — i.e. its decision depends on
        nothing but the running set and the free blocks (which only shrink while decoding). The
        engine then simulates such a run of iterations in one exact step. A policy whose state
        changes per decode iteration keeps it exact through ``on_decode_run``."""
        return True

    def on_decode_run(self, sched: Scheduler, num_steps: int) -> None:
        """Called after the engine advanced ``num_steps`` decode-only iterations in one step:
        apply whatever per-iteration bookkeeping the policy keeps (counters, decaying ratios)
        exactly as ``num_steps`` calls of ``schedule`` would have."""
        return None

    def next_wakeup(self, sched: Scheduler, now: float) -> float | None:
        """A time (seconds) at which the policy wants to be asked again even with no arrival."""
        return None

    def notes(self) -> list[str]:
        """Things the user should know about how this configuration is simulated (e.g. a flag
        accepted but not modelled yet); printed by the CLI."""
        return []

    def describe(self) -> str:
        """The policy with its resolved flags, e.g. ``vllm:max_num_batched_tokens=512``."""
        fields = getattr(self.config, "__dataclass_fields__", {})
        parts = [f"{k}={getattr(self.config, k)}" for k in fields]
        return f"{self.name}(" + ", ".join(parts) + ")"
