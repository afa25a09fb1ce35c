"""A policy is one engine's ordering and budget rules, nothing else.

The scheduler (``core/scheduler.py``) owns the queues (``waiting``, ``running``, ``swapped``,
``finished``), the KV manager and the shared mechanics (token accounting, ``allocate``,
``admit``, ``preempt_by_recompute`` / ``preempt_by_swap``, ``swap_in``, ``reject``, ``abort``).
A policy decides through these hooks, and nothing in the core calls it but the scheduler — the
engine asks the scheduler, which asks the policy (``PolicyHooks`` in ``core/scheduler.py`` names
what it asks):

- **Queue order.** ``create_waiting_queue()`` picks the waiting-queue strategy
  (``core/queues.py``: ``FCFSRequestQueue`` by default; vLLM's ``PriorityRequestQueue`` with
  ``scheduling_policy=priority``). The policy adds, peeks, pops and re-queues through the queue's
  vLLM names (``add_request``, ``peek_request``, ``pop_request``, ``prepend_request``,
  ``remove_requests``); an engine that re-sorts its queue every iteration (SGLang's
  ``calc_priority``, vLLM V0's priority pass) hands the new order to ``reorder`` / ``sort``,
  never rebuilding the container itself. The queue also names its preemption victim
  (``preemption_victim``), since the order that admits first is the one that preempts last.
- **Arrival / admission control.** ``add_request(sched, request)``: queue the request
  (``sched.waiting.add_request``) or refuse it (``sched.reject``), e.g. TGI's backpressure;
  ``refuses_at_arrival`` says whether a live server answers such a refusal at once (vLLM's 503).
- **The decision.** ``schedule(sched, now) -> SchedulerOutput``: budgets, who runs with how
  many tokens, victims, by calling the scheduler's mechanics; the output lists the decisions.
- **Departures.** ``on_finished(sched, finished)``: bookkeeping when requests leave.
- **Time.** ``next_wakeup`` (a timer, e.g. static batching's ``max_wait``); ``async_scheduling``
  (vLLM's: the engine schedules a step while the previous one runs).
- **The executor's part.** ``speculative_decoding`` (draft tokens and their acceptance, priced
  and drawn by the simulated executor).
- **Declarations.** ``kv_spec`` (the KV manager kind and CPU swap space the engine needs;
  ``kv/factory.py`` builds it), ``default_config`` (with ``default_notes``), ``profile_tokens``,
  ``drafter_memory`` (a drafter's weights and KV layers that share the pool), ``admits_fcfs`` (whether
  ``fairness=vtc`` may order its waiting queue), ``stream_interval`` (how the engine's API server
  chunks a streamed response: the client's ITL, not the engine's steps), ``notes``, ``describe``.

A new policy (e.g. an SLO-aware one) is one file: a frozen config, these hooks, and a
``registry.py`` entry.

Two optional protocols live beside the simulator's cost model, not in this class (most policies
need neither, and the core knows no executor): ``executors/simulated/fast_paths.py``'s
``FastPaths``, inherited by a policy that signs the exactness contracts under which the
simulator's driver advances many iterations in one step (it asks such a policy directly; a
policy without them is always stepped), and ``executors/simulated/cost_binding.py``'s
``PredictsIterations`` (``bind_cost_model``: a policy that predicts iteration times, ``slo``, is
handed the cost model when the engine is assembled).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar, Literal

from tailserve.core.device import DeviceInfo
from tailserve.core.queues import FCFSRequestQueue, RequestQueue
from tailserve.core.request import Request
from tailserve.core.scheduler import Scheduler
from tailserve.core.scheduler_output import SchedulerOutput
from tailserve.core.stream_interval import StreamInterval
from tailserve.kv.spec import KVSpec


class Policy(ABC):
    name: ClassVar[str]
    summary: ClassVar[str]
    config_cls: ClassVar[type]
    # Engine-wide defaults of the engine this policy models.
    default_block_size: ClassVar[int] = 16
    default_gpu_memory_utilization: ClassVar[float] = 0.9
    # Whether that fraction is of the memory left after weights and activations (TensorRT-LLM's
    # free_gpu_memory_fraction) rather than of the whole memory (vLLM's, and the rest's).
    memory_fraction_of_free: ClassVar[bool] = False
    # The engine loop that runs the batches through pipeline stages (``pipeline_parallel_size``
    # > 1): "vllm", vLLM V1's batch queue (``Engine._step_pipelined``: computed tokens advance at
    # scheduling); "sarathi", Sarathi-Serve's pipelined engine (``Engine._step_paused``: only
    # requests with no batch in flight are scheduled, ``Scheduler.batch_of``), whose schedule
    # loop also wakes on a ``schedule_tick``-second timer; "trtllm", TensorRT-LLM's
    # ``_executor_loop_pp`` (``Engine._step_ring``: the same skip, micro-batch slots in turn).
    pipeline_engine: ClassVar[Literal["vllm", "sarathi", "trtllm"]] = "vllm"
    schedule_tick: ClassVar[float] = 0.0

    def __init__(self, config: Any) -> None:
        self.config = config

    @classmethod
    @abstractmethod
    def default_config(cls, device: DeviceInfo, max_model_len: int, **overrides: Any) -> Any:
        """The engine's defaults for this device, with the user's overrides applied."""

    @classmethod
    def default_notes(cls, device: DeviceInfo, config: Any, overrides: dict[str, Any]) -> list[str]:
        """One line for each default ``default_config`` chose by a rule of the engine's that the
        user may want to know about (vLLM's async scheduling on or off, and why), as the engine
        logs it at startup; the run's notes carry them."""
        return []

    @classmethod
    def drafter_memory(cls, config: Any) -> Any:
        """What the engine's speculative drafter takes from the KV pool, the one hook for every
        engine: a ``executors/simulated/drafter_memory.DrafterMemory`` (draft weight layers
        loaded before the pool is sized, draft KV layers every token holds, where the engine
        does it) that the simulated KV capacity resolves against the deployment (``kv_capacity``);
        None without a drafter on the GPU, or where the policy does not count it (the default)."""
        return None

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

    # The HTTP status an API server answers such a refusal with (vLLM's and SGLang's 503; TGI's
    # router answers 429).
    refusal_status: ClassVar[int] = 503

    def refuses_at_arrival(self) -> bool:
        """True when ``add_request`` may refuse a request the way an API server answers it at
        once (vLLM's ``max_num_queued_reqs`` / ``max_num_queued_tokens``, TGI's backpressure):
        a server's engine (``LLMEngine.raise_refusals``) then hands the policy each request as it
        is added and raises the refusal to the caller instead of reporting a finished output."""
        return False

    @abstractmethod
    def schedule(self, sched: Scheduler, now: float) -> SchedulerOutput: ...

    def on_finished(self, sched: Scheduler, finished: list[Request]) -> None:
        """Hook for policies that track batches (static batching)."""
        return None

    # What the engine's stream_interval counts, and what a request's own value does to it
    # (core/stream_interval.py). An engine without one streams every step and takes no request's.
    stream_unit: ClassVar[str] = "tokens"
    stream_per_request: ClassVar[str] = "ignore"

    def stream_interval(self) -> StreamInterval:
        """How the engine's API server chunks a streamed response: the config's
        ``stream_interval`` (1, every step's tokens at once, for a policy without one)."""
        every = getattr(self.config, "stream_interval", 1)
        return StreamInterval(every, self.stream_unit, self.stream_per_request)

    def admits_fcfs(self) -> bool:
        """True when, as configured, the policy admits from the head of a plain FCFS waiting
        queue, so ``fairness=vtc`` may choose that order instead (``policies/fairness.py``)."""
        return False

    def load_done(self, request: Request) -> float | None:
        """When the KV load into a request of ``Scheduler.loading`` is done (None: no load in
        flight); a request aborted before then keeps its blocks until it is."""
        return None

    def next_wakeup(self, sched: Scheduler, now: float) -> float | None:
        """A time (seconds) at which the policy wants to be asked again even with no arrival."""
        return None

    def async_scheduling(self) -> bool:
        """True when the engine schedules each step while the previous one runs (vLLM's async
        scheduling): ``Engine`` then applies a step's outputs after scheduling the next, and the
        simulated executor's host time overlaps the previous step's forward pass. Such a policy
        advances computed tokens when it schedules (``SchedulerOutput.advanced``)."""
        return False

    def pipeline_parallel_size(self) -> int:
        """Pipeline stages the engine's batches pass through (vLLM's ``--pipeline-parallel-size``):
        above 1, ``Engine`` keeps ``max_concurrent_batches`` batches in flight and the simulated
        executor times each stage (``executors/simulated/pipeline.py``)."""
        return 1

    def max_concurrent_batches(self) -> int:
        """Batches the engine keeps in flight: 2 with async scheduling, else 1 (vLLM's
        ``max_concurrent_batches``; a pipeline-parallel policy says its own)."""
        return 2 if self.async_scheduling() else 1

    def fetch_wait(self) -> tuple[float, int] | None:
        """(seconds, requests): the engine's fetch of new requests waits up to that long, at the
        start of every step, for that many when fewer came (TensorRT-LLM's
        ``batch_wait_timeout_ms``, ``Engine._fetched``); None: the step takes what has arrived."""
        return None

    def speculative_decoding(self) -> Any:
        """The speculative decoding this configuration runs, for the simulated executor (its
        acceptance model and drafter cost: ``executors/simulated/spec_decode.py``'s
        ``SpecDecoding``; ``core`` knows no executor, hence ``Any``); None without."""
        return None

    def cuda_graph_padding(self) -> Any:
        """How the engine pads generation-only steps to a captured CUDA-graph batch size, for the
        simulated executor (``executors/simulated/cuda_graph.py``'s ``CudaGraphPadding``); None
        where it is not priced."""
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
