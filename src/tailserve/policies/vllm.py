"""vLLM V1 (``vllm/v1/core/sched/scheduler.py``, 0.32, checked step for step by tailserve.validate): one token budget, running first.

The rules, in the engine's order (``docs/policies.md``, "`vllm` — vLLM V1"):
1. Budget ``max_num_batched_tokens``; per-request cap ``long_prefill_token_threshold`` (0 = off,
   and off whenever only one request is running or waiting).
2. RUNNING requests in admission order each get ``min(num_tokens - num_computed_tokens, cap,
   budget left)``: 1 for a decode, a chunk for a prefill still in progress. If their KV does not
   fit, preempt by recompute the *last* running request (most recently admitted), retrying
   until it fits or the request preempted itself, which ends the pass.
3. If anyone was preempted this iteration, admit nothing.
4. WAITING requests in FCFS order while budget is left and fewer than ``max_num_seqs`` run:
   with ``scheduler_reserve_full_isl`` the free blocks must hold the whole prompt (plus the
   watermark once something runs); the first chunk is allocated; the first request that does
   not fit stops the pass (head-of-line blocking). Without chunked prefill a prompt larger than
   the budget left also stops it.
5. A preempted request goes back to the *front* of the waiting queue and recomputes its prompt
   and its generated tokens.

With ``scheduling_policy=priority`` the waiting queue is ordered by (priority, arrival time,
request id), lower values first; the preemption victim is the running request with the largest
(priority, arrival time) — the least urgent, then the latest — whose tokens go back to the budget
if it was already scheduled; a request that preempted itself ends the running pass, as under
FCFS (``scheduler.py`` 0.32: ``if new_blocks is None: break`` after the preemption loop); and a
preempted request re-enters the queue by its key (a plain heap push), not at the front.

Prefix caching (``enable_prefix_caching``, on by default in V1): a new or preempted request
first looks up the longest chain of its cached full blocks (capped so one token is computed);
the hit raises ``num_computed_tokens`` without using the budget, and the admission gate counts
the hit blocks only if they sit evictable in the free queue. A preempted request finds its own
surviving blocks. Keys need token identities: token ids, or Mooncake ``hash_ids``.

Async scheduling (``async_scheduling``) and speculative decoding (``speculative_method``,
``num_speculative_tokens``, ``synthetic_acceptance_rates`` / ``synthetic_acceptance_length``:
vLLM's ``--speculative-config`` fields) switch to vLLM's own accounting, with output
placeholders and draft tokens (``vllm_async.py``); the plain pass below is unchanged without them.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any

from tailserve.core.device import DeviceInfo
from tailserve.core.policy import Policy
from tailserve.core.queues import RequestQueue, create_request_queue
from tailserve.core.request import Request
from tailserve.core.scheduler import Scheduler
from tailserve.core.scheduler_output import ScheduledRequest, SchedulerOutput, new_output, scheduled_decode
from tailserve.executors.simulated.drafter_memory import DrafterMemory
from tailserve.executors.simulated.fast_paths import FastPaths
from tailserve.executors.simulated.spec_decode import METHODS, SpecDecoding, resolve_acceptance_rates
from tailserve.kv.spec import KVSpec
from tailserve.policies.vllm_admission import Admission
from tailserve.policies.vllm_async import schedule_advanced
from tailserve.policies.vllm_dp_prefill import PrefillThrottle
from tailserve.policies.vllm_offload import BLOCKED, OffloadLoads
from tailserve.policies.vllm_pipeline import DecodeStagger, max_concurrent_batches
from tailserve.policies.vllm_prefill_cap import prefill_cap
from tailserve.policies.vllm_remote import Pull, RemoteLoads

# Fields of features off by default: a run file names them only when set (sim/run.py).
_WHEN_SET = {"recorded_when_set": True}


@dataclass(frozen=True, slots=True)
class VllmConfig:
    max_num_batched_tokens: int
    max_num_seqs: int
    long_prefill_token_threshold: int = 0
    # vLLM 0.32: floor the threshold at max_num_batched_tokens // (running + waiting requests)
    long_prefill_token_threshold_adaptive: bool = field(default=False, metadata=_WHEN_SET)
    # vLLM 0.32: admission into RUNNING stops at this many (max_num_seqs still sizes the runner,
    # its CUDA graphs and a hybrid model's sliding-window pages); none: max_num_seqs
    max_num_active_seqs: int | None = field(default=None, metadata=_WHEN_SET)
    # vLLM 0.32, an MoE model's DP group: new prefills only every N-th group step
    # (policies/vllm_dp_prefill.py); no effect on one engine
    prefill_schedule_interval: int = field(default=1, metadata=_WHEN_SET)
    enable_chunked_prefill: bool = True
    scheduler_reserve_full_isl: bool = True
    watermark: float = 0.0  # fraction of KV blocks kept free when admitting
    scheduling_policy: str = "fcfs"  # or "priority"
    enable_prefix_caching: bool = True  # automatic prefix caching (hashed 16-token blocks, LRU)
    # Schedule each step while the previous one runs (vLLM's --async-scheduling,
    # --no-async-scheduling). none: as vLLM 0.32 decides, on on GPUs unless an option rules it out,
    # off on its CPU platform and with the CPU ngram drafter (async_scheduling_default)
    async_scheduling: bool | None = field(default=None, metadata=_WHEN_SET)
    # Speculative decoding: the drafter, vLLM's --speculative-config "method" (the fields below
    # are that config's own names; executors/simulated/spec_decode.py).
    speculative_method: str | None = field(default=None, metadata={"choices": tuple(METHODS), **_WHEN_SET})
    # drafts per decode step (0: no speculative decoding)
    num_speculative_tokens: int = field(default=0, metadata=_WHEN_SET)
    # per-position unconditional acceptance rates (vLLM's logged per-position acceptance
    # rate), non-increasing, one per draft; 0.8,0.5 (0.8/0.5 in a policy spec)
    synthetic_acceptance_rates: tuple[float, ...] | None = field(default=None, metadata=_WHEN_SET)
    # or the mean acceptance length: 1 + accepted drafts per decode step, in [1, k + 1]
    synthetic_acceptance_length: float | None = field(default=None, metadata=_WHEN_SET)
    # A CPU tier behind the prefix cache (vLLM's --kv-offloading-size with the native backend):
    # GiB of host memory over all TP ranks (policies/vllm_offload.py, kv/host_tier.py)
    kv_offloading_size: float | None = field(default=None, metadata=_WHEN_SET)
    # vLLM 0.32's API-server admission limits (policies/vllm_admission.py; none: no limit).
    # Refuse an arrival (HTTP 503) when it and the unfinished requests would be more than this
    max_num_queued_reqs: int | None = field(default=None, metadata=_WHEN_SET)
    # Refuse an arrival (HTTP 503) while the prompts of the requests before their first token
    # hold at least this many tokens (vLLM: target TTFT x prefill throughput)
    max_num_queued_tokens: int | None = field(default=None, metadata=_WHEN_SET)
    # Tokens the API server holds per streamed chunk (core/stream_interval.py): the client's ITL,
    # not the engine's steps
    stream_interval: int = field(default=1, metadata=_WHEN_SET)
    # vLLM's --pipeline-parallel-size, set from the deployment's pipeline stages (``--pp``): the
    # engine core keeps this many batches in flight (one more with async scheduling), and the
    # scheduler skips a request whose step in flight has not returned (vllm_pipeline.py)
    pipeline_parallel_size: int = field(default=1, metadata=_WHEN_SET)

    def __post_init__(self) -> None:
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be fcfs or priority, got {self.scheduling_policy!r}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be greater than or "
                f"equal to max_num_seqs ({self.max_num_seqs})"
            )
        if self.long_prefill_token_threshold < 0:
            raise ValueError(
                f"long_prefill_token_threshold must be >= 0, got {self.long_prefill_token_threshold}"
            )
        active = self.max_num_active_seqs
        if active is not None and not 1 <= active <= self.max_num_seqs:  # config/scheduler.py:69, :335
            raise ValueError(
                f"max_num_active_seqs must be in [1, max_num_seqs = {self.max_num_seqs}], got {active}"
            )
        if self.stream_interval < 1:  # Field(default=1, ge=1), config/scheduler.py:213
            raise ValueError(f"stream_interval must be >= 1, got {self.stream_interval}")
        if self.pipeline_parallel_size < 1:
            raise ValueError(f"pipeline_parallel_size must be >= 1, got {self.pipeline_parallel_size}")
        if self.prefill_schedule_interval < 1:  # Field(default=1, ge=1), config/scheduler.py:203
            raise ValueError(f"prefill_schedule_interval must be >= 1, got {self.prefill_schedule_interval}")
        if not 0.0 <= self.watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {self.watermark}")
        for name in ("max_num_queued_reqs", "max_num_queued_tokens"):
            value = getattr(self, name)
            if value is not None and value < 0:
                # vLLM: pydantic Field(ge=0), vllm/config/scheduler.py:92,105@v0.32.0
                raise ValueError(f"{name} must be >= 0 (or unset: no limit), got {value}")
        if self.kv_offloading_size is not None:
            if not self.kv_offloading_size > 0:
                raise ValueError(f"kv_offloading_size must be > 0 GiB, got {self.kv_offloading_size}")
            if not self.enable_prefix_caching:
                raise ValueError(
                    "kv_offloading_size needs prefix caching: tailserve's CPU tier holds the prefix "
                    "cache's blocks (drop --no-enable-prefix-caching)"
                )
        self._check_speculative()

    def _check_speculative(self) -> None:
        k = self.num_speculative_tokens
        if k < 0:
            raise ValueError(f"num_speculative_tokens must be >= 0, got {k}")
        given = [
            name
            for name in ("speculative_method", "synthetic_acceptance_rates", "synthetic_acceptance_length")
            if getattr(self, name) is not None
        ]
        if not k:
            if given:
                raise ValueError(f"{given[0]} needs num_speculative_tokens >= 1")
            return
        if self.speculative_method is None:
            raise ValueError(
                f"num_speculative_tokens={k} needs speculative_method (one of {', '.join(METHODS)})"
            )
        if self.speculative_method not in METHODS:
            raise ValueError(
                f"speculative_method must be one of {', '.join(METHODS)}, got {self.speculative_method!r} "
                "(draft_model, medusa, suffix, ... are not modelled)"
            )
        resolve_acceptance_rates(k, self.synthetic_acceptance_rates, self.synthetic_acceptance_length)
        if self.async_scheduling and not METHODS[self.speculative_method][2]:
            raise ValueError(
                "async scheduling is only supported with EAGLE/MTP/NGram GPU speculative decoding "
                f"(vLLM 0.32), not speculative_method={self.speculative_method}"
            )
        if 0 < self.long_prefill_token_threshold < 1 + k:
            raise ValueError(
                f"long_prefill_token_threshold ({self.long_prefill_token_threshold}) is below 1 + "
                f"num_speculative_tokens ({1 + k}): vLLM 0.32 fails an assertion when it pads a new "
                "decode to that size"
            )

    def speculative_decoding(self) -> SpecDecoding | None:
        """The resolved speculative decoding (None without)."""
        k = self.num_speculative_tokens
        if not k:
            return None
        assert self.speculative_method is not None  # __post_init__
        rates = resolve_acceptance_rates(k, self.synthetic_acceptance_rates, self.synthetic_acceptance_length)
        return SpecDecoding(self.speculative_method, k, rates)


# vLLM 0.32's choice when --async-scheduling is not given: vllm/config/vllm.py:1585-1644@v0.32.0
# (off for pooling models, a speculative method other than EAGLE/MTP/draft model/ngram_gpu, an
# executor backend without support (Ray), ROCm DeepEP high-throughput DBO, pipeline parallelism
# on the V1 model runner; on otherwise), then the CPU platform's hook turns it off
# (vllm/platforms/cpu.py:331@v0.32.0). Of those options tailserve models the device and the drafter.
_ASYNC_RULE = "vllm/config/vllm.py:1585-1644@v0.32.0"


def async_scheduling_default(device: DeviceInfo, config: VllmConfig) -> tuple[bool, str]:
    """vLLM 0.32's default for async scheduling on ``device`` with ``config``'s drafter: (on,
    a one-line note saying why, vLLM's own warning where it logs one)."""
    if device.vendor == "cpu":
        return False, (
            "async scheduling off: vLLM's CPU platform turns it off (vllm/platforms/cpu.py:331@v0.32.0)"
        )
    method = config.speculative_method
    if config.num_speculative_tokens and method is not None and not METHODS[method][2]:
        return False, (
            f'async scheduling off: "Async scheduling not supported with {method}-based speculative '
            f'decoding and will be disabled." (vllm/config/vllm.py:1605@v0.32.0)'
        )
    return True, (
        f"async scheduling on: vLLM 0.32's default on a GPU ({_ASYNC_RULE}); "
        "vllm:async_scheduling=false (--no-async-scheduling) simulates the synchronous scheduler"
    )


def device_batch_defaults(device: DeviceInfo) -> tuple[int, int]:
    """vLLM's API-server defaults (``EngineArgs.get_batch_defaults``): (budget, max_num_seqs)."""
    if device.memory_gib >= 160:
        return 16384, 1024
    if device.memory_gib >= 70 and not device.is_a100:
        return 8192, 1024
    return 2048, 256


class VllmPolicy(Policy, FastPaths):
    name = "vllm"
    summary = "vLLM V1: one token budget, running requests first, chunked prefill, recompute preemption"
    config_cls = VllmConfig
    stream_per_request = "max"  # a request's stream_interval is raised to the server's
    default_block_size = 16
    default_gpu_memory_utilization = 0.92

    @classmethod
    def default_config(cls, device: DeviceInfo, max_model_len: int, **overrides: Any) -> VllmConfig:
        budget, max_seqs = device_batch_defaults(device)
        chunked = overrides.get("enable_chunked_prefill", True)
        if "max_num_batched_tokens" not in overrides and not chunked:
            budget = max(budget, max_model_len)
        budget = overrides.get("max_num_batched_tokens", budget)
        if "max_num_seqs" not in overrides:
            max_seqs = min(max_seqs, budget)  # an explicit small budget lowers the default
        max_seqs = overrides.get("max_num_seqs", max_seqs)
        if max_seqs < 1:  # before the default budget is derived from it (0 would name the budget)
            raise ValueError(f"max_num_seqs must be >= 1, got {max_seqs}")
        if "max_num_batched_tokens" not in overrides:
            budget = min(budget, max_seqs * max_model_len)
        known = {f.name for f in fields(VllmConfig)}
        rest = {k: v for k, v in overrides.items() if k in known}
        config = replace(VllmConfig(budget, max_seqs), **rest)
        if config.async_scheduling is None:  # as vLLM decides
            config = replace(config, async_scheduling=async_scheduling_default(device, config)[0])
        if config.long_prefill_token_threshold > max_model_len:
            raise ValueError(
                f"long_prefill_token_threshold ({config.long_prefill_token_threshold}) must be <= "
                f"max_model_len ({max_model_len})"
            )
        if not config.enable_chunked_prefill and config.max_num_batched_tokens < max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({config.max_num_batched_tokens}) is smaller than "
                f"max_model_len ({max_model_len}) with chunked prefill disabled: prompts longer "
                "than the budget could never be scheduled; raise it or enable chunked prefill"
            )
        return config

    @classmethod
    def default_notes(cls, device: DeviceInfo, config: VllmConfig, overrides: dict[str, Any]) -> list[str]:
        """Async scheduling on or off and why, when vLLM's rule chose it (not the user)."""
        if overrides.get("async_scheduling") is not None:
            return []
        return [async_scheduling_default(device, config)[1]]

    @classmethod
    def profile_tokens(cls, config: VllmConfig, max_model_len: int) -> int:
        return config.max_num_batched_tokens  # vLLM profiles its token budget

    @classmethod
    def drafter_memory(cls, config: VllmConfig) -> DrafterMemory | None:
        """EAGLE / EAGLE-3 / MTP drafters are loaded with the target before the memory profile
        (``GPUModelRunner.load_model``, gpu_model_runner.py:5070-5073@v0.32.0), and their
        attention layers get KV like the target's (``get_kv_cache_spec`` walks every attention
        layer of the config, :7146-7180): the pool loses the draft layer's weights and each
        token's KV grows by its layer. N-gram drafters load nothing."""
        spec = config.speculative_decoding()
        if spec is None or not spec.drafter_on_gpu:
            return None
        return DrafterMemory(1, 1, source="vllm gpu_model_runner.py:5070-5073,7146-7180@v0.32.0")

    def __init__(self, config: VllmConfig) -> None:
        super().__init__(config)
        self._spec = config.speculative_decoding()
        # vLLM's own accounting (vllm_async.py) with async scheduling or drafts.
        # (A config made without default_config leaves async_scheduling None: synchronous.)
        # and under pipeline parallelism, whose steps in flight skip their requests (vllm_pipeline.py).
        pp = config.pipeline_parallel_size
        if pp > 1 and self._spec is not None and not config.async_scheduling:
            # Synchronously the drafts reach the scheduler through take_draft_token_ids after
            # each step_with_batch_queue call, in the order the ranks answer (EngineCore.post_step).
            raise ValueError(
                "speculative decoding under pipeline parallelism is simulated with async scheduling "
                "(vLLM 0.32's default on the V2 model runner, which drafts in the worker); synchronously "
                "the drafts reach the scheduler as the ranks answer: not simulated (for n-gram drafts, "
                "speculative_method=ngram_gpu runs with async scheduling)"
            )
        self._advanced = bool(config.async_scheduling) or self._spec is not None or pp > 1
        self._stagger = DecodeStagger(pp) if pp > 1 and config.async_scheduling else None
        # The plain pass's one-token decode items, reused from step to step (``ScheduledRequest``'s
        # docstring); dropped in ``on_finished``.
        self._decode_items: dict[Request, ScheduledRequest] = {}
        # The advanced pass's: two per running request, handed out in turn (its step's item
        # stays in flight while the next step is scheduled); dropped in ``on_finished`` too.
        self._advanced_items: dict[Request, list[ScheduledRequest]] = {}
        # Loads from the CPU offloading tier, None without one (vllm_offload.py).
        self._offload = (
            self._bind_loads(OffloadLoads(bool(config.async_scheduling), self._advanced))
            if config.kv_offloading_size
            else None
        )
        # The API server's admission limits, None without (vllm_admission.py).
        limits = (config.max_num_queued_reqs, config.max_num_queued_tokens)
        self._admission = Admission(*limits) if limits != (None, None) else None
        # DP prefill balancing (vllm_dp_prefill.py): a DP group marks its off-cadence steps.
        self.prefill_throttle = PrefillThrottle()

    def _bind_loads(self, loads: OffloadLoads) -> OffloadLoads:
        """A loading connector's loads, told the drafter's slots per step."""
        spec = self._spec
        if spec is not None:
            loads.bind_spec(spec.num_speculative_tokens, spec.num_lookahead_tokens)
        return loads

    def bind_cost_model(self, cost_model: Any, exact: bool) -> None:
        """The CPU tier's loads are priced as the host link moves a token's KV shard
        (``CostModel.swap_time``); nothing else here reads the cost model."""
        if self._offload is not None and cost_model is not None:
            self._offload.seconds_per_token = cost_model.swap_time(1)

    def next_wakeup(self, sched: Scheduler, now: float) -> float | None:
        return self._offload.next_done(now) if self._offload is not None else None

    def load_done(self, request: Request) -> float | None:
        return self._offload.load_done(request) if self._offload is not None else None

    def async_scheduling(self) -> bool:
        return bool(self.config.async_scheduling)

    def pipeline_parallel_size(self) -> int:
        return self.config.pipeline_parallel_size

    def max_concurrent_batches(self) -> int:
        return max_concurrent_batches(self.config.pipeline_parallel_size, bool(self.config.async_scheduling))

    def speculative_decoding(self) -> SpecDecoding | None:
        return self._spec

    def can_fast_forward(self, sched: Scheduler) -> bool:
        # With async scheduling alone the decisions over a run of decodes are the plain pass's
        # (each running request one token, on its placeholder; nobody admitted), which the
        # driver's async decode run follows (async_decode_run.py). Drafts step: several tokens
        # per decode, as many as the rejection sampler's draws accept. Loads in flight (the CPU
        # tier's, a decode side's reads) let a run go on: it stops before the first pass at or
        # after the next load's end (``next_wakeup``), which reads it; a load read and not yet
        # promoted, or anything else the loads hold, is stepped.
        offload = self._offload
        return self._spec is None and (not offload or offload.only_in_flight())

    def kv_spec(self) -> KVSpec:
        return KVSpec(
            "hashed" if self.config.enable_prefix_caching else "paged",
            offload_gib=self.config.kv_offloading_size or 0.0,
        )

    def add_request(self, sched: Scheduler, request: Request) -> None:
        """vLLM's API server refuses a request over ``max_num_queued_reqs`` or
        ``max_num_queued_tokens`` with a 503 (``vllm_admission.py``); the rest are queued."""
        admission = self._admission
        if admission is not None:
            reason = admission.refusal(sched, request)
            if reason is not None:
                # Scheduler.add_request stamped enqueue_time with the current time just before.
                now = request.enqueue_time if request.enqueue_time is not None else request.arrival_time
                sched.reject(request, reason, now)
                return
            admission.accept(request)
        sched.waiting.add_request(request)

    def refuses_at_arrival(self) -> bool:
        return self._admission is not None

    @property
    def admission(self) -> Admission | None:
        """The admission limits' counters (None without limits)."""
        return self._admission

    def share_admission(self, admission: Admission) -> None:
        """A DP engine's ranks sit behind one API server: its counters, not one per rank."""
        self._admission = admission

    def on_finished(self, sched: Scheduler, finished: list[Request]) -> None:
        if self._admission is not None:
            self._admission.left(finished)
        deferred = self.prefill_throttle.deferred
        if deferred:
            deferred.difference_update(finished)
        if self._offload:
            self._offload.forget(sched, finished)
        items = self._decode_items
        for request in finished:
            items.pop(request, None)
        if self._stagger is not None:
            self._stagger.forget(finished)
        pairs = self._advanced_items
        if pairs:  # (empty in the plain pass)
            for request in finished:
                pairs.pop(request, None)

    def admits_fcfs(self) -> bool:
        return self.config.scheduling_policy == "fcfs"

    def create_waiting_queue(self) -> RequestQueue:
        """``create_request_queue(scheduling_policy)``: FCFS deque or the priority heap, which
        also decide where a preempted request re-enters and whom to preempt."""
        return create_request_queue(self.config.scheduling_policy)

    def expect_remote_kv(self, request_id: str, num_tokens: int, pull: Pull) -> None:
        """A P/D pair's decode side: the request's prompt KV is read from its prefill replica
        once the request is admitted (``vllm_remote.py``)."""
        if self._offload is None:
            self._offload = self._bind_loads(RemoteLoads(bool(self.config.async_scheduling), self._advanced))
        elif not isinstance(self._offload, RemoteLoads):
            raise ValueError("a vLLM decode replica with kv_offloading_size (a CPU tier) is not modelled")
        self._offload.expect(request_id, num_tokens, pull)

    def schedule(self, sched: Scheduler, now: float) -> SchedulerOutput:
        offload = self._offload
        if offload is not None:
            host = sched.kv_cache.host if offload.uses_host_tier else None
            if host is not None:
                # A step's stores are reported with its outputs: pending a pass longer when
                # those arrive late (``Scheduler.reports_lag``).
                host.pending_passes = int(sched.reports_lag())
                host.new_pass()  # the stores of earlier passes are ready
            elif offload.uses_host_tier:
                # A workload of bare lengths gets no prefix cache (kv/factory.py), so no tier
                # either: nothing to load, ever.
                self._offload = offload = None
            if offload is not None:
                # A loading connector (a decode side's NIXL, the CPU tier's kv_both) with steps
                # in flight: freed blocks wait for them (``Scheduler.defer_in_flight_frees``).
                sched.defer_in_flight_frees = bool(self.config.async_scheduling)
                offload.read_reports(sched, now)
        if self._advanced:
            stagger = self._stagger
            if stagger is not None:
                stagger.begin_pass()
            out = schedule_advanced(
                self.config,
                self._spec,
                sched,
                now,
                self._advanced_items,
                self._offload,
                self.prefill_throttle,
                stagger,
            )
            if stagger is not None:
                stagger.scheduled(out)
            if out.num_admitted and self._admission is not None:  # they may sample from now
                self._admission.started(sched.running, out.num_admitted)
            return out
        cfg: VllmConfig = self.config
        out = new_output()
        budget = cfg.max_num_batched_tokens
        cap = cfg.long_prefill_token_threshold
        # Off with one request in all (vLLM's get_request_counts: running, waiting and the
        # requests holding KV while they wait, loads from the CPU tier among them).
        if cap:
            cap = prefill_cap(cfg, len(sched.running) + len(sched.waiting) + len(sched.loading))
        scheduled = out.scheduled
        preempted = out.preempted
        waiting = sched.waiting
        kv = sched.kv_cache
        block_size = kv.block_size

        # 2. Running requests, oldest admission first. (``preempt_by_recompute`` removes from
        # this very list, so it is bound once: this loop runs per running request per step.)
        running = sched.running
        decode_items = self._decode_items
        throttle = self.prefill_throttle
        # (mid-prefill in this pass: its last grant left tokens uncomputed, ``prefill_outputs``)
        defer = throttle.throttled and throttle.defers(
            any(r.prefill_outputs != r.num_output_tokens for r in running)
        )
        tracked = throttle.deferred if throttle.tracking else None
        i = 0
        # Its length bound too, and refreshed where the slow path below preempts.
        num_running = len(running)
        # The leading one-token decodes that each sample, and their context tokens, counted as
        # they are scheduled for ``decode_head``; ``leading`` ends at the first other entry.
        leading = True
        num_leading = context = 0
        while i < num_running and budget > 0:
            request = running[i]
            if defer and request.prefill_outputs == request.num_output_tokens:
                i += 1  # a prefill chunk waits for a cadence step
                continue
            computed = request.num_computed_tokens
            # ``min(missing, budget)`` spelled out: the builtin parses its arguments as keywords
            # (~750 instructions a call), once per running request per stepped iteration.
            want = request.prompt_len + request.num_output_tokens - computed
            if budget < want:
                want = budget
            if want == 1 and computed % block_size:
                # A decode whose slot is in its last, partly filled block: nothing to allocate,
                # but a block it fills is cached now, as vLLM's allocate_slots does every step.
                if not (computed + 1) % block_size:  # a no-op without prefix caching
                    sched.cache_computed(request, computed + 1)
                # Its decode item of an earlier step, the context set anew (``ScheduledRequest``'s
                # docstring), or a new one, kept until it leaves.
                item = decode_items.get(request)
                if item is None:
                    item = decode_items[request] = scheduled_decode(request, computed)
                else:
                    item.num_context_tokens = computed
                scheduled.append(item)
                if leading:
                    context += computed
                budget -= 1
                i += 1
                continue
            if cap:
                want = min(want, cap)
            target = computed + want
            self_preempted = False
            while not sched.allocate(request, target):
                victim = waiting.preemption_victim(sched.running)
                item = next((s for s in scheduled if s.request is victim), None)
                if item is not None:
                    # Already scheduled this iteration (priority only): its tokens go back.
                    scheduled.remove(item)
                    budget += item.num_new_tokens
                    i -= 1
                sched.preempt_by_recompute(victim)
                waiting.prepend_request(victim)
                preempted.append(victim)
                if victim is request:
                    self_preempted = True
                    break
            num_running = len(running)
            if self_preempted:
                break  # a request that preempted itself ends the running pass (fcfs and priority)
            computed = request.num_computed_tokens
            # (vLLM's in-flight prefills, for the reserve of KV loads: ``vllm_offload.py``)
            request.prefill_outputs = request.num_output_tokens if target < request.num_tokens else -1
            if leading:
                if want == 1 and computed + 1 == request.prompt_len + request.num_output_tokens:
                    context += computed  # a decode that took a block: it samples
                else:
                    leading = False
                    num_leading = len(scheduled)
            scheduled.append(ScheduledRequest(request, want, computed))
            budget -= want
            i += 1

        # 3-4. Waiting requests, FCFS, unless someone was preempted.
        if preempted:
            return out  # a preemption may have taken an entry of the head: none is vouched for
        if leading:
            num_leading = len(scheduled)
            # The fast path's ``want == 1`` is also a prompt's one-token chunk where one token of
            # budget was left: then the last entry, which samples nothing.
            if num_leading and not budget:
                last = scheduled[-1]
                r = last.request
                if last.num_context_tokens + 1 != r.prompt_len + r.num_output_tokens:
                    num_leading -= 1
                    context -= last.num_context_tokens
        # These stay the output's first entries: the pass below appends after them.
        out.decode_head = (num_leading, context)
        kv = sched.kv_cache
        watermark_blocks = int(cfg.watermark * kv.num_blocks)
        offload = self._offload
        queue = waiting
        max_active = cfg.max_num_active_seqs or cfg.max_num_seqs  # (admission into RUNNING)
        if offload is not None:
            queue = offload.pass_queue(sched, now)  # the requests whose KV is in first
        while queue and budget > 0 and len(sched.running) < max_active:
            request = queue.peek_request()
            # Prefix lookup for a new or preempted request: hits are not charged to the budget.
            match = sched.cached_prefix(request) if not request.num_computed_tokens else None
            hit = match.num_tokens if match is not None else 0
            if offload is not None and not request.num_computed_tokens:
                # The CPU tier's blocks after the GPU hit: a request that has some only loads now.
                reserve = watermark_blocks if sched.running else 0
                taken = offload.admit(
                    sched, request, match, hit, now, reserve, cfg.scheduler_reserve_full_isl
                )
                if taken is BLOCKED:
                    break
                if taken is not None:
                    if tracked is not None:
                        tracked.add(request)  # vLLM's ``deferred_waiting``, until admitted
                    continue  # loading, or skipped for this pass
            if defer and request.num_computed_tokens + hit < request.num_tokens - 1:
                break  # prompt tokens to compute: they wait for a cadence step
            # ``num_remaining_tokens`` inlined and ``min(want, budget)`` spelled out (a property
            # is a call through C, the builtin parses its arguments as keywords): per admission.
            want = request.prompt_len + request.num_output_tokens - request.num_computed_tokens - hit
            if cap:
                want = min(want, cap)
            if not cfg.enable_chunked_prefill and want > budget:
                break
            if budget < want:
                want = budget
            reserve = watermark_blocks if sched.running else 0
            if hit:
                # KV gate net of the hit blocks (those sitting evictable in the free queue count).
                total = request.num_tokens if cfg.scheduler_reserve_full_isl else hit + want
                if kv.num_blocks_needed_after_hit(match, total) + reserve > kv.num_free_blocks:
                    break
                sched.allocate_with_cached_prefix(request, match, hit + want)
            else:
                if cfg.scheduler_reserve_full_isl and not kv.can_allocate(
                    request.request_id, request.num_tokens, reserve
                ):
                    break
                if not sched.allocate(request, request.num_computed_tokens + want, reserve):
                    break  # head-of-line blocking: nothing behind it is tried
            if hit and request.first_scheduled_time is None:
                request.num_cached_tokens = hit
            # (its hit is in its computed tokens by now: ``allocate_with_cached_prefix``)
            partial = request.num_computed_tokens + want < request.num_tokens
            request.prefill_outputs = request.num_output_tokens if partial else -1
            queue.pop_request()
            sched.admit(request, now)
            if tracked:
                tracked.discard(request)
            out.num_admitted += 1
            scheduled.append(ScheduledRequest(request, want, request.num_computed_tokens))
            budget -= want
        if offload is not None:
            offload.requeue(waiting)
        if tracked is not None and not defer:  # (read only on throttled steps: tracking's)
            throttle.released(len(waiting) + len(sched.loading))
        if out.num_admitted and self._admission is not None:  # (a pass that preempts admits nobody)
            self._admission.started(sched.running, out.num_admitted)
        return out
