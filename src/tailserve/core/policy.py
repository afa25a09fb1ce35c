"""A policy is one engine's ordering and budget rules, nothing else.

The scheduler (``core/scheduler.py``) owns the queues (``waiting``, ``running``, ``swapped``,
``finished``), the KV manager and the shared mechanics (token accounting, ``allocate``,
``admit``, ``preempt_by_recompute`` / ``preempt_by_swap``, ``swap_in``, ``reject``, ``abort``).
A policy decides through these hooks, and nothing else calls it — the engine and the fast paths
ask the scheduler, which asks the policy:

- **Queue order.** ``create_waiting_queue()`` picks the waiting-queue strategy
  (``core/queues.py``: ``FCFSRequestQueue`` by default; vLLM's ``PriorityRequestQueue`` with
  ``scheduling_policy=priority``). The policy adds, peeks, pops and re-queues through the queue's
  vLLM names (``add_request``, ``peek_request``, ``pop_request``, ``prepend_request``,
  ``remove_requests``); an engine that re-sorts its queue every iteration (SGLang's
  ``calc_priority``, vLLM V0's priority pass) hands the new order to ``reorder`` / ``sort``,
  never rebuilding the container itself. The queue also names its preemption victim
  (``preemption_victim``), since the order that admits first is the one that preempts last.
- **Arrival / admission control.** ``add_request(sched, request)``: queue the request
  (``sched.waiting.add_request``) or refuse it (``sched.reject``), e.g. TGI's backpressure.
- **The decision.** ``schedule(sched, now) -> SchedulerOutput``: budgets, who runs with how
  many tokens, victims, by calling the scheduler's mechanics; the output lists the decisions.
- **Departures.** ``on_finished(sched, finished)``: bookkeeping when requests leave.
- **Fast paths** (exactness contracts, see each docstring): ``can_fast_forward``,
  ``on_decode_run``, ``decode_reserve_blocks``, ``chunk_run_budget``, ``chunk_run_ready``,
  ``chunk_run_grants``, ``on_chunk_run``, ``chunk_run_takes_arrivals``, ``lone_chunk_run``,
  ``on_lone_chunk_run``.
- **Time and executor.** ``next_wakeup`` (a timer, e.g. static batching's ``max_wait``);
  ``bind_executor`` (a policy that predicts iteration times takes the executor's cost model).
- **Declarations.** ``kv_spec`` (the KV manager kind and CPU swap space the engine needs;
  ``kv/factory.py`` builds it), ``default_config``, ``profile_tokens``, ``admits_fcfs`` (whether
  ``fairness=vtc`` may order its waiting queue), ``notes``, ``describe``.

A new policy (e.g. an SLO-aware one) is one file: a frozen config, these hooks, and a
``registry.py`` entry.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, ClassVar

from tailserve.core.device import DeviceInfo
from tailserve.core.queues import FCFSRequestQueue, RequestQueue
from tailserve.core.request import Request
from tailserve.core.scheduler import Scheduler
from tailserve.core.scheduler_output import SchedulerOutput
from tailserve.kv.spec import KVSpec

if TYPE_CHECKING:
    from tailserve.core.prefill_run import LoneChunkRun


class Policy(ABC):
    name: ClassVar[str]
    summary: ClassVar[str]
    config_cls: ClassVar[type]
    # Engine-wide defaults of the engine this policy models.
    default_block_size: ClassVar[int] = 16
    default_gpu_memory_utilization: ClassVar[float] = 0.9
    # Free blocks a decode iteration must leave untouched or it preempts (Sarathi: 1).
    decode_reserve_blocks: ClassVar[int] = 0
    # ``core/chunk_run.py`` may add arrivals inside a run of full-chunk iterations: True only
    # where a request that arrives then can neither join such an iteration nor change the
    # policy's later decisions except by waiting (or being rejected) — TGI, whose router has no
    # prefill budget left beside a full chunk.
    chunk_run_takes_arrivals: ClassVar[bool] = False

    def __init__(self, config: Any) -> None:
        self.config = config

    @classmethod
    @abstractmethod
    def default_config(cls, device: DeviceInfo, max_model_len: int, **overrides: Any) -> Any:
        """The engine's defaults for this device, with the user's overrides applied."""

    @classmethod
    def profile_tokens(cls, config: Any, max_model_len: int) -> int:
        """Tokens of the largest forward pass the engine sizes its activation memory for: one
        whole ``max_model_len`` sequence unless the policy says otherwise (vLLM profiles
        ``max_num_batched_tokens``)."""
        return max_model_len

    def kv_spec(self) -> KVSpec:
        """The KV cache this configuration needs (plain paged blocks by default)."""
        return KVSpec()

    def create_waiting_queue(self) -> RequestQueue:
        """The waiting-queue strategy (called once, by the scheduler's constructor)."""
        return FCFSRequestQueue()

    def add_request(self, sched: Scheduler, request: Request) -> None:
        """A request arrived (already checked against ``max_model_len`` and the KV capacity):
        queue it, or refuse it with ``sched.reject``."""
        sched.waiting.add_request(request)

    @abstractmethod
    def schedule(self, sched: Scheduler, now: float) -> SchedulerOutput: ...

    def on_finished(self, sched: Scheduler, finished: list[Request]) -> None:
        """Hook for policies that track batches (static batching)."""
        return None

    def admits_fcfs(self) -> bool:
        """True when, as configured, the policy admits from the head of a plain FCFS waiting
        queue, so ``fairness=vtc`` may choose that order instead (``policies/fairness.py``)."""
        return False

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

    def chunk_run_budget(self) -> int | None:
        """The fixed token budget of a Sarathi-style iteration (decodes first, then one prompt
        chunked to fill the budget), for ``core/chunk_run.py``'s exact fast path; None (the
        default) when the policy's iterations are not of that shape."""
        return None

    def chunk_run_ready(self, sched: Scheduler) -> bool:
        """A cheap test before ``core/chunk_run.py`` scans the running batch: False when the
        policy knows no prompt is being chunked (TGI: no chunk planned); True by default."""
        return True

    def chunk_run_grants(self, sched: Scheduler, prompt: Request, chunk: int) -> bool:
        """For ``core/chunk_run.py``: whether the next iteration grants ``prompt`` ``chunk``
        tokens beside one token per decode, as ``chunk_run_budget`` implies. A policy that plans
        a prompt's next chunk one forward ahead (TGI) checks its plan here; True by default."""
        return True

    def on_chunk_run(self, sched: Scheduler, prompt: Request, num_steps: int) -> None:
        """After the engine advanced ``num_steps`` iterations of ``core/chunk_run.py`` (already
        applied to ``prompt`` and the decodes): leave the policy's state as ``num_steps`` calls
        of ``schedule`` would have."""
        return None

    def lone_chunk_run(self, sched: Scheduler) -> LoneChunkRun | None:
        """For ``core/prefill_run.py``'s exact fast path: when the next iterations each grant
        one chunked prompt the same full chunk and nobody else anything (SGLang's chunked
        request without mixed decodes), that request, the chunk and how many such iterations
        follow if nothing arrives; None (the default) otherwise."""
        return None

    def on_lone_chunk_run(self, sched: Scheduler, num_steps: int) -> None:
        """After the engine advanced ``num_steps`` iterations promised by ``lone_chunk_run``:
        leave the policy's state as ``num_steps`` calls of ``schedule`` would have."""
        return None

    def bind_executor(self, executor: Any) -> None:
        """Called once by the engine with its executor (a policy that predicts iteration
        times takes the cost model here); the default ignores it."""
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
