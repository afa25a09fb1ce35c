"""TensorRT-LLM 1.2, PyTorch backend: ``PyExecutor``'s scheduling as its source does it.

Version followed: TensorRT-LLM 1.2 (1.2.1 is the release on PyPI), read in the stored
NVIDIA/TensorRT-LLM repository: ``tensorrt_llm/_torch/pyexecutor/scheduler/scheduler.py``
(commit 5f480b7a: ``SimpleScheduler``, the Python mirrors of the C++ capacity and micro-batch
schedulers), ``scheduler/waiting_queue.py`` (85942da5), ``executor_request_queue.py``,
``py_executor.py``, ``py_executor_creator.py``, ``_util.py``, ``cpp/tensorrt_llm/batch_manager/
kvCacheManager.cpp``, ``cpp/include/tensorrt_llm/batch_manager/llmRequest.h``,
``tensorrt_llm/llmapi/llm.py`` and ``llm_args.py``. Each rule cites its place (all of them:
``docs/policies.md``, "`trtllm`"); ``tests/test_trtllm.py`` has a hand-worked case for each.

One iteration of ``PyExecutor._executor_loop``:
1. Fetch: requests move from the FCFS waiting queue into the *active* list (arrival order) until
   ``max_batch_size`` are active (``_fetch_new_requests``: ``max_num_active_requests`` =
   ``max_batch_size`` x pipeline stages). Active requests stay active until they finish.
2. Capacity scheduler over the active list (``trtllm_capacity.py``): GUARANTEED_NO_EVICT (default;
   STATIC_BATCH is its variant) or MAX_UTILIZATION, which pauses the last started requests when
   KV runs short. At most ``max_batch_size`` requests fit.
3. A paused request (``_pause_requests``: ``LlmRequest.pause`` then ``_terminate_request``) gives
   back its KV, folds its outputs into its prompt and becomes a context again *in its place in
   the active list*: it recomputes everything (block reuse may find its own blocks).
4. Micro-batch scheduler (``trtllm_microbatch.py``): ``max_num_tokens`` and ``max_batch_size``,
   generation requests one token each, contexts whole or chunked (``enable_chunked_prefill``,
   ``context_chunking_policy``, chunk unit ``tokens_per_block``).
5. ``prepare_resources``: a context at its first chunk takes blocks for its whole prompt
   (``addSequence``); with ``enable_block_reuse`` its cached prefix is found then
   (``setPrepopulatedPromptLen``: it starts past the cached blocks and its chunk ends at the same
   block boundary or at the prompt's end — the budget was charged the chunk as scheduled); a
   generation request takes a slot for its next token.
6. After the forward, the blocks just computed become reusable (``storeContextBlocks``, and all
   full blocks on release): here, at the end of the step's allocations, so no request matches
   blocks computed in its own step — as in the engine, where stores follow the forward.

Requests longer than ``max_num_tokens`` are refused at arrival without chunked prefill, with the
LLM API's message (``llm.py`` ``_check_arguments``).

KV pool: ``free_gpu_memory_fraction`` (the engine-wide ``gpu_memory_utilization`` flag, 0.9) is
the fraction of the memory left after the weights and a profiled forward of ``max_num_tokens``
(``_util.py`` ``KvCacheCreator``: ``(total - peak) * fraction``), not vLLM's fraction of the
whole (``kv_capacity.py``, ``of_free_memory``).

Draft tokens (``speculative_config``: ``decoding_type`` MTP with ``num_nextn_predict_layers``
drafts, 1 by default, or Eagle3 with ``max_draft_len``; both one-model, the drafter inside the
target): every generation request carries ``max_draft_len`` drafts each step
(``_prepare_draft_requests``); the micro-batch scheduler charges it ``1 + drafts`` tokens
(``beam_width + num_draft_tokens``); ``getNeededBlocksOneStep`` counts ``1 + drafts`` slots;
``prepare_resources`` takes a KV slot for the token and each draft and ``update_resources``
rewinds the rejected ones; the request advances by 1 + its accepted drafts (trimmed at
``max_tokens``). Acceptance and the drafter's time are ``spec_decode.py``'s (the synthetic
sampler's rates or mean length; one decoder layer per draft); the drafter's layers add their KV
to the pool, and each request holds ``num_extra_kv_tokens`` (``max_draft_len - 1``) slots past
its tokens from its first chunk. GUARANTEED_NO_EVICT also reserves those and the last step's draft
slots (the engine counts prompt + ``max_new_tokens`` only; counting them keeps the no-evict
guarantee).

CUDA graphs (``cuda_graph_config``, here ``cuda_graph_padding_enabled``,
``cuda_graph_batch_sizes``, ``cuda_graph_max_batch_size``): with padding a generation-only step
is priced at the next captured batch size (``executors/simulated/cuda_graph.py``); without it
(the default) graphs change no price.

The overlap scheduler (``disable_overlap_scheduler``, default false: on; ``trtllm_overlap.py``):
``_executor_loop_overlap`` schedules step n+1 while step n runs, on step n-1's outputs — the
engine's async loop (``async_scheduling``) with the scheduler's placeholder accounting
(``advance_scheduled``). A request whose step in flight yields its last token is
``GENERATION_TO_COMPLETE``: kept by the capacity scheduler, skipped by the micro-batch one
(``to_complete``); its KV and active slot come back when that step's outputs are processed, a
step late; a context's last-chunk blocks become reusable then too. With MTP / Eagle3 drafts
(which keep it on) a step's accepted drafts, and the rewind of its rejected draft slots, are
known a step late: the next step is scheduled on the optimistic count and takes its slots past
the unrewound ones. On by default on a simulated GPU (a note says so), off where the executor
steps only synchronously.

Deviations (stated in ``notes`` where a flag is involved): partial-block reuse
(``enable_partial_reuse``) is not modelled (reuse is whole blocks, at least one token computed);
under overlap a partial context chunk's blocks become reusable a step early (the engine stores them with the step's outputs); a paused request's prompt keeps all
its outputs (``pause`` caps it at
``max_input_len``); a paused request whose grown prompt passes ``max_num_tokens`` without chunking
trips the engine's assertion, which fails the whole executor — here only that request is aborted.
TensorRT-LLM 1.3/1.4's scheduler additions: ``enable_prefix_aware_scheduling`` (1.3, true by
default there) is modelled opt-in, false by default here as 1.2.1 behaves: the micro-batch
scheduler's token-budget credit for a first chunk's reusable prefix (``trtllm_prefix_aware.py``;
what it changes in admission and duplicate-context deferral is not in the stored source, not
modelled). ``context_scheduling_policy`` (``fcfs`` | ``shortest_uncached_first``),
``context_starvation_iterations``, ``gen_preemption`` and ``max_gen_init_admissions_per_pass``
(1.4) are not modelled: the 1.4.0rc4 reference page lists them, but no stored TensorRT-LLM source
implements them (the newest stored ``SchedulerConfig``, ``llm_args.py@0004396``, has none of them),
so their rules are not known; ``lint --engine-version 1.4.0rc4`` says so per key. Not modelled
either: ``use_python_scheduler`` (the Python mirror), beams,
two-model drafters (Eagle, Draft/Target, NGram, Medusa), MTP's relaxed acceptance, LoRA pages,
sliding windows, disaggregated serving, and in attention DP (``trtllm_adp.py``: placement and
``attention_dp_config`` balancing, modelled) ``attention_dp_rank`` pinning and a dense model's
ranks (independent replicas here).

Batch waiting (``batch_wait_timeout_iters``, ``batch_wait_max_tokens_ratio``;
``trtllm_batch_wait.py``): without attention DP, a step with contexts and generations holds its
contexts back until their tokens reach the ratio of ``max_num_tokens`` or the counter reaches the
iterations; the fast paths step while it holds.

Attention DP (an MoE model's DP engine, ``cluster/adp_stage.py``): arrivals wait in one queue
shared by the ranks and are placed each iteration by TensorRT-LLM's heap rule; with
``attention_dp_enable_balance`` the group holds contexts (``plan_step`` then ``hold_contexts``)
until every rank has one or ``attention_dp_timeout_iters`` pass (``trtllm_adp.py``).

Fast paths: runs of decode-only steps only (``FastPaths`` defaults). When every running request
decodes and none can be admitted, nothing changes until an arrival or a finish: under
GUARANTEED_NO_EVICT the blocks left after the reservations do not move while decodes take
reserved blocks; under MAX_UTILIZATION a context that did not fit still does not (free blocks
only shrink), and one before a running request would have paused it. No chunk runs: chunks are
cut to ``tokens_per_block`` multiples, not to the budget. With draft tokens none: each step's
advance is a draw per request. CUDA-graph padding prices a decode run's steps padded as a
stepped one would (``SimExecutor.decode_run_durations``). Under overlap the async decode run
(``async_decode_run.py``), whose guard is ``GENERATION_TO_COMPLETE``'s rule; with requests
waiting behind a head it cannot admit (GUARANTEED_NO_EVICT or STATIC_BATCH, no chunked prefill)
the run goes on across arrivals, which join the queue behind it (``arrivals_wait_in_async_runs``).
A stepped step: GUARANTEED_NO_EVICT's pass is lazy and bounds the reservations by a kept sum
(``trtllm_capacity.py``; ``_generating``) and hands its generation requests over as a list, which
the micro-batch scheduler takes whole (``Fitting``); a generation request gets one of two decode
items in turn (``_decode_items``), and its new token is registered for reuse only where the KV
manager's threshold says a block can fill (``registers_from``).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass, fields, replace
from typing import Any

from tailserve.core.device import DeviceInfo
from tailserve.core.policy import Policy
from tailserve.core.request import Request
from tailserve.core.scheduler import Scheduler
from tailserve.core.scheduler_output import ScheduledRequest, SchedulerOutput, alternate_decode
from tailserve.executors.simulated.cuda_graph import CudaGraphPadding
from tailserve.executors.simulated.drafter_memory import DrafterMemory
from tailserve.executors.simulated.fast_paths import FastPaths
from tailserve.executors.simulated.spec_decode import SpecDecoding
from tailserve.kv.paged import NEVER
from tailserve.kv.secondary_pool import DEFAULT_RETENTION_PRIORITY
from tailserve.kv.spec import KVSpec
from tailserve.policies.trtllm_adp import StepCounts
from tailserve.policies.trtllm_batch_wait import BatchWait
from tailserve.policies.trtllm_capacity import (
    DraftSlots,
    completion_blocks,
    guaranteed_no_evict,
    max_utilization,
)
from tailserve.policies.trtllm_config import (
    DEFAULT_MAX_BATCH_SIZE,
    MAX_UTILIZATION,
    STATIC_BATCH,
    TrtllmConfig,
)
from tailserve.policies.trtllm_host_cache import HostCacheCopies
from tailserve.policies.trtllm_microbatch import MicroBatch, micro_batch
from tailserve.policies.trtllm_overlap import overlap_default, to_complete
from tailserve.policies.trtllm_pipeline import PP_NO_OVERLAP, check_pipelined
from tailserve.policies.trtllm_prefix_aware import reusable_tokens


@dataclass(slots=True)
class _Plan:
    """A step's batch as the schedulers chose it, before any blocks are taken."""

    batch: MicroBatch
    paused: list[Request]  # paused by MAX_UTILIZATION while choosing it


class TrtllmPolicy(Policy, FastPaths):
    name = "trtllm"
    summary = (
        "TensorRT-LLM 1.2 (PyTorch backend): capacity scheduler (GUARANTEED_NO_EVICT reserves KV to "
        "completion; MAX_UTILIZATION pauses the last started), then max_num_tokens, chunked prefill off"
    )
    config_cls = TrtllmConfig
    # stream_interval counts decoding iterations; the OpenAI server takes no per-request value
    stream_unit = "iterations"
    stream_per_request = "ignore"
    default_block_size = 32  # kv_cache_config.tokens_per_block
    default_gpu_memory_utilization = 0.9  # kv_cache_config.free_gpu_memory_fraction
    memory_fraction_of_free = True  # of the memory left after weights and activations (_util.py)
    pipeline_engine = "trtllm"  # _executor_loop_pp under pipeline stages (trtllm_pipeline.py)

    def __init__(self, config: TrtllmConfig) -> None:
        super().__init__(config)
        check_pipelined(config)  # what the PP loop refuses, before anything else is built
        self._active: list[Request] = []  # PyExecutor.active_requests, in fetch order
        self._ids: set[str] = set()  # their ids
        # Active requests in the scheduler's waiting queue (never scheduled, or paused): always a
        # prefix of it — a fetch takes the requests right behind them, a pause prepends.
        self._unscheduled: set[str] = set()
        # Context done: GENERATION_IN_PROGRESS. Each with its blocks to completion, held ones
        # included (remaining_blocks' total: fixed, prompt_len and max_tokens never change), and
        # their sum: GUARANTEED_NO_EVICT's bound on the reservations (guaranteed_no_evict).
        self._generating: dict[str, int] = {}
        self._generating_blocks = 0
        # Two plain decode items per generation request, handed out in turn (vllm_async.py's
        # technique): a new ScheduledRequest per generation request per stepped iteration was a
        # class call each. Dropped when it leaves generation.
        self._decode_items: dict[Request, list[ScheduledRequest]] = {}
        self._checked_unit = False
        self._spec = config.speculative_decoding()
        # Draft tokens each generation request verifies per step (py_draft_tokens: always
        # max_draft_len with a one-model drafter, _prepare_draft_requests); 0 without.
        self._num_drafts = self._spec.num_speculative_tokens if self._spec is not None else 0
        self._graph = (
            CudaGraphPadding(config.captured_batch_sizes(), 1 + self._num_drafts)
            if config.cuda_graph_padding_enabled
            else None
        )
        # The overlap scheduler (trtllm_overlap.py). A config made without default_config
        # leaves disable_overlap_scheduler None: no overlap. Under pipeline stages the engine
        # runs _executor_loop_pp, which has none (trtllm_pipeline.py).
        self._pp = config.pipeline_parallel_size
        self._overlap = config.disable_overlap_scheduler is False and self._pp == 1
        # max_num_sequences (_util.py): max_batch_size per micro-batch, times the stages for the
        # capacity scheduler and the active requests (get_max_num_sequences)
        self._max_sequences = config.batch_size * self._pp
        # A step's computed blocks stored for reuse when its outputs are processed
        # (Scheduler.update_advanced), not when it is scheduled: under overlap and under stages.
        self._store_at_update = self._overlap or self._pp > 1
        # The scheduler's own accounting (computed tokens advance at scheduling): with drafts,
        # under overlap, and under pipeline stages, where a context's next chunk is scheduled
        # while its previous one is in flight (trtllm_pipeline.py)
        self._advance = self._num_drafts > 0 or self._store_at_update
        # attention-DP balancing's two passes (plan_step, hold_contexts): the planned batch and
        # whether its contexts wait; both used up by the next schedule.
        self._planned: _Plan | None = None
        self._hold_contexts = False
        in_flight = self._num_drafts if self._overlap else 0
        self._slots = DraftSlots(self._num_drafts, config.num_extra_kv_tokens, in_flight)
        # The host KV pool's copies (kv_cache_config.host_cache_size: trtllm_host_cache.py),
        # None without one; used only where the KV manager got the pool (token identities).
        self._host = HostCacheCopies() if config.offloads_to_host else None
        # Batch waiting (trtllm_batch_wait.py); _schedule applies it only without attention DP,
        # whose group sets in_attention_dp on its ranks (cluster/dp_group.py).
        self.in_attention_dp = False
        self._batch_wait = (
            BatchWait(config.batch_wait_timeout_iters, config.batch_wait_max_tokens_ratio * config.num_tokens)
            if config.batch_waiting
            else None
        )

    def bind_cost_model(self, cost_model: Any, exact: bool) -> None:
        """The host pool's copies are priced as the host link moves a token's KV shard
        (``CostModel.swap_time``); nothing else here reads the cost model."""
        if self._host is not None and cost_model is not None:
            self._host.seconds_per_token = cost_model.swap_time(1)

    @classmethod
    def default_config(cls, device: DeviceInfo, max_model_len: int, **overrides: Any) -> TrtllmConfig:
        known = {f.name for f in fields(TrtllmConfig)}
        config = TrtllmConfig(**{k: v for k, v in overrides.items() if k in known})
        if config.disable_overlap_scheduler is None:  # as TensorRT-LLM decides
            on = overlap_default(device, config.num_draft_tokens)[0]
            config = replace(config, disable_overlap_scheduler=not on)
        return config

    @classmethod
    def default_notes(cls, device: DeviceInfo, config: TrtllmConfig, overrides: dict[str, Any]) -> list[str]:
        """The overlap scheduler on or off and why, when the engine's rule chose it (not the
        user); a host KV pool that nothing is offloaded to."""
        notes = []
        if config.pipeline_parallel_size > 1:
            notes.append(PP_NO_OVERLAP)
        elif overrides.get("disable_overlap_scheduler") is None:
            notes.append(overlap_default(device, config.num_draft_tokens)[1])
        if config.host_cache_size and not config.offloads_to_host:
            notes.append(
                f"host_cache_size: secondary_offload_min_priority {config.secondary_offload_min_priority} is "
                f"above the blocks' retention priority ({DEFAULT_RETENTION_PRIORITY}, none is set per "
                "request), so no block is offloaded: simulated without the host pool"
            )
        return notes

    @classmethod
    def profile_tokens(cls, config: TrtllmConfig, max_model_len: int) -> int:
        # estimate_max_kv_cache_tokens profiles a forward of max_num_tokens (py_executor_creator).
        return config.num_tokens

    @classmethod
    def drafter_memory(cls, config: TrtllmConfig) -> DrafterMemory | None:
        return config.drafter_memory()

    def kv_spec(self) -> KVSpec:
        cfg: TrtllmConfig = self.config
        host = int(cfg.host_cache_size) if cfg.offloads_to_host and cfg.host_cache_size else 0
        return KVSpec("hashed" if cfg.enable_block_reuse else "paged", host_cache_bytes=host)

    def speculative_decoding(self) -> SpecDecoding | None:
        return self._spec

    def async_scheduling(self) -> bool:
        return self._overlap

    def pipeline_parallel_size(self) -> int:
        return self._pp

    def max_concurrent_batches(self) -> int:
        # num_micro_batches = pp_size (PyExecutor 1.2); the overlap scheduler's two otherwise
        return self._pp if self._pp > 1 else super().max_concurrent_batches()

    def fetch_wait(self) -> tuple[float, int] | None:
        """``batch_wait_timeout_ms``: ``ExecutorRequestQueue._get_from_request_queue`` takes what
        has arrived (blocking for the first only when idle), then, with fewer than
        ``max_batch_size``, waits up to the timeout for more, at every iteration's fetch."""
        cfg: TrtllmConfig = self.config
        if not cfg.batch_wait_timeout_ms:
            return None
        return cfg.batch_wait_timeout_ms / 1000, cfg.max_batch_size or DEFAULT_MAX_BATCH_SIZE

    def cuda_graph_padding(self) -> CudaGraphPadding | None:
        return self._graph

    def can_fast_forward(self, sched: Scheduler) -> bool:
        # With drafts a step advances each request by 1 + the drafts its verification accepts,
        # a draw per request: stepped, as the vllm policy's. With a host KV pool a decode that
        # opens a block may evict and offload a cached one, a copy its step waits for: stepped.
        # With enable_prefix_aware_scheduling a waiting context's charge follows the reuse tree,
        # which a decode may grow (a keyed output block) as well as shrink: stepped.
        # While batch waiting holds contexts its counter moves each step: stepped.
        cfg: TrtllmConfig = self.config
        return (
            self._spec is None
            and sched.kv_cache.secondary is None
            and not cfg.enable_prefix_aware_scheduling
            and not (self._batch_wait is not None and self._batch_wait.count)
        )

    def arrivals_wait_in_async_runs(self, sched: Scheduler) -> bool:
        # With the overlap scheduler, requests waiting and the step in flight having admitted
        # nobody (nobody finished since): the capacity pass walks contexts in active order and
        # GUARANTEED_NO_EVICT's second pass ends at the first that does not fit (head of line);
        # without chunking the micro-batch walk ends at the first context past max_num_tokens.
        # The first context walked is never skipped by the reuse rule (no context runs in
        # chunks; nothing was looked at before it), so that walk ended at the queue's head, and
        # with nobody finishing neither the blocks left after the reservations nor the decodes'
        # tokens move. An arrival is fetched behind every waiting request (FCFS, the only
        # waiting_queue_policy) or not at all (max_batch_size active), so it is never walked. Not
        # MAX_UTILIZATION (its pass may pause), nor chunked prefill (contexts set aside and
        # chunked together), nor drafts (stepped: ``can_fast_forward``).
        cfg: TrtllmConfig = self.config
        return (
            self._overlap
            and self._spec is None
            and sched.kv_cache.secondary is None
            and not cfg.enable_prefix_aware_scheduling
            and not cfg.enable_chunked_prefill
            and cfg.capacity_scheduler_policy != MAX_UTILIZATION
        )

    # ---- requests in and out ------------------------------------------------------------------
    def add_request(self, sched: Scheduler, request: Request) -> None:
        cfg: TrtllmConfig = self.config
        if not cfg.enable_chunked_prefill and request.prompt_len > cfg.num_tokens:
            now = request.enqueue_time if request.enqueue_time is not None else request.arrival_time
            sched.reject(
                request,
                f"The sum of prompt length ({request.prompt_len}), query length (0) should not "
                f"exceed max_num_tokens ({cfg.num_tokens})",
                now,
            )
            return
        sched.waiting.add_request(request)

    def on_finished(self, sched: Scheduler, finished: list[Request]) -> None:
        gone = {r.request_id for r in finished} & self._ids
        if not gone:
            return
        self._active = [r for r in self._active if r.request_id not in gone]
        self._ids -= gone
        self._unscheduled -= gone
        for request_id in gone:
            self._leave_generation(request_id)
        if self._decode_items:
            for request in finished:
                self._decode_items.pop(request, None)

    def _is_generation(self, request: Request) -> bool:
        return request.request_id in self._generating

    def _enter_generation(self, sched: Scheduler, request: Request) -> None:
        if request.request_id not in self._generating:
            blocks = completion_blocks(sched.kv_cache, request, self._slots)
            self._generating[request.request_id] = blocks
            self._generating_blocks += blocks

    def _leave_generation(self, request_id: str) -> None:
        blocks = self._generating.pop(request_id, None)
        if blocks is not None:
            self._generating_blocks -= blocks

    # ---- the iteration --------------------------------------------------------------------------
    def schedule(self, sched: Scheduler, now: float) -> SchedulerOutput:
        kv = sched.kv_cache
        out = SchedulerOutput()
        planned = self._planned if self._planned is not None else self._plan(sched)
        self._planned = None
        batch = planned.batch
        out.preempted.extend(planned.paused)
        if self._hold_contexts:
            # attention-DP balancing held this step's contexts (trtllm_adp.py): they stay
            # active and unscheduled; the generations run.
            batch.contexts = []
            self._hold_contexts = False
        drafts = self._num_drafts
        wait = self._batch_wait
        if (
            wait is not None
            and not self.in_attention_dp
            and batch.contexts
            and batch.generations
            and wait.holds(batch, drafts)
        ):
            batch.contexts = []  # held: they stay active and unscheduled
        for request in batch.too_long:
            self._abort_too_long(sched, request, now)

        # prepare_resources: contexts (their first chunk takes the whole prompt's blocks and
        # finds its cached prefix), then a slot for each generation request's next token.
        computed_after: list[tuple[Request, int]] = []
        for request, chunk in batch.contexts:
            if not kv.num_held(request.request_id):
                chunk = self._start_context(sched, request, chunk, now)
                out.num_admitted += 1
            start = request.num_computed_tokens
            out.scheduled.append(ScheduledRequest(request, chunk, start))
            if start + chunk == request.num_tokens:
                self._enter_generation(sched, request)  # its last chunk: generation next
                if self._store_at_update:
                    continue  # stored when its outputs are processed (Scheduler.update_advanced)
            elif self._pp > 1:
                continue  # the PP loop stores a context's blocks when its last chunk returns
            computed_after.append((request, start + chunk))
        tables = kv.block_tables
        block_size = kv.block_size
        ahead = self._slots.extra + 1 + drafts  # slots past the computed tokens (below)
        decode_items = self._decode_items
        scheduled = out.scheduled
        # storeContextBlocks for each generation request's new token (not under overlap: there
        # only known tokens' blocks, at update). Asked only where it can register something: at
        # or past the manager's threshold (``registers_from``, as Scheduler.update_advanced reads
        # it; None: every call counts; empty: nobody has a keyed block left, as in a workload
        # without token ids). A block fills once in block_size steps.
        gate = kv.registers_from
        register = not self._store_at_update and (gate is None or len(gate) > 0)
        for request in batch.generations:
            computed = request.num_computed_tokens
            # A slot for the next token and one for each draft (KVCacheManager.prepare_resources:
            # add_token 1 + get_draft_token_length times), past the drafter's extra slots;
            # rejected drafts' slots are rewound after the step (update_resources), here by the
            # computed tokens rolling back. A block opens once in block_size steps: the table's
            # length answers first (allocate's own test), the call only when one opens.
            slots = computed + ahead
            rid = request.request_id
            table = tables.get(rid)
            if (table is None or len(table) * block_size < slots) and kv.allocate(rid, slots) is None:
                raise RuntimeError(
                    f"trtllm: no KV block for generation request {rid} although the "
                    "capacity scheduler counted one (a bug in this policy)"
                )
            if drafts:
                item = ScheduledRequest(request, 1 + drafts, computed, num_spec_tokens=drafts)
            else:
                pair = decode_items.get(request)
                if pair is None:
                    item = alternate_decode(decode_items, request, computed)
                else:  # alternate_decode's turn, without its call (once per request per step)
                    item = pair[1]
                    pair[1] = pair[0]
                    pair[0] = item
                    item.num_context_tokens = computed
            scheduled.append(item)
            if register and (gate is None or gate.get(rid, NEVER) <= computed + 1):
                computed_after.append((request, computed + 1))  # drafts are not known tokens
        # storeContextBlocks after the forward: only now do this step's blocks become reusable
        # (under pipeline stages none here: update_resources when the batch returns, through
        # Scheduler.update_advanced, for its generations and last chunks only).
        for request, tokens in computed_after:
            sched.cache_computed(request, tokens)
        if self._host is not None and kv.secondary is not None:
            self._host.price(sched, out)  # prepare_resources' host copies (refresh_blocks waits)
        if self._advance:
            # The step's outputs come back as 1 + accepted drafts per generation request, or a
            # step late under overlap: the scheduler's accounting (advance now, outputs in flight
            # as placeholders, rejected drafts rolled back at update).
            sched.advance_scheduled(out)
        return out

    def _plan(self, sched: Scheduler) -> _Plan:
        """Fetch, the capacity scheduler, the micro-batch scheduler: the step's batch before
        ``prepare_resources`` (a pause happens here, as in the engine)."""
        cfg: TrtllmConfig = self.config
        chunking = cfg.context_chunking_policy if cfg.enable_chunked_prefill else None
        if chunking is not None and not self._checked_unit:
            if cfg.num_tokens < sched.kv_cache.block_size:
                # FCFS chunks round down to tokens_per_block: a prompt longer than the budget
                # would get chunks of 0 forever.
                raise ValueError(
                    f"max_num_tokens ({cfg.num_tokens}) is smaller than tokens_per_block "
                    f"({sched.kv_cache.block_size}) with chunked prefill: chunks are multiples of tokens_per_block"
                )
            self._checked_unit = True
        self._fetch(sched)
        is_generation = self._is_generation
        paused: list[Request] = []
        fitting: Iterable[Request]
        if cfg.capacity_scheduler_policy == MAX_UTILIZATION:
            fitting, paused = max_utilization(
                sched, self._active, is_generation, self._max_sequences, cfg.enable_block_reuse,
                lambda request: self._pause(sched, request), self._slots,
            )  # fmt: skip
        else:
            # Lazy: the micro-batch scheduler takes what it walks (trtllm_capacity.py).
            static = cfg.capacity_scheduler_policy == STATIC_BATCH
            fitting = guaranteed_no_evict(
                sched,
                self._active,
                is_generation,
                self._max_sequences,
                static,
                cfg.enable_block_reuse,
                self._slots,
                self._generating_blocks,
            )
        # GENERATION_TO_COMPLETE (overlap): kept by the capacity scheduler (its slot and blocks
        # counted), skipped by the micro-batch scheduler.
        # enable_prefix_aware_scheduling (1.3): first chunks charged past their reusable prefix.
        reusable = (
            reusable_tokens(sched) if cfg.enable_prefix_aware_scheduling and cfg.enable_block_reuse else None
        )
        # Under pipeline stages the requests of the micro-batches in flight (inflight_req_ids).
        busy = sched.batch_of
        skips = to_complete if self._overlap else (busy.__contains__ if busy else None)
        batch = micro_batch(
            fitting, is_generation, cfg.batch_size, cfg.num_tokens, chunking, sched.kv_cache.block_size,
            1 + self._num_drafts, skips, reusable,
        )  # fmt: skip
        return _Plan(batch, list(paused))

    # ---- attention-DP balancing: the group's two passes (cluster/adp_stage.py) ----------------
    def plan_step(self, sched: Scheduler) -> StepCounts:
        """The first pass: this step's batch planned (and kept for ``schedule``); its context and
        generation counts, what ``_balance_adp_requests`` all-gathers."""
        self._planned = self._plan(sched)
        return StepCounts(len(self._planned.batch.contexts), len(self._planned.batch.generations))

    def hold_contexts(self) -> None:
        """The group held contexts this step: ``schedule`` runs the planned batch without them."""
        self._hold_contexts = True

    def _fetch(self, sched: Scheduler) -> None:
        """``_fetch_new_requests``: FCFS from the waiting queue until ``max_batch_size`` x the stages
        are active."""
        room = self._max_sequences - len(self._active)  # max_num_active_requests
        if room <= 0 or len(sched.waiting) <= len(self._unscheduled):
            return
        for request in itertools.islice(sched.waiting, len(self._unscheduled), len(self._unscheduled) + room):
            self._active.append(request)
            self._ids.add(request.request_id)
            self._unscheduled.add(request.request_id)

    def _start_context(self, sched: Scheduler, request: Request, chunk: int, now: float) -> int:
        """A context's first chunk: ``addSequence`` takes the whole prompt's blocks, reusing its
        cached prefix, then ``setPrepopulatedPromptLen`` moves the chunk past that prefix; the
        request enters the running set. Returns the chunk it computes."""
        kv = sched.kv_cache
        num_tokens = request.num_tokens
        extra = self._slots.extra  # the drafter's num_extra_kv_tokens, added after addSequence
        match = sched.cached_prefix(request) if self.config.enable_block_reuse else None
        hit = match.num_tokens if match is not None else 0
        # The host pool's blocks right after the GPU hit are onboarded (trtllm_host_cache.py):
        # taken out of the pool before the GPU blocks are, reused as the hit is.
        onboarded = self._host.onboard(sched, request, hit) if self._host is not None and kv.secondary else 0
        prepopulated = hit + onboarded
        if prepopulated:
            if prepopulated + chunk < num_tokens:
                # End the chunk at the same block boundary (prepopulated is block-aligned).
                chunk = (prepopulated + chunk) // kv.block_size * kv.block_size - prepopulated
            else:
                chunk = num_tokens - prepopulated
        if hit:
            assert match is not None
            fits = sched.allocate_with_cached_prefix(
                request, match, num_tokens + extra, num_computed_tokens=prepopulated, register=False
            )
        else:
            fits = kv.allocate(request.request_id, num_tokens + extra) is not None
            if fits and onboarded:
                request.num_computed_tokens = prepopulated
        if not fits:
            raise RuntimeError(
                f"trtllm: no KV blocks for the prompt of {request.request_id} although the capacity "
                "scheduler counted them (a bug in this policy)"
            )
        if onboarded:
            # Onboarded blocks keep their place in the reuse tree, now on the GPU.
            sched.cache_computed(request, prepopulated)
        if request.first_scheduled_time is None:
            request.num_cached_tokens = prepopulated
        sched.waiting.remove_request(request)
        self._unscheduled.discard(request.request_id)
        sched.admit(request, now)
        return chunk

    def _pause(self, sched: Scheduler, request: Request) -> None:
        """``LlmRequest.pause`` + ``_terminate_request``: KV freed (its computed blocks stay
        reusable), outputs folded into the prompt, back to a context in its active place."""
        sched.preempt_by_recompute(request)
        sched.waiting.prepend_request(request)
        self._unscheduled.add(request.request_id)
        self._leave_generation(request.request_id)
        self._decode_items.pop(request, None)

    def _abort_too_long(self, sched: Scheduler, request: Request, now: float) -> None:
        sched.waiting.remove_request(request)
        limit = self.config.num_tokens
        sched.abort(request, f"Context tokens ({request.num_tokens}) exceeds limit ({limit})", now)
        self.on_finished(sched, [request])
