"""SGLang 0.5.23 (``managers/scheduler.py``, ``schedule_policy.py``, ``schedule_batch.py``).

Prefill first, optimistic KV reservation, and retraction to the tail. The rules, in the engine's
order (``docs/policies.md``, "`sglang` — SGLang 0.5.23"):

1. **Prefill first.** Each iteration first tries to build a prefill batch; if it builds one, the
   iteration runs *only* that batch and every running decode waits (with ``enable_mixed_chunk``
   the decodes ride along and their count comes off the chunk and input budgets). Only when no
   prefill batch is built does every running request decode one token.
2. **Quick exits.** No prefill is tried while ``batch_is_full`` is set, or when nothing waits and
   no chunk is pending. The flag is set when the walk in 5 ends on NO_TOKEN or on the
   ``max_running_requests`` cap, and cleared when a request leaves the running batch: at the
   next iteration after a prefill batch (finished requests, or the still-chunked request kept out
   of the merge), or during the next *decode* after a decode batch (so a finish in a decode
   unblocks admission one iteration later, as in SGLang).
3. **Order the waiting queue** with ``schedule_policy``: ``fcfs`` keeps it; ``lof`` sorts by
   descending ``max_tokens``; ``random`` shuffles it with the policy's own seeded generator.
   ``lpm`` sorts by descending radix match length (stable; priorities ignored, as SGLang does
   with its cache on), falling back to fcfs above 128 waiting; ``lpm_aging_rate`` (not in SGLang;
   the aging of PR #31723 against the starvation of #31954) adds that many tokens per second
   waited. ``dfs-weight`` walks the tree from the root, heavier subtrees first, a node's own
   requests after its subtree. With ``disable_radix_cache`` (or no request with token identities)
   they become ``fcfs`` (keep the queue), as in SGLang. ``hrrn`` ranks by (prefill tokens the
   engine processed since the request entered the queue) / (uncached prompt tokens), ties by
   request id, and falls back like lpm above 128; ``shortest-prefill-first`` by uncached prompt +
   outputs, then queue time, and caps a continuing chunk to leave budget for shorter waiting
   requests (both send in-batch duplicates last; ``sglang_order_work.py``). ``routing-key`` puts
   first the keys (``tenant_id``) most common in the running batch.
4. **Budgets** (``PrefillAdder``): ``rem_input_tokens = max_prefill_tokens``, ``rem_chunk_tokens =
   chunked_prefill_size`` (none when chunking is off), and KV ``remaining_total`` = free slots +
   evictable radix tokens - Σ over running requests of min(max_tokens - outputs, 4096) x
   ``new_token_ratio``.
5. **The chunked request continues first** with min(rest of its prompt, ``rem_chunk_tokens``,
   ``remaining_total``) tokens (the full chunk when ``remaining_total`` <= 0). Then the **waiting
   queue is walked**: each request is matched against the radix tree (``prefix_len``, its node
   locked while checked) and needs (prompt + outputs - prefix_len) + min(max_tokens - outputs,
   4096) + one page, admitted only if that is < ``remaining_total``, else NO_TOKEN **stops the walk**
   (head-of-line blocking). Without chunking, a request whose input is >= ``rem_input_tokens``
   stops it once something is admitted (the first may exceed ``max_prefill_tokens``). A request
   larger than ``rem_chunk_tokens`` is cut to it and becomes *the* chunked request (only one at a
   time: while one is unfinished such a request waits); the walk stops when a budget reaches 0,
   or before a request when the continuing chunk or the mixed decodes spent one.
6. **Decode.** If the free slots cannot hold one more token per running request, **retract**:
   order by (outputs, -prompt) descending and retract from the end (fewest outputs first, among
   equals the longest prompt), at least one, until the rest fit, always keeping one (aborted if
   even it cannot fit). A retracted request frees its KV, goes to the **tail** of the waiting
   queue with a new queue time and later recomputes prompt + outputs. Then ``new_token_ratio =
   min(1, (Σ outputs + 20 x n) / (Σ max_tokens + 1))`` over the n kept; without retraction it
   decays by (init - min) / 600 per decode step, init = min(0.7 x
   ``schedule_conservativeness``, 1), min = 0.14 x init.
7. **Priorities** (``enable_priority_scheduling``): the queue is sorted by (priority x sign, queue
   time), a *higher* value more urgent unless ``schedule_low_priority_values_first`` (note: the
   opposite of vLLM's convention for the same ``Request.priority`` field). When the
   ``max_running_requests`` cap is hit, a waiting request may evict running requests less urgent
   by more than ``priority_scheduling_preemption_threshold``, least urgent and most recent first,
   if their reservations cover its need — SGLang's estimate, read before the walk looks at the
   request: its fill ids less its prefix as its last look left them (nothing for a request never
   looked at, so only its outputs count) + its outputs - the budget left; each victim makes the
   tree evict for 20 tokens per request left; they are recomputed from the tail of the queue.

``assume_ignore_eos``: the simulator always runs a request to ``max_tokens``, like SGLang's
``ignore_eos``, whose running reservations use ratio 1.0 instead of ``new_token_ratio`` (and,
with ``disable_radix_cache``, a different admission test, ``add_one_req_ignore_eos``, modelled
here too). Off by default: real traffic does not set it, and the optimistic ratio, its decay and
the retractions it causes are SGLang's defining behaviour.

A request that could not be admitted even into an idle engine is rejected at arrival (SGLang
clips its ``max_new_tokens`` instead; here outputs are fixed), so it cannot block the queue.

**Radix cache** (``policies/sglang_radix.py`` asking the KV manager's tree, ``kv/radix_manager.py``
over ``kv/radix.py``, page size 1). Built by the manager with the first request that
carries token identities: its token ids plus the planned outputs, or Mooncake ``hash_ids``
(``token_keys_from_hash_ids``: full 512-token blocks only); requests without them never share and
the cache stays inert. The KV manager is a ``RadixKVCacheManager`` of flavour ``sglang``
(``kv_spec``): the tree holds
one reference on each slot it caches, a request one per table entry. An admitted request shares
its matched slots (match capped so one token is computed), keeps its node locked, and starts at
the match. After every prefill batch its prefilled tokens are inserted (the checkpoint; the lock
moves to the new node); at finish prompt + outputs with KV are inserted, then it unlocks.
Retracted or aborted requests unlock without inserting decoded tokens; after each retraction the
tree evicts what the kept requests' next 20 tokens lack. Allocation evicts least recently used
unlocked leaves when the free slots fall short; decode fits if free + evictable slots suffice.
Decodes never touch the tree, so the decode fast path stays exact. Deviations: a request keeps
its own slots for tokens it computed that another request inserted meanwhile (SGLang frees them
and points at the tree's); the checkpoint happens at the
start of the next iteration (nothing touches the tree in between, except finishes).

**Speculative decoding** (``speculative_algorithm`` EAGLE / EAGLE3 / NEXTN, topk 1;
``sglang_spec.py``): a decode verifies steps + 1 tokens and makes each request hold 2 x (steps +
1) slots past its committed tokens, which ``decode_fits`` (and so retraction) asks for too; 1 +
the accepted drafts become outputs (``Scheduler.update``); the running cap defaults to 48; the
draft layer's weights and KV come off the pool (``drafter_memory``); the fast paths are off.

**Overlap scheduler** (``disable_overlap_schedule``, SGLang's default on; ``sglang_overlap.py``):
each step is built while the previous one runs (the engine's async path, the scheduler's advanced
accounting): finishes by length are foreseen and left out of the next decode, a finish frees its
KV a step late, a retracted request's in-flight output is dropped, the per-step host time is
hidden. Of the fast paths only the async decode run (``async_decode_run.py``) applies, its skip
``_reqs_finishing_inflight`` (``can_fast_forward``). Off on the real and real-time executors. With
speculative decoding it is SGLang's spec v2: a verify's accepted tokens are committed when its
result is processed, after the next verify was launched, so that one's KV reserve counts from
the committed length before the verify in flight (``_committed_lag``), and a request whose
accepted run crosses ``max_tokens`` (unforeseen: only a first token that is the last is) runs
one more verify, dropped.

**Load and cadence** (``sglang_load.py``): ``max_queued_requests`` refuses a request entering a
full waiting queue with 503 (arrivals, and retracted or preempted requests going back), under
priority scheduling pushing out a less urgent waiting one instead; ``prefill_max_requests`` caps a
prefill batch's requests (the adder); ``prefill_decode_interval`` skips the prefill pass for that
many turns after each prefill batch while ``prefill_decode_interval_min_bs`` requests decode.

Not modelled: speculative trees (topk > 1) and other drafters, LoRA (``num_continuous_decode_steps``
is read by nothing in 0.5.23), the waiting-prefix refresh (every 32nd pass of a cache-agnostic order
touches the waiting requests' cached prefixes, reordering LRU eviction: found by the prefill-pass
differential; modelling it changes the golden corpus's ``mooncake600/sglang``).

Why this file is past the style guide's ~300 lines: it is one engine's batch rules, read top to
bottom in the order SGLang's scheduler applies them (prefill first, quick exits, the adder walk,
retraction, the decode step); the radix bookkeeping (``sglang_radix.py``), the queue orders
(``sglang_priority.py``), the adder's budgets (``sglang_adder.py``, handed its collaborators
explicitly, as SGLang's ``PrefillAdder`` is) and the flags (``sglang_config.py``) already live
apart, and a further cut would split one rule across files.
"""

from __future__ import annotations

import random
from dataclasses import fields, replace
from typing import Any, ClassVar

from tailserve.core.device import DeviceInfo
from tailserve.core.policy import Policy
from tailserve.core.request import Request
from tailserve.core.scheduler import Scheduler
from tailserve.core.scheduler_output import ScheduledRequest, SchedulerOutput, new_output, scheduled_decode
from tailserve.executors.simulated.drafter_memory import DrafterMemory
from tailserve.executors.simulated.fast_paths import FastPaths, LoneChunkRun
from tailserve.executors.simulated.spec_decode import SpecDecoding
from tailserve.kv.prefix import PrefixMatch
from tailserve.kv.radix import RadixCache
from tailserve.kv.spec import KVSpec
from tailserve.policies.sglang_adder import (
    ABORT_REASON,
    CLIP_MAX_NEW_TOKENS,
    IGNORE_EOS_RESERVE_TOKENS,
    INIT_NEW_TOKEN_RATIO,
    MIN_NEW_TOKEN_RATIO_FACTOR,
    NEVER_FITS_REASON,
    NEW_TOKEN_RATIO_DECAY_STEPS,
    RETRACT_DECODE_STEPS,
    AddReqResult,
    PrefillAdder,
    decode_fits,
    reserved_tokens,
)
from tailserve.policies.sglang_config import CACHE_AWARE_POLICIES, SglangConfig
from tailserve.policies.sglang_hicache import HiCacheLoads, hicache_spec
from tailserve.policies.sglang_load import PrefillDecodeInterval, admit_to_queue
from tailserve.policies.sglang_order_work import ProcessedTokens, shortest_prefill_chunk_limit
from tailserve.policies.sglang_overlap import (
    committed_lag,
    drop_in_flight,
    finishes_in_flight,
    overlap_default,
)
from tailserve.policies.sglang_priority import calc_priority
from tailserve.policies.sglang_radix import SglangRadix
from tailserve.policies.sglang_spec import MAX_RUNNING_REQUESTS, draft_tokens_note, resolve_speculative


def device_chunked_prefill_size(device: DeviceInfo) -> int:
    """SGLang's default ``chunked_prefill_size`` by GPU memory (``arg_groups/memory_hook.py``)."""
    gib = device.memory_gib
    if gib < 20:
        return 2048
    if gib < 60:
        return 4096
    if gib < 160:
        return 8192
    return 16384


def auto_max_running_requests(num_kv_tokens: int, context_len: int) -> int:
    """SGLang's default ``max_running_requests`` (``kv_cache_configurator.py``)."""
    estimated = max(min(int(num_kv_tokens / context_len * 512), 4096), 2048)
    return min(estimated, num_kv_tokens // 2)


class SglangPolicy(Policy, FastPaths):
    name = "sglang"
    summary = "SGLang: prefill-only batches first, optimistic KV reservation, retraction to the tail"
    config_cls = SglangConfig
    stream_per_request = "replace"  # a request's stream_interval replaces the server's
    default_block_size = 1  # SGLang's page_size on CUDA
    # SGLang derives mem_fraction_static per GPU (memory_hook.handle_gpu_memory_settings): (memory
    # - activation/graph reserve) / memory, 0.83 on an 80 GB GPU at its default chunk of 8192
    # (0.82 at TP 4; 0.90 on an H200). Note the simulator subtracts its own activation estimate
    # on top, so its KV pool is ~2 GiB smaller than SGLang's.
    default_gpu_memory_utilization = 0.83
    # The batch record (``--save-run``, ``--explain``, ``--report``) may keep an async run as one
    # entry of its steps; SGLang's saved runs in the golden corpus were recorded with its overlap
    # scheduler stepped, one entry per step, so its async run records one per step
    # (``async_decode_run.py``): the saved runs stay byte-identical. True would group them (the
    # same rows per iteration, fewer entries) once those saved runs are re-recorded.
    batch_entry_per_async_run: ClassVar[bool] = False
    async_run_after_prefill: ClassVar[bool] = True
    async_runs_chain: ClassVar[bool] = True

    def __init__(self, config: SglangConfig) -> None:
        super().__init__(config)
        init = min(INIT_NEW_TOKEN_RATIO * config.schedule_conservativeness, 1.0)
        self.init_new_token_ratio = init
        self.min_new_token_ratio = min(init * MIN_NEW_TOKEN_RATIO_FACTOR, 1.0)
        self.new_token_ratio_decay = (init - self.min_new_token_ratio) / NEW_TOKEN_RATIO_DECAY_STEPS
        self.new_token_ratio = init
        self.batch_is_full = False
        self.chunked: Request | None = None  # admitted, in ``sched.running``, prompt unfinished
        self._rng = random.Random(config.random_seed)
        # Speculative decoding (sglang_spec.py): SGLang's decode KV sizes and the shared
        # acceptance model and drafter the simulated executor runs.
        self.spec = resolve_speculative(
            config.speculative_algorithm,
            config.speculative_num_steps,
            config.synthetic_acceptance_rates,
            config.synthetic_acceptance_length,
        )
        self._max_running = config.max_running_requests
        if self._max_running is None and self.spec is not None:
            self._max_running = MAX_RUNNING_REQUESTS  # SGLang's default with speculative decoding
        self._last_batch: list[Request] = []  # requests of the last iteration
        self._last_was_prefill = False
        self.radix = SglangRadix()  # built with the first request that carries token identities
        self.processed = ProcessedTokens()  # hrrn's aging axis: prefill tokens launched so far
        # SGLang's ``req.prefix_len`` and ``len(req.full_untruncated_fill_ids)`` as its scheduler
        # last left them (absent: 0): priority preemption reads both before this pass's look.
        self.sgl_prefix_len: dict[str, int] = {}
        self.sgl_fill_len: dict[str, int] = {}
        self.num_second_chunks_refused = 0  # where SGLang 0.5.23 would fail an assertion
        # The overlap scheduler (sglang_overlap.py): each step decided while the previous one
        # runs, with the scheduler's advanced accounting. A config made without default_config
        # leaves the flag None: synchronous (the differential harnesses' standalone scheduler).
        self.overlap = config.disable_overlap_schedule is False
        # HiCache (sglang_hicache.py): the load-backs each prefill batch waits for, priced once
        # the cost model is bound; None without the host tier.
        self.hicache = HiCacheLoads() if config.enable_hierarchical_cache else None
        # ``prefill_decode_interval`` (sglang_load.py): turns left in which no prefill is tried.
        self.cadence = PrefillDecodeInterval(config.decode_interval, config.prefill_decode_interval_min_bs)

    def bind_cost_model(self, cost_model: Any, exact: bool) -> None:
        """HiCache's load-backs are priced as the host link moves a token's KV shard
        (``CostModel.swap_time``); nothing else here reads the cost model."""
        if self.hicache is not None:
            self.hicache.bind(cost_model)

    @classmethod
    def default_config(cls, device: DeviceInfo, max_model_len: int, **overrides: Any) -> SglangConfig:
        known = {f.name for f in fields(SglangConfig)}
        base = SglangConfig(chunked_prefill_size=device_chunked_prefill_size(device))
        config = replace(base, **{k: v for k, v in overrides.items() if k in known})
        if config.disable_overlap_schedule is None:  # as SGLang decides
            on = overlap_default(device, config.speculative_algorithm is not None)[0]
            config = replace(config, disable_overlap_schedule=not on)
        if config.disaggregation_mode == "decode" and not config.disable_radix_cache:
            # ``pd_disaggregation_hook.py``: the decode server's radix cache is off unless
            # ``--disaggregation-decode-enable-radix-cache`` (not modelled)
            config = replace(config, disable_radix_cache=True)
        return config

    @classmethod
    def default_notes(cls, device: DeviceInfo, config: SglangConfig, overrides: dict[str, Any]) -> list[str]:
        """SGLang's start-up warnings with speculative decoding: the running cap it sets, the
        draft-token count it overrides, the synchronous spec v2 when overlap was turned off; the
        overlap scheduler on or off and why, when SGLang's default chose it (not the user)."""
        notes = []
        if overrides.get("disable_overlap_schedule") is None:
            notes.append(overlap_default(device, config.speculative_algorithm is not None)[1])
        if config.speculative_algorithm is None:
            return notes
        if overrides.get("disable_overlap_schedule") is not None and config.disable_overlap_schedule:
            notes.append(
                "sglang: non-overlap (synchronous) spec v2 is used for speculative decoding "
                "(sglang/srt/arg_groups/speculative_hook.py:1098-1101@v0.5.23)"
            )
        if config.max_running_requests is None:
            notes.append(
                f"sglang: max_running_requests is reset to {MAX_RUNNING_REQUESTS} for speculative decoding "
                "(sglang/srt/arg_groups/speculative_hook.py:1086-1093@v0.5.23)"
            )
        note = draft_tokens_note(config.speculative_num_steps, config.speculative_num_draft_tokens)
        if note:
            notes.append(note)
        return notes

    @classmethod
    def drafter_memory(cls, config: SglangConfig) -> DrafterMemory | None:
        """EAGLE / EAGLE3 / NEXTN load their draft layer before the KV pool is sized and give it
        a KV pool of the same tokens: ``kv_cache_configurator.py:3042`` ("Loaded weights (target +
        draft)"), ``pool_configurator.py:259-314`` (cell size x (1 + draft layers / layers))."""
        spec = resolve_speculative(
            config.speculative_algorithm,
            config.speculative_num_steps,
            config.synthetic_acceptance_rates,
            config.synthetic_acceptance_length,
        )
        if spec is None or not spec.spec.drafter_on_gpu:
            return None
        return DrafterMemory(
            1, 1, source="sglang kv_cache_configurator.py:3042, pool_configurator.py:259-314@v0.5.23"
        )

    @classmethod
    def profile_tokens(cls, config: SglangConfig, max_model_len: int) -> int:
        """SGLang sizes its activation reserve for max(chunk, 2048) tokens, or max(
        ``max_prefill_tokens``, 2048) without chunking (``memory_hook.py``): a prefill batch never
        exceeds the chunk (mixed decodes come off it), and without chunking SGLang does not size
        for a first prompt larger than ``max_prefill_tokens``."""
        if config.chunking:
            return max(config.chunked_prefill_size, 2048)
        return max(config.max_prefill_tokens, 2048)

    def kv_spec(self) -> KVSpec:
        if self.config.disable_radix_cache:
            return KVSpec("paged", radix="sglang")
        return KVSpec("radix", radix="sglang", hicache=hicache_spec(self.config))

    def speculative_decoding(self) -> SpecDecoding | None:
        return self.spec.spec if self.spec is not None else None

    def async_scheduling(self) -> bool:
        return self.overlap

    def decode_tokens(self) -> int:
        """Slots past its verified tokens a decode makes a request hold: 1, or SGLang's
        speculative reserve (``SglangSpec.decode_reserve``)."""
        return self.spec.decode_reserve if self.spec is not None else 1

    def add_request(self, sched: Scheduler, request: Request) -> None:
        """Reject at arrival a request that could never be admitted, even into an idle engine.
        SGLang clips ``max_new_tokens`` to fit instead; a simulated request runs to exactly
        ``max_tokens``, so it is refused with the numbers."""
        kv = sched.kv_cache
        capacity, page = kv.num_blocks * kv.block_size, kv.block_size
        prompt, max_tokens = request.prompt_len, request.max_tokens
        if self.config.assume_ignore_eos and self.config.disable_radix_cache:
            # ``_add_one_req_ignore_eos`` with nothing running.
            fits = capacity - (-(-prompt // page) * page + page) - max_tokens > IGNORE_EOS_RESERVE_TOKENS
        else:
            fits = prompt + min(max_tokens, CLIP_MAX_NEW_TOKENS) + page < capacity  # ``add_one_req``
        now = request.enqueue_time if request.enqueue_time is not None else request.arrival_time
        if not fits:
            reason = (
                f"prompt {prompt} + max_tokens {max_tokens} cannot be admitted into {capacity} KV slots "
                "(SGLang reserves the outputs, capped at 4096, plus one page, with room to spare); "
                "SGLang would clip max_new_tokens"
            )
            sched.reject(request, reason, now)
            return
        if not admit_to_queue(self.config, sched, request, now):
            return
        if not self.config.disable_radix_cache:
            self.radix.add(sched, request)
        sched.waiting.add_request(request)
        self.processed.stamp(request)

    def on_finished(self, sched: Scheduler, finished: list[Request]) -> None:
        for request in finished:
            self.processed.forget(request)
            self.sgl_prefix_len.pop(request.request_id, None)
            self.sgl_fill_len.pop(request.request_id, None)

    # ---- helpers the adder shares --------------------------------------------------------
    def ratio_for(self) -> float:
        return 1.0 if self.config.assume_ignore_eos else self.new_token_ratio

    def reserved_tokens(self, request: Request) -> float:
        """A running request's future tokens in the admission budget."""
        return reserved_tokens(request, self.ratio_for())

    def max_running_requests(self, sched: Scheduler) -> int:
        """The cap, computed on first use from the KV capacity when the flag is None (auto)."""
        if self._max_running is None:
            kv = sched.kv_cache
            self._max_running = auto_max_running_requests(kv.num_blocks * kv.block_size, sched.max_model_len)
        return self._max_running

    # ---- radix cache (policies/sglang_radix.py) -----------------------------------------
    @property
    def tree(self) -> RadixCache | None:
        return self.radix.tree

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Cached tokens / tokens to prefill, over every admission (retractions included)."""
        return self.radix.hit_rate

    def evictable_tokens(self) -> int:
        return self.radix.evictable_tokens()

    def match(self, request: Request) -> PrefixMatch | None:
        return self.radix.match(request)

    def allocate(self, sched: Scheduler, request: Request, num_total_tokens: int) -> bool:
        return self.radix.allocate(sched, request, num_total_tokens)

    # ---- the iteration -------------------------------------------------------------------
    def schedule(self, sched: Scheduler, now: float) -> SchedulerOutput:
        out = new_output()
        if self.chunked is not None and self.chunked.is_finished:
            self.chunked = None  # aborted from outside
        if self.tree is not None and self._last_was_prefill:
            self.radix.checkpoint(self._last_batch)
        clear_during_decode = self._note_departures()
        cadence = self.cadence
        deferred = cadence.remaining > 0 and cadence.defer(len(self._decoding(sched)))
        prefilled = not deferred and self._prefill(sched, now, out)
        if not prefilled:
            was_full = self.batch_is_full
            if clear_during_decode:
                self.batch_is_full = False
            aborted = self._decode(sched, now, out)
            # Nothing left to decode and admission unblocked (or only deferred): SGLang's next
            # loop turns, with no forward pass in between, which also spin a deferral's countdown
            # out. Under overlap that turn first processes the step in flight (its finishes free
            # KV), so the engine applies it and asks again.
            in_flight = self._step_in_flight(sched) is not None
            if not out.scheduled and not in_flight:
                cadence.remaining = 0
                if deferred or aborted or (was_full and not self.batch_is_full):
                    prefilled = self._prefill(sched, now, out)
        if prefilled and cadence.interval:
            cadence.arm()
        self._last_batch = [s.request for s in out.scheduled]
        self._last_was_prefill = prefilled
        if prefilled:  # ``run_batch``: the batch's extend tokens, mixed decodes included
            self.processed.add(sum([s.num_new_tokens for s in out.scheduled]))
        if self.overlap:
            # ``prepare_for_extend`` / ``prepare_for_decode`` advance seq_lens at launch; the
            # outputs come one step later (``Scheduler.update_advanced``).
            sched.advance_scheduled(out)
        return out

    def _step_in_flight(self, sched: Scheduler) -> SchedulerOutput | None:
        """Overlap: the batch launched last and still running while this one is built — the
        scheduler's last output (``Scheduler.schedule`` keeps it; the driver's async decode run
        replaces it with the step it leaves in flight); None without overlap or when the last
        turn launched nothing."""
        if not self.overlap:
            return None
        out = sched.last_output
        return out if out is not None and out.scheduled else None

    def _note_departures(self) -> bool:
        """Clear ``batch_is_full`` where SGLang would; True when that happens in this iteration's
        decode (a request left during the last decode batch)."""
        batch = self._last_batch
        # ``any(r.is_finished for r in batch)`` as a loop over the statuses: the generator and
        # two property calls per request cost, once per request of the last batch per step.
        left = False
        for r in batch:
            if r.status._finished:
                left = True
                break
        if not self._last_was_prefill:
            return left
        if left or (self.chunked is not None and self.chunked in batch):
            self.batch_is_full = False
        return False

    def _decoding(self, sched: Scheduler) -> list[Request]:
        chunked = self.chunked
        if chunked is None:
            return sched.running.copy()  # (the filter below, in C: once per prefill step)
        return [r for r in sched.running if r is not chunked]

    def _prefill(self, sched: Scheduler, now: float, out: SchedulerOutput) -> bool:
        """Build a prefill batch into ``out``; False when none is built."""
        cfg = self.config
        try_preemption = cfg.enable_priority_scheduling and not cfg.disable_priority_preemption
        if try_preemption:
            self.batch_is_full = False
        if (self.batch_is_full or not sched.waiting) and self.chunked is None:
            return False
        decodes = self._decoding(sched)
        max_running = self.max_running_requests(sched)
        if max_running - len(decodes) <= 0 and self.chunked is None and not try_preemption:
            self.batch_is_full = True
            return False
        prefix = self.order_waiting(sched, now)
        self.sgl_prefix_len.update(prefix)
        shortest_first = cfg.schedule_policy == "shortest-prefill-first"
        # ``is_mixed_chunk``: mixing needs chunked prefill (``scheduler.py``); without it the
        # decodes neither ride along nor take from the budgets.
        mixed = cfg.enable_mixed_chunk and cfg.chunking
        num_mixed = len(decodes) if mixed else 0
        adder = PrefillAdder(
            sched,
            self.radix,
            decodes,
            self.ratio_for(),
            cfg.max_prefill_tokens,
            cfg.chunked_prefill_size if cfg.chunking else None,
            mixed_with_decode_tokens=num_mixed,
            priority_scheduling_preemption_threshold=cfg.priority_scheduling_preemption_threshold,
            schedule_low_priority_values_first=cfg.schedule_low_priority_values_first,
            ignore_eos_without_cache=cfg.assume_ignore_eos and cfg.disable_radix_cache,
            shortest_prefill_first=shortest_first,
            prefill_max_requests=cfg.prefill_max_requests,
        )
        continuing = self.chunked
        if continuing is not None:
            self.sgl_fill_len[continuing.request_id] = continuing.num_tokens  # ``init_next_round_input``
            limit = None
            if shortest_first:  # keep chunk budget for waiting requests shorter than its rest
                waiting = sched.waiting
                matched = {r.request_id: min(prefix.get(r.request_id, 0), r.num_tokens - 1) for r in waiting}
                rest = continuing.num_tokens - continuing.num_computed_tokens
                budget = adder.rem_chunk_tokens or 0
                limit = shortest_prefill_chunk_limit(
                    rest, waiting, matched, budget, sched.kv_cache.block_size
                )
            self.chunked = adder.add_chunked_req(continuing, limit)
        # A walk by index, not over a copy: the walk stops after a few requests, and copying the
        # queue each prefill made the step's cost grow with the queue. Only aborting the request
        # at hand changes the queue meanwhile (the walk then stays at its index).
        waiting, i = sched.waiting, 0
        while i < len(waiting):
            request = waiting[i]
            i += 1
            if adder.budget_state() is AddReqResult.OTHER:
                break  # the continuing chunk or the mixed decodes spent a token budget: admit nobody
            if len(adder.can_run) >= max_running - len(decodes):
                self.batch_is_full = True
            rid = request.request_id
            if self.batch_is_full and not (
                try_preemption
                and adder.preempt_to_schedule(
                    request, self.sgl_fill_len.get(rid, 0), self.sgl_prefix_len.get(rid, 0)
                )
            ):
                break
            match = self.match(request)  # ``init_next_round_input``: the lengths it leaves
            self.sgl_prefix_len[rid] = match.num_tokens if match is not None else 0
            self.sgl_fill_len[rid] = request.num_tokens
            result = adder.add_one_req(request, match, has_chunked_req=self.chunked is not None)
            if (
                result is AddReqResult.NO_TOKEN
                and not adder.can_run
                and not decodes
                and self.chunked is None
                and not sched.held
            ):
                # It cannot fit even into an idle engine: ``add_request`` rejects such requests at
                # arrival, so this one's need grew since (retracted after generating outputs). (A
                # P/D prefill server keeping sent-out KV is not idle: ``core/kv_hold.py``.)
                sched.abort_request(request.request_id, NEVER_FITS_REASON, now)
                i -= 1  # it left the queue: the next one is at its index
                continue
            if result is not AddReqResult.CONTINUE:
                if result is AddReqResult.NO_TOKEN:
                    self.batch_is_full = True
                break

        self.num_second_chunks_refused += adder.num_second_chunks_refused
        admitted = [s.request for s in adder.can_run if s.request is not continuing]
        if admitted:
            sched.waiting.remove_requests(admitted)
            for request in admitted:
                sched.admit(request, now)
            out.num_admitted += len(admitted)
        for victim in adder.preempted:
            self._requeue(sched, victim, now, out)
        if adder.new_chunked is not None:
            assert self.chunked is None, "SGLang keeps at most one chunked request"
            self.chunked = adder.new_chunked
        if not adder.can_run:
            return False
        out.scheduled.extend(adder.can_run)
        if self.hicache is not None:  # the batch's forward waits for its load-backs, layer-wise
            self.hicache.charge(out, adder.num_loaded_tokens)
        kv = sched.kv_cache
        if mixed and decodes and decode_fits(kv, decodes, self.evictable_tokens()):  # no mixing with spec
            for request in decodes:  # ``mix_with_running`` refreshes their fill ids
                self.sgl_fill_len[request.request_id] = request.num_tokens
            self._add_decodes(sched, decodes, out)
        return True

    def build_prefill(self, sched: Scheduler, now: float) -> SchedulerOutput:
        """One prefill pass alone (SGLang's ``get_new_batch_prefill``): the batch, or an output
        with nothing scheduled when none is built; public for ``validate/sglang_pass.py``."""
        out = SchedulerOutput()
        self._prefill(sched, now, out)
        return out

    def order_waiting(self, sched: Scheduler, now: float) -> dict[str, int]:
        """Order the waiting queue in place by ``schedule_policy`` (SGLang's ``calc_priority``,
        ``sglang_priority.py``) and return the uncapped radix match of each request where the pass
        matched the queue; public for ``validate/sglang_order.py``."""
        running = self._decoding(sched)
        return calc_priority(self.config, self.radix, sched.waiting, self._rng, now, running, self.processed)

    def _decode(self, sched: Scheduler, now: float, out: SchedulerOutput) -> bool:
        """Decode every running request (``update_running_batch``); True if one was aborted."""
        decodes = self._decoding(sched)
        if not decodes:
            self.batch_is_full = False
            return False
        kv = sched.kv_cache
        aborted = False
        lag = self._committed_lag(sched)
        if self.overlap:
            # ``_reqs_finishing_inflight``: leave out requests whose step in flight yields their
            # last token; a batch that shrank clears ``batch_is_full``; if the rest still does not
            # fit, decode nothing this turn (the in-flight result frees their KV first).
            finishing = [r for r in decodes if finishes_in_flight(r)]
            if finishing:
                gone = set(map(id, finishing))
                decodes = [r for r in decodes if id(r) not in gone]
                self.batch_is_full = False
                if not decodes:
                    return False
                if not decode_fits(kv, decodes, self.evictable_tokens(), self.decode_tokens(), lag):
                    return False
        if not decode_fits(kv, decodes, self.evictable_tokens(), self.decode_tokens(), lag):
            decodes, aborted = self._retract(sched, decodes, now, out, lag)
            self.batch_is_full = False  # the running batch shrank
        else:
            self.new_token_ratio = max(
                self.new_token_ratio - self.new_token_ratio_decay, self.min_new_token_ratio
            )
        self._add_decodes(sched, decodes, out, lag)
        return aborted

    def _committed_lag(self, sched: Scheduler) -> dict[str, int]:
        """Spec v2 under the overlap scheduler: the verified positions of each request's verify
        in flight, which SGLang commits only when that result is processed (``committed_lag``);
        empty otherwise (a plain decode's slot is committed at launch)."""
        if self.spec is None:
            return {}
        return committed_lag(self._step_in_flight(sched))

    def _retract(
        self, sched: Scheduler, decodes: list[Request], now: float, out: SchedulerOutput, lag: dict[str, int]
    ) -> tuple[list[Request], bool]:
        """``retract_decode``: returns the requests kept (running order) and whether one was
        aborted; ``lag``: ``_committed_lag``."""
        kv = sched.kv_cache
        if self.config.retraction_policy == "priority":
            sign = -1 if self.config.schedule_low_priority_values_first else 1
            keep = sorted(
                decodes,
                key=lambda r: (r.priority * sign, r.num_output_tokens, -r.prompt_len),
                reverse=True,
            )
        else:
            keep = sorted(decodes, key=lambda r: (r.num_output_tokens, -r.prompt_len), reverse=True)
        first = True
        while first or not decode_fits(kv, keep, self.evictable_tokens(), self.decode_tokens(), lag):
            if len(keep) == 1:
                break  # always keep at least one request
            first = False
            victim = keep.pop()
            sched.preempt_by_recompute(victim)  # unlocks its path; decoded tokens not inserted
            self._requeue(sched, victim, now, out)
            if self.tree is not None:
                # ``release_req``: make room for RETRACT_DECODE_STEPS tokens per kept request.
                self.radix.evict_for(len(keep) * RETRACT_DECODE_STEPS)
        aborted = False
        if len(keep) <= 1 and not decode_fits(kv, keep, self.evictable_tokens(), self.decode_tokens(), lag):
            sched.abort_request(keep.pop().request_id, ABORT_REASON, now)
            aborted = True
        kept = [r for r in decodes if r in keep]
        decoded = sum(r.num_output_tokens for r in kept)
        max_new = sum(r.max_tokens for r in kept)
        self.new_token_ratio = min(1.0, (decoded + RETRACT_DECODE_STEPS * len(kept)) / (max_new + 1))
        return kept, aborted

    def _requeue(self, sched: Scheduler, request: Request, now: float, out: SchedulerOutput) -> None:
        """A retracted or evicted request re-enters at the tail of the waiting queue
        (``_add_request_to_queue``: a new queue time and processed-tokens snapshot;
        ``reset_for_retract`` zeroes its ``prefix_len``)."""
        out.preempted.append(request)
        drop_in_flight(self._step_in_flight(sched), request)  # overlap: its in-flight output is dropped
        if not admit_to_queue(self.config, sched, request, now):
            return  # a full queue (max_queued_requests): aborted
        request.enqueue_time = now
        sched.waiting.add_request(request)
        self.processed.stamp(request)
        self.sgl_prefix_len.pop(request.request_id, None)  # its fill ids stay as they were

    def _add_decodes(
        self,
        sched: Scheduler,
        decodes: list[Request],
        out: SchedulerOutput,
        lag: dict[str, int] | None = None,
    ) -> None:
        spec = self.spec
        if spec is not None:
            # ``eagle_prepare_for_decode``: hold ``decode_reserve`` slots past the committed
            # tokens (slots held already are kept), then verify the last token and the drafts.
            # Under overlap the committed tokens trail the computed ones by the verify in flight
            # (``lag``), whose positions the verify scheduled now follows.
            reserve, verify, drafts = spec.decode_reserve, spec.num_draft_tokens, spec.num_steps
            lag = lag or {}
            for request in decodes:
                computed = request.num_computed_tokens
                committed = computed - lag.get(request.request_id, 0)
                self.allocate(sched, request, committed + reserve)  # checked by the caller
                out.scheduled.append(ScheduledRequest(request, verify, computed, num_spec_tokens=drafts))
            return
        self.radix.allocate_decodes(sched, decodes)  # checked by the caller; page size 1 never fails
        scheduled = out.scheduled
        leading = not scheduled  # ``_decode``'s batch (a mixed batch's decodes follow its chunks)
        context = 0
        for request in decodes:
            computed = request.num_computed_tokens
            context += computed
            scheduled.append(scheduled_decode(request, computed))
        if leading and decodes:
            # Every one samples its one token: a running request other than the chunked one is
            # one token behind (its token in flight under overlap, on its placeholder). Said
            # here, the step's update and pricing skip their tests per request per stepped turn
            # (``decode_head``: ``advance_scheduled`` and ``advanced_batch_fields`` under
            # overlap, ``Scheduler.update`` and ``batch_fields`` without).
            out.decode_head = (len(decodes), context)

    # ---- fast path -----------------------------------------------------------------------
    def notes(self) -> list[str]:
        cfg = self.config
        notes = []
        if cfg.schedule_policy in CACHE_AWARE_POLICIES and not cfg.disable_radix_cache and self.tree is None:
            if cfg.schedule_policy in ("lpm", "dfs-weight"):
                notes.append(
                    f"sglang --schedule-policy {cfg.schedule_policy}: no request carried token ids or hash_ids, "
                    "so the radix tree was never built (no radix cache yet to match against): every prefix "
                    "match is 0 and the waiting queue keeps its arrival order (fcfs)"
                )
            else:
                notes.append(
                    f"sglang --schedule-policy {cfg.schedule_policy}: no request carried token ids or hash_ids, "
                    "so every prefix match is 0: the order ranks whole prompts"
                )
        if self.num_second_chunks_refused:
            notes.append(
                f"sglang: {self.num_second_chunks_refused} time(s) a request needing a chunk met an unfinished "
                "chunked request (cut short by the KV budget, then a priority preemption freed room); SGLang "
                "0.5.23 stops there on `assert self.chunked_req is None` (scheduler.py:4326), tailserve let it wait"
            )
        if self.tree is not None:
            notes.append(
                f"sglang radix cache: {self.prefix_cache_hit_rate:.1%} of the tokens prefilled at admission "
                f"were cached ({self.tree.stats.num_evicted_tokens} tokens evicted)"
            )
        return notes

    def admits_fcfs(self) -> bool:
        return self.config.schedule_policy == "fcfs" and not self.config.enable_priority_scheduling

    def can_fast_forward(self, sched: Scheduler) -> bool:
        """Identical decode iterations follow while no chunk is pending and no prefill would be
        tried: nothing waits, or ``batch_is_full`` holds (it clears only when a request leaves:
        with requests waiting that ends the driver's runs, with none ``on_decode_run`` clears it
        as the next run's first iteration would). The decaying ratio is replayed by
        ``on_decode_run``.

        Under the overlap scheduler the same answer signs the async decode run
        (``async_decode_run.py``), whose steps are SGLang's: with every running request on the
        placeholder of the batch in flight, ``update_running_batch`` decodes each one token on
        it (``prepare_for_decode``: one slot each, ``alloc_for_decode``; the run stops before a
        step whose slots the free ones cannot hold, so ``check_decode_mem`` never retracts or
        evicts inside it), and the quick exit above admits nobody. The run's skip is
        ``_reqs_finishing_inflight`` (``finishes_in_flight``: one placeholder and outputs + 1 >=
        ``max_tokens`` is the run's ``max_tokens - outputs - 1`` steps left); the skipping step
        clears ``batch_is_full`` and, with nobody waiting (the only case the run takes it),
        decodes the rest, as vLLM's does. With requests waiting the run stops before it: the
        cleared flag lets the next turn walk the queue, stepped. A finish foreseen this way
        leaves no request of the batch in flight finished, so ``_note_departures`` finds none
        inside a run; the run's first step replays a departure or a prefill batch before it as
        the synchronous run's does (``on_decode_run``)."""
        if self.chunked is not None or self.spec is not None or self.cadence.remaining:
            # Speculative decodes advance by the accepted drafts; a prefill deferral's countdown
            # (``prefill_decode_interval``) ends within a few turns: stepped.
            return False
        if self.overlap and self._last_was_prefill and self.tree is not None:
            # The prefill batch in flight is checkpointed at the next turn, before its outputs
            # apply; a run that starts with its skipping step (a first token that is the last)
            # would replay that only after they applied (``on_decode_run`` with the skipping
            # step), its tree stamps in another order: that turn steps.
            return False
        if not sched.waiting:
            return True
        cfg = self.config
        try_preemption = cfg.enable_priority_scheduling and not cfg.disable_priority_preemption
        return self.batch_is_full and not try_preemption

    def lone_chunk_run(self, sched: Scheduler) -> LoneChunkRun | None:
        """While the chunked request continues alone (no mixed decodes, fcfs, no radix tree,
        one-token pages): the iterations in which ``add_chunked_req`` grants it the full chunk
        and the walk admits nobody (the chunk spends ``rem_chunk_tokens``), before its last
        chunk. The KV budget of each (free slots minus the running requests' reservations,
        which do not change while nobody decodes) is the adder's own."""
        cfg = self.config
        request = self.chunked
        if (
            request is None
            or not cfg.chunking
            or cfg.enable_mixed_chunk
            or cfg.assume_ignore_eos
            or self.spec is not None  # the drafter prices each chunk too: stepped
            or self.overlap  # each chunk scheduled before the previous one's result: stepped
            or self.cadence.interval  # each chunk may start a prefill_decode_interval: stepped
            or not self.admits_fcfs()
            or self.tree is not None
            or not self._last_was_prefill
            or request not in self._last_batch
            or request.is_finished
        ):
            return None
        kv = sched.kv_cache
        q = cfg.chunked_prefill_size
        if kv.block_size != 1 or q < 2:
            return None
        offset = 0 + sum(self.reserved_tokens(r) for r in self._decoding(sched))  # PrefillAdder's
        free = kv.num_free_blocks
        slack = kv.num_held(request.request_id) - request.num_computed_tokens  # slots held ahead
        rest = request.num_tokens - request.num_computed_tokens
        steps = 0
        while rest > q and free + slack >= q:  # truncated (not the last chunk) and room for it
            budget = int(free - offset)
            if 0 < budget < q:
                break  # the budget cuts the chunk short
            steps += 1
            rest -= q
            free -= q
        return LoneChunkRun(request, q, steps) if steps else None

    def on_lone_chunk_run(self, sched: Scheduler, num_steps: int) -> None:
        """The state after the run's last iteration: the walk after its chunk looked at the
        waiting head (``batch_is_full`` from the running cap or its NO_TOKEN), as in ``_prefill``."""
        request = self.chunked
        assert request is not None
        self.processed.add(self.config.chunked_prefill_size * num_steps)  # each run step's full chunk
        self._last_batch = [request]
        self._last_was_prefill = True
        self.batch_is_full = False  # cleared by ``_note_departures`` (the chunk was in the batch)
        if not sched.waiting:
            return
        decodes = self._decoding(sched)
        if self.max_running_requests(sched) - len(decodes) <= 1:
            self.batch_is_full = True
            return
        head = sched.waiting.peek_request()
        kv = sched.kv_cache
        page = kv.block_size
        q = self.config.chunked_prefill_size
        offset = 0 + sum(self.reserved_tokens(r) for r in decodes)
        offset += q + page + 0  # the chunk's charge (``_commit``: paged + page + max_new 0)
        remaining = (kv.num_free_blocks + q) * page + self.evictable_tokens() - offset
        max_new = min(max(head.max_tokens - head.num_output_tokens, 0), CLIP_MAX_NEW_TOKENS)
        if not head.num_remaining_tokens + max_new + page < remaining:
            self.batch_is_full = True  # NO_TOKEN

    def on_decode_run(self, sched: Scheduler, num_steps: int) -> None:
        """``num_steps`` decode turns of ``schedule``. Under overlap the async run calls it for
        its steps before their outputs apply, then with 1 for its skipping step once the
        requests it skipped finished: their departure from ``_last_batch`` (the batch this call
        left, or the one in flight before the run) is what clears ``batch_is_full`` below, as
        the skipping step's shrunk batch clears it in ``_decode``."""
        if self.batch_is_full:
            # The run's first iteration is a ``schedule``: a request that left since the last
            # batch clears the flag there (``_note_departures``), even with nobody waiting to be
            # unblocked — a request may arrive later in the run or after it (a waiting request
            # aborted while the flag was set leaves it set on an empty queue). This run's own
            # finishes are marked already but still running; they clear it at the next run.
            done = [r for r in self._last_batch if r.is_finished]
            if done:
                running = set(map(id, sched.running))
                if any(id(r) not in running for r in done):
                    self.batch_is_full = False
        if self.tree is not None and self._last_was_prefill:
            # The run's first decode is where stepping checkpoints the last prefill batch.
            self.radix.checkpoint(self._last_batch)
        ratio, floor, decay = self.new_token_ratio, self.min_new_token_ratio, self.new_token_ratio_decay
        for _ in range(num_steps):
            if ratio == floor:
                break  # max(floor - decay, floor) == floor from here on
            ratio = max(ratio - decay, floor)
        self.new_token_ratio = ratio
        self._last_batch = list(sched.running)
        self._last_was_prefill = False
