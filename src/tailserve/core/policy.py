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

    def __init__(self, config: Any) -> None:
        self.config = config

    @classmethod
    @abstractmethod
    def default_config(cls, device: DeviceInfo, max_model_len: int, **overrides: Any) -> Any:
        """The engine's defaults for this device, with the user's overrides applied."""

    def add_request(self, sched: Scheduler, request: Request) -> None:
        sched.waiting.append(request)

    @abstractmethod
    def schedule(self, sched: Scheduler, now: float) -> SchedulerOutput: ...

    def on_finished(self, sched: Scheduler, finished: list[Request]) -> None:
        """Hook for policies that track batches (static batching)."""
        return None

    def can_fast_forward(self, sched: Scheduler) -> bool:
        """True when, while the running set only decodes, this policy's next decision depends
        on nothing but free KV blocks (which only shrink during decodes) and the running set.
        Then a run of identical decode iterations can be simulated in one exact step."""
        return True

    def next_wakeup(self, sched: Scheduler, now: float) -> float | None:
        """A time (seconds) at which the policy wants to be asked again even with no arrival."""
        return None

    def describe(self) -> str:
        """The policy with its resolved flags, e.g. ``vllm:max_num_batched_tokens=512``."""
        fields = getattr(self.config, "__dataclass_fields__", {})
        parts = [f"{k}={getattr(self.config, k)}" for k in fields]
        return f"{self.name}(" + ", ".join(parts) + ")"
