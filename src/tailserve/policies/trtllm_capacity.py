"""TensorRT-LLM's capacity scheduler: which active requests may hold KV blocks this step.

Source: ``cpp/tensorrt_llm/batch_manager/capacityScheduler.cpp`` (the default, through
``BindCapacityScheduler``) and its line-for-line Python mirror ``PyCapacityScheduler`` in
``tensorrt_llm/_torch/pyexecutor/scheduler/scheduler.py`` (stored commit 5f480b7a; its
docstrings cite the C++ lines: GuaranteedNoEvict 194-331, MaxUtilization 341-425), with the
block counts of ``kvCacheManager.cpp`` (``getRemainingBlocksToCompletion``,
``getNeededBlocksOneStep``) and ``scheduledBlocksManager.h``. One attention window, beam width
1, no LoRA pages, no disaggregated requests: what tailserve models. A one-model drafter's slots
(MTP, EAGLE-3: ``DraftSlots``) count in the one-step blocks, as the engine counts them, and in the
reservation to completion (``remaining_blocks``).

A request is a *generation* request (``GENERATION_IN_PROGRESS``) once its context is computed,
else a *context* request (``CONTEXT_INIT``); its *first chunk* is still to run while it holds no
KV (``isFirstContextChunk``: blocks are taken for the whole prompt when that chunk runs).
``is_generation`` is the policy's answer (it knows when a context finished).
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from tailserve.core.request import Request
from tailserve.core.scheduler import Scheduler
from tailserve.kv.paged import KVCacheManager

IsGeneration = Callable[[Request], bool]


@dataclass(frozen=True, slots=True)
class DraftSlots:
    """KV slots a one-model drafter adds to a request's (``resource_manager.py``
    ``prepare_resources``): ``drafts`` per generation step (``add_token`` per draft, the rejected
    ones rewound after the step) and ``extra`` for the request's life (``num_extra_kv_tokens``,
    ``max_draft_len - 1``: ``speculative/utils.py`` ``get_num_extra_kv_tokens``; added at its
    first context chunk)."""

    drafts: int = 0
    extra: int = 0
    # Under the overlap scheduler, the draft slots of the step in flight: its rejected drafts are
    # rewound only when its outputs are processed (update_resources in _process_previous_batch),
    # after the next step took its own slots.
    in_flight: int = 0


NO_DRAFTS = DraftSlots()


def remaining_blocks(sched: Scheduler, request: Request, slots: DraftSlots = NO_DRAFTS) -> int:
    """``getRemainingBlocksToCompletion``: blocks for prompt + ``max_tokens`` less those held
    (the prompt's blocks once its first chunk ran). A paused request's prompt has grown by its
    outputs and its ``max_tokens`` shrunk by as many, so the total is the one it arrived with.
    With a drafter the total also holds its slots (``extra`` and the last step's ``drafts``): a
    deviation, the engine counts prompt + ``max_new_tokens`` only and leaves those slots to the
    blocks nobody reserved; counting them keeps the no-evict guarantee (under overlap the step in
    flight's unrewound drafts too, ``in_flight``)."""
    kv = sched.kv_cache
    return max(completion_blocks(kv, request, slots) - kv.num_held(request.request_id), 0)


def completion_blocks(kv: KVCacheManager, request: Request, slots: DraftSlots = NO_DRAFTS) -> int:
    """``remaining_blocks``' total: the blocks of prompt + ``max_tokens`` (and the drafter's
    slots), held ones included; fixed for a request (the policy keeps their sum)."""
    return kv.blocks_for(
        request.prompt_len + request.max_tokens + slots.extra + slots.drafts + slots.in_flight
    )


def blocks_one_step(
    sched: Scheduler, request: Request, generation: bool, slots: DraftSlots = NO_DRAFTS
) -> int:
    """``getNeededBlocksOneStep`` without two-step lookahead (only pipeline parallelism turns it
    on, ``_util.py``): a generation request the blocks its next token and its drafts may open
    (``tokensPerStep = getNumDraftTokens() + 1``; blocks a rolled-back draft left held count as
    held); a context request its whole prompt's blocks (and the drafter's extra slots) at its
    first chunk (shared prefix blocks are not credited: the match happens later, in
    ``addSequence``), nothing at later chunks."""
    kv = sched.kv_cache
    if generation:
        need = request.num_computed_tokens + slots.extra + 1 + slots.drafts
        return max(kv.blocks_for(need) - kv.num_held(request.request_id), 0)
    if kv.num_held(request.request_id):
        return 0
    return kv.blocks_for(request.num_tokens + slots.extra)


class SkipRule:
    """``beneficialToSkip`` (``capacityScheduler.cpp`` 70-123): with block reuse, a context
    request at its first chunk is skipped this step when its first uncached block is the same
    as that of a context already executing in chunks or of one looked at before it this step —
    it waits one step and then reuses that block instead of computing it twice. Every request
    looked at adds its block to the set, scheduled or not.

    ``lazy``: the executing contexts' blocks are collected at the first block compared, not
    here — the same set where nothing changes KV in between (GUARANTEED_NO_EVICT's pass;
    MAX_UTILIZATION's calls ``collect`` before its first pause frees blocks); a step whose
    contexts carry no block keys (no prefix keys: nothing to share) never walks the active list
    for it."""

    def __init__(
        self, sched: Scheduler, active: list[Request], is_generation: IsGeneration, lazy: bool = False
    ) -> None:
        self._sched = sched
        self._active = active
        self._is_generation = is_generation
        self._blocks: set[int] | None = None if lazy else self._executing()

    def _executing(self) -> set[int]:
        """``prefillWithChunkedContextsAlreadyExecuting``: contexts past their first chunk."""
        sched = self._sched
        kv = sched.kv_cache
        blocks: set[int] = set()
        for request in self._active:
            if not self._is_generation(request) and kv.num_held(request.request_id):
                block = sched.new_context_block(request)
                if block is not None:
                    blocks.add(block)
        return blocks

    def collect(self) -> None:
        """Collect the executing contexts' blocks now if not yet (before KV changes)."""
        if self._blocks is None:
            self._blocks = self._executing()

    def skips(self, request: Request) -> bool:
        if self._is_generation(request) or self._sched.kv_cache.num_held(request.request_id):
            return False  # only a context at its first chunk
        return self.skips_first_chunk(request)

    def skips_first_chunk(self, request: Request) -> bool:
        """``skips`` for a request the caller knows is a context at its first chunk."""
        block = self._sched.new_context_block(request)
        if block is None:
            return False
        blocks = self._blocks
        if blocks is None:
            blocks = self._blocks = self._executing()
        if block in blocks:
            return True
        blocks.add(block)
        return False


@dataclass(slots=True)
class Fitting:
    """GUARANTEED_NO_EVICT's fitting requests: ``generations``, the first pass's (a list, in
    active order), then ``contexts``, the second pass's, computed only as far as they are asked
    for. Iterating yields both in that order, the engine's fitting list. The micro-batch
    scheduler takes ``generations`` whole (``micro_batch``): a length and a slice instead of a
    generator resumption and two tests per generation request per step (~26 a step, 17,017
    stepped steps in sim_speed's trtllm case at 20,000 requests; r49). Single use: ``contexts``
    is a generator."""

    generations: list[Request]
    contexts: Iterable[Request]

    def __iter__(self) -> Iterator[Request]:
        return itertools.chain(self.generations, self.contexts)


def guaranteed_no_evict(
    sched: Scheduler,
    active: list[Request],
    is_generation: IsGeneration,
    max_num_requests: int,
    static_batch: bool,
    block_reuse: bool,
    slots: DraftSlots = NO_DRAFTS,
    reservation_bound: int | None = None,
) -> Fitting:
    """GUARANTEED_NO_EVICT (and STATIC_BATCH): reserve every running request's blocks to
    completion, then admit contexts in active order while the rest holds theirs to completion.

    1. Free blocks (cached ones nobody holds count: reuse keeps them in the free queue).
    2. First pass, active order: each generation request is kept and its remaining blocks to
       completion reserved; contexts wait for the second pass. At ``max_num_requests`` kept, stop.
    3. Second pass (STATIC_BATCH: only when no generation request runs), contexts in active
       order: skipped by the reuse rule (not under STATIC_BATCH), or kept if their remaining
       blocks fit what is left; the first that does not fit ends the pass (head-of-line).
    Returns the fitting requests in that order: generation requests first (``Fitting``'s
    ``generations``), then contexts (its ``contexts``).

    Lazily: the second pass changes nothing (no KV taken, the reuse rule's set its own), so what
    the micro-batch scheduler, which stops at its token budget, does not ask for is not computed
    — a long queue of contexts that all fit the KV pool but not ``max_num_tokens`` was walked
    whole each step (sim_memory's workload, 20,000 requests: ~30 contexts a step, ~2 run).

    ``reservation_bound``: at least the generation requests' reservations (the policy keeps the
    sum of their blocks to completion, held ones included; a reservation is at most that). A
    context that fits what the bound leaves fits what the exact reservations leave; only one
    that does not makes the pass sum them (nothing changes the blocks in between), so the
    decisions are the engine's. Steps whose contexts fit easily skip the per-request sum."""
    # Each active request asked once (the second pass's contexts are the rest), the walks in C.
    generation = list(map(is_generation, active))
    scheduled = list(itertools.compress(active, generation))
    pending: list[Request]
    if len(scheduled) < max_num_requests:
        # The first pass reaches the end of the list: every context waits for the second, which
        # walks them in active order only as far as it is asked to.
        if len(scheduled) == len(active) or (static_batch and scheduled):
            return Fitting(scheduled, ())
        pending = list(itertools.compress(active, map(operator.not_, generation)))
    else:
        # It stops at the max_num_requests-th generation request: the contexts before it wait.
        count = end = 0
        while count < max_num_requests:
            if generation[end]:
                count += 1
            end += 1
        del scheduled[max_num_requests:]
        pending = list(itertools.compress(active[:end], map(operator.not_, generation)))
        if not pending or static_batch:
            return Fitting(scheduled, ())
    # The reuse rule (lazy: its executing contexts are collected on first use, before any KV moves).
    skip = SkipRule(sched, active, is_generation, lazy=True) if block_reuse and not static_batch else None
    return Fitting(
        scheduled, _second_pass(sched, scheduled, pending, skip, max_num_requests, slots, reservation_bound)
    )


def _second_pass(
    sched: Scheduler,
    scheduled: list[Request],
    pending: list[Request],
    skip: SkipRule | None,
    max_num_requests: int,
    slots: DraftSlots,
    reservation_bound: int | None,
) -> Iterator[Request]:
    """``guaranteed_no_evict``'s step 3 over ``pending`` (the contexts in active order), with
    the generation requests ``scheduled`` kept and ``skip`` the reuse rule (None: none applies):
    yields the contexts kept, lazily."""
    free = sched.kv_cache.num_free_blocks
    exact = reservation_bound is None
    available = free - reservation_bound if reservation_bound is not None else free
    if exact:
        for request in scheduled:
            available -= remaining_blocks(sched, request, slots)
    taken = 0  # blocks reserved for the contexts kept so far
    num_scheduled = len(scheduled)
    for request in pending:
        if skip is not None and skip.skips(request):
            continue
        if num_scheduled >= max_num_requests:
            break
        need = remaining_blocks(sched, request, slots)
        if need > available and not exact:
            # Past the bound: the exact reservations decide (what the engine compares).
            exact = True
            available = free - taken
            for generation in scheduled:
                available -= remaining_blocks(sched, generation, slots)
        if need > available:
            break
        num_scheduled += 1
        taken += need
        available -= need
        yield request


def max_utilization(
    sched: Scheduler,
    active: list[Request],
    is_generation: IsGeneration,
    max_num_requests: int,
    block_reuse: bool,
    pause: Callable[[Request], None],
    slots: DraftSlots = NO_DRAFTS,
) -> tuple[list[Request], list[Request]]:
    """MAX_UTILIZATION: blocks for this step only; when a request does not fit, pause the
    *last started* request (from the end of the active list back to it) and try again.

    Active order; each request is skipped by the reuse rule, or scheduled if fewer than
    ``max_num_requests`` are and its one-step blocks fit beside those already scheduled
    (``MaxUtilizationScheduledBlocksManager``); otherwise the last request after it (or itself)
    that has started (holds KV: a generation request or a context past its first chunk) is
    paused — ``pause`` frees its blocks, as ``schedulingRemoveSequence`` counts them free — and
    the list ends before it; with none, the pass ends. Returns (scheduled in active order,
    paused in the order paused)."""
    kv = sched.kv_cache
    skip = SkipRule(sched, active, is_generation, lazy=True) if block_reuse else None
    scheduled: list[Request] = []
    paused: list[Request] = []
    scheduled_blocks = 0
    free = kv.num_free_blocks  # read again after a pause, the only change during the pass
    end = len(active)
    i = 0
    while i < end:
        request = active[i]
        if skip is not None and skip.skips(request):
            i += 1
            continue
        need = blocks_one_step(sched, request, is_generation(request), slots)
        if len(scheduled) < max_num_requests and scheduled_blocks + need <= free:
            scheduled.append(request)
            scheduled_blocks += need
            i += 1
            continue
        victim = next((j for j in range(end - 1, i - 1, -1) if kv.num_held(active[j].request_id)), None)
        if victim is None:
            break
        if skip is not None:
            skip.collect()  # the executing contexts as they were before any pause
        pause(active[victim])
        paused.append(active[victim])
        free = kv.num_free_blocks
        end = victim
    return scheduled, paused
